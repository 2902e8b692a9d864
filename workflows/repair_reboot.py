"""The remediation ladder's rung in place: reset the GPU or reboot the instance, and replace it only when that fails.

Under a group's `remediation = "reboot-first"`, a repair whose finding NVIDIA's Xid catalog answers with RESET_GPU,
RESTART_VM or RESTART_BM (GpuFinding.immediate_action) is first handled in place, in the same repair workflow:
  1-2. (repair.py) Acquire a drain permit, set the container instance DRAINING: the cap and the breaker apply.
  3. Let the tasks stop within their stop timeouts (the repair's own step): a reboot would kill them.
  4. Where the group has `gpu_reset = true` and NVIDIA says RESET_GPU: `nvidia-smi -r -i <pci>` through SSM Run
     Command. A reset the driver refuses (processes hold the GPU; NVSwitch systems reset their GPUs only together)
     reboots instead. Otherwise: EC2 RebootInstances.
  5. Wait, polling on a named timer, until the probe heartbeats from a new boot (after a reset: from the same boot,
     a heartbeat's time later) with every GPU source OK, no new GPU fault, and ECS says the agent is connected.
  6. Set the container instance ACTIVE; the repair completes without a replacement and its permit goes back.
Escalation (an `Escalated` event saying why) to the replacement steps of repair.py, start-before-stop:
  - at the start, when the finding's action is anything else (CONTACT_SUPPORT, WORKFLOW_XID_48, the NVLink
    workflows, a heartbeat loss: no finding at all), or the same GPU (the same instance when the GPU cannot be told)
    was fixed in place within the group's `escalation_window` (RepairInput.last_in_place_fix);
  - after the reset or reboot, when a new GPU fault shows, or the instance is not back by `reboot_timeout`.
Under `remediation = "replace"` nothing here runs: the repair's history is the one it always was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from temporalio import workflow
from temporalio.exceptions import ActivityError

from contract.config import format_seconds
from contract.groups import CapacityGroup, Remediation
from contract.health import HealthState
from contract.probe import STATE_TRANSITION_KINDS
from contract.repair import IN_PLACE_ACTIONS, RESET_GPU, InPlaceFix, RepairAction, RepairInput, RepairPhase
from workflows import repair_evidence as evidence
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.repair_replacement import describe_error, permanent_error

with workflow.unsafe.imports_passed_through():
    from activities.models import (
        EventType,
        GpuResetCheck,
        GpuResetRequest,
        HealthViewExcerpt,
        InstanceRef,
        RebootRequest,
        RecoveryCheck,
        RecoveryStatus,
    )
    from activities.remediation import RemediationActivities

if TYPE_CHECKING:
    from workflows.repair import InstanceRepairWorkflow

MIN_POLL = timedelta(seconds=1)

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


def choose(wf: InstanceRepairWorkflow, group: CapacityGroup) -> None:
    """Decide the first rung from the group's setting, the finding and the instance's last fix in place."""
    ladder = wf._ladder
    ladder.remediation = group.remediation
    if group.remediation is not Remediation.REBOOT_FIRST:
        return
    input = wf._input
    finding = input.finding
    ladder.nvidia_action = finding.immediate_action if finding is not None else ""
    why = _replace_at_once(input, group, workflow.now())
    if why is not None:
        ladder.escalations.append((RepairAction.REBOOT, RepairAction.REPLACE, why))
        return
    assert finding is not None  # _replace_at_once says why when there is none
    reset = ladder.nvidia_action == RESET_GPU and group.gpu_reset and bool(finding.gpu.pci)
    ladder.first = ladder.action = RepairAction.GPU_RESET if reset else RepairAction.REBOOT


def _replace_at_once(input: RepairInput, group: CapacityGroup, now: datetime) -> str | None:
    finding = input.finding
    if finding is None:
        return f"{input.reason}: not a GPU fault NVIDIA's catalog answers with a reset or a reboot"
    if finding.immediate_action not in IN_PLACE_ACTIONS:
        action = finding.immediate_action or "none"
        return f"{finding.reason}: NVIDIA's immediate action is {action}, not a GPU reset or a reboot"
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


async def fix_in_place(wf: InstanceRepairWorkflow, group: CapacityGroup) -> bool:
    """Steps 3-6 on the DRAINING instance. True: fixed, the instance stays; False: the repair goes on to replace it
    (its events and runbook say why)."""
    ladder = wf._ladder
    if ladder.remediation is not Remediation.REBOOT_FIRST:
        return False
    if ladder.first is RepairAction.REPLACE:
        await _escalate(wf, *ladder.escalations[-1])
        return False
    await wf._enter(RepairPhase.STOPPING_TASKS)
    stopped, forced = await wf._let_tasks_stop(group)
    wf._notes[RepairPhase.STOPPING_TASKS] = f"{stopped} tasks, {forced} stopped at their timeout"
    await wf._event(EventType.TASKS_STOPPED, tasks=stopped, forced=forced)
    ladder.tasks = (stopped, forced)

    # What the host knows of its fault goes before a reset or a reboot clears it.
    await evidence.keep_evidence(wf, group)
    before = await _look(wf, "look at the instance before touching it")
    known = {f.finding_id for f in before.probe.recent_findings} if before.probe is not None else set()
    old_boot = before.probe.boot_id if before.probe is not None else None
    started = workflow.now()
    settle_from: datetime | None = None
    if ladder.action is RepairAction.GPU_RESET:
        refused = await _reset_gpu(wf, group)
        if refused is None:
            settle_from = workflow.now()
        else:
            await _escalate(wf, RepairAction.GPU_RESET, RepairAction.REBOOT, refused)
            ladder.action = RepairAction.REBOOT
            started = workflow.now()
    if ladder.action is RepairAction.REBOOT:
        await _reboot(wf, old_boot)
    why = await _await_recovery(wf, group, started, known, old_boot, settle_from)
    if why is not None:
        await _escalate(wf, ladder.action, RepairAction.REPLACE, why)
        return False
    done = EventType.GPU_RESET_COMPLETED if ladder.action is RepairAction.GPU_RESET else EventType.REBOOT_COMPLETED
    await wf._event(done, **_about(wf), took_seconds=int((workflow.now() - started).total_seconds()))

    await wf._enter(RepairPhase.REACTIVATING)
    await workflow.execute_activity_method(
        RemediationActivities.set_active,
        InstanceRef(group=wf._input.group, instance_id=wf._input.instance_id),
        summary=f"set {wf._input.instance_id} ACTIVE: fixed by {ladder.action.value}",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
    finding = wf._input.finding
    ladder.fix = InPlaceFix(
        workflow_id=workflow.info().workflow_id,
        action=ladder.action,
        reason=finding.reason if finding is not None else wf._input.reason[:128],
        gpu=finding.gpu.pci if finding is not None else None,
        fixed_at=workflow.now(),
        started_at=started,
    )
    return True


async def _reset_gpu(wf: InstanceRepairWorkflow, group: CapacityGroup) -> str | None:
    """Reset the finding's GPU; None when it was, else why not (the command's own words)."""
    finding = wf._input.finding
    assert finding is not None and finding.gpu.pci is not None  # choose() resets only a named GPU
    instance_id, gpu = wf._input.instance_id, finding.gpu.pci
    await wf._enter(RepairPhase.RESETTING_GPU)
    try:
        sent = await workflow.execute_activity_method(
            RemediationActivities.send_gpu_reset,
            GpuResetRequest(group=wf._input.group, instance_id=instance_id, gpu=gpu, token=str(workflow.uuid4())),
            summary=f"reset GPU {gpu} of {instance_id}: nvidia-smi -r through SSM Run Command",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
    except ActivityError as err:
        if not permanent_error(err):
            raise
        # No SSM agent on the host, or no permission: a reboot does without either.
        return f"reset of GPU {gpu} could not be sent: {describe_error(err)}"
    wf._notes[RepairPhase.RESETTING_GPU] = f"SSM command {sent.command_id}"
    await wf._event(EventType.GPU_RESET_STARTED, **_about(wf), command_id=sent.command_id)
    deadline = workflow.now() + group.reboot_timeout
    check = GpuResetCheck(group=wf._input.group, instance_id=instance_id, command_id=sent.command_id)
    while True:
        status = await workflow.execute_activity_method(
            RemediationActivities.gpu_reset_status,
            check,
            summary=f"has the reset of GPU {gpu} finished?",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        if status.done:
            code = f", exit status {status.exit_code}" if status.exit_code is not None else ""
            wf._notes[RepairPhase.RESETTING_GPU] = f"SSM command {sent.command_id}: {status.status}{code}"
            if status.reset:
                return None
            return f"reset of GPU {gpu} refused ({status.status}{code}): {status.why}"
        if workflow.now() >= deadline:
            return f"reset of GPU {gpu} still {status.status} after {format_seconds(group.reboot_timeout)}"
        await workflow.sleep(_poll(group), summary=f"GPU {gpu} reset {status.status or 'pending'}")


async def _reboot(wf: InstanceRepairWorkflow, old_boot: str | None) -> None:
    instance_id = wf._input.instance_id
    await wf._enter(RepairPhase.REBOOTING)
    token = str(workflow.uuid4())
    await workflow.execute_activity_method(
        RemediationActivities.reboot_instance,
        RebootRequest(group=wf._input.group, instance_id=instance_id, token=token),
        summary=f"reboot {instance_id} (EC2 RebootInstances)",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
    wf._notes[RepairPhase.REBOOTING] = f"from boot {old_boot or 'unknown'}"
    await wf._event(EventType.REBOOT_STARTED, **_about(wf), boot_id_before=old_boot, token=token)


async def _await_recovery(
    wf: InstanceRepairWorkflow,
    group: CapacityGroup,
    started: datetime,
    known: set[str],
    old_boot: str | None,
    settle_from: datetime | None,
) -> str | None:
    """Poll until the instance is back; None once it is, else why it is not going to be (a new fault, the
    reboot_timeout)."""
    await wf._enter(RepairPhase.AWAITING_RECOVERY)
    deadline = started + group.reboot_timeout
    rebooted = wf._ladder.action is RepairAction.REBOOT
    while True:
        look = await _look(wf, f"is {wf._input.instance_id} back: new boot, GPUs OK, ECS agent connected?")
        fault = _new_fault(look.probe, known, started)
        if fault is not None:
            return f"faulted again after the {wf._ladder.action.value}: {fault}"
        missing = _missing(look, old_boot if rebooted else None, rebooted)
        if settle_from is not None and workflow.now() - settle_from < group.heartbeat_interval:
            missing = missing or "a heartbeat's time after the reset"
        wf._notes[RepairPhase.AWAITING_RECOVERY] = f"waiting for {missing}" if missing else "back"
        if missing is None:
            boot = look.probe.boot_id if look.probe is not None else None
            wf._notes[RepairPhase.AWAITING_RECOVERY] = f"back on boot {boot}" if rebooted else "GPUs OK after reset"
            return None
        if workflow.now() >= deadline:
            return f"not back within reboot_timeout {format_seconds(group.reboot_timeout)}: still waiting for {missing}"
        workflow.set_current_details(wf._runbook_markdown())
        await workflow.sleep(_poll(group), summary=f"waiting for {wf._input.instance_id}: {missing}")


def _new_fault(probe: HealthViewExcerpt | None, known: set[str], since: datetime) -> str | None:
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


def _missing(look: RecoveryStatus, old_boot: str | None, rebooted: bool) -> str | None:
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


async def _look(wf: InstanceRepairWorkflow, summary: str) -> RecoveryStatus:
    return await workflow.execute_activity_method(
        RemediationActivities.recovery_status,
        RecoveryCheck(group=wf._input.group, instance_id=wf._input.instance_id),
        summary=summary,
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )


async def _escalate(wf: InstanceRepairWorkflow, frm: RepairAction, to: RepairAction, why: str) -> None:
    ladder = wf._ladder
    if (frm, to, why) not in ladder.escalations:
        ladder.escalations.append((frm, to, why))
    ladder.action = to
    await wf._event(EventType.ESCALATED, **_about(wf), from_action=frm.value, to_action=to.value, why=why)


def _about(wf: InstanceRepairWorkflow) -> dict[str, str | None]:
    finding = wf._input.finding
    return {
        "reason": wf._input.reason,
        "gpu": finding.gpu.pci if finding is not None else None,
        "nvidia_action": wf._ladder.nvidia_action or None,
    }


def _poll(group: CapacityGroup) -> timedelta:
    # The probe says something new at most once a heartbeat: looking more often only costs history.
    return max(group.heartbeat_interval, MIN_POLL)


# --- what the Web UI shows -----------------------------------------------------------------------------------------


def runbook_lines(wf: InstanceRepairWorkflow) -> list[str] | None:
    """The runbook of a repair that took the rung (None: it replaces at once, repair.py's runbook), with the rung's
    header; `header_lines` is the header alone."""
    ladder = wf._ladder
    if ladder.first is RepairAction.REPLACE:
        return None
    steps = [
        (RepairPhase.WAITING_FOR_PERMIT, "Acquire a drain permit"),
        (RepairPhase.DRAINING, "Set the container instance DRAINING"),
        (RepairPhase.STOPPING_TASKS, "Let tasks stop within their stop timeouts"),
    ]
    if wf._evidence_step:
        steps.append((RepairPhase.COLLECTING_EVIDENCE, evidence.EVIDENCE_STEP))
    if ladder.first is RepairAction.GPU_RESET:
        pci = wf._input.finding.gpu.pci if wf._input.finding is not None else None
        steps.append((RepairPhase.RESETTING_GPU, f"Reset GPU {pci} (nvidia-smi -r through SSM)"))
    if ladder.first is RepairAction.REBOOT or any(to is RepairAction.REBOOT for _, to, _ in ladder.escalations):
        steps.append((RepairPhase.REBOOTING, "Reboot the instance (EC2 RebootInstances)"))
    steps.append((RepairPhase.AWAITING_RECOVERY, "Wait for it to come back: GPUs OK, ECS agent connected"))
    if ladder.action is RepairAction.REPLACE:
        steps += [
            (p, "Stop what is left of the tasks" if p is RepairPhase.STOPPING_TASKS else t)
            for p, t in wf._runbook
            if p in REPLACEMENT_PHASES
        ]
    else:
        steps.append((RepairPhase.REACTIVATING, "Set the container instance ACTIVE"))
    marks = _marks([phase for phase, _ in steps], [step.phase for step in wf._timeline])
    lines = header_lines(wf)
    for index, ((phase, text), mark) in enumerate(zip(steps, marks, strict=True)):
        note = wf._notes.get(phase)
        lines.append(f"{index + 1}. [{mark}] {text}" + (f" — {note}" if note else ""))
    return lines


def header_lines(wf: InstanceRepairWorkflow) -> list[str]:
    """Which rung was taken and why, for a reboot-first group's repairs; nothing for a `replace` group's."""
    ladder = wf._ladder
    if ladder.remediation is not Remediation.REBOOT_FIRST:
        return []
    nvidia = f" (NVIDIA: {ladder.nvidia_action})" if ladder.nvidia_action else ""
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
