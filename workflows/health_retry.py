"""A health workflow never fails on an activity error: it says so, keeps its findings, and tries again later.

An unknown group (a probe started with the wrong --group, a group removed from the settings) or a permanent error
starting a repair used to fail the workflow, and with it the finding already out of the probe's spool; every later
heartbeat then started a run that failed the same way. Now the error is in the workflow's state (the health query,
describe-instances, the Web UI) and in a warning, and the step is tried again with a backoff that doubles.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

from contract.groups import CapacityGroup
from workflows.group_config import read_group_config
from workflows.group_events import activity_cause
from workflows.models import HealthCarry

FIRST_BACKOFF = timedelta(seconds=30)
MAX_BACKOFF = timedelta(minutes=10)


def failed(state: HealthCarry, instance_id: str, what: str, err: ActivityError) -> timedelta:
    """Record the failure of `what`; the wait before trying it again."""
    state.activity_failures += 1
    backoff = min(FIRST_BACKOFF * 2 ** min(state.activity_failures - 1, 10), MAX_BACKOFF)
    state.last_activity_error = f"{what} failed, trying again in {backoff}: {activity_cause(err)}"[:1000]
    state.retry_at = workflow.now() + backoff
    workflow.logger.warning("%s: %s", instance_id, state.last_activity_error)
    return backoff


def succeeded(state: HealthCarry) -> None:
    state.activity_failures = 0
    state.last_activity_error = None
    state.retry_at = None


def may_try_now(state: HealthCarry) -> bool:
    return state.retry_at is None or workflow.now() >= state.retry_at


async def group_config(state: HealthCarry, instance_id: str, group: str) -> CapacityGroup:
    """The group's configuration, however long it takes to be readable; signals keep arriving meanwhile."""
    while True:
        try:
            config = await read_group_config(group)
        except ActivityError as err:
            backoff = failed(state, instance_id, f"reading capacity group {group}", err)
            await workflow.sleep(backoff, summary=f"capacity group {group} unreadable: try again")
            continue
        succeeded(state)
        return config
