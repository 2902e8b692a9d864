"""Whether an event must queue behind its sink's outbox (activities/events.py, Outboxes.backlogged) is asked of
Temporal once per BACKLOG_RECHECK, not once per event: in a burst every describe of the one outbox waits for its lock
behind the hand-overs (7.8 s at the median in a 1,000 / 200 run), which timed out publish_event. Against the dev
server, with a fake clock; no worker runs the outbox, so it stays RUNNING with what it was handed."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from temporalio.client import Client, DescribeWorkflowInput, Interceptor, OutboundInterceptor

from activities.events import BACKLOG_RECHECK, Outboxes
from contract.config import EventSettings
from contract.event_outbox import OutboxEntry, Sink, SinkTarget, outbox_workflow_id
from tests.harness import unique


class CountDescribes(Interceptor):
    def __init__(self) -> None:
        self.describes = 0

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _Counting(next, self)


class _Counting(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, counter: CountDescribes) -> None:
        super().__init__(next)
        self.counter = counter

    async def describe_workflow(self, input: DescribeWorkflowInput) -> Any:
        self.counter.describes += 1
        return await super().describe_workflow(input)


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
