"""WorkflowOps' calls for a batch, through the frontend: send_signals, a drain semaphore's grants of a batch, sent
by one activity rather than by the semaphore itself (each of its own signals a transfer task and two events on its
one history: 200 reached their repairs over 220 s on the dev server, benchmarks/SCALE.md); find_running_repairs, the
batch's requesters described side by side. Against the dev server: no worker runs the receivers, so a running one
keeps what it was sent in its history."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from temporalio.client import Client, DescribeWorkflowInput, Interceptor, OutboundInterceptor
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.testing import ActivityEnvironment

from activities.models import RepairsOfGroup, SignalsToSend, SignalTo, WorkflowRun
from activities.workflow_ops import WorkflowOps
from contract import names
from contract import search_attributes as sa
from tests.harness import unique
from workflows.models import PermitGrant


async def test_each_run_gets_its_signal_and_the_runs_that_no_longer_run_come_back(client: Client) -> None:
    task_queue = unique("nobody-polls")
    running = [await client.start_workflow("Receiver", id=unique("receiver"), task_queue=task_queue) for _ in range(40)]
    ended = await client.start_workflow("Receiver", id=unique("ended"), task_queue=task_queue)
    await ended.terminate()
    grants = {
        handle.id: PermitGrant(group="g", holder_workflow_id=handle.id, granted_at=datetime.now(UTC), token=handle.id)
        for handle in [*running, ended]
    }
    order = SignalsToSend(
        signal=names.SIGNAL_PERMIT_GRANTED,
        to=[
            SignalTo(workflow_id=h.id, run_id=h.result_run_id, payload=grants[h.id].model_dump(mode="json"))
            for h in [*running, ended]
        ],
    )

    gone = await ActivityEnvironment().run(WorkflowOps(client, task_queue).send_signals, order)

    assert gone.runs == [WorkflowRun(workflow_id=ended.id, run_id=ended.result_run_id)]
    for handle in running:
        signals = [
            event.workflow_execution_signaled_event_attributes
            async for event in handle.fetch_history_events()
            if event.HasField("workflow_execution_signaled_event_attributes")
        ]
        [signal] = signals
        assert signal.signal_name == names.SIGNAL_PERMIT_GRANTED
        [received] = await client.data_converter.decode(signal.input.payloads, [PermitGrant])
        assert received == grants[handle.id]  # what the repair reads: the grant whole, its token included
        await handle.terminate()


class PeakDescribes(Interceptor):
    """How many DescribeWorkflowExecution calls were in flight at once, at most."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.peak = 0

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _Peak(next, self)


class _Peak(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, counter: PeakDescribes) -> None:
        super().__init__(next)
        self.counter = counter

    async def describe_workflow(self, input: DescribeWorkflowInput) -> Any:
        self.counter.in_flight += 1
        self.counter.peak = max(self.counter.peak, self.counter.in_flight)
        try:
            return await super().describe_workflow(input)
        finally:
            self.counter.in_flight -= 1


async def test_a_batch_of_requesters_is_described_side_by_side(client: Client) -> None:
    """The semaphore's check that a batch's requesters are running repairs of its group: each run described, a
    batch's at once (one after another, 200 were 200 round trips on the way to their permits), the answer as before."""
    task_queue = unique("nobody-polls")
    group = unique("group")

    async def repair(of: str) -> Any:
        return await client.start_workflow(
            names.REPAIR_WORKFLOW,
            id=unique("repair"),
            task_queue=task_queue,
            search_attributes=TypedSearchAttributes([SearchAttributePair(sa.CAPACITY_GROUP, of)]),
        )

    ours = [await repair(group) for _ in range(30)]
    other_group = await repair(unique("other"))
    not_a_repair = await client.start_workflow("Receiver", id=unique("receiver"), task_queue=task_queue)
    ended = await repair(group)
    await ended.terminate()
    runs = [WorkflowRun(workflow_id=h.id, run_id=h.result_run_id) for h in [*ours, other_group, not_a_repair, ended]]
    runs.append(WorkflowRun(workflow_id=unique("never-started")))
    counter = PeakDescribes()
    counting = Client(
        client.service_client, namespace=client.namespace, data_converter=client.data_converter, interceptors=[counter]
    )

    found = await ActivityEnvironment().run(
        WorkflowOps(counting, task_queue).find_running_repairs, RepairsOfGroup(group=group, runs=runs)
    )

    assert found.runs == runs[: len(ours)]
    assert counter.peak > 1
    for handle in [*ours, other_group, not_a_repair]:
        await handle.terminate()
