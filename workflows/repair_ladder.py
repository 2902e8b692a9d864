"""The remediation ladder's decisions, as a plain model: which rung a repair takes first, and whether an instance is
back after its reset or reboot. No Temporal here; workflows/repair_reboot.py runs the steps, these decide.

What the rung is, step by step, and when it escalates: workflows/repair_reboot.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from activities.models import HealthViewExcerpt, RecoveryStatus
from contract.config import format_seconds
from contract.groups import CapacityGroup, Remediation
from contract.health import HealthState
from contract.probe import (
    ACTION_DRAIN_AND_RESET,
    ACTION_DRAIN_P2P,
    ACTION_NONE,
    ACTION_REPLACE,
    ACTION_RESET_GPU,
    ACTION_RESTART_BM,
    ACTION_RESTART_VM,
    STATE_TRANSITION_KINDS,
    VERDICT_RECOVERY_ACTION,
    GpuFinding,
)
from contract.repair import GpuVerdict, InPlaceFix, RepairAction, RepairInput


@dataclass
class Ladder:
    """The rung's part of a repair's state: what it tries, what it did, and why it escalated."""

    remediation: Remediation = Remediation.REPLACE
    first: RepairAction = RepairAction.REPLACE  # what is tried first; REPLACE: the rung is skipped
    action: RepairAction = RepairAction.REPLACE  # what is being (or was) done now
    nvidia_action: str = ""
    nvidia_why: str = ""  # where NVIDIA's action came from: the catalog, or a standing verdict on a GPU
    escalations: list[tuple[RepairAction, RepairAction, str]] = field(default_factory=list)
    fix: InPlaceFix | None = None
    tasks: tuple[int, int] = (0, 0)  # tasks stopped before the reset or reboot, and of them stopped at their timeout

    @property
    def escalated(self) -> str | None:
        return "; ".join(f"{a.value} -> {b.value}: {why}" for a, b, why in self.escalations) or None

    def choose(self, input: RepairInput, group: CapacityGroup, now: datetime) -> None:
        """Decide the first rung from the group's setting, what NVIDIA says of the fault and the instance's fixes in
        place."""
        self.remediation = group.remediation
        if group.remediation is not Remediation.REBOOT_FIRST:
            return
        finding = input.finding
        says = nvidia_says(finding, input.nvidia_verdicts) if finding is not None else None
        self.nvidia_action = says.action if says is not None else ""
        self.nvidia_why = says.why if says is not None else ""
        why = replace_at_once(input, says, group, now)
        if why is not None:
            self.escalations.append((RepairAction.REBOOT, RepairAction.REPLACE, why))
            return
        assert finding is not None and says is not None  # replace_at_once says why when there is none
        rung = RUNGS[says.action]
        reset = rung is RepairAction.GPU_RESET and group.gpu_reset and bool(finding.gpu.pci)
        self.first = self.action = RepairAction.GPU_RESET if reset else RepairAction.REBOOT

    def reconsider(
        self, finding: GpuFinding | None, verdicts: Sequence[GpuVerdict], group: CapacityGroup
    ) -> tuple[RepairAction, RepairAction, str] | None:
        """The escalation NVIDIA's verdicts ask for now, right before the reset or reboot, if any (and NVIDIA's action
        becomes theirs). A verdict stated after the repair began counts (Xid 154 follows the Xid it is about, and the
        repair may have started between them); it can only ask for more than the rung chosen, never less: a reboot
        resets every GPU."""
        if finding is None or self.action is RepairAction.REPLACE:
            return None
        says = nvidia_says(finding, verdicts)
        rung = _rung(says.action)
        if rung is RepairAction.GPU_RESET and not (group.gpu_reset and finding.gpu.pci):
            rung = RepairAction.REBOOT
        if _SEVERITY.index(rung) <= _SEVERITY.index(self.action):
            return None
        self.nvidia_action, self.nvidia_why = says
        source = f" ({says.why})" if says.why else ""
        return self.action, rung, f"{finding.reason}: NVIDIA now asks for {says.action or 'none'}{source}"

    def escalate(self, frm: RepairAction, to: RepairAction, why: str) -> None:
        if (frm, to, why) not in self.escalations:
            self.escalations.append((frm, to, why))
        self.action = to


# The decision table (docs/operations.md §13): what a reboot-first repair does for the action NVIDIA names. Any other
# action (CONTACT_SUPPORT, WORKFLOW_XID_48, the NVLink workflows, REPLACE, none) is a replacement at once. A GPU reset
# needs the group's `gpu_reset` and a finding that names its GPU, else it is a reboot, which resets every GPU.
RUNGS: dict[str, RepairAction] = {
    ACTION_RESET_GPU: RepairAction.GPU_RESET,
    # The rung drains the instance and lets its tasks stop before every reset: NVIDIA's "drain" is done either way.
    ACTION_DRAIN_AND_RESET: RepairAction.GPU_RESET,
    # Drained, the GPU has no peer-to-peer user left; the reset then clears what they left behind.
    ACTION_DRAIN_P2P: RepairAction.GPU_RESET,
    ACTION_RESTART_VM: RepairAction.REBOOT,
    ACTION_RESTART_BM: RepairAction.REBOOT,
}
# Rungs from the least to the most drastic: of two asks, the more drastic wins (a reboot also resets every GPU).
_SEVERITY = (RepairAction.GPU_RESET, RepairAction.REBOOT, RepairAction.REPLACE)


class NvidiaSays(NamedTuple):
    action: str  # NVIDIA's action for the fault (contract.probe's ACTION_*, or a catalog bucket); "" for none
    why: str  # the standing verdict it comes from, for the runbook and the events; "": the fault's own action


def _rung(action: str) -> RepairAction:
    return RUNGS.get(action, RepairAction.REPLACE)


def nvidia_says(finding: GpuFinding, verdicts: Sequence[GpuVerdict]) -> NvidiaSays:
    """What NVIDIA asks for this fault, in this order:
    1. a standing verdict on any GPU of the instance that asks for a replacement (unrepairable memory, the SRAM
       threshold exceeded, a row-remapping failure): the instance is out of service already, and putting back a GPU
       NVIDIA says cannot be repaired in place only waits for its next fault;
    2. the recovery action of the fault's GPU (NVML's, or Xid 154's): NVIDIA's catalog says it overrides the Xids
       around it, so it may ask for less than the fault's own action (a reset where the Xid says reboot);
    3. the fault's own action (the Xid catalog's), or a standing verdict on its GPU that asks for more (a channel
       repair pending needs a reset, which a reboot also gives).
    A verdict whose action is NONE was withdrawn: the health workflow no longer holds it."""
    held = [v for v in verdicts if v.action and v.action != ACTION_NONE]
    replace = [v for v in held if v.action == ACTION_REPLACE]
    if replace:
        v = replace[-1]
        return NvidiaSays(ACTION_REPLACE, f"NVIDIA's {v.verdict} ({v.reason}) on {_on(v.gpu)}")
    pci = finding.gpu.pci
    mine = [v for v in held if pci is None or v.gpu is None or v.gpu == pci]
    recovery = [v for v in mine if v.verdict == VERDICT_RECOVERY_ACTION and v.action in RUNGS]
    if recovery:
        v = max(recovery, key=lambda v: v.observed_at)
        return NvidiaSays(v.action, f"NVIDIA's recovery action {v.action} ({v.reason}) on {_on(v.gpu)}")
    says = NvidiaSays(finding.immediate_action, "")
    for v in mine:
        if v.action in RUNGS and _SEVERITY.index(_rung(v.action)) > _SEVERITY.index(_rung(says.action)):
            says = NvidiaSays(v.action, f"NVIDIA's {v.verdict} ({v.reason}) on {_on(v.gpu)}")
    return says


def _on(gpu: str | None) -> str:
    return f"GPU {gpu}" if gpu else "the instance"


def replace_at_once(input: RepairInput, says: NvidiaSays | None, group: CapacityGroup, now: datetime) -> str | None:
    """Why a reboot-first repair skips the rung (None: it takes it)."""
    finding = input.finding
    if finding is None or says is None:
        return f"{input.reason}: not a GPU fault NVIDIA's catalog answers with a reset or a reboot"
    if says.action not in RUNGS:
        action = says.action or "none"
        source = f" ({says.why})" if says.why else ""
        return f"{finding.reason}: NVIDIA's immediate action is {action}{source}, not a GPU reset or a reboot"
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


@dataclass(frozen=True)
class WorldWait:
    """A wait on the world (a replacement's boot, an instance's recovery, one look at a fixed instance) that the
    engine's own silence does not use up. A look whose health workflow gave no answer (no worker free to take the
    query in time, or none started yet: the engine behind) says nothing of the instance, so at the deadline it earns
    more time, at most `patience` past it: a busy worker never abandons a healthy replacement, or fails a fix, for
    its own delay; and one that never answers still ends the wait."""

    deadline: datetime
    patience: timedelta

    def over(self, now: datetime, look: RecoveryStatus) -> bool:
        if now < self.deadline:
            return False
        return not (look.probe_unanswered and now < self.deadline + self.patience)


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
