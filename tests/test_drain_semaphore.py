"""The drain semaphore on its own: bad input is counted, and its state survives continue-as-new."""

from __future__ import annotations

from pathlib import Path

from temporalio.client import Client

from contract.ids import semaphore_workflow_id
from tests.harness import eventually, make_settings, running_worker, unique
from workflows.models import SemaphoreRun, SemaphoreView


async def test_semaphore_counts_bad_signals_and_continues_as_new_with_its_state(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    group = unique("g")
    settings = make_settings(client, aws_env, tmp_path / "events.jsonl", group=group, cluster=group)
    async with running_worker(settings, client):
        handle = await client.start_workflow(
            "DrainSemaphoreWorkflow",
            SemaphoreRun(group=group, max_holders_seen=3),
            id=semaphore_workflow_id(group),
            task_queue=settings.temporal.task_queue,
        )
        latest = client.get_workflow_handle(semaphore_workflow_id(group))
        first_run = (await latest.describe()).run_id
        # The test server suggests continue-as-new at 200 history events; each rejected signal adds about two.
        for index in range(150):
            await handle.signal("request", {"holder_workflow_id": ""} if index % 2 else "not a request")
        await handle.signal("no_such_signal")

        view = await eventually(
            lambda: latest.query("state", result_type=SemaphoreView), lambda v: v.rejected_signals == 151
        )
        assert (await latest.describe()).run_id != first_run
        assert view.max_holders_seen == 3 and view.holders == [] and view.waiters == []
        await latest.terminate("test over")
