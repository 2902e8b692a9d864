"""Make AWS say what moto never does, through the fault proxy (simulator/aws_proxy.py): an EC2 status check impaired or
insufficient-data (with its ImpairedSince), a scheduled event, an ECS agent disconnected, a task's health check
failing (moto's tasks have no healthStatus).

moto's own answers to DescribeInstanceStatus (query protocol, XML) and DescribeContainerInstances (json protocol)
are edited on their way to the engine, in the wire format botocore parses; an instance the test said nothing of is
answered as moto answers it. Only the engine's calls go through the proxy.
"""

from __future__ import annotations

import json
import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime

from simulator.aws_proxy import AwsRequest, FlakyAws

EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15"


@dataclass(frozen=True)
class Check:
    status: str  # impaired, insufficient-data, ok
    since: datetime | None = None
    detail: str = "reachability"


@dataclass(frozen=True)
class Event:
    code: str
    not_before: datetime
    event_id: str = ""
    description: str = "The instance is running on degraded hardware"


class AwsSays:
    def __init__(self, proxy: FlakyAws) -> None:
        self._lock = threading.Lock()
        self._system: dict[str, Check] = {}
        self._instance: dict[str, Check] = {}
        self._events: dict[str, list[Event]] = {}
        self._disconnected: set[str] = set()
        self._task_health: dict[str, str] = {}
        proxy.rewrite("DescribeInstanceStatus", self._edit_status, service="ec2")
        proxy.rewrite("DescribeContainerInstances", self._edit_agents, service="ecs")
        proxy.rewrite("DescribeTasks", self._edit_tasks, service="ecs")

    def status(self, instance_id: str, *, system: Check | None = None, instance: Check | None = None) -> None:
        """The two status checks from now on (None: as moto says, ok)."""
        with self._lock:
            for table, check in ((self._system, system), (self._instance, instance)):
                if check is None:
                    table.pop(instance_id, None)
                else:
                    table[instance_id] = check

    def events(self, instance_id: str, *events: Event) -> None:
        with self._lock:
            self._events[instance_id] = list(events)

    def agent(self, instance_id: str, *, connected: bool) -> None:
        with self._lock:
            (self._disconnected.discard if connected else self._disconnected.add)(instance_id)

    def task_health(self, task_arn: str, health: str | None) -> None:
        """The task's healthStatus from now on (HEALTHY, UNHEALTHY, UNKNOWN; None: as moto says, none)."""
        with self._lock:
            if health is None:
                self._task_health.pop(task_arn, None)
            else:
                self._task_health[task_arn] = health

    # --- on the proxy's threads ----------------------------------------------------------------------------------

    def _edit_status(self, request: AwsRequest, body: bytes) -> bytes:
        ET.register_namespace("", EC2_NS)
        root = ET.fromstring(body)
        with self._lock:
            for item in root.iterfind(f"{{{EC2_NS}}}instanceStatusSet/{{{EC2_NS}}}item"):
                instance_id = item.findtext(f"{{{EC2_NS}}}instanceId", "")
                for tag, table in (("systemStatus", self._system), ("instanceStatus", self._instance)):
                    summary = item.find(f"{{{EC2_NS}}}{tag}")
                    if instance_id in table and summary is not None:
                        _set_check(summary, table[instance_id])
                if self._events.get(instance_id):
                    _set_events(item, self._events[instance_id])
        return ET.tostring(root, xml_declaration=True, encoding="utf-8")

    def _edit_agents(self, request: AwsRequest, body: bytes) -> bytes:
        answer = json.loads(body)
        with self._lock:
            for ci in answer.get("containerInstances", []):
                if ci.get("ec2InstanceId") in self._disconnected:
                    ci["agentConnected"] = False
        return json.dumps(answer).encode()

    def _edit_tasks(self, request: AwsRequest, body: bytes) -> bytes:
        answer = json.loads(body)
        with self._lock:
            for task in answer.get("tasks", []):
                if task.get("taskArn") in self._task_health:
                    task["healthStatus"] = self._task_health[task["taskArn"]]
        return json.dumps(answer).encode()


def _el(parent: ET.Element, tag: str, text: str | None = None) -> ET.Element:
    child = ET.SubElement(parent, f"{{{EC2_NS}}}{tag}")
    if text is not None:
        child.text = text
    return child


def _set_check(summary: ET.Element, check: Check) -> None:
    for child in list(summary):
        summary.remove(child)
    details = _el(summary, "details")
    item = _el(details, "item")
    _el(item, "name", check.detail)
    _el(item, "status", {"impaired": "failed", "ok": "passed"}.get(check.status, check.status))
    if check.since is not None:
        _el(item, "impairedSince", _aws_time(check.since))
    _el(summary, "status", check.status)


def _set_events(item: ET.Element, events: list[Event]) -> None:
    listed = _el(item, "eventsSet")
    for event in events:
        entry = _el(listed, "item")
        _el(entry, "code", event.code)
        _el(entry, "description", event.description)
        _el(entry, "instanceEventId", event.event_id)
        _el(entry, "notBefore", _aws_time(event.not_before))


def _aws_time(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")
