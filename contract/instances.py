"""Per-instance operator controls: `autorepair instance exclude | include | repair | clear`.

Each is an update of the instance's health workflow (names in contract/names.py): its validator refuses what cannot
be done, with a message for the operator and no trace in the history; its handler records the change in the history,
publishes it as an event and answers with an InstanceControlResult. Unset `requested_by` reads as "unknown".
Reasons are short (at most 128 characters, like `requested_by`): they end up in Web UI summaries, which the server
keeps under 400 bytes.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from contract.health import CheckType, HealthState
from contract.limits import Name, Text, Timestamp, Token
from contract.repair import RepairPhase


class InstanceExclude(BaseModel):
    """Watch and report the instance as usual, never repair it (maintenance, an investigation)."""

    reason: Name = ""
    requested_by: Name = ""


class InstanceInclude(BaseModel):
    """Repair the instance again; if it is impaired now, its repair starts."""

    reason: Name = ""
    requested_by: Name = ""


class InstanceRepairNow(BaseModel):
    """Repair the instance now, OK or not: the operator's judgement, through the group's drain cap like any repair.
    `reason` is required; the validator refuses an empty one (so that the operator gets a message, not a decode
    error)."""

    reason: Name = ""
    requested_by: Name = ""


class FindingsClear(BaseModel):
    """The operator's verdict that the impairment was false: its checks go back to OK, its findings are kept,
    marked cleared."""

    reason: Name = ""
    requested_by: Name = ""


class Exclusion(BaseModel):
    by: str
    reason: str
    since: Timestamp


class ClearedFinding(BaseModel):
    """One impairment an operator cleared as false: the check, its reason then, and the finding behind it."""

    check: CheckType
    status_reason: str | None = None  # the check's statusReason when it was cleared, e.g. XID_79
    finding_id: str = ""  # the GPU or daemon finding that impaired it; empty for a heartbeat loss
    cleared_by: str
    cleared_at: Timestamp
    reason: str = ""  # the operator's


class InstanceControlResult(BaseModel):
    """What an operator control did, and the instance's state after it."""

    instance_id: str
    message: str  # one line for the operator: what changed, and what became of a repair
    overall_status: HealthState
    excluded: Exclusion | None = None
    repair_workflow_id: str | None = None
    repair_phase: RepairPhase | None = None
    repair_withheld: str | None = None
    cleared: list[ClearedFinding] = Field(default_factory=list)  # what this control cleared


class RepairWithdrawal(BaseModel):
    """A health workflow takes back the repair it started while that repair still waits for its drain permit (it
    has not touched the instance). Only with the repair's progress token: only the health workflow knows it."""

    token: Token = ""
    reason: Text = ""


class RepairWithdrawalResult(BaseModel):
    withdrawn_at: Timestamp
