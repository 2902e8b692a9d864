"""A repair's looks at an instance through its health workflow, and the gate (workflows/fix_gate.py) each fix must
pass before work returns: a reset or reboot before the instance goes back to ACTIVE (workflows/repair_reboot.py), a
replacement before the impaired instance is terminated (workflows/repair_replacement.py, `verify_replacement`)."""

from __future__ import annotations

from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

from contract import event_types as ev
from contract.config import format_seconds
from contract.groups import CapacityGroup
from contract.repair import RepairPhase
from workflows import repair_patches
from workflows.activity_errors import describe_error, permanent_error
from workflows.fix_gate import GATE_CHECKS, GateCheck, failures, run_gate
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.repair_context import RepairContext
from workflows.repair_ladder import WorldWait, missing

with workflow.unsafe.imports_passed_through():
    from activities.models import GateCommandRequest, HostCommandCheck, RecoveryCheck, RecoveryStatus
    from activities.remediation import RemediationActivities

MIN_POLL = timedelta(seconds=1)
GATE_SUMMARY = ", ".join(row.what for row in GATE_CHECKS)


def poll_interval(group: CapacityGroup) -> timedelta:
    # The probe says something new at most once a heartbeat: looking more often only costs history.
    return max(group.heartbeat_interval, MIN_POLL)


async def look_at(repair: RepairContext, summary: str, replacement: str | None = None) -> RecoveryStatus:
    """One look at the impaired instance, or at its replacement."""
    record = repair.record
    instance_id, arn = (
        (record.instance_id, record.container_instance_arn)
        if replacement is None
        else (replacement, record.replacement_container_instance_arn)
    )
    return await workflow.execute_activity_method(
        RemediationActivities.recovery_status,
        RecoveryCheck(group=record.group, instance_id=instance_id, container_instance_arn=arn),
        summary=summary,
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )


def _gate(look: RecoveryStatus, since: datetime) -> list[GateCheck]:
    if look.probe is None:
        return [GateCheck(name="health", passed=False, detail=look.probe_error or "its health workflow did not answer")]
    return run_gate(look.probe, since)


async def verify_fix(repair: RepairContext, group: CapacityGroup, since: datetime) -> str | None:
    """The fix in place's gate on one look at the instance, then on the host itself where the group asks for it;
    None: passed, else why it failed."""
    record = repair.record
    # One look decides, once it is the instance's answer: a look our own worker was too busy to answer is taken again.
    wait = WorldWait(workflow.now(), patience=group.reboot_timeout)
    while True:
        look = await look_at(repair, f"verify the fix of {record.instance_id} before work returns: {GATE_SUMMARY}")
        if wait.over(workflow.now(), look):
            break
        await workflow.sleep(poll_interval(group), summary=f"{record.instance_id}: {look.probe_error}; look again")
    checks = _gate(look, since)
    if failures(checks) is None and group.gates_on_host:
        checks.append(await _on_host(repair, group, record.instance_id))
    failed = failures(checks)
    note = record.notes.get(RepairPhase.AWAITING_RECOVERY, "")
    record.notes[RepairPhase.AWAITING_RECOVERY] = f"{note}; gate {'passed' if failed is None else 'FAILED: ' + failed}"
    await repair.event(
        ev.FixVerified(
            **record.about(),
            passed=failed is None,
            checks=[ev.GateResult.model_validate(c.model_dump()) for c in checks],
        )
    )
    return None if failed is None else f"the fix did not pass the gate: {failed}"


async def _on_host(repair: RepairContext, group: CapacityGroup, instance_id: str) -> GateCheck:
    """DCGM's diagnostic and the operator's command on the host (the repaired instance, or its replacement), through
    SSM Run Command: passed on exit 0; a command that cannot be sent, fails, or is not done within gate_timeout fails
    the gate."""
    record = repair.record
    asks = [f"dcgmi diag -r {group.gate_diag_level}"] if group.gate_diag_level else []
    asks += ["the group's gate_command"] if group.gate_command else []
    try:
        sent = await workflow.execute_activity_method(
            RemediationActivities.send_gate_command,
            GateCommandRequest(group=record.group, instance_id=instance_id, token=str(workflow.uuid4())),
            summary=f"run the gate on {instance_id}: {' and '.join(asks)} through SSM Run Command",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
    except ActivityError as err:
        if not permanent_error(err):
            raise
        return GateCheck(name="host", passed=False, detail=f"could not be sent: {describe_error(err)}")
    deadline = workflow.now() + group.gate_timeout
    check = HostCommandCheck(instance_id=instance_id, command_id=sent.command_id)
    while True:
        status = await workflow.execute_activity_method(
            RemediationActivities.host_command_status,
            check,
            summary=f"has the gate on {instance_id} finished?",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        if status.done:
            code = f", exit status {status.exit_code}" if status.exit_code is not None else ""
            said = f": {status.output}" if status.output else ""
            detail = f"SSM command {sent.command_id} {status.status}{code}{said}"
            return GateCheck(name="host", passed=status.succeeded, detail=detail)
        if workflow.now() >= deadline:
            return GateCheck(
                name="host",
                passed=False,
                detail=f"no answer within gate_timeout {format_seconds(group.gate_timeout)} ({status.status})",
            )
        await workflow.sleep(poll_interval(group), summary=f"the gate on {instance_id}: {status.status}")


async def verify_replacement(
    repair: RepairContext, group: CapacityGroup, replacement: str, since: datetime
) -> tuple[list[GateCheck], str | None]:
    """Wait, within replacement_ready_timeout of its launch, for the replacement's probe to report with every GPU
    source OK, then run the gate on it (with verify_replacement "on_host", the host's part too, within gate_timeout):
    its checks, and None when it passed, else why it did not (the caller abandons it and launches another). A
    health workflow that gives no answer at the deadline holds the wait up to one more replacement_ready_timeout."""
    wait = WorldWait(since + group.replacement_ready_timeout, patience=group.replacement_ready_timeout)
    while True:
        look = await look_at(
            repair, f"verify replacement {replacement} before work moves to it: {GATE_SUMMARY}", replacement
        )
        lacking = missing(look, None, rebooted=False)
        if lacking is None:
            checks = _gate(look, since)
            if (
                failures(checks) is None
                and group.gates_replacement_on_host
                and repair_patches.patched(repair_patches.VERIFY_REPLACEMENT_ON_HOST)
            ):
                checks.append(await _on_host(repair, group, replacement))
            failed = failures(checks)
            return checks, None if failed is None else f"failed the gate: {failed}"
        if wait.over(workflow.now(), look):
            why = f"not verified within replacement_ready_timeout {format_seconds(group.replacement_ready_timeout)}"
            return [], f"{why}: still waiting for {lacking}"
        await workflow.sleep(poll_interval(group), summary=f"replacement {replacement}: waiting for {lacking}")
