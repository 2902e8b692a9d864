"""Event sinks fail open: a deleted bus, a throttling storm or an unwritable JSON-lines file never holds up
publish_event (so never a health change or a repair step); what a sink refuses is kept on disk, retried by the
worker's delivery task, delivered in order once the sink is back, or dead-lettered past `events.outbox_deadline`.

Real moto (EventBridge routed to SQS to read back), the fault-injecting proxy where EventBridge must misbehave, real
Temporal for the repairs. Every wait is a poll; the only bounds on time are wide ones that tell "waited for the
sink's outage" from "did not" (PROMPT), never how fast this machine is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber
from temporalio.client import Client
from temporalio.common import MetricMeter
from temporalio.exceptions import ApplicationError
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.testing import ActivityEnvironment

from activities.aws import AwsClients
from activities.events import EVENTBRIDGE, JSONL, EventActivities, event_delivery
from activities.models import EventType, FleetEvent
from activities.webhook import EVENT_RETRIES, EVENTS_DEAD_LETTERED, EVENTS_QUEUED, DrainTiming, Outbox
from contract.config import AwsSettings, EventSettings
from simulator.servers import free_port
from tests.flaky_aws import FlakyAws
from tests.fleet import START_BEFORE_STOP, Fleet, simulated_fleet
from tests.harness import eventually, unique
from worker.main import build_worker

# The sink's one try is 2 s by default; a publish that returns within PROMPT did not wait for the outage (which
# lasts far longer in every test below), whatever the load on this machine.
PROMPT = 10.0
FAST = DrainTiming(idle_poll=0.05, first_backoff=0.1, max_backoff=0.5)


# --- an event bus whose events land in an SQS queue, read back in arrival order ----------------------------------


@dataclass
class RoutedBus:
    name: str
    source: str
    queue_url: str
    endpoint: str
    got: list[dict[str, Any]] = field(default_factory=list)

    def sqs(self) -> Any:
        return boto3.client("sqs", region_name="us-east-1", endpoint_url=self.endpoint)

    def events(self) -> Any:
        return boto3.client("events", region_name="us-east-1", endpoint_url=self.endpoint)

    def received(self) -> list[dict[str, Any]]:
        """Every event's detail so far, in arrival order (each message read once, then deleted)."""
        sqs = self.sqs()
        while True:
            messages = sqs.receive_message(QueueUrl=self.queue_url, MaxNumberOfMessages=10).get("Messages", [])
            if not messages:
                return list(self.got)
            for message in messages:
                self.got.append(json.loads(message["Body"])["detail"])
                sqs.delete_message(QueueUrl=self.queue_url, ReceiptHandle=message["ReceiptHandle"])

    def ids(self) -> list[str]:
        return [d["event_id"] for d in self.received()]

    def delete(self) -> None:
        """As an operator (or a stack update) would: the bus is gone, its rule and target with it."""
        events = self.events()
        events.remove_targets(Rule="all", EventBusName=self.name, Ids=["queue"])
        events.delete_rule(Name="all", EventBusName=self.name)
        events.delete_event_bus(Name=self.name)


