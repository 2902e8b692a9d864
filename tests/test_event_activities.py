"""publish_event against a real moto server: EventBridge (routed to SQS to read back) and JSON lines."""

from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from activities.aws import AwsClients
from activities.events import EventActivities
from activities.models import HEALTH_DETAIL_TYPE, REPAIR_DETAIL_TYPE, FleetEvent, RepairNews
from contract import event_types as ev
from contract import names
from contract.config import AwsSettings, EventSettings
from contract.health import CheckType, HealthState
from contract.repair import RepairPhase, RepairProgress
from tests.event_schema_check import problems

ENVELOPE = ["schema_version", "type", "event_id", "time", "group", "instance_id", "workflow_id", "detail"]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def aws(aws_env: str) -> AwsClients:
    return AwsClients(AwsSettings(endpoint_url=aws_env, max_attempts=2))


@pytest.fixture
def bus(aws_env: str) -> tuple[str, str, Any, str]:
    """A new bus whose events from a new source land in an SQS queue: (bus, source, sqs client, queue url)."""
    name, source = unique("bus"), unique("gpu-autorepair")
    events = boto3.client("events", region_name="us-east-1", endpoint_url=aws_env)
    events.create_event_bus(Name=name)
    sqs = boto3.client("sqs", region_name="us-east-1", endpoint_url=aws_env)
    queue_url = sqs.create_queue(QueueName=unique("events"))["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_rule(Name="all", EventBusName=name, EventPattern=json.dumps({"source": [source]}))
    events.put_targets(Rule="all", EventBusName=name, Targets=[{"Id": "queue", "Arn": queue_arn}])
    return name, source, sqs, queue_url


def received(sqs: Any, queue_url: str) -> list[dict[str, Any]]:
    messages = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages", [])
    return [json.loads(m["Body"]) for m in messages]


def health_event() -> FleetEvent:
    return FleetEvent.of(
        ev.HealthChanged(overall_status=HealthState.IMPAIRED, details=DETAILS),
        event_id=unique("evt"),
        time=datetime(2026, 3, 1, 12, 30, 5, tzinfo=UTC),
        group="gpu-a",
        instance_id="i-0123456789abcdef0",
        workflow_id="health/i-0123456789abcdef0",
    )


def repair_event(detail: ev.EventDetail | None = None) -> FleetEvent:
    return FleetEvent.of(
        detail or ev.ReplacementLaunched(replacement_instance_id="i-0fedcba9876543210", attempt=1),
        event_id=unique("evt"),
        time=datetime.now(UTC),
        group="gpu-a",
        instance_id="i-0123456789abcdef0",
        workflow_id="repair/i-0123456789abcdef0",
    )


DETAILS = [
    ev.HealthCheck(
        type=CheckType.ACCELERATED_COMPUTE,
        status=HealthState.IMPAIRED,
        statusReason="XID_79",
        lastUpdated=datetime(2026, 3, 1, 12, 30, 5, tzinfo=UTC),
        lastStatusChange=datetime(2026, 3, 1, 12, 30, 5, tzinfo=UTC),
    )
]


async def test_put_to_event_bus(client: Client, aws: AwsClients, bus: tuple[str, str, Any, str]) -> None:
    name, source, sqs, queue_url = bus
    acts = EventActivities(aws, EventSettings(bus_name=name, source=source), client)
    event = health_event()

    await ActivityEnvironment().run(acts.publish_event, event)

    [envelope] = received(sqs, queue_url)
    assert envelope["source"] == source
    assert envelope["detail-type"] == HEALTH_DETAIL_TYPE
    assert envelope["time"].startswith("2026-03-01T12:30:05")
    # EventBridge's Detail is the whole event as the other sinks receive it: the envelope, the type's own under detail.
    body = envelope["detail"]
    assert list(body) == ENVELOPE and problems(body) == []
    assert body["schema_version"] == 2 and body["time"] == "2026-03-01T12:30:05Z"
    assert (body["type"], body["group"], body["instance_id"], body["event_id"]) == (
        "HealthChanged",
        "gpu-a",
        event.instance_id,
        event.event_id,
    )
    own = body["detail"]
    assert own["overall_status"] == "IMPAIRED" and own["finding"] is None
    # ECS's event names for the API's `details` and `overallStatus`, both present and identical.
    assert own["healthChecks"] == own["details"] and own["overallStatus"] == own["overall_status"]
    assert own["healthChecks"][0]["lastUpdated"] == "2026-03-01T12:30:05Z"


async def test_repair_event_detail_type_and_no_health_checks(
    client: Client, aws: AwsClients, bus: tuple[str, str, Any, str]
) -> None:
    name, source, sqs, queue_url = bus
    acts = EventActivities(aws, EventSettings(bus_name=name, source=source), client)

    await ActivityEnvironment().run(acts.publish_event, repair_event())

    [envelope] = received(sqs, queue_url)
    assert envelope["detail-type"] == REPAIR_DETAIL_TYPE
    assert envelope["detail"]["detail"] == {"replacement_instance_id": "i-0fedcba9876543210", "attempt": 1}
    assert problems(envelope["detail"]) == []


async def test_put_to_default_bus(client: Client, aws: AwsClients) -> None:
    acts = EventActivities(aws, EventSettings(), client)
    await ActivityEnvironment().run(acts.publish_event, repair_event(ev.Terminated()))


async def test_jsonl_lines(client: Client, aws: AwsClients, tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "events.jsonl"
    acts = EventActivities(aws, EventSettings(eventbridge=False, jsonl_path=path), client)
    events = [health_event(), repair_event(), repair_event()]

    for event in events:
        await ActivityEnvironment().run(acts.publish_event, event)

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 3
    for line, event in zip(lines, events, strict=True):
        assert list(line) == ENVELOPE and problems(line) == []
        assert line["time"].endswith("Z")
        assert datetime.fromisoformat(line["time"]).utcoffset() is not None
        assert datetime.fromisoformat(line["time"]) == event.time
        assert (line["type"], line["group"], line["instance_id"]) == (
            event.type.value,
            event.group,
            event.instance_id,
        )
    assert lines[0]["detail"]["healthChecks"] == lines[0]["detail"]["details"]
    assert lines[1]["detail"]["replacement_instance_id"] == "i-0fedcba9876543210"


async def test_both_sinks(client: Client, aws: AwsClients, bus: tuple[str, str, Any, str], tmp_path: Path) -> None:
    name, source, sqs, queue_url = bus
    path = tmp_path / "events.jsonl"
    acts = EventActivities(aws, EventSettings(bus_name=name, source=source, jsonl_path=path), client)
    event = repair_event()

    await ActivityEnvironment().run(acts.publish_event, event)

    [envelope] = received(sqs, queue_url)
    assert envelope["detail"] == json.loads(path.read_text())


async def test_the_sinks_run_on_the_workers_call_threads_not_the_default_executor(
    client: Client, aws: AwsClients, bus: tuple[str, str, Any, str], tmp_path: Path
) -> None:
    # asyncio's default executor is min(32, cpus + 4) threads shared with the whole process: a burst of events at a
    # correlated failure queued there past the sinks' timeout (benchmarks/SCALE.md). One that refuses all work shows
    # that neither sink waits on it.
    name, source, sqs, queue_url = bus
    path = tmp_path / "events.jsonl"
    acts = EventActivities(aws, EventSettings(bus_name=name, source=source, jsonl_path=path), client)
    refusing = ThreadPoolExecutor(max_workers=1)
    refusing.shutdown()
    loop = asyncio.get_running_loop()
    loop.set_default_executor(refusing)
    try:
        await ActivityEnvironment().run(acts.publish_event, repair_event())
    finally:
        loop.set_default_executor(ThreadPoolExecutor())
    [envelope] = received(sqs, queue_url)
    assert envelope["detail"] == json.loads(path.read_text())


async def signals_to(client: Client, workflow_id: str) -> list[RepairProgress]:
    return [
        RepairProgress.model_validate_json(event.workflow_execution_signaled_event_attributes.input.payloads[0].data)
        async for event in client.get_workflow_handle(workflow_id).fetch_history_events()
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
        and event.workflow_execution_signaled_event_attributes.signal_name == names.SIGNAL_REPAIR_PROGRESS
    ]


async def test_news_tells_the_health_workflow_once_then_publishes_its_events_in_order(
    client: Client, aws: AwsClients, tmp_path: Path
) -> None:
    path = tmp_path / "events.jsonl"
    acts = EventActivities(aws, EventSettings(eventbridge=False, jsonl_path=path), client)
    # A workflow no worker runs still takes signals into its history.
    health = await client.start_workflow("NobodyRunsThis", id=unique("health/i"), task_queue=unique("nobody"))
    progress = RepairProgress(workflow_id="repair/i-0123456789abcdef0/1", phase=RepairPhase.DRAINING, token="secret")
    news = RepairNews(
        events=[repair_event(ev.DrainPermitGranted()), repair_event(ev.Draining())],
        progress=progress,
        health_workflow_id=health.id,
        signal_request_id=str(uuid.uuid4()),
    )

    # Twice, as a retry after a try that got through: the server drops the second signal by its request id.
    for _ in range(2):
        await ActivityEnvironment().run(acts.publish_news, news)

    assert await signals_to(client, health.id) == [progress]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    # Events go again on a retry (at least once): a consumer drops a duplicate by its id.
    assert [(line["type"], line["event_id"]) for line in lines] == [(e.type.value, e.event_id) for e in news.events] * 2
    await health.terminate()


async def test_news_of_a_health_workflow_gone_still_publishes_its_events(
    client: Client, aws: AwsClients, tmp_path: Path
) -> None:
    path = tmp_path / "events.jsonl"
    acts = EventActivities(aws, EventSettings(eventbridge=False, jsonl_path=path), client)
    progress = RepairProgress(workflow_id="repair/i-0123456789abcdef0/1", phase=RepairPhase.COMPLETED, token="secret")
    news = RepairNews(
        events=[repair_event(ev.Terminated())],
        progress=progress,
        health_workflow_id=unique("health/never-started"),
        signal_request_id=str(uuid.uuid4()),
    )

    await ActivityEnvironment().run(acts.publish_news, news)

    assert [json.loads(line)["event_id"] for line in path.read_text().splitlines()] == [news.events[0].event_id]
