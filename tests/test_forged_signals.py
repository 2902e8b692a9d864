"""Internal signals are taken only from who should send them, and nothing a signal says can wedge a workflow.

Against the real dev server. The repairs and holders here are real repair workflows started on a task queue no
worker polls: to the semaphore they are running repairs of their group, exactly as a stuck repair would be.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy

from contract import names
from contract import search_attributes as sa
from contract.ids import repair_workflow_id, semaphore_workflow_id
from contract.repair import RepairInput, RepairPhase, RepairProgress
from contract.semaphore import PermitRequest, SemaphoreInput
from tests.harness import eventually, make_settings, running_worker, unique
from tests.test_health_signals import finding, health_of, monitor_only, start_health
from worker.settings import Settings
from workflows.drain_semaphore import MAX_WAITERS
from workflows.instance_health import MAX_WARNING_KINDS
from workflows.models import PermitGrant, PermitRelease, RepairStatus, SemaphoreView


@asynccontextmanager
async def group_worker(client: Client, aws_env: str, tmp_path: Path) -> AsyncIterator[Settings]:
    """A worker for a new group whose ECS cluster is empty: the drain cap is one permit."""
    group = unique("g")
    settings = make_settings(client, aws_env, tmp_path / "events.jsonl", group=group, cluster=group)
    async with running_worker(settings, client):
        yield settings


async def idle_repair(client: Client, group: str, instance: str) -> WorkflowHandle[Any, Any]:
    """A running repair workflow of `group` that never moves: no worker polls its task queue."""
    return await client.start_workflow(
        names.REPAIR_WORKFLOW,
        RepairInput(instance_id=instance, group=group, reason="XID_79", progress_token="t"),
        id=repair_workflow_id(instance),
        task_queue=unique("nobody-polls"),
        search_attributes=TypedSearchAttributes(
            [SearchAttributePair(sa.INSTANCE_ID, instance), SearchAttributePair(sa.CAPACITY_GROUP, group)]
        ),
    )


async def semaphore_state(client: Client, group: str) -> SemaphoreView:
    handle = client.get_workflow_handle(semaphore_workflow_id(group))
    return await handle.query(names.QUERY_STATE, result_type=SemaphoreView)


async def request_permit(client: Client, settings: Settings, request: PermitRequest) -> None:
    group = settings.groups[0].name
    await client.start_workflow(
        names.SEMAPHORE_WORKFLOW,
        SemaphoreInput(group=group),
        id=semaphore_workflow_id(group),
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal=names.SIGNAL_REQUEST,
        start_signal_args=[request],
    )


async def hold_the_one_permit(client: Client, settings: Settings) -> WorkflowHandle[Any, Any]:
    """A repair of the group that never moves, holding the group's one permit (its cluster is empty)."""
    group = settings.groups[0].name
    blocker = await idle_repair(client, group, unique("i"))
    instance = blocker.id.split("/")[1]
    await request_permit(
        client, settings, PermitRequest(holder_workflow_id=blocker.id, instance_id=instance, token="b")
    )
    await eventually(lambda: semaphore_state(client, group), lambda v: len(v.holders) == 1)
    return blocker


