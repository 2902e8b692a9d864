"""A repair's step "let tasks stop within their stop timeouts": before a termination, and before a reset or reboot."""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow

from contract.formats import iso
from contract.groups import CapacityGroup
from contract.repair import RepairPhase
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.repair_context import RepairContext

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import EventType, StopTasksRequest


async def let_tasks_stop(repair: RepairContext, group: CapacityGroup) -> tuple[int, int]:
    """The step, said: how many tasks there were, and how many were stopped at their timeout."""
    await repair.enter(RepairPhase.STOPPING_TASKS)
    stopped, forced = await _wait_for_tasks(repair, group)
    repair.record.notes[RepairPhase.STOPPING_TASKS] = f"{stopped} tasks, {forced} stopped at their timeout"
    await repair.event(EventType.TASKS_STOPPED, tasks=stopped, forced=forced)
    return stopped, forced


async def _wait_for_tasks(repair: RepairContext, group: CapacityGroup) -> tuple[int, int]:
    """Give every task its own stop timeout, counted from the start of this step, then stop what is left."""
    instance_id = repair.record.instance_id
    started = workflow.now()
    deadlines: dict[str, datetime] = {}
    forced: set[str] = set()
    while True:
        running = await workflow.execute_activity_method(
            FleetActivities.list_instance_tasks,
            repair.instance,
            summary=f"list tasks still running on {instance_id}",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        if not running.tasks:
            return len(deadlines), len(forced)
        for task in running.tasks:
            deadlines.setdefault(task.task_arn, started + timedelta(seconds=task.stop_timeout_seconds))
        now = workflow.now()
        overdue = [t.task_arn for t in running.tasks if deadlines[t.task_arn] <= now and t.task_arn not in forced]
        if overdue:
            await workflow.execute_activity_method(
                FleetActivities.stop_tasks,
                StopTasksRequest(
                    group=repair.record.group,
                    task_arns=overdue,
                    reason=f"gpu-autorepair: stop timeout reached while draining {instance_id}",
                ),
                summary=f"stop {len(overdue)} tasks past their stop timeout",
                start_to_close_timeout=CALL_TIMEOUT,
                retry_policy=CALL_RETRY,
            )
            forced.update(overdue)
            continue
        pending = [deadlines[t.task_arn] for t in running.tasks if t.task_arn not in forced]
        next_deadline = min(pending) if pending else now + group.task_poll_interval
        wait = max(min(group.task_poll_interval, next_deadline - now), timedelta(seconds=1))
        await workflow.sleep(
            wait,
            summary=f"{len(running.tasks)} tasks draining; next stop timeout at {iso(next_deadline, 'seconds')}",
        )
