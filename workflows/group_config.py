"""Reading a capacity group's configuration from a workflow: the worker's settings merged with live overrides
(or, for the drain semaphore, which holds the overrides, the settings alone)."""

from __future__ import annotations

from temporalio import workflow

from contract.groups import CapacityGroup
from workflows.options import CALL_RETRY, CALL_TIMEOUT

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import GroupConfigRequest


async def read_group_config(group: str, summary: str | None = None, *, live_overrides: bool = True) -> CapacityGroup:
    return await workflow.execute_activity_method(
        FleetActivities.get_group_config,
        GroupConfigRequest(group=group, live_overrides=live_overrides),
        summary=summary or f"read capacity group {group}",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
