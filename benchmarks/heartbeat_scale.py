"""Heartbeats at production scale and cadence through the ingest, one worker (issue 23, part 2).

    .venv/bin/python -m benchmarks.heartbeat_scale [--instances 10000] [--minutes 30] [--faults 100]
        [--warmup-concurrency 32] [--seed 1] [--state-dir DIR] [--json FILE]

The real stack, each part its own process (so each one's CPU and RSS are its own): moto_server, the Temporal dev
server, one `autorepair worker` (simulator/engine_process.py) and the real ingest (ingest_throughput.ingest_process).
`--instances` EC2 instances in moto, each with its own identity (simulator/host_identity.py). This process is their
probes: per host the real IngestReporter with session tokens (the probe's default), sending what a probe on a GPU host
sends over HTTP to the ingest, each host's heartbeat at its slot (the hosts spread evenly over the 60 s interval),
all from one asyncio loop. The group has production timing (heartbeat 60 s, loss after 10 min) and auto repair
DISABLED: no ECS fleet stands behind these hosts, so this measures detection and the steady load, not repairs.

Warm-up: every host's first heartbeat (it starts the host's health workflow: STS, an EC2 lookup, a signal-with-start),
`--warmup-concurrency` at a time, each host then joining the schedule; then until every host's HealthChanged(OK) is in
the events file. Then the measured window of `--minutes`, with `--faults` critical-Xid findings (the probe's own
parser and ECS policy) from distinct random hosts, spread evenly over it. Every 10 s a sample: CPU and RSS of worker,
Temporal, moto, ingest and this process; the task queue backlog (DescribeTaskQueue with report_stats; the worker's
sticky queue shows in the workflow tasks' schedule-to-start time instead); workflow tasks/s and activities/s (the
worker's Prometheus metrics); signals/s reaching Temporal and task timeouts (the dev server's); heartbeats/s the ingest
accepted. Detection: finding sent -> the HealthChanged(IMPAIRED) event's time (the workflow's decision), and -> when
that event was read from the events file. A summary goes to stdout; --json FILE gets everything, the series included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import math
import os
import random
import re
import resource
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from botocore.credentials import ReadOnlyCredentials

from benchmarks import ingest_throughput as throughput
from benchmarks.sim_cost import rss_mb
from benchmarks.support import CRITICAL_XIDS, check_critical_xids
from contract.config import IngestSettings
from contract.health import HealthState
from contract.probe import GpuFinding, Heartbeat, ProbeSourceHealth
from node_probe.classify.manual import manual_findings, records_from_text, xid_line
from node_probe.classify.policy import POLICY_ECS, Policy
from node_probe.delivery.ingest_reporter import IngestRefused, IngestReporter
from simulator.demo_summary import EventLog

if TYPE_CHECKING:
    from temporalio.client import Client

REGION = throughput.REGION
INTERVAL_S = 60.0  # the probe's default heartbeat interval, and the group's heartbeat_interval
SAMPLE_EVERY_S = 10.0
QUEUES = ("workflow", "activity")  # the task queue's two kinds of task, each described for its backlog
EVENTS_POLL_S = 0.1  # how often the events file is read: the resolution of "seen in the file"
SETTLE_TIMEOUT_S = 900.0
DETECT_GRACE_S = 60.0  # after the window, how long a fault's IMPAIRED is still waited for
TASK_QUEUE_NOTE = "the ingest's to choose"  # IngestReporter ignores the task queue argument
FINDING_SOURCE = "kmsg"  # the source a probe following /dev/kmsg names in its findings

# What a probe on a GPU host with NVML and DCGM reports of its sources (node_probe/probe.py, Probe.heartbeat):
# the daemons and container runtime checks are not GPU sources.
PROBE_SOURCES = [ProbeSourceHealth(name=name, state=HealthState.OK) for name in ("kmsg", "nvml", "dcgm")] + [
    ProbeSourceHealth(name=name, state=HealthState.OK, gpu_source=False) for name in ("daemons", "container_runtime")
]


# --- Reading processes and Prometheus endpoints -------------------------------------------------------------------


_SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
Metrics = dict[str, list[tuple[dict[str, str], float]]]


def scrape(url: str, wanted: set[str]) -> Metrics:
    """The samples of the `wanted` metric families on a Prometheus text page (the dev server's page is large: only
    the lines of those families are parsed). Blocking: run it in a thread."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode(errors="replace")
    found: Metrics = {}
    for line in text.splitlines():
        if not line.startswith(tuple(wanted)):
            continue
        match = _SAMPLE_LINE.match(line)
        if match and match[1] in wanted:
            labels = dict(_LABEL.findall(match[2] or ""))
            found.setdefault(match[1], []).append((labels, float(match[3])))
    return found