def routed_bus(endpoint: str) -> RoutedBus:
    bus = RoutedBus(name=unique("bus"), source=unique("gpu-autorepair"), queue_url="", endpoint=endpoint)
    events, sqs = bus.events(), bus.sqs()
    events.create_event_bus(Name=bus.name)
    bus.queue_url = sqs.create_queue(QueueName=unique("events"))["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=bus.queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_rule(Name="all", EventBusName=bus.name, EventPattern=json.dumps({"source": [bus.source]}))
    events.put_targets(Rule="all", EventBusName=bus.name, Targets=[{"Id": "queue", "Arn": arn}])
    return bus


# --- events, publishing, what waits on disk ----------------------------------------------------------------------


def events(count: int) -> list[FleetEvent]:
    run = uuid.uuid4().hex[:8]
    steps = [EventType.REPAIR_STARTED, EventType.DRAIN_PERMIT_GRANTED, EventType.DRAINING]
    return [
        FleetEvent(
            event_id=f"evt-{run}-{i:03d}",
            time=datetime.now(UTC),
            type=steps[i % len(steps)],
            group="gpu-a",
            instance_id="i-0123456789abcdef0",
            workflow_id="repair/i-0123456789abcdef0",
            fields={"reason": "XID_79", "step": i},
        )
        for i in range(count)
    ]


async def publish_all(acts: EventActivities, batch: list[FleetEvent], meter: MetricMeter | None = None) -> list[float]:
    """Publish one after another, as a workflow does; returns how long each publish took."""
    took = []
    for event in batch:
        env = ActivityEnvironment()
        if meter is not None:
            env.metric_meter = meter
        started = time.monotonic()
        await env.run(acts.publish_event, event)
        took.append(time.monotonic() - started)
    return took


def waiting(settings: EventSettings, sink: str) -> list[dict[str, Any]]:
    """The events waiting in a sink's outboxes, oldest first."""
    found = Outbox.under(settings.webhook_outbox_dir / sink, 10_000, sink)
    return [json.loads(path.read_bytes())["event"] for outbox in found for path in outbox.entries()]


def dead_letters(settings: EventSettings, sink: str) -> list[dict[str, Any]]:
    path = settings.webhook_outbox_dir / sink / "dead-letter.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def dead_letters_of(settings: EventSettings, workflow_id: str) -> list[dict[str, Any]]:
    return [r for r in dead_letters(settings, EVENTBRIDGE) if r["event"]["workflow_id"] == workflow_id]


def delivery(settings: EventSettings, meter: MetricMeter | None = None) -> AbstractAsyncContextManager[None]:
    """The worker's delivery tasks, polling and backing off in tenths of seconds rather than seconds."""
    return event_delivery(settings, meter, timing=FAST)


# --- metrics, as the worker exports them --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prometheus() -> Iterator[tuple[MetricMeter, int]]:
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}")))
    yield runtime.metric_meter, port  # the endpoint lives as long as the runtime
    del runtime


def metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- the sinks, one by one ----------------------------------------------------------------------------------------


async def test_a_bus_deleted_mid_run_keeps_the_events_then_dead_letters_them_with_a_log_line_and_a_metric(
    aws_env: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, prometheus: tuple[MetricMeter, int]
) -> None:
    meter, port = prometheus
    case = unique("case")
    labelled = meter.with_additional_attributes({"case": case})
    bus = routed_bus(aws_env)
    settings = EventSettings(
        bus_name=bus.name,
        source=bus.source,
        webhook_outbox_dir=tmp_path / "outbox",
        outbox_deadline=timedelta(seconds=3),
    )
    acts = EventActivities(AwsClients(AwsSettings(endpoint_url=aws_env)), settings)
    first, *later = events(4)

    await publish_all(acts, [first], labelled)
    assert await eventually(lambda: asyncio.to_thread(bus.ids), bool) == [first.event_id]

    bus.delete()
    with caplog.at_level(logging.WARNING):
        took = await publish_all(acts, later, labelled)
    assert max(took) < PROMPT, took
    assert [e["event_id"] for e in waiting(settings, EVENTBRIDGE)] == [e.event_id for e in later]
    # The first to meet the missing bus tried it and says why, as an error (it needs an operator); the rest queued
    # behind it without a request of their own.
    [refused] = [r for r in caplog.records if "queued for retry" in r.getMessage()]
    assert refused.levelno == logging.ERROR and later[0].event_id in refused.getMessage()
    assert "ResourceNotFoundException" in refused.getMessage() and bus.name in refused.getMessage()
    assert metric(port, EVENTS_QUEUED, sink=EVENTBRIDGE, cause="permanent_error", case=case) == 1
    assert metric(port, EVENTS_QUEUED, sink=EVENTBRIDGE, cause="backlog", case=case) == 2

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        async with delivery(settings, labelled):
            records = await eventually(
                lambda: asyncio.sleep(0, dead_letters(settings, EVENTBRIDGE)), lambda r: len(r) == 3, within=60
            )
    # Kept and retried until the deadline, then dead-lettered in order, each with the event whole and the last error.
    assert metric(port, EVENT_RETRIES, sink=EVENTBRIDGE, outcome="permanent_error", case=case) >= 1
    assert [r["event_id"] for r in records] == [e.event_id for e in later]
    assert [r["event"]["event_id"] for r in records] == [e.event_id for e in later]
    assert all(r["sink"] == EVENTBRIDGE and r["reason"] == "deadline" for r in records)
    assert all("ResourceNotFoundException" in r["error"] for r in records)
    assert all(r["target"]["bus_name"] == bus.name and r["event"]["reason"] == "XID_79" for r in records)
    assert waiting(settings, EVENTBRIDGE) == []
    gave_up = [r for r in caplog.records if "dead-lettered" in r.getMessage()]
    assert len(gave_up) == 3 and all(r.levelno == logging.ERROR for r in gave_up)
    assert metric(port, EVENTS_DEAD_LETTERED, sink=EVENTBRIDGE, reason="deadline", case=case) == 3


