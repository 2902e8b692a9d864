"""Event sinks fail open: a deleted bus, a throttling storm or an unwritable JSON-lines file never holds up
publish_event (so never a health change or a repair step); what a sink refuses waits in that sink's event outbox, a
Temporal workflow, is retried from there, delivered in order once the sink is back, or dead-lettered past
`events.outbox_deadline`. Nothing waits on a worker's disk.

Real moto (EventBridge routed to SQS to read back), the fault-injecting proxy where EventBridge must misbehave, a real
Temporal dev server for the outboxes and the repairs. Every wait is a poll; the only bounds on time are wide ones that
tell "waited for the sink's outage" from "did not" (PROMPT), never how fast this machine is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from temporalio.api.history.v1 import ActivityTaskScheduledEventAttributes
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.runtime import Runtime
from temporalio.testing import ActivityEnvironment

from activities.aws import AwsClients
from activities.events import EventActivities
from activities.metrics import EVENT_RETRIES, EVENTS_DEAD_LETTERED, EVENTS_QUEUED
from contract import names
from contract.config import AwsSettings, EventSettings
from contract.event_outbox import Sink, SinkTarget, outbox_workflow_id
from simulator.aws_proxy import FlakyAws
from simulator.servers import free_port
from tests.fleet import START_BEFORE_STOP, Fleet, simulated_fleet
from tests.harness import eventually, unique
from tests.outbox_harness import Publisher, events, metered_client, metric, prometheus_runtime, publisher
from worker.main import build_worker

__all__ = ["prometheus_runtime"]  # a fixture, used by name

# The sink's one try is 2 s by default; a publish that returns within PROMPT did not wait for the outage (which
# lasts far longer in every test below), whatever the load on this machine.
PROMPT = 10.0


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


def bus_target(bus: RoutedBus) -> SinkTarget:
    return SinkTarget(
        sink=Sink.EVENTBRIDGE, region="us-east-1", endpoint_url=bus.endpoint, bus_name=bus.name, source=bus.source
    )


# --- the sinks, one by one ----------------------------------------------------------------------------------------


async def test_a_bus_deleted_mid_run_keeps_the_events_then_dead_letters_them_with_a_log_line_and_a_metric(
    client: Client, aws_env: str, caplog: pytest.LogCaptureFixture, prometheus_runtime: tuple[Runtime, int]
) -> None:
    runtime, port = prometheus_runtime
    bus = routed_bus(aws_env)
    settings = EventSettings(bus_name=bus.name, source=bus.source, outbox_deadline=timedelta(seconds=3))
    events_of = publisher(await metered_client(client, runtime), AwsSettings(endpoint_url=aws_env), settings)
    target = bus_target(bus)
    first, *later = events(4)

    await events_of.publish([first])
    assert await eventually(lambda: asyncio.to_thread(bus.ids), bool) == [first.event_id]
    assert await events_of.outbox(target) == (None, False)  # a healthy sink costs no outbox

    bus.delete()
    with caplog.at_level(logging.WARNING):
        took = await events_of.publish(later)
    assert max(took) < PROMPT, took
    # The first to meet the missing bus tried it and says why, as an error (it needs an operator); the rest queued
    # behind it (its outbox runs: a backlog) without a request of their own.
    [refused] = [r for r in caplog.records if "queued for retry" in r.getMessage()]
    assert refused.levelno == logging.ERROR and later[0].event_id in refused.getMessage()
    assert "ResourceNotFoundException" in refused.getMessage() and bus.name in refused.getMessage()

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        async with events_of.outbox_worker():
            # Kept: the outbox holds all three in order. The 3 s deadline may already have dead-lettered the oldest
            # on a loaded machine, so what it has given up and what still waits are counted together.
            now, running = await events_of.outbox(target)
            assert now is not None and now.delivered == 0
            held = [d.entry.event_id for d in now.dead_letters] + (now.waiting_event_ids if running else [])
            assert held == [e.event_id for e in later]
            view = await eventually(
                lambda: events_of.outbox(target), lambda found: not found[1] and found[0] is not None, within=60
            )
    # Kept and retried until the deadline, then dead-lettered in order, each with the event whole and the last error.
    result = view[0]
    assert result is not None and result.waiting == 0 and result.dead_lettered == 3
    assert [d.entry.event_id for d in result.dead_letters] == [e.event_id for e in later]
    assert all(d.reason == "deadline" and "ResourceNotFoundException" in d.error for d in result.dead_letters)
    assert all(
        (d.entry.event["type"], d.entry.event["detail"]) == (e.type.value, e.detail)
        for d, e in zip(result.dead_letters, later, strict=True)
    )
    gave_up = [r for r in caplog.records if "dead-lettered (deadline)" in r.getMessage()]
    assert len(gave_up) == 3 and all(r.levelno == logging.ERROR for r in gave_up)
    assert all(e.event_id in r.getMessage() for e, r in zip(later, gave_up, strict=True))
    assert metric(port, EVENTS_QUEUED, sink="eventbridge", cause="permanent_error") >= 1
    assert metric(port, EVENTS_QUEUED, sink="eventbridge", cause="backlog") >= 2
    assert metric(port, EVENT_RETRIES, sink="eventbridge", outcome="permanent_error") >= 1
    assert metric(port, EVENTS_DEAD_LETTERED, sink="eventbridge", reason="deadline") >= 3


async def test_a_throttling_storm_on_put_events_delays_the_events_which_arrive_in_order_once_it_stops(
    client: Client, aws_env: str
) -> None:
    bus = routed_bus(aws_env)
    settings = EventSettings(bus_name=bus.name, source=bus.source)
    batch = events(8)
    with FlakyAws(aws_env) as proxy:
        events_of = publisher(client, AwsSettings(endpoint_url=proxy.url), settings)
        target = bus_target(bus).model_copy(update={"endpoint_url": proxy.url})
        storm = proxy.fail("PutEvents", "ThrottlingException")
        took = await events_of.publish(batch[:4])
        assert max(took) < PROMPT, took
        # One request, no retry of it by botocore: the outbox is the retry, and the rest queued behind the first.
        assert proxy.calls("PutEvents") == 1

        async with events_of.outbox_worker():
            # The storm goes on: the outbox keeps trying, and events published meanwhile queue behind.
            await eventually(lambda: asyncio.sleep(0, storm.failed), lambda failed: failed >= 3, within=60)
            took = await events_of.publish(batch[4:])
            assert max(took) < PROMPT, took
            assert await asyncio.to_thread(bus.ids) == []
            assert await events_of.waiting_ids(target) == [e.event_id for e in batch]

            proxy.heal()
            await eventually(lambda: asyncio.to_thread(bus.ids), lambda ids: len(ids) >= len(batch), within=120)
            # The outbox ends once the bus took its last event.
            view, _ = await eventually(lambda: events_of.outbox(target), lambda found: not found[1])
    assert bus.ids() == [e.event_id for e in batch]
    assert [(d["type"], d["detail"]) for d in bus.received()] == [(e.type.value, e.detail) for e in batch]
    assert view is not None and view.delivered == len(batch) and view.dead_letters == []


async def test_an_unwritable_json_lines_file_keeps_the_events_and_writes_them_in_order_once_it_can(
    client: Client, tmp_path: Path, caplog: pytest.LogCaptureFixture, prometheus_runtime: tuple[Runtime, int]
) -> None:
    runtime, port = prometheus_runtime
    # A file where the folder should be: no process, root included, can create the events file under it.
    blocker = tmp_path / "logs"
    blocker.write_text("not a folder\n")
    path = blocker / "events.jsonl"
    settings = EventSettings(eventbridge=False, jsonl_path=path)
    events_of = publisher(await metered_client(client, runtime), AwsSettings(region="us-east-1"), settings)
    target = SinkTarget(sink=Sink.JSONL, path=str(path))
    batch = events(5)

    with caplog.at_level(logging.WARNING):
        took = await events_of.publish(batch)
    assert max(took) < PROMPT, took
    [refused] = [r for r in caplog.records if "queued for retry" in r.getMessage()]
    assert str(path) in refused.getMessage()

    async with events_of.outbox_worker():
        assert await events_of.waiting_ids(target) == [e.event_id for e in batch]
        await eventually(
            lambda: asyncio.to_thread(metric, port, EVENT_RETRIES, sink="jsonl", outcome="transient_error"),
            lambda failed: failed >= 2,
            within=60,
        )
        assert not path.exists()
        blocker.unlink()  # the operator fixes the disk
        await eventually(
            lambda: asyncio.sleep(0, path.read_text().splitlines() if path.exists() else []),
            lambda lines: len(lines) >= len(batch),
            within=120,
        )
        view, _ = await eventually(lambda: events_of.outbox(target), lambda found: not found[1])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event_id"] for line in lines] == [e.event_id for e in batch]
    assert lines[0]["type"] == "RepairStarted" and lines[0]["time"].endswith("Z")
    assert view is not None and view.dead_letters == [] and view.delivered == len(batch)


async def test_a_retried_publish_queues_its_event_once(client: Client, aws_env: str) -> None:
    settings = EventSettings(bus_name=unique("no-such-bus"))
    events_of = publisher(client, AwsSettings(endpoint_url=aws_env), settings)
    [event] = events(1)
    # As when Temporal retries the activity (the worker died after handing it over, before completing).
    await events_of.publish([event, event, event])
    target = SinkTarget(
        sink=Sink.EVENTBRIDGE,
        region="us-east-1",
        endpoint_url=aws_env,
        bus_name=settings.bus_name,
        source=settings.source,
    )
    async with events_of.outbox_worker():
        assert await events_of.waiting_ids(target) == [event.event_id]


async def test_a_signal_no_outbox_can_read_is_counted_and_dropped_and_the_events_still_flow(
    client: Client, tmp_path: Path
) -> None:
    blocker = tmp_path / "logs"
    blocker.write_text("not a folder\n")
    path = blocker / "events.jsonl"
    settings = EventSettings(eventbridge=False, jsonl_path=path)
    events_of = publisher(client, AwsSettings(region="us-east-1"), settings)
    target = SinkTarget(sink=Sink.JSONL, path=str(path))
    batch = events(2)
    # Two events queued while the file cannot be written, and garbage between them (a hand-made signal, a bug).
    await events_of.publish(batch[:1])
    handle = client.get_workflow_handle(outbox_workflow_id(target, events_of.task_queue))
    await handle.signal(names.SIGNAL_OUTBOX_ENQUEUE, {"not": "an entry"})
    await handle.signal("no-such-signal", "x")
    await events_of.publish(batch[1:])
    blocker.unlink()

    async with events_of.outbox_worker():
        view, _ = await eventually(lambda: events_of.outbox(target), lambda found: not found[1], within=60)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event_id"] for line in lines] == [e.event_id for e in batch]
    assert view is not None and view.rejected_signals == 2 and view.dead_letters == []


# --- a repair while EventBridge misbehaves ---------------------------------------------------------------------


@asynccontextmanager
async def repairing_fleet(
    client: Client, aws_env: str, tmp_path: Path, proxy: FlakyAws, bus: RoutedBus, **events_settings: Any
) -> AsyncIterator[Fleet]:
    """The simulated fleet, with the engine's EventBridge behind `proxy`."""
    async with simulated_fleet(
        client, aws_env, tmp_path, instances=2, engine_proxy=proxy, in_process_worker=False
    ) as fleet:
        fleet.settings.events = EventSettings(
            jsonl_path=fleet.events_path,
            bus_name=bus.name,
            source=bus.source,
            **events_settings,
        )
        async with build_worker(fleet.settings, client):
            yield fleet


