"""A repair's account of itself, as a plain model: where it is, what each step found, what it replaced, what failed.

The workflow (workflows/repair.py) and its steps write it; its runbook (workflows/repair_runbook.py), its query and
its closing events read it. No Temporal here: `now` comes from the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypedDict

from contract.repair import FINISHED, PhaseStep, RepairInput, RepairPhase
from workflows.repair_ladder import Ladder


class FaultAbout(TypedDict):
    reason: str
    gpu: str | None
    nvidia_action: str | None


@dataclass
class RepairRecord:
    input: RepairInput
    started_at: datetime
    # Put in the repair's permit request; the semaphore's grant must carry it back, and its launch outcomes show it.
    permit_token: str
    phase: RepairPhase = RepairPhase.WAITING_FOR_PERMIT
    timeline: list[PhaseStep] = field(default_factory=list)
    notes: dict[RepairPhase, str] = field(default_factory=dict)  # each step's outcome, shown beside it
    runbook: list[tuple[RepairPhase, str]] = field(default_factory=list)  # the steps, for this repair's group
    replacement: str | None = None
    # The container instances the repair found (set_draining's, the replacement's wait's): its later looks at each
    # describe it by ARN instead of finding it again (activities/models.py, KnownInstance).
    container_instance_arn: str | None = None
    replacement_container_instance_arn: str | None = None
    error: str | None = None
    ladder: Ladder = field(default_factory=Ladder)
    evidence_step: bool = False  # the group keeps evidence: the ladder's runbook shows the step too
    evidence_taken: bool = False
    evidence: str | None = None  # the incident's evidence in S3, once stored (workflows/repair_evidence.py)
    avoid_azs: list[str] = field(default_factory=list)  # from the grant: AZs the group's launches found out of capacity
    rejected: int = 0  # malformed signals dropped
    forged: int = 0  # permit grants and denials dropped for want of this repair's token

    def __post_init__(self) -> None:
        if not self.timeline:
            self.timeline.append(PhaseStep(phase=self.phase, started_at=self.started_at))

    @property
    def instance_id(self) -> str:
        return self.input.instance_id

    @property
    def group(self) -> str:
        return self.input.group

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED

    def enter(self, phase: RepairPhase, now: datetime) -> None:
        self.phase = phase
        self.timeline.append(PhaseStep(phase=phase, started_at=now))

    def steps(self) -> list[dict[str, Any]]:
        # Closing events carry the phase timeline; activities/metrics.py turns it into per-phase durations.
        return [s.model_dump(mode="json") for s in self.timeline]

    def about(self) -> FaultAbout:
        """What the ladder's events say of the fault they act on (contract/event_types.py's LadderStep)."""
        finding = self.input.finding
        return {
            "reason": self.input.reason,
            "gpu": finding.gpu.pci if finding is not None else None,
            "nvidia_action": self.ladder.nvidia_action or None,
        }
