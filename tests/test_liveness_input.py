"""The liveness tracker under input that once broke it (found by tests/test_signal_fuzz.py): receipts dated at the
edge of the calendar, a group change with an absurd threshold, and a mass loss told across continue-as-new. Against
the real dev server (continue-as-new suggested at 200 events)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle

from contract import names
from contract.groups import AutoRepair
from contract.ids import liveness_workflow_id
from contract.liveness import LivenessInput, LivenessReport
from tests.harness import eventually, make_settings, running_worker, unique
from worker.settings import Settings
from workflows.models import LivenessView


def report(group: str, at: datetime, heard: dict[str, int]) -> LivenessReport:
    # Not a relay: these tests are about the receipts, not about a silent pipeline.
    return LivenessReport(
        group=group, reporter="test", at=at, report_every=timedelta(seconds=1), relay=False, heard=heard
    )


async def send(client: Client, settings: Settings, group: str, batch: LivenessReport) -> WorkflowHandle:
    return await client.start_workflow(
        names.LIVENESS_WORKFLOW,
        LivenessInput(group=group),
        id=liveness_workflow_id(group),
        task_queue=settings.temporal.task_queue,
        start_signal=names.SIGNAL_LIVENESS_REPORT,
        start_signal_args=[batch],
    )


async def view(handle: WorkflowHandle) -> LivenessView:
    return await handle.query(names.QUERY_LIVENESS, result_type=LivenessView)


async def failed_tasks(client: Client, workflow_id: str) -> list[str]:
    """WorkflowTaskFailed events in every run of the workflow (continue-as-new followed)."""
    failures = []
    async for execution in client.list_workflows(f"WorkflowId = '{workflow_id}'"):
        history = await client.get_workflow_handle(workflow_id, run_id=execution.run_id).fetch_history()
        failures += [
            e.workflow_task_failed_event_attributes.failure.message
            for e in history.events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED
        ]
    return failures


def settings_for(client: Client, aws_env: str, tmp_path: Path, group: str) -> Settings:
    return make_settings(
        client,
        aws_env,
        tmp_path / "events.jsonl",
        group=group,
        cluster=group,
        auto_repair=AutoRepair.DISABLED,
        heartbeat_loss_threshold=timedelta(seconds=3),
    )


async def test_receipts_at_the_calendars_edge_and_an_absurd_threshold_are_harmless(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    group = unique("g-edge")
    settings = settings_for(client, aws_env, tmp_path, group)
    async with running_worker(settings, client):
        handle = await send(
            client, settings, group, report(group, datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC), {"i-future": 0})
        )
        await handle.signal(
            names.SIGNAL_LIVENESS_REPORT, report(group, datetime(1, 1, 1, 0, 0, 1, tzinfo=UTC), {"i-ancient": 5})
        )
        absurd = settings.groups[0].model_copy(update={"heartbeat_loss_threshold": timedelta(days=10**6)})
        await handle.signal(names.SIGNAL_GROUP_CHANGED, absurd)
        # A receipt "from the future" counts as at most five minutes ahead (clocks drift; receipts are rounded up);
        # the ancient one is no news: never tracked. The absurd threshold is refused; the group's own still applies.
        tracked = await eventually(
            lambda: view(handle), lambda v: v.rejected_signals == 1 and v.window_s is not None, within=60
        )
        assert (tracked.instances, tracked.lost, tracked.window_s) == (1, [], 3)
        heard = await handle.query(names.QUERY_LAST_HEARD, ["i-future", "i-ancient"], result_type=dict[str, datetime])
        assert list(heard) == ["i-future"] and heard["i-future"] <= datetime.now(UTC) + timedelta(minutes=5, seconds=1)
        # It goes on working: a later timer, a later batch.
        await handle.signal(names.SIGNAL_LIVENESS_REPORT, report(group, datetime.now(UTC), {"i-now": 0}))
        await eventually(lambda: view(handle), lambda v: v.declared_lost == 1 and v.forgotten == 1, within=60)
        assert await failed_tasks(client, handle.id) == []
        await handle.terminate("test over")


async def test_a_mass_loss_is_told_in_full_across_continue_as_new(client: Client, aws_env: str, tmp_path: Path) -> None:
    group = unique("g-mass")
    settings = settings_for(client, aws_env, tmp_path, group)
    ghosts = {f"i-ghost-{n:04d}": 0 for n in range(250)}
    async with running_worker(settings, client):
        # 250 instances last heard a minute ago, whose health workflows do not exist: each is declared lost, told
        # (the signal fails: no such workflow) and forgotten. Telling them takes the run past the server's
        # continue-as-new suggestion, which must wait until every one has been told.
        handle = await send(client, settings, group, report(group, datetime.now(UTC) - timedelta(minutes=1), ghosts))
        latest = client.get_workflow_handle(handle.id)
        done = await eventually(lambda: view(latest), lambda v: v.forgotten == len(ghosts), within=90)
        assert (done.declared_lost, done.lost, done.instances) == (len(ghosts), [], 0)
        assert (await latest.describe()).run_id != handle.first_execution_run_id  # it did continue as new
        # The run that took over gave the batches refused while the last one closed an interval to arrive. (Asked
        # of the run now: the last ghost may have been forgotten before the first run handed over.)
        assert (await view(latest)).floor is not None
        assert await failed_tasks(client, handle.id) == []
        await latest.terminate("test over")