def total(metrics: Metrics, name: str, **labels: str | tuple[str, ...]) -> float:
    """The sum of `name`'s samples whose labels match (a tuple: any of these values)."""

    def matches(have: dict[str, str]) -> bool:
        return all(have.get(k) in (v if isinstance(v, tuple) else (v,)) for k, v in labels.items())

    return sum(value for have, value in metrics.get(name, []) if matches(have))


SIGNALS = ("SignalWorkflowExecution", "SignalWithStartWorkflowExecution")
WFT_TIMER = "TimerActiveTaskWorkflowTaskTimeout"  # the history service's timer task, as its metrics tag it
ACT_TIMER, ACT_TIMEOUTS = "TimerActiveTaskActivityTimeout", ("start_to_close_timeout", "schedule_to_close_timeout")
RESPOND = "RespondWorkflowTaskCompleted"
Labels = dict[str, str | tuple[str, ...]]
WFT_FAILED = "temporal_workflow_task_execution_failed_total"
FAILURE_LABELS = ("failure_reason", "workflow_type")
FAILURES_BY_LABEL = "workflow_task_failures_by_label_whole_run"
# What each sample reads: (name, endpoint, metric families summed, the labels a sample must have: a tuple, any of
# these). The worker's are the Temporal SDK core's (durations in ms, counters with _total); "temporal" is the dev
# server's page, read for the benchmark's namespace only. All are counters but the two gauges.
COUNTERS: list[tuple[str, str, tuple[str, ...], Labels]] = [
    ("workflow_tasks", "worker", ("temporal_workflow_task_execution_latency_count",), {}),
    ("workflow_task_failures", "worker", (WFT_FAILED,), {}),
    ("wft_schedule_to_start_ms_sum", "worker", ("temporal_workflow_task_schedule_to_start_latency_sum",), {}),
    ("wft_schedule_to_start_count", "worker", ("temporal_workflow_task_schedule_to_start_latency_count",), {}),
    ("activities", "worker", ("temporal_activity_execution_latency_count",), {}),
    ("activity_failures", "worker", ("temporal_activity_execution_failed_total",), {}),
    ("sticky_cache_size", "worker", ("temporal_sticky_cache_size",), {}),
    ("workflow_slots_used", "worker", ("temporal_worker_task_slots_used",), {"worker_type": "WorkflowWorker"}),
    # Signals (and signal-with-starts) from clients: the ingest's, and the worker's activities'. A workflow signalling
    # another (the liveness tracker telling a health workflow of a loss) does not pass the frontend: not counted.
    ("signals_from_clients", "temporal", ("service_requests",), {"service_name": "frontend", "operation": SIGNALS}),
    ("workflow_tasks_completed", "temporal", ("service_requests",), {"service_name": "frontend", "operation": RESPOND}),
    ("frontend_requests", "temporal", ("service_requests",), {"service_name": "frontend"}),
    ("workflow_task_timeouts", "temporal", ("start_to_close_timeout",), {"operation": WFT_TIMER}),
    # A task that waited 10 s on the worker's sticky queue went to the normal queue, to be replayed there: the
    # worker is not keeping up.
    ("sticky_schedule_to_start_timeouts", "temporal", ("schedule_to_start_timeout",), {"operation": WFT_TIMER}),
    ("activity_timeouts", "temporal", ACT_TIMEOUTS, {"operation": ACT_TIMER}),
    ("heartbeats_accepted", "ingest", ("autorepair_ingest_reports_accepted_total",), {"kind": "heartbeat"}),
    ("findings_accepted", "ingest", ("autorepair_ingest_reports_accepted_total",), {"kind": "finding"}),
    ("refused", "ingest", ("autorepair_ingest_reports_refused_total",), {}),
]


# --- The hosts: what their probes send, on the probes' schedule -----------------------------------------------


def critical_finding(instance_id: str, group: str, xid: int) -> GpuFinding:
    """The finding a probe sends for an Xid line in its kernel log: its parser, the ECS policy, its finding id."""
    records = records_from_text(xid_line(xid, by="benchmarks.heartbeat_scale"))
    now = datetime.now(UTC)
    (finding,) = manual_findings(
        records, Policy(POLICY_ECS), instance_id=instance_id, group=group, source=FINDING_SOURCE, now=now
    )
    if not finding.impairs:
        raise ValueError(f"Xid {xid} does not impair under the ECS policy")
    return finding


@dataclass
class Sends:
    """Heartbeats answered since the last sample (or in a phase): statuses, latencies, how late each was sent."""

    statuses: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)

    def add(self, status: str, latency: float, lag: float) -> None:
        self.statuses[status] += 1
        self.latencies.append(latency)
        self.lags.append(lag)

    def summary(self) -> dict[str, Any]:
        return {
            "sent": sum(self.statuses.values()),
            "statuses": dict(self.statuses),
            "latency_ms_p50": ms(throughput.percentile(self.latencies, 50)),
            "latency_ms_p99": ms(throughput.percentile(self.latencies, 99)),
            "send_lag_ms_p99": ms(throughput.percentile(self.lags, 99)),
        }


def ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(1000 * seconds, 1)


@dataclass
class Fault:
    instance_id: str
    xid: int
    sent_at: float = 0.0  # epoch seconds, just before the first attempt
    status: str = "not sent"


def fixed(credentials: ReadOnlyCredentials) -> Callable[[], ReadOnlyCredentials]:
    """The host's instance-profile credentials, as the reporter reads them (IMDS on a real host)."""
    return lambda: credentials


class Fleet:
    """Every host's probe stand-in, driven from one loop: a heap of (due, host) sends each heartbeat at its slot
    (host i at i/N of the interval); a host whose previous heartbeat is still unanswered skips its slot, as a probe
    sends one at a time."""

    def __init__(self, hosts: Sequence[throughput.Host], group: str, url: str, ingest: IngestSettings) -> None:
        self.ids = [host.instance_id for host in hosts]
        self.boot_ids = [str(uuid.uuid4()) for _ in hosts]
        self.reporters = [
            IngestReporter(
                url, ingest_id=ingest.id, sts_endpoint=ingest.sts_endpoint, credentials=fixed(host.credentials)
            )
            for host in hosts
        ]
        self.group = group
        self._due: list[tuple[float, int]] = []
        self._in_flight: set[int] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._origin = 0.0
        self.interval = Sends()  # since the last sample
        self.window = Sends()  # the measured window's
        self.measuring = False
        self.skipped_in_flight = 0
        self.schedule_full_at = 0.0

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)  # the loop holds only a weak reference
        task.add_done_callback(self._tasks.discard)

    def join(self, index: int, not_before: float) -> None:
        """Put the host on the schedule at its first slot from `not_before` (loop time)."""
        slot = self._origin + index * INTERVAL_S / len(self.ids)
        due = slot + max(0, math.ceil((not_before - slot) / INTERVAL_S)) * INTERVAL_S
        heapq.heappush(self._due, (due, index))
        self.schedule_full_at = max(self.schedule_full_at, due)  # loop time when every host has had a slot

    async def heartbeat(self, index: int, due: float) -> str:
        loop = asyncio.get_running_loop()
        self._in_flight.add(index)
        lag, start = loop.time() - due, time.perf_counter()
        try:
            now, boot_id = datetime.now(UTC), self.boot_ids[index]
            beat = Heartbeat(
                instance_id=self.ids[index], group=self.group, sent_at=now, sources=PROBE_SOURCES, boot_id=boot_id
            )
            await self.reporters[index].send_heartbeat(beat, TASK_QUEUE_NOTE)
            status = "202"
        except IngestRefused as refused:
            status = str(refused.status)
        except Exception as err:  # a connection error or timeout: counted, the host carries on
            status = type(err).__name__
        finally:
            self._in_flight.discard(index)
        latency = time.perf_counter() - start
        self.interval.add(status, latency, lag)
        if self.measuring:
            self.window.add(status, latency, lag)
        return status

    async def warm_up(self, concurrency: int) -> Sends:
        """Every host's first heartbeat, `concurrency` at a time, in host order; each host joins the schedule
        half an interval after it was answered (whatever the answer: a probe keeps heartbeating)."""
        loop = asyncio.get_running_loop()
        self._origin = loop.time()
        sends, hosts = Sends(), iter(range(len(self.ids)))

        async def sender() -> None:
            for index in hosts:
                start = time.perf_counter()
                status = await self.heartbeat(index, loop.time())
                sends.add(status, time.perf_counter() - start, 0.0)
                self.join(index, loop.time() + INTERVAL_S / 2)

        await asyncio.gather(*(sender() for _ in range(min(concurrency, len(self.ids)))))
        return sends

    async def run(self) -> None:
        """Send heartbeats at their slots until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            while self._due and self._due[0][0] <= now:
                due, index = heapq.heappop(self._due)
                heapq.heappush(self._due, (due + INTERVAL_S, index))
                if index in self._in_flight:
                    self.skipped_in_flight += 1
                    continue
                self.spawn(self.heartbeat(index, due))
            wait = self._due[0][0] - now if self._due else 0.1
            await asyncio.sleep(min(max(wait, 0.0), 0.1))

    async def inject(self, fault: Fault, attempts: int = 3) -> None:
        """One finding through the host's reporter; tried again a second later, as the probe's spool would."""
        fault.sent_at = time.time()
        finding = critical_finding(fault.instance_id, self.group, fault.xid)
        reporter = self.reporters[self.ids.index(fault.instance_id)]
        for _ in range(attempts):
            try:
                await reporter.send_finding(finding, TASK_QUEUE_NOTE)
                fault.status = "202"
                return
            except IngestRefused as refused:
                fault.status = str(refused.status)
            except Exception as err:  # a connection error or timeout
                fault.status = type(err).__name__
            await asyncio.sleep(1.0)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(reporter.close() for reporter in self.reporters), return_exceptions=True)


# --- What the worker published ----------------------------------------------------------------------------------


class Detection:
    """Follows the events file: which instances are OK (warm-up), and when each first turned IMPAIRED, by the
    event's own time (the workflow's decision) and by when this process read it."""

    def __init__(self, path: Path, group: str) -> None:
        self.log = EventLog(path)
        self.group = group
        self.ok: set[str] = set()
        self.impaired: dict[str, tuple[float, float]] = {}

    def poll(self) -> None:
        seen = time.time()
        for event in self.log.read_new():
            if event.get("type") != "HealthChanged" or event.get("group") != self.group:
                continue
            instance_id, status = str(event.get("instance_id")), (event.get("detail") or {}).get("overall_status")
            if status == HealthState.OK.value:
                self.ok.add(instance_id)
            elif status == HealthState.IMPAIRED.value and instance_id not in self.impaired:
                at = datetime.fromisoformat(str(event["time"]).replace("Z", "+00:00")).timestamp()
                self.impaired[instance_id] = (at, seen)

    async def follow(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(EVENTS_POLL_S)


# --- Samples ------------------------------------------------------------------------------------------------------


@dataclass
class Reading:
    at: float
    cpu: dict[str, float]
    counters: dict[str, float | None]


class Sampler:
    """Every SAMPLE_EVERY_S: the processes' CPU and RSS, the task queue's backlog, and the metrics' counters turned
    into rates over the interval."""

    def __init__(
        self, processes: throughput.Processes, client: Client, task_queue: str, urls: dict[str, str], fleet: Fleet
    ) -> None:
        self.processes = processes
        self.client = client
        self.task_queue = task_queue
        self.urls = urls
        self.fleet = fleet
        self.series: list[dict[str, Any]] = []
        self.errors: Counter[str] = Counter()
        # The worker's failed workflow tasks by the SDK's labels (its failure_reason, the workflow type), as last read:
        # a failed task that the server never records (a query's, or one not reported again) is only seen here.
        self.task_failures_by: dict[str, float] = {}
        self.phase = "warm-up"
        self.began = time.monotonic()
        self._last: Reading | None = None
        self._lock = asyncio.Lock()

    async def read(self) -> Reading:
        parts: dict[str, float | None] = {}
        for endpoint, url in self.urls.items():
            rows = [row for row in COUNTERS if row[1] == endpoint]
            try:
                metrics = await asyncio.to_thread(scrape, url, {family for row in rows for family in row[2]})
            except Exception as err:  # an endpoint not up yet or gone: that sample goes without it
                self.errors[f"{endpoint} metrics: {type(err).__name__}"] += 1
                continue
            if endpoint == "worker":
                self.task_failures_by = {
                    ", ".join(f"{k}={v}" for k, v in sorted(have.items()) if k in FAILURE_LABELS): value
                    for have, value in metrics.get(WFT_FAILED, [])
                }
            for name, _, families, labels in rows:
                if endpoint == "temporal":
                    labels = labels | {"namespace": self.client.namespace}
                parts[name] = sum(total(metrics, family, **labels) for family in families)
        return Reading(time.monotonic(), self.processes.snapshot(), parts)

    async def backlog(self) -> dict[str, float | None]:
        from temporalio.api.enums.v1 import TaskQueueType
        from temporalio.api.taskqueue.v1 import TaskQueue
        from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

        found: dict[str, float | None] = {}
        for name in QUEUES:
            kind = TaskQueueType.Value(f"TASK_QUEUE_TYPE_{name.upper()}")
            queue, namespace = TaskQueue(name=self.task_queue), self.client.namespace
            request = DescribeTaskQueueRequest(
                namespace=namespace, task_queue=queue, task_queue_type=kind, report_stats=True
            )
            try:
                stats = (await self.client.workflow_service.describe_task_queue(request)).stats
                found[f"{name}_backlog"] = stats.approximate_backlog_count
                found[f"{name}_backlog_age_s"] = round(stats.approximate_backlog_age.ToTimedelta().total_seconds(), 2)
                found[f"{name}_add_per_s"] = round(stats.tasks_add_rate, 2)
            except Exception as err:
                self.errors[f"describe {name} task queue: {type(err).__name__}"] += 1
                found[f"{name}_backlog"] = None
        return found

    async def sample(self) -> None:
        async with self._lock:  # the periodic samples and the window's first and last ones
            await self._sample()

    async def _sample(self) -> None:
        reading, backlog = await self.read(), await self.backlog()
        last, self._last = self._last, reading
        rss = {role: rss_mb(pid) for role, pid in self.processes.pids.items()}
        sample: dict[str, Any] = {
            "t_s": round(reading.at - self.began, 1),
            "phase": self.phase,
            "rss_mb": rss,
            "cpu_s": {role: round(seconds, 2) for role, seconds in reading.cpu.items()},
            **backlog,
            "sticky_cache_size": reading.counters.get("sticky_cache_size"),
            "workflow_slots_used": reading.counters.get("workflow_slots_used"),
            "heartbeats": self.fleet.interval.summary(),
        }
        self.fleet.interval = Sends()
        if last is not None:
            dt = reading.at - last.at
            sample["cores"] = {role: round((reading.cpu[role] - last.cpu[role]) / dt, 3) for role in reading.cpu}
            sample |= rates(last.counters, reading.counters, dt)
        self.series.append(sample)
        if len(self.series) % 6 == 1:  # a line a minute: a 10,000-host run takes the better part of an hour
            keys = ("phase", "t_s", "cores", "workflow_backlog", "activity_backlog", "wft_schedule_to_start_ms_mean")
            print(json.dumps({key: sample.get(key) for key in keys}), flush=True)

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            await self.sample()
            await asyncio.sleep(max(0.0, SAMPLE_EVERY_S - (time.monotonic() - started)))


# Counters reported per sample as counts, and as rates.
COUNTS: tuple[str, ...] = ("workflow_task_failures", "workflow_task_timeouts", "sticky_schedule_to_start_timeouts")
COUNTS += ("activity_timeouts", "activity_failures", "refused")
PER_SECOND: tuple[str, ...] = ("workflow_tasks", "workflow_tasks_completed", "activities", "signals_from_clients")
PER_SECOND += ("frontend_requests", "heartbeats_accepted", "findings_accepted")


def rates(before: dict[str, float | None], after: dict[str, float | None], dt: float) -> dict[str, Any]:
    delta = {k: v - b for k, v in after.items() if v is not None and (b := before.get(k)) is not None}
    out: dict[str, Any] = {f"{n}_per_s": round(delta[n] / dt, 2) if n in delta else None for n in PER_SECOND}
    out |= {name: delta.get(name) for name in COUNTS}
    count, summed = delta.get("wft_schedule_to_start_count"), delta.get("wft_schedule_to_start_ms_sum", 0.0)
    out["wft_schedule_to_start_ms_mean"] = round(summed / count, 1) if count else None
    return out


# --- Summary ------------------------------------------------------------------------------------------------------


def mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(sum(present) / len(present), 3) if present else None


def summarise_window(series: list[dict[str, Any]], cpu: dict[str, float], seconds: float) -> dict[str, Any]:
    window = [s for s in series if s["phase"] == "window" and "cores" in s]
    backlogs = [
        None if s.get("workflow_backlog") is None else s["workflow_backlog"] + (s.get("activity_backlog") or 0)
        for s in window
    ]
    third = max(1, len(window) // 3)
    first, last = mean(backlogs[:third]), mean(backlogs[-third:])
    roles = [role for role in cpu if role != "other_jobs"]

    def rss(role: str) -> list[float]:
        return [s["rss_mb"][role] for s in window if s["rss_mb"].get(role) is not None]

    return {
        "samples": len(window),
        "cpu_cores_mean": {role: round(cpu[role] / seconds, 3) for role in cpu},
        "cpu_cores_max_sample": {role: max((s["cores"][role] for s in window), default=None) for role in roles},
        "rss_mb_max": {role: max(rss(role), default=None) for role in roles},
        **{f"{name}_per_s_mean": mean([s.get(f"{name}_per_s") for s in window]) for name in PER_SECOND},
        "wft_schedule_to_start_ms_mean_of_samples": mean([s.get("wft_schedule_to_start_ms_mean") for s in window]),
        "wft_schedule_to_start_ms_max_sample": max(
            (s.get("wft_schedule_to_start_ms_mean") or 0 for s in window), default=None
        ),
        "backlog_max": max((b for b in backlogs if b is not None), default=None),
        "backlog_age_s_max": max((s.get(f"{q}_backlog_age_s") or 0 for s in window for q in QUEUES), default=None),
        "backlog_mean_first_third": first,
        "backlog_mean_last_third": last,
        **{name: sum(s.get(name) or 0 for s in window) for name in COUNTS},
    }


def summarise_faults(faults: list[Fault], detection: Detection) -> dict[str, Any]:
    pairs = [(detection.impaired[f.instance_id], f.sent_at) for f in faults if f.instance_id in detection.impaired]
    decided, seen = [at - sent for (at, _), sent in pairs], [read - sent for (_, read), sent in pairs]
    faulted = {f.instance_id for f in faults}

    def spread(values: list[float]) -> dict[str, float | None]:
        return {q: ms(throughput.percentile(values, p)) for q, p in (("p50_ms", 50), ("p99_ms", 99))} | {
            "max_ms": ms(max(values, default=float("nan")))
        }

    return {
        "injected": len(faults),
        "accepted_by_ingest": sum(1 for f in faults if f.status == "202"),
        "statuses": dict(Counter(f.status for f in faults)),
        "impaired": len(decided),
        "missing": sorted(faulted - set(detection.impaired)),
        "finding_to_impaired_event_time": spread(decided),
        "finding_to_event_seen_in_file": spread(seen),
        # IMPAIRED without a fault: a heartbeat loss the liveness tracker declared, say. Should be none.
        "impaired_without_fault": sorted(set(detection.impaired) - faulted),
    }


def goals(window: dict[str, Any], faults: dict[str, Any]) -> dict[str, Any]:
    first, last = window["backlog_mean_first_third"], window["backlog_mean_last_third"]
    growing = first is None or last is None or last > first + max(1.0, 0.1 * first)
    timeouts = sum(window[name] for name in COUNTS if name.endswith("timeouts"))
    p99 = faults["finding_to_impaired_event_time"]["p99_ms"]
    worker = window["cpu_cores_mean"].get("worker")
    return {
        "steady": not growing and timeouts == 0 and window["workflow_task_failures"] == 0,
        "steady_why": f"backlog first third {first}, last third {last}; task timeouts {timeouts}; workflow task "
        f"failures {window['workflow_task_failures']}",
        "finding_to_impaired_p99_under_1s": p99 is not None and p99 < 1000 and not faults["missing"],
        "worker_under_one_core": worker is not None and worker < 1.0,
    }


def worker_log_summary(path: Path) -> dict[str, Any]:
    """Lines by level, and the most frequent warnings and errors (a failed workflow task is logged as one)."""
    levels: Counter[str] = Counter()
    messages: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        with contextlib.suppress(json.JSONDecodeError, AttributeError):
            entry = json.loads(line)
            levels[str(entry.get("level", "?"))] += 1
            if entry.get("level") in ("warning", "error", "critical"):
                messages[f"{entry['level']}: {str(entry.get('event', ''))[:160]}"] += 1
            continue
        levels["not json"] += 1
        messages[f"not json: {line[:160]}"] += 1
    return {"lines_by_level": dict(levels), "warnings_and_errors_top": messages.most_common(10)}


# --- The run ------------------------------------------------------------------------------------------------------


def raise_open_files(instances: int) -> int:
    """Each host keeps its connection to the ingest open between heartbeats, as the probe does: this process and
    the ingest (which inherits the limit) each hold one socket per host."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < instances + 2048:
        raise SystemExit(f"open files: the hard limit is {hard}; {instances} hosts need about {instances + 2048}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


async def run(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    import boto3

    from benchmarks.support import engine_settings
    from contract.groups import AutoRepair, CapacityGroup
    from contract.ingest import METRICS_PATH
    from contract.temporal_client import connect
    from simulator.engine_process import EngineProcess
    from simulator.fleet import SimTiming
    from simulator.servers import MotoServer, TemporalDevServer, free_port

    check_critical_xids()
    results: dict[str, Any] = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python -m benchmarks.heartbeat_scale", *sys.argv[1:]]),
        "machine": throughput.machine(),
        "uptime_before": throughput.shell(["uptime"]),
        "open_files_limit": raise_open_files(args.instances),
        "notes": "auto repair DISABLED: no ECS fleet behind these hosts (its cluster is empty, so the worker's AWS "
        "watch reads no instances): detection and the steady load, not repairs. A heartbeat after a host's first "
        "reaches Temporal only when it changed (the ingest's LivenessRelay); the liveness tracker hears in batches "
        "every 8 min",
    }
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION=REGION)
    group = f"gpu-{uuid.uuid4().hex[:8]}"
    timing = SimTiming(heartbeat_interval=timedelta(seconds=INTERVAL_S), heartbeat_loss_threshold=timedelta(minutes=10))
    metrics_port, worker_metrics_port, ingest_metrics_port = free_port(), free_port(), free_port()
    server_args = ["--headless", "--metrics-port", str(metrics_port)]
    async with (
        MotoServer(state / "moto", port=free_port()) as moto,
        TemporalDevServer(
            state / "temporal", port=free_port(), ui_port=free_port(), extra_args=server_args
        ) as temporal,
    ):
        settings = engine_settings(temporal.address, moto.endpoint_url, state / "events.jsonl", group, timing)
        # Production's group: every setting its default but the names and auto repair.
        production = CapacityGroup(
            name=group, cluster=group, launch_template=f"{group}-lt", auto_repair=AutoRepair.DISABLED
        )
        ingest_settings = IngestSettings(
            sts_endpoint=moto.endpoint_url,
            allowed_accounts=[throughput.ACCOUNT],
            metrics_bind=f"127.0.0.1:{ingest_metrics_port}",  # its metrics port: the hosts' serves none
        )
        # No health endpoint: its default port is fixed, and other runs may share the machine.
        update = {"groups": [production], "ingest": ingest_settings, "health_bind_address": None}
        settings = settings.model_copy(update=update)
        results["group"] = production.model_dump(mode="json")
        results["ingest_settings"] = ingest_settings.model_dump(mode="json", exclude={"session_secret"})
        ecs = boto3.client("ecs", endpoint_url=moto.endpoint_url, region_name=REGION)
        ecs.create_cluster(clusterName=group)  # empty: the worker's AWS watch reads no instances
        started = time.perf_counter()
        hosts = await asyncio.to_thread(throughput.launch_hosts, moto.endpoint_url, group, args.instances)
        results["setup_s"] = {"launch_hosts_and_assume_roles": round(time.perf_counter() - started, 1)}

        # The worker's Prometheus endpoint: engine_environment passes the environment on.
        os.environ["AUTOREPAIR_METRICS_BIND_ADDRESS"] = f"127.0.0.1:{worker_metrics_port}"
        worker = EngineProcess(settings, state / "worker.log", "worker")
        await worker.start()
        try:
            client = await connect(settings.temporal)
            worker_url = f"http://127.0.0.1:{worker_metrics_port}/metrics"
            await worker.listening("127.0.0.1", worker_metrics_port, within=90)
            async with throughput.ingest_process(settings, state, None, None) as ingest:
                fleet = Fleet(hosts, group, ingest.url, settings.ingest)
                assert moto.pid is not None and temporal.pid is not None and worker.pid is not None
                pids = {"worker": worker.pid, "temporal": temporal.pid, "moto": moto.pid}
                processes = throughput.Processes(pids | {"ingest": ingest.proc.pid, "loadgen": os.getpid()})
                urls = {
                    "worker": worker_url,
                    "temporal": f"http://127.0.0.1:{metrics_port}/metrics",
                    "ingest": f"http://127.0.0.1:{ingest_metrics_port}{METRICS_PATH}",
                }
                sampler = Sampler(processes, client, settings.temporal.task_queue, urls, fleet)
                try:
                    results |= await phases(args, fleet, sampler, Detection(state / "events.jsonl", group))
                finally:
                    await fleet.close()
            results["ingest_counters_at_exit"] = ingest.counters
        finally:
            await worker.stop()
    results["worker_log"] = worker_log_summary(state / "worker.log")
    results["uptime_after"] = throughput.shell(["uptime"])
    return results