async def test_a_throttling_storm_on_put_events_delays_the_events_which_arrive_in_order_once_it_stops(
    aws_env: str, tmp_path: Path
) -> None:
    bus = routed_bus(aws_env)
    settings = EventSettings(bus_name=bus.name, source=bus.source, webhook_outbox_dir=tmp_path / "outbox")
    batch = events(8)
    with FlakyAws(aws_env) as proxy:
        storm = proxy.fail("PutEvents", "ThrottlingException")
        acts = EventActivities(AwsClients(AwsSettings(endpoint_url=proxy.url)), settings)
        took = await publish_all(acts, batch[:4])
        assert max(took) < PROMPT, took
        # One request, no retry of it by botocore: the outbox is the retry, and the rest queued behind the first.
        assert proxy.calls("PutEvents") == 1

        async with delivery(settings):
            # The storm goes on: the delivery task keeps trying, and events published meanwhile queue behind.
            await eventually(lambda: asyncio.sleep(0, storm.failed), lambda failed: failed >= 5, within=60)
            took = await publish_all(acts, batch[4:])
            assert max(took) < PROMPT, took
            assert await asyncio.to_thread(bus.ids) == []
            assert len(waiting(settings, EVENTBRIDGE)) == len(batch)

            proxy.heal()
            await eventually(lambda: asyncio.to_thread(bus.ids), lambda ids: len(ids) >= len(batch), within=60)
            # An entry is removed from the outbox once the bus took it: the last removal follows the last put.
            await eventually(lambda: asyncio.sleep(0, waiting(settings, EVENTBRIDGE)), lambda left: left == [])
    assert bus.ids() == [e.event_id for e in batch]
    assert [d["step"] for d in bus.received()] == list(range(len(batch)))
    assert waiting(settings, EVENTBRIDGE) == [] and dead_letters(settings, EVENTBRIDGE) == []


async def test_an_unwritable_json_lines_file_keeps_the_events_and_writes_them_in_order_once_it_can(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, prometheus: tuple[MetricMeter, int]
) -> None:
    meter, port = prometheus
    case = unique("case")
    labelled = meter.with_additional_attributes({"case": case})
    # A file where the folder should be: no process, root included, can create the events file under it.
    blocker = tmp_path / "logs"
    blocker.write_text("not a folder\n")
    path = blocker / "events.jsonl"
    settings = EventSettings(eventbridge=False, jsonl_path=path, webhook_outbox_dir=tmp_path / "outbox")
    acts = EventActivities(AwsClients(AwsSettings(region="us-east-1")), settings)
    batch = events(5)

    with caplog.at_level(logging.WARNING):
        took = await publish_all(acts, batch, labelled)
    assert max(took) < PROMPT, took
    assert [e["event_id"] for e in waiting(settings, JSONL)] == [e.event_id for e in batch]
    [refused] = [r for r in caplog.records if "queued for retry" in r.getMessage()]
    assert str(path) in refused.getMessage()

    async with delivery(settings, labelled):
        await eventually(
            lambda: asyncio.to_thread(metric, port, EVENT_RETRIES, sink=JSONL, outcome="transient_error", case=case),
            lambda failed: failed >= 2,
            within=60,
        )
        assert not path.exists()
        blocker.unlink()  # the operator fixes the disk
        await eventually(
            lambda: asyncio.sleep(0, path.read_text().splitlines() if path.exists() else []),
            lambda lines: len(lines) >= len(batch),
            within=60,
        )
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event_id"] for line in lines] == [e.event_id for e in batch]
    assert lines[0]["type"] == "RepairStarted" and lines[0]["time"].endswith("Z")
    assert waiting(settings, JSONL) == [] and dead_letters(settings, JSONL) == []


async def test_a_retried_publish_queues_its_event_once(aws_env: str, tmp_path: Path) -> None:
    settings = EventSettings(bus_name=unique("no-such-bus"), webhook_outbox_dir=tmp_path / "outbox")
    acts = EventActivities(AwsClients(AwsSettings(endpoint_url=aws_env)), settings)
    [event] = events(1)
    # As when Temporal retries the activity (the worker died after queueing, before completing).
    await publish_all(acts, [event, event, event])
    assert [e["event_id"] for e in waiting(settings, EVENTBRIDGE)] == [event.event_id]


