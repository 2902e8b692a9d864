"""The health workflow never fails on an activity error: it says so, keeps its findings, and tries again."""

from __future__ import annotations

from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy

from contract.groups import AutoRepair
from contract.health import CheckType, HealthInput, HealthState
from contract.ids import health_workflow_id
from tests.harness import eventually, make_settings, running_worker, unique
from tests.test_health_signals import check, finding, health_of, heartbeat


async def test_an_unknown_group_keeps_the_finding_says_why_and_recovers_once_the_group_exists(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    known, unknown = unique("g"), unique("typo")
    settings = make_settings(
        client, aws_env, tmp_path / "events.jsonl", group=known, cluster=known, auto_repair=AutoRepair.DISABLED
    )
    instance = unique("i")
    async with running_worker(settings, client):
        # A probe started with the wrong --group: its health workflow cannot read the group.
        handle = await client.start_workflow(
            "InstanceHealthWorkflow",
            HealthInput(instance_id=instance, group=unknown),
            id=health_workflow_id(instance),
            task_queue=settings.temporal.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal="heartbeat",
            start_signal_args=[heartbeat(instance, unknown)],
        )
        await handle.signal("gpu_finding", finding(instance, unknown, unique("f")))
        view = await eventually(lambda: health_of(handle), lambda v: v.last_activity_error is not None, within=60)
        assert f"reading capacity group {unknown} failed" in (view.last_activity_error or "")
        error = view.last_activity_error or ""
        assert unknown in error and "unknown capacity group" in error
        # Nothing lost: the finding is kept and the instance shows IMPAIRED; the workflow runs on.
        assert [f.reason for f in view.recent_findings] == ["XID_79"]
        assert check(view, CheckType.ACCELERATED_COMPUTE) is HealthState.IMPAIRED
        assert (await handle.describe()).status is WorkflowExecutionStatus.RUNNING

    # The group is added to the settings (the operator fixed the typo the other way round): the next try reads it.
    fixed = settings.model_copy(
        update={"groups": [*settings.groups, settings.groups[0].model_copy(update={"name": unknown})]}
    )
    async with running_worker(fixed, client):
        view = await eventually(
            lambda: health_of(handle), lambda v: v.last_activity_error is None and bool(v.repair_withheld), within=120
        )
        assert "DISABLED" in (view.repair_withheld or "")
        assert [f.reason for f in view.recent_findings] == ["XID_79"]
        assert (await handle.describe()).status is WorkflowExecutionStatus.RUNNING