async def phases(args: argparse.Namespace, fleet: Fleet, sampler: Sampler, detection: Detection) -> dict[str, Any]:
    out: dict[str, Any] = {}
    background = [
        asyncio.create_task(fleet.run(), name="heartbeat schedule"),
        asyncio.create_task(sampler.run(), name="sampler"),
        asyncio.create_task(detection.follow(), name="events"),
    ]
    try:
        started = time.monotonic()
        warm = await fleet.warm_up(args.warmup_concurrency)
        sent_s = time.monotonic() - started
        sampler.phase = "settling"
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while len(detection.ok) < args.instances and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        settled_s = time.monotonic() - started
        # The window's load is the steady one only once every host heartbeats on its slot: wait for the last's first.
        await asyncio.sleep(max(0.0, fleet.schedule_full_at + 1 - asyncio.get_running_loop().time()))
        out["warmup"] = {
            "first_heartbeats": warm.summary(),
            "concurrency": args.warmup_concurrency,
            "sending_s": round(sent_s, 1),
            "first_heartbeats_per_s": round(args.instances / sent_s, 1),
            "until_every_host_ok_s": round(settled_s, 1),
            "until_every_host_on_its_slot_s": round(time.monotonic() - started, 1),
            "hosts_ok": len(detection.ok),
            "settled": len(detection.ok) >= args.instances,
        }
        print(f"warm-up: {args.instances} first heartbeats in {sent_s:.0f} s, every host OK after {settled_s:.0f} s")

        window_s = 60 * args.minutes
        out["warmup"]["window_starts_at_t_s"] = round(time.monotonic() - sampler.began, 1)
        await sampler.sample()  # the settling's last: the window's rates count from here
        sampler.phase, fleet.measuring = "window", True
        before = sampler.processes.snapshot()
        wall = time.monotonic()
        faults = await inject_spread(args, fleet, window_s)
        await asyncio.sleep(max(0.0, wall + window_s - time.monotonic()))
        after = sampler.processes.snapshot()
        seconds = time.monotonic() - wall
        await sampler.sample()
        sampler.phase, fleet.measuring = "after", False
        out["window"] = {"seconds": round(seconds, 1), "heartbeats": fleet.window.summary()}
        out["window"]["heartbeat_slots_skipped_in_flight"] = fleet.skipped_in_flight
        cpu = {role: after[role] - before[role] for role in before}
        out["window"] |= summarise_window(sampler.series, cpu, seconds)

        deadline = time.monotonic() + DETECT_GRACE_S
        while time.monotonic() < deadline and any(f.instance_id not in detection.impaired for f in faults):
            await asyncio.sleep(0.5)
        detection.poll()
        out["faults"] = summarise_faults(faults, detection)
        out["faults"]["xids"] = dict(Counter(f.xid for f in faults))
        out["events_by_type"] = dict(detection.log.counts)
        out["goals"] = goals(out["window"], out["faults"])
        out["sampling_errors"] = dict(sampler.errors)
        out["window"][FAILURES_BY_LABEL] = sampler.task_failures_by
        out["series"] = sampler.series
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    return out