async def test_an_entry_no_sink_can_take_is_dead_lettered_at_once_and_does_not_block_the_rest(tmp_path: Path) -> None:
    blocker = tmp_path / "logs"
    blocker.write_text("not a folder\n")
    path = blocker / "events.jsonl"
    settings = EventSettings(eventbridge=False, jsonl_path=path, webhook_outbox_dir=tmp_path / "outbox")
    acts = EventActivities(AwsClients(AwsSettings(region="us-east-1")), settings)
    batch = events(2)
    # Two events queued while the file cannot be written, and a damaged entry (a torn copy, a hand edit) between.
    await publish_all(acts, batch[:1])
    [outbox] = Outbox.under(settings.webhook_outbox_dir / JSONL, 10, JSONL)
    (outbox.directory / f"{time.time_ns():020d}-damaged.json").write_bytes(b"{not json")
    await publish_all(acts, batch[1:])
    assert len(outbox.entries()) == 3
    blocker.unlink()

    async with delivery(settings):
        await eventually(lambda: asyncio.sleep(0, outbox.entries()), lambda left: left == [], within=30)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event_id"] for line in lines] == [e.event_id for e in batch]
    [record] = dead_letters(settings, JSONL)
    assert record["reason"] == "rejected" and record["event"] == "{not json"
    assert "unreadable outbox entry" in record["error"]


# --- a repair while EventBridge misbehaves ---------------------------------------------------------------------


@asynccontextmanager
async def repairing_fleet(
    client: Client, aws_env: str, tmp_path: Path, proxy: FlakyAws, bus: RoutedBus, **events_settings: Any
) -> AsyncIterator[Fleet]:
    """The simulated fleet, with the engine's EventBridge behind `proxy` and its outboxes under tmp_path."""
    async with simulated_fleet(
        client, aws_env, tmp_path, instances=2, engine_endpoint=proxy.url, in_process_worker=False
    ) as fleet:
        fleet.settings.events = EventSettings(
            jsonl_path=fleet.events_path,
            bus_name=bus.name,
            source=bus.source,
            webhook_outbox_dir=tmp_path / "outbox",
            **events_settings,
        )
        async with delivery(fleet.settings.events), build_worker(fleet.settings, client):
            yield fleet


async def publish_durations(client: Client, workflow_id: str) -> list[tuple[int, float]]:
    """(attempt, seconds from scheduled to completed) of each publish_event of a workflow."""
    history = (await client.get_workflow_handle(workflow_id).fetch_history()).events
    scheduled = {
        e.event_id: e.event_time.ToDatetime()
        for e in history
        if e.HasField("activity_task_scheduled_event_attributes")
        and e.activity_task_scheduled_event_attributes.activity_type.name == "publish_event"
    }
    attempts = {
        e.event_id: e.activity_task_started_event_attributes.attempt
        for e in history
        if e.HasField("activity_task_started_event_attributes")
        and e.activity_task_started_event_attributes.scheduled_event_id in scheduled
    }
    out = []
    for e in history:
        if e.HasField("activity_task_completed_event_attributes"):
            done = e.activity_task_completed_event_attributes
            if done.scheduled_event_id in scheduled:
                took = (e.event_time.ToDatetime() - scheduled[done.scheduled_event_id]).total_seconds()
                out.append((attempts[done.started_event_id], took))
    return out


async def repair_one(fleet: Fleet) -> tuple[str, str]:
    """Impair one instance and wait for its repair to finish; returns the instance and its repair's workflow id."""
    [faulty] = fleet.sim.live_instances()[:1]
    fleet.sim.inject_fault(faulty)
    await eventually(lambda: asyncio.sleep(0, fleet.events("DrainPermitReleased", faulty)), bool, within=180)
    assert fleet.steps(faulty) == START_BEFORE_STOP
    [started] = fleet.events("RepairStarted", faulty)
    return faulty, str(started["workflow_id"])


async def assert_no_publish_waited(client: Client, workflow_id: str, steps: int) -> None:
    durations = await publish_durations(client, workflow_id)
    assert len(durations) >= steps, durations
    # Each on its first attempt, none waiting for the sink's outage (which outlasted the whole repair).
    assert all(attempt == 1 and took < PROMPT for attempt, took in durations), durations


