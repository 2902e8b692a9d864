"""An event outbox in a burst (activities/events.py, Outboxes): one outbox takes signals one at a time, so in a
1,000 / 200 run every describe and every hand-over queued for its lock (7.8 and 9.9 s at the median) and timed out
publish_event. Whether an event must queue behind the outbox is asked of Temporal once per BACKLOG_RECHECK, not once
per event; and the events handed over while a hand-over is in flight go together in the next. Against the dev
server, with a fake clock; until a test starts one, no worker runs the outbox, so it stays RUNNING with what it was
handed."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from temporalio.client import (
    Client,
    DescribeWorkflowInput,
    Interceptor,
    OutboundInterceptor,
    StartWorkflowInput,
    WorkflowHandle,
)
from temporalio.worker import Worker

from activities.aws import AwsClients
from activities.events import BACKLOG_RECHECK, EventActivities, Outboxes, event_body
from contract import names
from contract.config import AwsSettings, EventSettings
from contract.event_outbox import OutboxEntries, OutboxEntry, OutboxView, Sink, SinkTarget, outbox_workflow_id
from tests.harness import unique
from tests.outbox_harness import events
from worker.main import SANDBOX
from workflows.event_outbox import EventOutboxWorkflow


class CountDescribes(Interceptor):
    def __init__(self) -> None:
        self.describes = 0
        self.starts = 0  # signal-with-start: the hand-overs

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _Counting(next, self)


class _Counting(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, counter: CountDescribes) -> None:
        super().__init__(next)
        self.counter = counter

    async def describe_workflow(self, input: DescribeWorkflowInput) -> Any:
        self.counter.describes += 1
        return await super().describe_workflow(input)

    async def start_workflow(self, input: StartWorkflowInput) -> WorkflowHandle[Any, Any]:
        self.counter.starts += 1
        return await super().start_workflow(input)


async def test_a_backlog_is_asked_of_temporal_once_a_recheck_not_once_an_event(client: Client, tmp_path: Path) -> None:
    counter = CountDescribes()
    counting = Client(
        client.service_client, namespace=client.namespace, data_converter=client.data_converter, interceptors=[counter]
    )
    now = [1_000.0]
    task_queue = unique("events")
    path = tmp_path / "events.jsonl"
    outboxes = Outboxes(counting, task_queue, EventSettings(jsonl_path=path), clock=lambda: now[0])
    target = SinkTarget(sink=Sink.JSONL, path=str(path))
    at = datetime.now(UTC)
    entry = OutboxEntry(event_id="e-1", queued_at=at, time=at, detail_type="x", event={"event_id": "e-1"})

    assert not await outboxes.backlogged(target)  # an outbox this process never used costs no call
    assert counter.describes == 0
    await outboxes.hand_over(target, entry)
    assert all([await outboxes.backlogged(target) for _ in range(20)])
    assert counter.describes == 1
    now[0] += BACKLOG_RECHECK.total_seconds()
    assert await outboxes.backlogged(target)
    assert counter.describes == 2

    await counting.get_workflow_handle(outbox_workflow_id(target, task_queue)).terminate()
    # Within the recheck it is still taken as a backlog (an event would go through a new outbox, still in order)...
    assert await outboxes.backlogged(target)
    assert counter.describes == 2
    # ...and once it is over, the ended outbox is seen and the sink tried directly again.
    now[0] += BACKLOG_RECHECK.total_seconds()
    assert not await outboxes.backlogged(target)
    assert not await outboxes.backlogged(target)
    assert counter.describes == 3


def entries(count: int) -> list[OutboxEntry]:
    """Real events, as publish_event would hand them over."""
    at = datetime.now(UTC)
    return [
        OutboxEntry(
            event_id=e.event_id,
            queued_at=at,
            time=e.time,
            detail_type=e.detail_type,
            event=json.loads(json.dumps(event_body(e), default=str)),
        )
        for e in events(count)
    ]


async def test_events_handed_over_while_one_hand_over_is_in_flight_go_together_oldest_first(
    client: Client, tmp_path: Path
) -> None:
    counter = CountDescribes()
    counting = Client(
        client.service_client, namespace=client.namespace, data_converter=client.data_converter, interceptors=[counter]
    )
    task_queue = unique("events")
    path = tmp_path / "events.jsonl"
    settings = EventSettings(eventbridge=False, jsonl_path=path)
    outboxes = Outboxes(counting, task_queue, settings)
    target = SinkTarget(sink=Sink.JSONL, path=str(path))
    burst = entries(30)

    # Each returns once its event is in Temporal: the first alone, the 29 that came while it was in flight in one.
    await asyncio.gather(*(outboxes.hand_over(target, e) for e in burst))
    assert counter.starts == 2
    handle = counting.get_workflow_handle(outbox_workflow_id(target, task_queue))
    signalled: list[str] = []
    async for event in handle.fetch_history_events():
        if event.HasField("workflow_execution_signaled_event_attributes"):
            attributes = event.workflow_execution_signaled_event_attributes
            model = OutboxEntry if attributes.signal_name == names.SIGNAL_OUTBOX_ENQUEUE else OutboxEntries
            [value] = await client.data_converter.decode(attributes.input.payloads, [model])
            signalled.append(attributes.signal_name)
            handed = [value] if isinstance(value, OutboxEntry) else value.entries
            assert all(isinstance(e, OutboxEntry) for e in handed)
    assert signalled == [names.SIGNAL_OUTBOX_ENQUEUE, names.SIGNAL_OUTBOX_ENQUEUE_MANY]

    # The outbox takes them all and delivers them in order, then ends.
    activities = EventActivities(
        AwsClients(AwsSettings(endpoint_url="http://127.0.0.1:1")), settings, client, task_queue
    )
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[EventOutboxWorkflow],
        activities=activities.activities(),
        workflow_runner=SANDBOX,
    ):
        view = await counting.get_workflow_handle(handle.id, result_type=OutboxView).result()
    assert view.delivered == len(burst) and view.dead_letters == [] and view.rejected_signals == 0
    assert [json.loads(line)["event_id"] for line in path.read_text().splitlines()] == [e.event_id for e in burst]
