"""A repair as others see it: its phases, and the input that starts `repair/<instance>`."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel

from contract.limits import Id, Text, Token
from contract.probe import GpuFinding


class RepairPhase(StrEnum):
    WAITING_FOR_PERMIT = "WaitingForPermit"
    DRAINING = "Draining"
    LAUNCHING_REPLACEMENT = "LaunchingReplacement"
    WAITING_FOR_REPLACEMENT = "WaitingForReplacement"
    STOPPING_TASKS = "StoppingTasks"
    TERMINATING = "Terminating"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"
    # Held by the breaker and let go by `--resume --discard-held`: the instance was never touched, and must prove
    # its fault again before another repair.
    DISCARDED = "Discarded"


class PhaseStep(BaseModel):
    phase: RepairPhase
    started_at: datetime


class RepairInput(BaseModel):
    instance_id: Id
    group: Id
    reason: Text
    finding: GpuFinding | None = None
    # Set by the health workflow that starts the repair; the repair puts it in every `repair_progress` it sends,
    # and the health workflow takes progress only with it.
    progress_token: Token = ""
    # Outside the group's maintenance windows only critical repairs get a permit (docs/operations.md).
    critical: bool = True
