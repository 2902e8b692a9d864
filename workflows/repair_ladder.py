"""The remediation ladder's decisions, as a plain model: which rung a repair takes first, and whether an instance is
back after its reset or reboot. No Temporal here; workflows/repair_reboot.py runs the steps, these decide.

What the rung is, step by step, and when it escalates: workflows/repair_reboot.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from activities.models import HealthViewExcerpt, RecoveryStatus
from contract.config import format_seconds
from contract.groups import CapacityGroup, Remediation
from contract.health import HealthState
from contract.probe import STATE_TRANSITION_KINDS
from contract.repair import IN_PLACE_ACTIONS, RESET_GPU, InPlaceFix, RepairAction, RepairInput


@dataclass
class Ladder:
    """The rung's part of a repair's state: what it tries, what it did, and why it escalated."""

    remediation: Remediation = Remediation.REPLACE
    first: RepairAction = RepairAction.REPLACE  # what is tried first; REPLACE: the rung is skipped
    action: RepairAction = RepairAction.REPLACE  # what is being (or was) done now
    nvidia_action: str = ""
    escalations: list[tuple[RepairAction, RepairAction, str]] = field(default_factory=list)
    fix: InPlaceFix | None = None
    tasks: tuple[int, int] = (0, 0)  # tasks stopped before the reset or reboot, and of them stopped at their timeout

    @property
    def escalated(self) -> str | None:
        return "; ".join(f"{a.value} -> {b.value}: {why}" for a, b, why in self.escalations) or None

    def choose(self, input: RepairInput, group: CapacityGroup, now: datetime) -> None:
        """Decide the first rung from the group's setting, the finding and the instance's last fix in place."""
        self.remediation = group.remediation
        if group.remediation is not Remediation.REBOOT_FIRST:
            return
        finding = input.finding
        self.nvidia_action = finding.immediate_action if finding is not None else ""
        why = replace_at_once(input, group, now)
        if why is not None:
            self.escalations.append((RepairAction.REBOOT, RepairAction.REPLACE, why))
            return
        assert finding is not None  # replace_at_once says why when there is none
        reset = self.nvidia_action == RESET_GPU and group.gpu_reset and bool(finding.gpu.pci)
        self.first = self.action = RepairAction.GPU_RESET if reset else RepairAction.REBOOT

    def escalate(self, frm: RepairAction, to: RepairAction, why: str) -> None:
        if (frm, to, why) not in self.escalations:
            self.escalations.append((frm, to, why))
        self.action = to


def replace_at_once(input: RepairInput, group: CapacityGroup, now: datetime) -> str | None:
    """Why a reboot-first repair skips the rung (None: it takes it)."""
    finding = input.finding
    if finding is None:
        return f"{input.reason}: not a GPU fault NVIDIA's catalog answers with a reset or a reboot"
    if finding.immediate_action not in IN_PLACE_ACTIONS:
        action = finding.immediate_action or "none"
        return f"{finding.reason}: NVIDIA's immediate action is {action}, not a GPU reset or a reboot"
    recent = [f for f in input.in_place_fixes if now - f.fixed_at <= group.fix_window]
    if len(recent) >= group.max_fixes_in_place:
        times = f"{len(recent)} time{'s' if len(recent) > 1 else ''}"
        return (
            f"{finding.reason}: the instance was fixed in place {times} within fix_window "
            f"{format_seconds(group.fix_window)}, the last by {recent[-1].workflow_id} "
            f"(max_fixes_in_place {group.max_fixes_in_place})"
        )
    fix = input.last_in_place_fix
    if fix is None or now - fix.fixed_at > group.escalation_window:
        return None
    pci = finding.gpu.pci
    if fix.gpu is not None and pci is not None and fix.gpu != pci:
        return None  # another GPU of the instance: its own fault, its own first reboot
    where = f"GPU {pci}" if pci is not None and fix.gpu is not None else "the instance"
    return (
        f"{finding.reason} on {where} {format_seconds(now - fix.fixed_at)} after its {fix.action.value} by "
        f"{fix.workflow_id} (escalation_window {format_seconds(group.escalation_window)})"
    )


def new_fault(probe: HealthViewExcerpt | None, known: set[str], since: datetime) -> str | None:
    """A GPU fault the probe found after the reset or reboot began, if any."""
    if probe is None:
        return None
    for finding in probe.recent_findings:
        if (
            finding.impairs
            and finding.kind not in STATE_TRANSITION_KINDS
            and finding.finding_id not in known
            and finding.observed_at >= since
        ):
            gpu = f" on GPU {finding.gpu.pci}" if finding.gpu.pci else ""
            return f"{finding.reason}{gpu}"
    return None


def missing(look: RecoveryStatus, old_boot: str | None, rebooted: bool) -> str | None:
    """What the instance still lacks to count as back; None: nothing."""
    probe = look.probe
    if probe is None:
        return f"its health workflow ({look.probe_error or 'no answer'})"
    if rebooted and (probe.boot_id is None or probe.boot_id == old_boot):
        return f"a heartbeat from a new boot (the probe's last is from boot {probe.boot_id or 'unknown'})"
    gpu_sources = [s for s in probe.probe_sources if s.gpu_source]
    if not gpu_sources:
        return "the probe's GPU sources"
    down = [s.reason or s.name for s in gpu_sources if s.state is not HealthState.OK]
    if down:
        return f"GPU sources OK ({'; '.join(down)})"
    if look.agent_connected is not True:
        state = "not registered" if look.agent_connected is None else "disconnected"
        return f"the ECS agent to connect ({state})"
    return None
