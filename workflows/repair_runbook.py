"""What the Web UI shows of a repair: its runbook, each step marked done, **now** or next, with what it found.

Plain: rendered from the repair's record (workflows/repair_record.py), so a test reads it without a server.
"""

from __future__ import annotations

from contract.groups import CapacityGroup, Remediation
from contract.repair import RepairAction, RepairPhase
from workflows.repair_ladder import Ladder
from workflows.repair_record import RepairRecord

RUNBOOK = [
    (RepairPhase.WAITING_FOR_PERMIT, "Acquire a drain permit"),
    (RepairPhase.DRAINING, "Set the container instance DRAINING"),
    (RepairPhase.LAUNCHING_REPLACEMENT, "Launch a replacement in the same AZ"),
    (RepairPhase.WAITING_FOR_REPLACEMENT, "Wait for the replacement to be ACTIVE"),
    (RepairPhase.STOPPING_TASKS, "Let tasks stop within their stop timeouts"),
    (RepairPhase.TERMINATING, "Terminate the impaired instance"),
]
EVIDENCE_STEP = "Store the evidence in S3 (findings, kernel log, bug report)"
QUARANTINE_STEP = "Stop and keep the impaired instance (quarantine)"

# After an escalation, the repair's own steps from the launch on (its runbook for the group: with a quarantine in
# place of the termination; the evidence, if kept, was stored before the reset or the reboot).
REPLACEMENT_PHASES = frozenset(
    {
        RepairPhase.LAUNCHING_REPLACEMENT,
        RepairPhase.WAITING_FOR_REPLACEMENT,
        RepairPhase.STOPPING_TASKS,
        RepairPhase.TERMINATING,
        RepairPhase.QUARANTINING,
    }
)


def for_group(group: CapacityGroup) -> list[tuple[RepairPhase, str]]:
    """The repair's steps for this group: the evidence before the termination, and a quarantine in its place."""
    out: list[tuple[RepairPhase, str]] = []
    for phase, text in RUNBOOK:
        if phase is RepairPhase.TERMINATING:
            if group.evidence_bucket is not None:
                out.append((RepairPhase.COLLECTING_EVIDENCE, EVIDENCE_STEP))
            if group.quarantine:
                out.append((RepairPhase.QUARANTINING, QUARANTINE_STEP))
                continue
        out.append((phase, text))
    return out


def markdown(record: RepairRecord) -> str:
    input = record.input
    gpu = input.finding.gpu.pci if input.finding and input.finding.gpu.pci else None
    title = f"### Repair of `{input.instance_id}` in `{input.group}`"
    lines = [title, f"Reason: **{input.reason}**" + (f" on GPU `{gpu}`" if gpu else ""), ""]
    rung = _ladder_lines(record)  # the remediation ladder's steps, when it takes the rung in place
    lines += rung if rung is not None else _header_lines(record.ladder)
    marks = _plain_marks(record)
    for index, (phase, text) in enumerate(record.runbook if rung is None else []):
        mark = marks[index]
        note = record.notes.get(phase)
        lines.append(f"{index + 1}. [{mark}] {text}" + (f" — {note}" if note else ""))
    if record.finished:
        lines += ["", f"Outcome: **{record.phase.value}**" + (f" — {record.error}" if record.error else "")]
    if record.rejected:
        lines += ["", f"{record.rejected} malformed signals dropped"]
    if record.forged:
        lines += ["", f"**{record.forged} forged permit grants dropped** (without this repair's request token)"]
    return "\n".join(lines)


def _plain_marks(record: RepairRecord) -> list[str]:
    """done / **now** / next by the step it is at (an adopted replacement skips the launch, which is still done); a
    repair that ended unrepaired marks the step it ended in with its outcome, and what it never reached "not done"."""
    order = [phase for phase, _ in record.runbook]
    if record.finished and record.phase is not RepairPhase.COMPLETED:
        reached = [order.index(step.phase) for step in record.timeline if step.phase in order]
        last = max(reached, default=0)
        outcome = f"**{record.phase.value.lower()}**"
        return ["done" if i < last else outcome if i == last else "not done" for i in range(len(order))]
    current = order.index(record.phase) if record.phase in order else len(order)
    return ["done" if i < current else "**now**" if i == current else "next" for i in range(len(order))]


