"""Evidence before anything destroys it, and the quarantine that keeps the instance itself.

Runbook, for a group with an `evidence_bucket`, once per repair, before its first reset, reboot or termination:
  1. Store what the worker holds in S3 under the incident: the finding, the probe's recent findings and sources,
     their kernel-log lines.
  2. Where the group has `bug_report`: the host's kernel log from before the fault and `nvidia-bug-report.sh`,
     through SSM Run Command, uploaded by the host to presigned URLs; waited for at most `bug_report_timeout`.
  3. Write the manifest: what is there, what is missing and why. `EvidenceStored` links it; the repair's last events
     (`Terminated`, `Quarantined`, `RepairCompleted`) carry its location.
Evidence never holds a repair hostage: S3 refusing, or a host that cannot run the command, is said
(`EvidenceNotStored`, the manifest's `missing`, the runbook) and the repair goes on. A group without a bucket takes
none of these steps.

With the group's `quarantine`, the impaired instance is stopped, not terminated: it leaves ECS and the group
(its group tag becomes gpu-autorepair:quarantined) and waits, stopped, for a hardware investigation.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, is_cancelled_exception

from contract import event_types as ev
from contract.config import format_seconds
from contract.evidence import QUARANTINE_TAG
from contract.groups import CapacityGroup
from contract.repair import RepairPhase
from workflows.activity_errors import describe_error
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.repair_context import RepairContext

with workflow.unsafe.imports_passed_through():
    from activities.evidence import EvidenceActivities
    from activities.fleet import FleetActivities
    from activities.models import (
        EvidenceCommandCheck,
        EvidenceFinish,
        EvidenceManifest,
        EvidenceRequest,
        EvidenceStored,
    )

# Evidence is worth minutes, not the repair: an S3 that keeps refusing is given up on after a few tries.
EVIDENCE_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=2), maximum_interval=timedelta(seconds=30), maximum_attempts=6
)
MIN_POLL = timedelta(seconds=1)


async def keep_evidence(repair: RepairContext, group: CapacityGroup) -> None:
    """Steps 1-3, once per repair; nothing for a group without an evidence bucket."""
    record = repair.record
    if record.evidence_taken or group.evidence_bucket is None:
        return
    record.evidence_taken = True
    await repair.enter(RepairPhase.COLLECTING_EVIDENCE)
    input = record.input
    try:
        stored: EvidenceStored = await workflow.execute_activity_method(
            EvidenceActivities.store_evidence,
            EvidenceRequest(
                group=input.group,
                instance_id=input.instance_id,
                repair_workflow_id=workflow.info().workflow_id,
                attempt=input.attempt,
                reason=input.reason,
                finding=input.finding,
                fault_at=input.finding.observed_at if input.finding is not None else workflow.info().start_time,
                token=str(workflow.uuid4()),
            ),
            summary=f"store the findings of {input.instance_id} in s3://{group.evidence_bucket}"
            + (" and ask the host for nvidia-bug-report.sh" if group.bug_report else ""),
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=EVIDENCE_RETRY,
        )
        note = await _host_part(repair, group, stored)
        manifest: EvidenceManifest = await workflow.execute_activity_method(
            EvidenceActivities.finish_evidence,
            EvidenceFinish(
                group=input.group,
                bucket=stored.bucket,
                prefix=stored.prefix,
                repair_workflow_id=workflow.info().workflow_id,
                stored=stored.objects,
                host_note=note,
                host_asked=stored.command_id is not None,
            ),
            summary="write the evidence manifest: what is there, what is missing",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=EVIDENCE_RETRY,
        )
    except ActivityError as err:
        if is_cancelled_exception(err):
            raise
        why = describe_error(err)
        record.notes[RepairPhase.COLLECTING_EVIDENCE] = f"**not stored**: {why}"
        await repair.event(ev.EvidenceNotStored(reason=input.reason, why=why))
        return
    record.evidence = manifest.location
    missing = f"; missing: {', '.join(manifest.missing)}" if manifest.missing else ""
    record.notes[RepairPhase.COLLECTING_EVIDENCE] = f"{manifest.location}{missing}"
    await repair.event(
        ev.EvidenceStored(
            reason=input.reason,
            evidence=manifest.location,
            objects=manifest.objects,
            missing=manifest.missing,
            complete=manifest.complete,
        )
    )


async def _host_part(repair: RepairContext, group: CapacityGroup, stored: EvidenceStored) -> str:
    """Wait for the host's command; "" when it ran, else what the manifest says of the host's missing objects."""
    if stored.command_id is None:
        return f"the host could not be asked: {stored.command_error}" if stored.command_error else ""
    instance_id = repair.record.instance_id
    check = EvidenceCommandCheck(group=repair.record.group, instance_id=instance_id, command_id=stored.command_id)
    deadline = workflow.now() + group.bug_report_timeout
    poll = max(group.task_poll_interval, MIN_POLL)
    while True:
        # First a poll's wait: nvidia-bug-report.sh takes a minute or more, and the first look would only say so.
        await workflow.sleep(poll, summary=f"the host {instance_id} collects its evidence (SSM {stored.command_id})")
        status = await workflow.execute_activity_method(
            EvidenceActivities.evidence_command_status,
            check,
            summary=f"has {instance_id} uploaded its evidence?",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=EVIDENCE_RETRY,
        )
        if status.done:
            if status.succeeded:
                return f"the host's command ran; it said: {status.output or 'nothing'}"
            return f"the host's command ended {status.status}: {status.output}"
        if workflow.now() >= deadline:
            return f"the host's command was still {status.status} after {format_seconds(group.bug_report_timeout)}"


async def quarantine(repair: RepairContext) -> None:
    """The group's quarantine, in place of the termination: the instance stopped, out of ECS and the group."""
    record = repair.record
    await repair.enter(RepairPhase.QUARANTINING)
    result = await workflow.execute_activity_method(
        FleetActivities.quarantine_instance,
        repair.instance,
        summary=f"quarantine {record.instance_id}: deregister, leave the group, stop (not terminate)",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
    if result.gone:
        record.notes[RepairPhase.QUARANTINING] = f"already {result.previous_state or 'gone'}: nothing to keep"
    else:
        record.notes[RepairPhase.QUARANTINING] = f"stopped, tagged {QUARANTINE_TAG}"
    await repair.event(
        ev.Quarantined(previous_state=result.previous_state, kept=not result.gone, evidence=record.evidence)
    )
