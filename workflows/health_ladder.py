"""A health workflow's part in the remediation ladder (workflows/repair_reboot.py has the repair's).

- Each forwarded heartbeat's boot id is kept and shown in the `health` view: a reboot-first repair waits for a
  heartbeat from a new boot.
- A repair that cleared its fault in place (a GPU reset or a reboot) ends COMPLETED with an `in_place_fix` in its
  last progress. The instance is not retired then, as after a replacement: its GPU and agent checks go back to OK,
  the findings that fix dealt with are dropped (a new fault is told by its own finding, never by an old one with
  the same reason), and the next repair is told of the fix (RepairInput.last_in_place_fix), so that the same GPU
  faulting again within the group's escalation_window is replaced rather than rebooted again.
- NVIDIA's standing verdicts on the GPUs (a finding with a `verdict`: the recovery action, unrepairable memory, ...)
  are kept, the newest per GPU and verdict, and given to each repair (RepairInput.nvidia_verdicts), where they choose
  the remedy. One whose action is NONE withdraws it; a fix in place withdraws those that asked for that fix, and a
  new boot all of them (the probe states again any that still holds).
"""

from __future__ import annotations

from datetime import datetime

from contract.health import CheckType, HealthState
from contract.probe import ACTION_NONE, ACTION_REPLACE, NVIDIA_VERDICTS, STATE_TRANSITION_KINDS, GpuFinding, Heartbeat
from contract.repair import MAX_FIXES_KEPT, MAX_VERDICTS_KEPT, GpuVerdict, RepairProgress
from workflows.models import HealthCarry, HealthCheckResult

# Checks a fix in place clears: the GPU fault it dealt with, and the agent silence the reboot itself caused (the
# repair saw the new boot's heartbeat and ECS's agent connected before it finished).
CLEARED_BY_FIX = (CheckType.ACCELERATED_COMPUTE, CheckType.AGENT_CONNECTIVITY)


BEFORE_FIX_RULE = "before-in-place-fix"


def from_before_fix(state: HealthCarry, finding: GpuFinding) -> GpuFinding:
    """A GPU fault the probe observed before the last fix in place began, delivered only after it (spooled through
    the reboot): the fault that fix dealt with. Kept as a warning, never an impairment: counted as the fault coming
    back, it would replace an instance the reboot had fixed."""
    fix = state.last_in_place_fix
    if (
        fix is None
        or fix.started_at is None
        or not finding.impairs
        or finding.kind in STATE_TRANSITION_KINDS
        or finding.observed_at >= fix.started_at
    ):
        return finding
    return finding.model_copy(update={"impairs": False, "rule": BEFORE_FIX_RULE})


def note_verdict(state: HealthCarry, finding: GpuFinding) -> bool:
    """Keep the finding's verdict, if it states one, in place of an older one of the same GPU and verdict. False: it
    states none, or an unknown one (a newer probe's), or is older than the one held (delivered late)."""
    if finding.verdict not in NVIDIA_VERDICTS:
        return False
    gpu = finding.gpu.pci or finding.gpu.uuid
    held = [v for v in state.nvidia_verdicts if (v.gpu, v.verdict) == (gpu, finding.verdict)]
    if held and held[0].observed_at > finding.observed_at:
        return False
    kept = [v for v in state.nvidia_verdicts if (v.gpu, v.verdict) != (gpu, finding.verdict)]
    if finding.immediate_action != ACTION_NONE:
        kept.append(
            GpuVerdict(
                verdict=finding.verdict,
                action=finding.immediate_action,
                gpu=gpu,
                reason=finding.reason,
                finding_id=finding.finding_id,
                observed_at=finding.observed_at,
            )
        )
    if len(kept) > MAX_VERDICTS_KEPT:
        state.dropped_entries += len(kept) - MAX_VERDICTS_KEPT
        kept = kept[-MAX_VERDICTS_KEPT:]
    state.nvidia_verdicts = kept
    return True


def heard(state: HealthCarry, beat: Heartbeat) -> None:
    if beat.boot_id:
        if state.boot_id is not None and beat.boot_id != state.boot_id:
            # A new boot resets every GPU: what NVIDIA asked of the old boot's is answered, and the probe states
            # again, from its first poll, any verdict that still holds (its findings' ids are new with the boot).
            state.nvidia_verdicts = []
        state.boot_id = beat.boot_id


def fixed_in_place(state: HealthCarry, progress: RepairProgress, now: datetime) -> bool:
    """Whether the completed repair of this progress fixed the instance in place; if so, the instance is healthy
    again and may be repaired anew (the caller releases its repair claim). False: it was replaced (the caller
    retires)."""
    fix = progress.in_place_fix
    if fix is None:
        return False
    state.last_in_place_fix = fix
    state.in_place_fixes = [*state.in_place_fixes, fix][-MAX_FIXES_KEPT:]
    for check in CLEARED_BY_FIX:
        current = state.checks.get(check)
        if current is not None and current.status is HealthState.IMPAIRED:
            state.checks[check] = HealthCheckResult(
                type=check, status=HealthState.OK, lastUpdated=now, lastStatusChange=now
            )
    state.findings = [f for f in state.findings if not f.impairs or f.kind in STATE_TRANSITION_KINDS]
    state.nvidia_verdicts = [v for v in state.nvidia_verdicts if v.action == ACTION_REPLACE]
    state.repair_retry = state.repair_retry.afresh()
    return True