async def test_a_repair_under_a_put_events_throttling_storm_is_not_held_up_and_its_events_arrive_after(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    bus = routed_bus(aws_env)
    with FlakyAws(aws_env) as proxy:
        async with repairing_fleet(client, aws_env, tmp_path, proxy, bus) as fleet:
            await eventually(fleet.sim.snapshot, lambda s: s.healthy == 2 and s.running == 2, within=90)
            storm = proxy.fail("PutEvents", "ThrottlingException")
            _, workflow_id = await repair_one(fleet)
            await assert_no_publish_waited(client, workflow_id, len(START_BEFORE_STOP))
            assert storm.failed >= 1
            kept = [e["type"] for e in waiting(fleet.settings.events, EVENTBRIDGE) if e["workflow_id"] == workflow_id]
            assert kept == START_BEFORE_STOP

            proxy.heal()

            def repair_steps() -> list[str]:
                return [d["type"] for d in bus.received() if d["workflow_id"] == workflow_id]

            arrived = await eventually(
                lambda: asyncio.to_thread(repair_steps), lambda s: len(s) >= len(START_BEFORE_STOP), within=120
            )
    assert arrived == START_BEFORE_STOP


async def test_a_repair_goes_on_when_its_event_bus_is_deleted_and_its_events_are_dead_lettered(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    bus = routed_bus(aws_env)
    with FlakyAws(aws_env) as proxy:
        async with repairing_fleet(
            client, aws_env, tmp_path, proxy, bus, outbox_deadline=timedelta(seconds=5)
        ) as fleet:
            await eventually(fleet.sim.snapshot, lambda s: s.healthy == 2 and s.running == 2, within=90)
            bus.delete()
            faulty, workflow_id = await repair_one(fleet)
            await assert_no_publish_waited(client, workflow_id, len(START_BEFORE_STOP))
            # The repair's events wait for the bus until the deadline, then go to the dead-letter file, in order.
            records = await eventually(
                lambda: asyncio.sleep(0, dead_letters_of(fleet.settings.events, workflow_id)),
                lambda r: len(r) >= len(START_BEFORE_STOP),
                within=120,
            )
    assert [r["event"]["type"] for r in records] == START_BEFORE_STOP
    assert all("ResourceNotFoundException" in r["error"] for r in records)
    assert fleet.ec2_state(faulty) == "terminated"


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        ("ThrottlingException", "transient"),
        ("InternalFailure", "transient"),
        ("AccessDeniedException", "permanent"),
        ("MalformedDetail", "rejected"),
    ],
)
async def test_a_failed_put_events_entry_is_kept_or_dead_lettered_by_its_error_code(
    aws_env: str, tmp_path: Path, code: str, kind: str
) -> None:
    # moto never fails an entry of a well-formed event, so the sink's answer is stubbed here.
    settings = EventSettings(webhook_outbox_dir=tmp_path / "outbox")
    acts = EventActivities(AwsClients(AwsSettings(endpoint_url=aws_env)), settings)
    assert acts._eventbridge is not None
    [event] = events(1)
    with Stubber(acts._eventbridge._put._aws.events) as stub:
        stub.add_response(
            "put_events", {"FailedEntryCount": 1, "Entries": [{"ErrorCode": code, "ErrorMessage": "boom"}]}
        )
        took = await publish_all(acts, [event])
    assert max(took) < PROMPT, took
    kept = [e["event_id"] for e in waiting(settings, EVENTBRIDGE)]
    buried = dead_letters(settings, EVENTBRIDGE)
    if kind == "rejected":
        # No retry can make the sink take it, and it must not block the events behind it.
        assert kept == [] and [(r["event_id"], r["reason"]) for r in buried] == [(event.event_id, "rejected")]
        assert code in buried[0]["error"] and event.event_id in buried[0]["error"]
    else:
        assert kept == [event.event_id] and buried == []


async def test_an_event_neither_delivered_nor_kept_fails_the_activity_for_a_bounded_retry(
    aws_env: str, tmp_path: Path
) -> None:
    # The bus is missing and the outbox cannot be created (a file where its folder should be): a broken disk.
    blocker = tmp_path / "outbox"
    blocker.write_text("")
    settings = EventSettings(bus_name=unique("no-such-bus"), webhook_outbox_dir=blocker)
    acts = EventActivities(AwsClients(AwsSettings(endpoint_url=aws_env)), settings)
    [event] = events(1)
    with pytest.raises(ApplicationError) as raised:
        await ActivityEnvironment().run(acts.publish_event, event)
    assert raised.value.type == "EventOutboxUnusable" and not raised.value.non_retryable
    assert event.event_id in raised.value.message
