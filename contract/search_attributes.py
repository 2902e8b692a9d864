"""Custom search attributes: what an operator filters repairs by in the Web UI and `temporal workflow list`."""

from datetime import datetime
from typing import Any

from temporalio.common import SearchAttributeKey

from contract import names

REPAIR_PHASE = SearchAttributeKey.for_keyword("RepairPhase")
INSTANCE_ID = SearchAttributeKey.for_keyword("InstanceId")
CAPACITY_GROUP = SearchAttributeKey.for_keyword("CapacityGroup")
XID = SearchAttributeKey.for_int("Xid")
OUTCOME = SearchAttributeKey.for_keyword("Outcome")
# A health workflow's overall status: the fleet's health is a count query (worker/health_gauges.py).
HEALTH_STATUS = SearchAttributeKey.for_keyword("HealthStatus")

ALL: list[SearchAttributeKey[Any]] = [REPAIR_PHASE, INSTANCE_ID, CAPACITY_GROUP, XID, OUTCOME, HEALTH_STATUS]


def quoted(value: str) -> str:
    """A string literal for a visibility query."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def long_repairs_query(group: str, started_before: datetime) -> str:
    """Running repairs of `group` that started before `started_before`."""
    return (
        f"WorkflowType={quoted(names.REPAIR_WORKFLOW)} AND ExecutionStatus='Running'"
        f" AND {CAPACITY_GROUP.name}={quoted(group)} AND StartTime < {quoted(started_before.isoformat())}"
    )


def health_count_query(group: str, status: str) -> str:
    """Running health workflows of `group` whose HealthStatus is `status` (contract.health.SEARCH_STATUSES)."""
    return (
        f"WorkflowType={quoted(names.HEALTH_WORKFLOW)} AND ExecutionStatus='Running'"
        f" AND {CAPACITY_GROUP.name}={quoted(group)} AND {HEALTH_STATUS.name}={quoted(status)}"
    )
