"""WorkflowOps.send_signals: a drain semaphore's grants of a batch, sent by one activity through the frontend
rather than by the semaphore itself (each of its own signals a transfer task and two events on its one history: 200
reached their repairs over 220 s on the dev server, benchmarks/SCALE.md). Against the dev server: no worker runs the
receivers, so a running one keeps what it was sent in its history."""

from __future__ import annotations

from datetime import UTC, datetime

from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from activities.models import SignalsToSend, SignalTo, WorkflowRun
from activities.workflow_ops import WorkflowOps
from contract import names
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