def _ladder_lines(record: RepairRecord) -> list[str] | None:
    """The runbook of a repair that took the rung (None: it replaces at once, the plain runbook), with the rung's
    header."""
    ladder = record.ladder
    if ladder.first is RepairAction.REPLACE:
        return None
    steps = [
        (RepairPhase.WAITING_FOR_PERMIT, "Acquire a drain permit"),
        (RepairPhase.DRAINING, "Set the container instance DRAINING"),
        (RepairPhase.STOPPING_TASKS, "Let tasks stop within their stop timeouts"),
    ]
    if record.evidence_step:
        steps.append((RepairPhase.COLLECTING_EVIDENCE, EVIDENCE_STEP))
    if ladder.first is RepairAction.GPU_RESET:
        pci = record.input.finding.gpu.pci if record.input.finding is not None else None
        steps.append((RepairPhase.RESETTING_GPU, f"Reset GPU {pci} (nvidia-smi -r through SSM)"))
    if ladder.first is RepairAction.REBOOT or any(to is RepairAction.REBOOT for _, to, _ in ladder.escalations):
        steps.append((RepairPhase.REBOOTING, "Reboot the instance (EC2 RebootInstances)"))
    steps.append(
        (RepairPhase.AWAITING_RECOVERY, "Wait for it to come back: GPUs OK, ECS agent connected; then the fix's gate")
    )
    if ladder.action is RepairAction.REPLACE:
        steps += [
            (p, "Stop what is left of the tasks" if p is RepairPhase.STOPPING_TASKS else t)
            for p, t in record.runbook
            if p in REPLACEMENT_PHASES
        ]
    else:
        steps.append((RepairPhase.REACTIVATING, "Set the container instance ACTIVE"))
    marks = _marks([phase for phase, _ in steps], [step.phase for step in record.timeline])
    lines = _header_lines(ladder)
    for index, ((phase, text), mark) in enumerate(zip(steps, marks, strict=True)):
        note = record.notes.get(phase)
        lines.append(f"{index + 1}. [{mark}] {text}" + (f" — {note}" if note else ""))
    return lines


def _header_lines(ladder: Ladder) -> list[str]:
    """Which rung was taken and why, for a reboot-first group's repairs; nothing for a `replace` group's."""
    if ladder.remediation is not Remediation.REBOOT_FIRST:
        return []
    why = f", {ladder.nvidia_why}" if ladder.nvidia_why else ""
    nvidia = f" (NVIDIA: {ladder.nvidia_action}{why})" if ladder.nvidia_action else ""
    first = "replaced at once" if ladder.first is RepairAction.REPLACE else f"first {ladder.first.value}"
    lines = [f"Remediation **reboot-first**: {first}{nvidia}"]
    lines += [f"- escalated {a.value} → **{b.value}**: {why}" for a, b, why in ladder.escalations]
    if ladder.fix is not None:
        lines.append(f"- fixed in place by **{ladder.fix.action.value}**: the instance stays")
    return [*lines, ""]


def _marks(steps: list[RepairPhase], entered: list[RepairPhase]) -> list[str]:
    """done / **now** / next for each step, matching the steps in order against the phases entered in order (a
    phase entered twice, as STOPPING_TASKS after an escalation, matches its steps one by one)."""
    marks: list[str] = []
    position = 0
    finished = bool(entered) and entered[-1] not in steps
    for phase in steps:
        try:
            found = entered.index(phase, position)
        except ValueError:
            marks.append("next")
            continue
        last = found == len(entered) - 1
        marks.append("**now**" if last and not finished else "done")
        position = found + 1
    return marks