def fleet_outbox(client: Client, fleet: Fleet, proxy: FlakyAws, bus: RoutedBus) -> Publisher:
    """The fleet's events as their outbox sees them (the publisher's own activities are not used)."""
    return Publisher(
        client=client,
        aws=AwsSettings(endpoint_url=proxy.url),
        settings=fleet.settings.events,
        task_queue=fleet.settings.temporal.task_queue,
    )


PUBLISHERS = ("publish_event", "publish_news")


def events_carried(scheduled: ActivityTaskScheduledEventAttributes) -> int:
    if scheduled.activity_type.name == "publish_event":
        return 1
    return len(json.loads(scheduled.input.payloads[0].data)["events"])


async def publish_durations(client: Client, workflow_id: str) -> list[tuple[int, float, int]]:
    """(attempt, seconds from scheduled to completed, events carried) of each activity of a workflow that published its
    events, once it has closed: its last event's line is in the log before that publish's completion is in its
    history."""
    handle = client.get_workflow_handle(workflow_id)
    await asyncio.wait_for(handle.result(), timeout=60)
    history = (await handle.fetch_history()).events
    scheduled = {
        e.event_id: (e.event_time.ToDatetime(), events_carried(e.activity_task_scheduled_event_attributes))
        for e in history
        if e.HasField("activity_task_scheduled_event_attributes")
        and e.activity_task_scheduled_event_attributes.activity_type.name in PUBLISHERS
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
                at, carried = scheduled[done.scheduled_event_id]
                out.append((attempts[done.started_event_id], (e.event_time.ToDatetime() - at).total_seconds(), carried))
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
    assert sum(carried for _, _, carried in durations) >= steps, durations
    # Each on its first attempt, none waiting for the sink's outage (which outlasted the whole repair).
    assert all(attempt == 1 and took < PROMPT for attempt, took, _ in durations), durations


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
            outbox = fleet_outbox(client, fleet, proxy, bus)
            waiting = await outbox.waiting_ids(bus_target(bus).model_copy(update={"endpoint_url": proxy.url}))
            steps = {e["event_id"]: e["type"] for e in fleet.events() if e["workflow_id"] == workflow_id}
            assert [steps[i] for i in waiting if i in steps] == START_BEFORE_STOP

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
            # The repair's events wait for the bus until the deadline, then are dead-lettered, in order.
            outbox = fleet_outbox(client, fleet, proxy, bus)
            target = bus_target(bus).model_copy(update={"endpoint_url": proxy.url})

            async def dead_letters() -> list[dict[str, Any]]:
                view, _ = await outbox.outbox(target)
                letters = view.dead_letters if view is not None else []
                return [
                    d.entry.event | {"error": d.error} for d in letters if d.entry.event["workflow_id"] == workflow_id
                ]

            records = await eventually(dead_letters, lambda r: len(r) >= len(START_BEFORE_STOP), within=120)
    assert [r["type"] for r in records] == START_BEFORE_STOP
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
    client: Client, aws_env: str, code: str, kind: str
) -> None:
    # moto never fails an entry of a well-formed event, so the bus's answer is canned by the proxy.
    with FlakyAws(aws_env) as proxy:
        proxy.answer("PutEvents", {"FailedEntryCount": 1, "Entries": [{"ErrorCode": code, "ErrorMessage": "boom"}]})
        settings = EventSettings(bus_name=unique("bus"))
        events_of = publisher(client, AwsSettings(endpoint_url=proxy.url), settings)
        target = SinkTarget(
            sink=Sink.EVENTBRIDGE,
            region="us-east-1",
            endpoint_url=proxy.url,
            bus_name=settings.bus_name,
            source=settings.source,
        )
        [event] = events(1)
        took = await events_of.publish([event])
        assert max(took) < PROMPT, took
        async with events_of.outbox_worker():
            if kind == "rejected":
                # No retry can make the sink take it, and it must not block the events behind it.
                view, _ = await eventually(lambda: events_of.outbox(target), lambda found: not found[1])
                assert view is not None and [(d.entry.event_id, d.reason) for d in view.dead_letters] == [
                    (event.event_id, "rejected")
                ]
                assert code in view.dead_letters[0].error and event.event_id in view.dead_letters[0].error
            else:
                view, running = await events_of.outbox(target)
                assert running and view is not None and view.waiting_event_ids == [event.event_id]
                assert view.dead_letters == []
                assert view.last_error is None or view.last_error.kind == kind


async def test_an_event_neither_delivered_nor_handed_to_temporal_fails_the_activity_for_a_bounded_retry(
    aws_env: str,
) -> None:
    # The bus is missing and Temporal cannot be reached (nothing listens where the client points).
    from contract.config import TemporalSettings
    from contract.temporal_client import connect

    unreachable = await connect(TemporalSettings(address=f"127.0.0.1:{free_port()}"), lazy=True)
    acts = EventActivities(
        AwsClients(AwsSettings(endpoint_url=aws_env)), EventSettings(bus_name=unique("no-such-bus")), unreachable
    )
    [event] = events(1)
    with pytest.raises(ApplicationError) as raised:
        await ActivityEnvironment().run(acts.publish_event, event)
    assert raised.value.type == "EventOutboxUnusable" and not raised.value.non_retryable
    assert event.event_id in raised.value.message
