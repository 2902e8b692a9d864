"""A repair as others see it: its phases, and the input that starts `repair/<instance>`."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel

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


class PhaseStep(BaseModel):
    phase: RepairPhase
    started_at: datetime


class RepairInput(BaseModel):
    instance_id: str
    group: str
    reason: str
    finding: GpuFinding | None = None
