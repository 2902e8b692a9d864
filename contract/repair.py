"""A repair as others see it: its phases, and the input that starts an attempt, `repair/<instance>/<n>`."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, Field

from contract.groups import CapacityGroup
from contract.limits import Id, Name, OptionalId, Text, Timestamp, Token
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
    # The remediation ladder's rung in place (workflows/repair_reboot.py): after DRAINING and STOPPING_TASKS.
    RESETTING_GPU = "ResettingGpu"
    REBOOTING = "Rebooting"
    AWAITING_RECOVERY = "AwaitingRecovery"
    REACTIVATING = "Reactivating"
    # Before anything destroys what the host knows (a reset, a reboot, a termination): the evidence to S3.
    COLLECTING_EVIDENCE = "CollectingEvidence"
    # The group's quarantine: the impaired instance stopped and kept, instead of TERMINATING.
    QUARANTINING = "Quarantining"


# Fixes in place an instance's health workflow keeps, newest last: far above any sane max_fixes_in_place.
MAX_FIXES_KEPT = 20
# Repairs that closed without replacing the instance: a later attempt may follow, once it has closed.
ENDED_UNREPAIRED = frozenset({RepairPhase.FAILED, RepairPhase.CANCELLED, RepairPhase.DISCARDED})
FINISHED = ENDED_UNREPAIRED | {RepairPhase.COMPLETED}


# NVIDIA's standing verdicts an instance's health workflow keeps (one per GPU and verdict, the newest): 8 GPUs with
# every verdict set fit, and a probe naming garbage GPUs cannot grow it.
MAX_VERDICTS_KEPT = 48


class GpuVerdict(BaseModel):
    """One of NVIDIA's standing verdicts on one GPU (contract.probe.NVIDIA_VERDICTS), as the instance's health
    workflow last heard it: the finding that stated it, and the action it asks for."""

    verdict: Name
    action: Name
    gpu: Name | None = None  # the GPU's PCI address; None: the finding did not say (the whole instance)
    reason: Name = ""
    finding_id: Id
    observed_at: Timestamp


class RepairAction(StrEnum):
    """How a repair handled its fault, as `autorepair history` and the events say it."""

    REPLACE = "replace"
    GPU_RESET = "gpu-reset"
    REBOOT = "reboot"


class PhaseStep(BaseModel):
    phase: RepairPhase
    started_at: Timestamp


class InPlaceFix(BaseModel):
    """A repair that cleared its fault without replacing the instance: what it did, to which GPU, and when."""

    workflow_id: Id
    action: RepairAction
    reason: Name = ""
    gpu: Name | None = None  # PCI address of the GPU the finding named; None: the instance as a whole
    fixed_at: Timestamp
    # When the reset or reboot began: a finding the probe observed before it, delivered after the fix (spooled through
    # the outage), is what the fix dealt with, not the fault coming back. None from repairs before it.
    started_at: Timestamp | None = None


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
    # The instance's last fix in place, as its health workflow learnt it: the same GPU faulting again within the
    # group's escalation_window is replaced, not rebooted again.
    last_in_place_fix: InPlaceFix | None = None
    # The instance's fixes in place its health workflow keeps (the newest MAX_FIXES_KEPT): the group's
    # max_fixes_in_place within fix_window are counted from them.
    in_place_fixes: list[InPlaceFix] = Field(default_factory=list, max_length=MAX_FIXES_KEPT)
    # Which attempt at repairing the instance this is (from 1; contract/ids.py repair_workflow_id). 0: one started
    # before attempts had ids of their own, as `repair/<instance>`.
    attempt: int = Field(default=0, ge=0)
    # The replacement an earlier attempt of this incident launched, when that attempt ended unrepaired (its
    # termination failed, say): adopted if it is still ACTIVE in ECS, so a retry never launches a second one.
    earlier_replacement: Id | None = None
    # NVIDIA's standing verdicts on the instance's GPUs its health workflow held when it started the repair (none
    # cleared): under reboot-first they choose the remedy (workflows/repair_ladder.py).
    nvidia_verdicts: list[GpuVerdict] = Field(default_factory=list, max_length=MAX_VERDICTS_KEPT)
    # The group's configuration (live overrides applied) its health workflow read to decide on this repair, a moment
    # before starting it: the repair works with it and does not read it again. None from a health workflow that
    # started repairs before it was passed: the repair reads it.
    group_config: CapacityGroup | None = None


class RepairProgress(BaseModel):
    """The repair workflow keeps the instance's health workflow told of where it is (signal `repair_progress`)."""

    workflow_id: Id
    phase: RepairPhase
    replacement_instance_id: OptionalId | None = None
    error: Text | None = None
    finished: bool = False
    token: Token = ""  # the repair's RepairInput.progress_token: only the health workflow that started it knows it
    # With the last progress of a repair that cleared its fault in place (reset or reboot): the instance stays.
    in_place_fix: InPlaceFix | None = None