async def inject_spread(args: argparse.Namespace, fleet: Fleet, window_s: float) -> list[Fault]:
    """Start the faults' task: one finding from each of `--faults` distinct random hosts, at even spacing over the
    window (the middle of each of its equal parts). Returns the faults, filled in as they are sent."""
    rng = random.Random(args.seed)
    chosen = rng.sample(fleet.ids, args.faults)
    faults = [Fault(instance_id, CRITICAL_XIDS[n % len(CRITICAL_XIDS)]) for n, instance_id in enumerate(chosen)]
    start = time.monotonic()

    async def injector() -> None:
        for n, fault in enumerate(faults):
            await asyncio.sleep(max(0.0, start + (n + 0.5) * window_s / len(faults) - time.monotonic()))
            fleet.spawn(fleet.inject(fault))

    if faults:
        fleet.spawn(injector())
    return faults


def print_summary(results: dict[str, Any]) -> None:
    window, faults, warm = results["window"], results["faults"], results["warmup"]
    beats = window["heartbeats"]
    w = {k: v for k, v in window.items() if not isinstance(v, dict)}  # the figures, for the lines below
    decided, seen = faults["finding_to_impaired_event_time"], faults["finding_to_event_seen_in_file"]
    print(
        f"{results['settings']['instances']} hosts, {w['seconds']:.0f} s window, auto repair DISABLED\n"
        f"warm-up: first heartbeats {warm['sending_s']} s ({warm['first_heartbeats_per_s']}/s) "
        f"{warm['first_heartbeats']['statuses']}, every host OK after {warm['until_every_host_ok_s']} s\n"
        f"window heartbeats: {beats['sent']} {beats['statuses']}, p50 {beats['latency_ms_p50']} ms, p99 "
        f"{beats['latency_ms_p99']} ms, send lag p99 {beats['send_lag_ms_p99']} ms\n"
        f"CPU cores, mean: {window['cpu_cores_mean']}\nRSS MB, max: {window['rss_mb_max']}\n"
        f"signals/s reaching Temporal {w['signals_from_clients_per_s_mean']}; workflow tasks/s "
        f"{w['workflow_tasks_per_s_mean']}, activities/s {w['activities_per_s_mean']}; workflow task schedule-to-start "
        f"ms {w['wft_schedule_to_start_ms_mean_of_samples']} (worst {w['wft_schedule_to_start_ms_max_sample']})\n"
        f"backlog max {w['backlog_max']}, first third {w['backlog_mean_first_third']}, last third "
        f"{w['backlog_mean_last_third']}; timeouts: workflow task {w['workflow_task_timeouts']}, sticky "
        f"{w['sticky_schedule_to_start_timeouts']}, activity {w['activity_timeouts']}; workflow task failures "
        f"{w['workflow_task_failures']} (whole run, by label: {window.get(FAILURES_BY_LABEL)})\n"
        f"finding -> IMPAIRED event: p50 {decided['p50_ms']} ms, p99 {decided['p99_ms']} ms, max {decided['max_ms']} "
        f"ms; seen in file p50 {seen['p50_ms']} ms, p99 {seen['p99_ms']} ms; {faults['impaired']}/{faults['injected']} "
        f"impaired, {len(faults['impaired_without_fault'])} without a fault\ngoals: {json.dumps(results['goals'])}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=10_000, help="hosts heartbeating, each its own identity")
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the measured window")
    parser.add_argument("--faults", type=int, default=100, help="critical-Xid findings spread over the window")
    parser.add_argument("--warmup-concurrency", type=int, default=32, help="first heartbeats in flight at once")
    parser.add_argument("--seed", type=int, default=1, help="which hosts the faults hit")
    parser.add_argument("--state-dir", type=Path, default=None, help="keep logs and databases here (default: temp)")
    parser.add_argument("--json", type=Path, default=None, help="write every result, the series included, here")
    args = parser.parse_args()
    if not 0 <= args.faults <= args.instances or args.instances < 1 or args.minutes <= 0:
        parser.error("need 1 <= --instances, 0 <= --faults <= --instances, and --minutes > 0")
    with contextlib.ExitStack() as stack:
        state = args.state_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="heartbeat-scale-")))
        state.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(run(args, state))
    results["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    print_summary(results)
    summary = {k: v for k, v in results.items() if k != "series"}
    print(json.dumps(summary, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