async def test_the_semaphore_grants_only_to_running_repairs_of_its_group_and_takes_release_only_from_holders(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with group_worker(client, aws_env, tmp_path) as settings:
        group = settings.groups[0].name
        # Not a repair at all: a long-running workflow that would never give the permit back.
        await request_permit(
            client, settings, PermitRequest(holder_workflow_id=semaphore_workflow_id(group), instance_id="x", token="k")
        )
        # Shaped like a repair, but no such workflow runs.
        ghost = unique("i")
        await request_permit(
            client, settings, PermitRequest(holder_workflow_id=repair_workflow_id(ghost), instance_id=ghost, token="k")
        )
        # A running repair, of another group.
        stranger = unique("i")
        await idle_repair(client, unique("other-group"), stranger)
        await request_permit(
            client,
            settings,
            PermitRequest(holder_workflow_id=repair_workflow_id(stranger), instance_id=stranger, token="k"),
        )
        view = await eventually(lambda: semaphore_state(client, group), lambda v: v.forged_signals == 3)
        assert view.holders == [] and view.waiters == []

        # A genuine repair of the group gets the one permit; a release without its token changes nothing.
        holder = unique("i")
        repair = await idle_repair(client, group, holder)
        await request_permit(
            client,
            settings,
            PermitRequest(
                holder_workflow_id=repair.id, holder_run_id=repair.result_run_id, instance_id=holder, token="s"
            ),
        )
        view = await eventually(lambda: semaphore_state(client, group), lambda v: len(v.holders) == 1)
        assert view.holders[0].holder_workflow_id == repair.id
        assert view.holders[0].token == "", "the state query must not tell the token"
        semaphore = client.get_workflow_handle(semaphore_workflow_id(group))
        await semaphore.signal(names.SIGNAL_RELEASE, PermitRelease(holder_workflow_id=repair.id, token="guess"))
        await semaphore.signal(names.SIGNAL_RELEASE, PermitRelease(holder_workflow_id=repair.id))
        view = await eventually(lambda: semaphore_state(client, group), lambda v: v.forged_signals == 5)
        assert [p.holder_workflow_id for p in view.holders] == [repair.id]

        # The grant reached the repair carrying the repair's own token.
        grants = [
            e
            async for e in repair.fetch_history_events()
            if e.workflow_execution_signaled_event_attributes.signal_name == names.SIGNAL_PERMIT_GRANTED
        ]
        assert len(grants) == 1
        (grant,) = await client.data_converter.decode(
            grants[0].workflow_execution_signaled_event_attributes.input.payloads, [PermitGrant]
        )
        assert grant.token == "s"

        await semaphore.signal(names.SIGNAL_RELEASE, PermitRelease(holder_workflow_id=repair.id, token="s"))
        view = await eventually(lambda: semaphore_state(client, group), lambda v: v.holders == [])
        assert view.forged_signals == 5
        await repair.terminate("test over")
        await semaphore.terminate("test over")


async def test_a_repair_takes_a_permit_only_with_its_own_token(client: Client, aws_env: str, tmp_path: Path) -> None:
    async with group_worker(client, aws_env, tmp_path) as settings:
        group = settings.groups[0].name
        # The group's one permit is held by a repair that never moves, so ours waits.
        blocker = await hold_the_one_permit(client, settings)

        instance = unique("i")
        repair = await client.start_workflow(
            names.REPAIR_WORKFLOW,
            RepairInput(instance_id=instance, group=group, reason="XID_79", progress_token="p"),
            id=repair_workflow_id(instance),
            task_queue=settings.temporal.task_queue,
            search_attributes=TypedSearchAttributes([SearchAttributePair(sa.CAPACITY_GROUP, group)]),
        )
        await eventually(lambda: semaphore_state(client, group), lambda v: len(v.waiters) == 1)
        now = datetime.now(UTC)
        for token in ("", "guess"):
            forged = PermitGrant(group=group, holder_workflow_id=repair.id, granted_at=now, token=token)
            await repair.signal(names.SIGNAL_PERMIT_GRANTED, forged)

        async def status() -> RepairStatus:
            return await repair.query(names.QUERY_STATUS, result_type=RepairStatus)

        view = await eventually(status, lambda s: s.forged_signals == 2)
        assert view.phase is RepairPhase.WAITING_FOR_PERMIT
        await repair.terminate("test over")
        await blocker.terminate("test over")
        await client.get_workflow_handle(semaphore_workflow_id(group)).terminate("test over")


async def test_forged_repair_progress_changes_nothing(client: Client, aws_env: str, tmp_path: Path) -> None:
    instance = unique("i")
    async with monitor_only(client, aws_env, tmp_path) as (settings, _):
        handle = await start_health(client, settings, instance)
        await eventually(lambda: health_of(handle), lambda v: v.last_heartbeat is not None)
        for workflow_id in (repair_workflow_id(instance), "anything"):
            forged = RepairProgress(workflow_id=workflow_id, phase=RepairPhase.COMPLETED, finished=True, token="x")
            await handle.signal(names.SIGNAL_REPAIR_PROGRESS, forged)
        view = await eventually(lambda: health_of(handle), lambda v: v.forged_signals == 2)
        assert not view.retired and view.repair is None
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
        await handle.terminate("test over")


async def test_out_of_range_injections_are_dropped_and_the_workflow_keeps_answering(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    instance = unique("i")
    async with monitor_only(client, aws_env, tmp_path) as (settings, _):
        handle = await start_health(client, settings, instance)
        await eventually(lambda: health_of(handle), lambda v: v.last_heartbeat is not None)
        for duration in ("P9000Y", "-PT1S", "PT0S", "P2D", "not a duration"):
            await handle.signal(names.SIGNAL_INJECT_HEARTBEAT_LOSS, {"duration": duration})
        view = await eventually(lambda: health_of(handle), lambda v: v.rejected_signals == 5)
        assert view.heartbeats_ignored_until is None
        # A day is the limit, and accepted.
        await handle.signal(names.SIGNAL_INJECT_HEARTBEAT_LOSS, {"duration": "P1D"})
        view = await eventually(lambda: health_of(handle), lambda v: v.heartbeats_ignored_until is not None)
        assert view.rejected_signals == 5
        history = [e async for e in handle.fetch_history_events()]
        assert not [e for e in history if e.HasField("workflow_task_failed_event_attributes")]
        await handle.terminate("test over")


async def test_carried_state_is_bounded_and_what_is_dropped_is_counted(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    instance = unique("i")
    async with monitor_only(client, aws_env, tmp_path) as (settings, group):
        handle = await start_health(client, settings, instance)
        extra = 7
        for n in range(MAX_WARNING_KINDS + extra):
            warning = finding(instance, group, f"w-{n}", code=13, impairs=False).model_copy(update={"reason": f"W_{n}"})
            await handle.signal(names.SIGNAL_GPU_FINDING, warning)
        view = await eventually(lambda: health_of(handle), lambda v: v.dropped_entries == extra, within=180)
        assert len(view.warning_counts) == MAX_WARNING_KINDS
        # Oversized identifiers are refused; oversized free text is cut.
        huge_id = finding(instance, group, "huge").model_dump(mode="json") | {"finding_id": "x" * 300}
        long_text = finding(instance, group, "long", impairs=False).model_copy(update={"raw": "r" * 100_000})
        await handle.signal(names.SIGNAL_GPU_FINDING, huge_id)
        await handle.signal(names.SIGNAL_GPU_FINDING, long_text.model_dump(mode="json"))
        view = await eventually(
            lambda: health_of(handle), lambda v: any(f.finding_id == "long" for f in v.recent_findings)
        )
        assert len(next(f for f in view.recent_findings if f.finding_id == "long").raw) <= 4096
        assert all(f.finding_id != "x" * 300 for f in view.recent_findings)
        await handle.terminate("test over")


async def test_the_waiting_line_is_bounded_and_what_is_dropped_is_counted(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with group_worker(client, aws_env, tmp_path) as settings:
        group = settings.groups[0].name
        blocker = await hold_the_one_permit(client, settings)
        semaphore = client.get_workflow_handle(semaphore_workflow_id(group))
        extra = 5
        for n in range(MAX_WAITERS + extra):
            instance = f"i-wait-{n}"
            request = PermitRequest(holder_workflow_id=repair_workflow_id(instance), instance_id=instance, token="w")
            await semaphore.signal(names.SIGNAL_REQUEST, request)
        view = await eventually(lambda: semaphore_state(client, group), lambda v: v.dropped_requests == extra)
        assert len(view.waiters) == MAX_WAITERS
        assert [p.holder_workflow_id for p in view.holders] == [blocker.id]
        await blocker.terminate("test over")
        await semaphore.terminate("test over")
