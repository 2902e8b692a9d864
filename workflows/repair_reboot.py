"""The remediation ladder's rung in place: reset the GPU or reboot the instance, and replace it only when that fails.

Under a group's `remediation = "reboot-first"`, a repair whose finding NVIDIA's Xid catalog answers with RESET_GPU,
RESTART_VM or RESTART_BM (GpuFinding.immediate_action) is first handled in place, in the same repair workflow:
  1-2. (repair.py) Acquire a drain permit, set the container instance DRAINING: the cap and the breaker apply.
  3. Let the tasks stop within their stop timeouts (the repair's own step): a reboot would kill them.
  4. Where the group has `gpu_reset = true` and NVIDIA says RESET_GPU: `nvidia-smi -r -i <pci>` through SSM Run
     Command. A reset the driver refuses (processes hold the GPU; NVSwitch systems reset their GPUs only together)
     reboots instead. Otherwise: EC2 RebootInstances.
  5. Wait, polling on a named timer, until the probe heartbeats from a new boot (after a reset: from the same boot,
     a heartbeat's time later) with every GPU source OK, no new GPU fault, and ECS says the agent is connected. Then
     the fix's gate (workflows/fix_gate.py): every GPU of the type visible, no standing NVIDIA verdict, no memory
     remap pending, no fault since the fix began; a failure escalates to a replacement (FixVerified says which).
  6. Set the container instance ACTIVE; the repair completes without a replacement and its permit goes back.
Escalation (an `Escalated` event saying why) to the replacement steps of repair.py, start-before-stop:
  - at the start, when the finding's action is anything else (CONTACT_SUPPORT, WORKFLOW_XID_48, the NVLink
    workflows, a heartbeat loss: no finding at all), or the same GPU (the same instance when the GPU cannot be told)
    was fixed in place within the group's `escalation_window` (RepairInput.last_in_place_fix), or the instance was
    fixed in place `max_fixes_in_place` times within `fix_window` (RepairInput.in_place_fixes), whichever GPU;
  - after the reset or reboot, when a new GPU fault shows, or the instance is not back by `reboot_timeout`.
Under `remediation = "replace"` nothing here runs: the repair's history is the one it always was.
Which rung, and whether the instance is back, are decided in workflows/repair_ladder.py.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow
from temporalio.exceptions import ActivityError

from contract import event_types as ev
from contract.config import format_seconds
from contract.groups import CapacityGroup, Remediation
from contract.repair import InPlaceFix, RepairAction, RepairPhase
from workflows import repair_evidence as evidence
from workflows import repair_patches
from workflows.activity_errors import describe_error, permanent_error
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.repair_context import RepairContext
from workflows.repair_ladder import WorldWait, missing, new_fault
from workflows.repair_tasks import let_tasks_stop
from workflows.repair_verify import look_at, poll_interval, verify_fix

with workflow.unsafe.imports_passed_through():
    from activities.models import (
        GpuResetCheck,
        GpuResetRequest,
        RebootRequest,
    )
    from activities.remediation import RemediationActivities


async def fix_in_place(repair: RepairContext, group: CapacityGroup) -> bool:
    """Steps 3-6 on the DRAINING instance. True: fixed, the instance stays; False: the repair goes on to replace it
    (its events and runbook say why)."""
    record = repair.record
    ladder = record.ladder
    if ladder.remediation is not Remediation.REBOOT_FIRST:
        return False
    if ladder.first is RepairAction.REPLACE:
        await _escalate(repair, *ladder.escalations[-1])
        return False
    ladder.tasks = await let_tasks_stop(repair, group)

    # What the host knows of its fault goes before a reset or a reboot clears it.
    await evidence.keep_evidence(repair, group)
    before = await look_at(repair, "look at the instance before touching it")
    change = ladder.reconsider(record.input.finding, before.probe.nvidia_verdicts if before.probe else [], group)
    if change is not None:
        await _escalate(repair, *change)
        if ladder.action is RepairAction.REPLACE:
            return False
    known = {f.finding_id for f in before.probe.recent_findings} if before.probe is not None else set()
    old_boot = before.probe.boot_id if before.probe is not None else None
    started = workflow.now()
    settle_from: datetime | None = None
    if ladder.action is RepairAction.GPU_RESET:
        refused = await _reset_gpu(repair, group)
        if refused is None:
            settle_from = workflow.now()
        else:
            await _escalate(repair, RepairAction.GPU_RESET, RepairAction.REBOOT, refused)
            started = workflow.now()
    if ladder.action is RepairAction.REBOOT:
        await _reboot(repair, old_boot)
    why = await _await_recovery(repair, group, started, known, old_boot, settle_from)
    if why is not None:
        await _escalate(repair, ladder.action, RepairAction.REPLACE, why)
        return False
    done = ev.GpuResetCompleted if ladder.action is RepairAction.GPU_RESET else ev.RebootCompleted
    await repair.event(done(**record.about(), took_seconds=int((workflow.now() - started).total_seconds())))
    if repair_patches.patched(repair_patches.VERIFY_FIX):
        why = await verify_fix(repair, group, started)
        if why is not None:
            await _escalate(repair, ladder.action, RepairAction.REPLACE, why)
            return False

    await repair.enter(RepairPhase.REACTIVATING)
    await workflow.execute_activity_method(
        RemediationActivities.set_active,
        repair.instance,
        summary=f"set {record.instance_id} ACTIVE: fixed by {ladder.action.value}",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
    finding = record.input.finding
    ladder.fix = InPlaceFix(
        workflow_id=workflow.info().workflow_id,
        action=ladder.action,
        reason=finding.reason if finding is not None else record.input.reason[:128],
        gpu=finding.gpu.pci if finding is not None else None,
        fixed_at=workflow.now(),
        started_at=started,
    )
    return True


async def _reset_gpu(repair: RepairContext, group: CapacityGroup) -> str | None:
    """Reset the finding's GPU; None when it was, else why not (the command's own words)."""
    record = repair.record
    finding = record.input.finding
    assert finding is not None and finding.gpu.pci is not None  # Ladder.choose resets only a named GPU
    instance_id, gpu = record.instance_id, finding.gpu.pci
    await repair.enter(RepairPhase.RESETTING_GPU)
    try:
        sent = await workflow.execute_activity_method(
            RemediationActivities.send_gpu_reset,
            GpuResetRequest(group=record.group, instance_id=instance_id, gpu=gpu, token=str(workflow.uuid4())),
            summary=f"reset GPU {gpu} of {instance_id}: nvidia-smi -r through SSM Run Command",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
    except ActivityError as err:
        if not permanent_error(err):
            raise
        # No SSM agent on the host, or no permission: a reboot does without either.
        return f"reset of GPU {gpu} could not be sent: {describe_error(err)}"
    record.notes[RepairPhase.RESETTING_GPU] = f"SSM command {sent.command_id}"
    await repair.event(ev.GpuResetStarted(**record.about(), command_id=sent.command_id))
    deadline = workflow.now() + group.reboot_timeout
    check = GpuResetCheck(group=record.group, instance_id=instance_id, command_id=sent.command_id)
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
            record.notes[RepairPhase.RESETTING_GPU] = f"SSM command {sent.command_id}: {status.status}{code}"
            if status.reset:
                return None
            return f"reset of GPU {gpu} refused ({status.status}{code}): {status.why}"
        if workflow.now() >= deadline:
            return f"reset of GPU {gpu} still {status.status} after {format_seconds(group.reboot_timeout)}"
        await workflow.sleep(poll_interval(group), summary=f"GPU {gpu} reset {status.status or 'pending'}")


async def _reboot(repair: RepairContext, old_boot: str | None) -> None:
    record = repair.record
    await repair.enter(RepairPhase.REBOOTING)
    token = str(workflow.uuid4())
    await workflow.execute_activity_method(
        RemediationActivities.reboot_instance,
        RebootRequest(group=record.group, instance_id=record.instance_id, token=token),
        summary=f"reboot {record.instance_id} (EC2 RebootInstances)",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
    record.notes[RepairPhase.REBOOTING] = f"from boot {old_boot or 'unknown'}"
    await repair.event(ev.RebootStarted(**record.about(), boot_id_before=old_boot, token=token))


async def _await_recovery(
    repair: RepairContext,
    group: CapacityGroup,
    started: datetime,
    known: set[str],
    old_boot: str | None,
    settle_from: datetime | None,
) -> str | None:
    """Poll until the instance is back; None once it is, else why it is not going to be (a new fault, the
    reboot_timeout)."""
    record = repair.record
    await repair.enter(RepairPhase.AWAITING_RECOVERY)
    # Up to one more reboot_timeout while the look that lacks is our own health workflow's missing answer.
    wait = WorldWait(started + group.reboot_timeout, patience=group.reboot_timeout)
    rebooted = record.ladder.action is RepairAction.REBOOT
    while True:
        look = await look_at(repair, f"is {record.instance_id} back: new boot, GPUs OK, ECS agent connected?")
        fault = new_fault(look.probe, known, started)
        if fault is not None:
            return f"faulted again after the {record.ladder.action.value}: {fault}"
        lacking = missing(look, old_boot if rebooted else None, rebooted)
        if settle_from is not None and workflow.now() - settle_from < group.heartbeat_interval:
            lacking = lacking or "a heartbeat's time after the reset"
        record.notes[RepairPhase.AWAITING_RECOVERY] = f"waiting for {lacking}" if lacking else "back"
        if lacking is None:
            boot = look.probe.boot_id if look.probe is not None else None
            record.notes[RepairPhase.AWAITING_RECOVERY] = f"back on boot {boot}" if rebooted else "GPUs OK after reset"
            return None
        if wait.over(workflow.now(), look):
            return f"not back within reboot_timeout {format_seconds(group.reboot_timeout)}: still waiting for {lacking}"
        repair.show()
        await workflow.sleep(poll_interval(group), summary=f"waiting for {record.instance_id}: {lacking}")


async def _escalate(repair: RepairContext, frm: RepairAction, to: RepairAction, why: str) -> None:
    repair.record.ladder.escalate(frm, to, why)
    await repair.event(ev.Escalated(**repair.record.about(), from_action=frm, to_action=to, why=why))
