"""A repair's step "let tasks stop within their stop timeouts": before a termination, and before a reset or reboot."""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow

from contract import event_types as ev
from contract.config import format_seconds
from contract.formats import iso
from contract.groups import CapacityGroup
from contract.repair import RepairPhase
from workflows import repair_patches
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.repair_context import RepairContext

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import InstanceTasks, StopTasksRequest, TasksWait

# The wait's heartbeat timeout is four looks: a lost worker's wait is taken again by another within that (the drain is
# on the repair's path: a minute at the default 15 s), and the SDK sends one heartbeat per 80 % of it, each a billed
# action (one per 48 s: 4 in a 2-minute stop timeout, 6 at two looks).
DRAIN_HEARTBEAT_MIN = timedelta(seconds=20)
FORCED_WAIT = timedelta(minutes=5)


async def let_tasks_stop(repair: RepairContext, group: CapacityGroup) -> tuple[int, int]:
    """The step, said: how many tasks there were, and how many were stopped at their timeout."""
    await repair.enter(RepairPhase.STOPPING_TASKS)
    stopped, forced = await _wait_for_tasks(repair, group)
    repair.record.notes[RepairPhase.STOPPING_TASKS] = f"{stopped} tasks, {forced} stopped at their timeout"
    await repair.event(ev.TasksStopped(tasks=stopped, forced=forced))
    return stopped, forced


async def _wait_for_tasks(repair: RepairContext, group: CapacityGroup) -> tuple[int, int]:
    """Give every task its own stop timeout, counted from the start of this step, then stop what is left."""
    instance_id = repair.record.instance_id
    started = workflow.now()
    deadlines: dict[str, datetime] = {}
    forced: set[str] = set()
    # Histories from before the patch slept and looked again from the workflow: a timer and an activity per look.
    waits_in_activity = repair_patches.patched(repair_patches.DRAIN_WAIT_IN_ACTIVITY)
    running = await _list_tasks(repair)
    while True:
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
            running = await _list_tasks(repair)
            continue
        pending = [deadlines[t.task_arn] for t in running.tasks if t.task_arn not in forced]
        if not waits_in_activity:
            next_deadline = min(pending) if pending else now + group.task_poll_interval
            wait = max(min(group.task_poll_interval, next_deadline - now), timedelta(seconds=1))
            await workflow.sleep(
                wait,
                summary=f"{len(running.tasks)} tasks draining; next stop timeout at {iso(next_deadline, 'seconds')}",
            )
            running = await _list_tasks(repair)
            continue
        # Every task left was stopped at its timeout: ECS kills it; look again at the latest after FORCED_WAIT.
        until = min(pending) if pending else now + FORCED_WAIT
        running = await workflow.execute_activity_method(
            FleetActivities.wait_for_tasks_to_stop,
            TasksWait(
                group=repair.record.group,
                instance_id=instance_id,
                container_instance_arn=repair.record.container_instance_arn,
                until=until,
                known=[t.task_arn for t in running.tasks],
                poll_seconds=group.task_poll_interval.total_seconds(),
            ),
            summary=(
                f"{len(running.tasks)} tasks draining on {instance_id}: look every "
                f"{format_seconds(group.task_poll_interval)} until none is left or the next stop timeout at "
                f"{iso(until, 'seconds')}"
            ),
            start_to_close_timeout=max(until - now, timedelta(0)) + CALL_TIMEOUT,
            heartbeat_timeout=drain_heartbeat_timeout(group.task_poll_interval),
            retry_policy=CALL_RETRY,
        )


def drain_heartbeat_timeout(poll: timedelta) -> timedelta:
    return max(poll * 4, DRAIN_HEARTBEAT_MIN)


async def _list_tasks(repair: RepairContext) -> InstanceTasks:
    return await workflow.execute_activity_method(
        FleetActivities.list_instance_tasks,
        repair.known_instance(),
        summary=f"list tasks still running on {repair.record.instance_id}",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
