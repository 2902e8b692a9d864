"""A health workflow's repairs: it starts each attempt, `repair/<instance>/<n>`, and retries the ones that fail.

Runbook (the run loop of workflows/health.py calls into here):
  1. An IMPAIRED instance, an operator's `instance repair` or a retry that is due gets attempt n+1; n is counted in
     the carried state, so it survives continue-as-new, and each attempt has an id of its own (contract/ids.py).
  2. An attempt that FAILED (its last progress says so) is counted once. The group's configuration is read then, so
     `repair_retry_delay` and `max_repair_attempts` are live; the next attempt starts on the run loop's named wake
     timer, repair_retry_delay after the first failure, doubling after each (CapacityGroup.repair_retry_wait).
  3. When max_repair_attempts have failed in a row: RepairsExhausted, published once, and nothing more is tried
     until an operator's `autorepair instance repair`, which starts a fresh attempt with the count back at zero.
  4. An attempt an operator cancelled or withdrew is not retried; a DISCARDED one goes back to proving its fault
     (workflows/health_breaker.py), and after it (or a fix in place) a new impairment counts afresh.

Histories recorded before retries existed never counted a failure: counting is behind the patch REPAIR_RETRIES
(workflows/instance_health.py, which keeps the count from each attempt's progress).
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError

from contract import event_types as ev
from contract.formats import iso
from contract.groups import CapacityGroup
from contract.ids import repair_attempt_of
from contract.repair import ENDED_UNREPAIRED, RepairInput, RepairPhase
from workflows import health_breaker as breaker
from workflows.group_config import read_group_config
from workflows.group_events import activity_cause
from workflows.health_checks import critical
from workflows.instance_health import InstanceHealth
from workflows.models import HealthCarry, RepairView
from workflows.options import CALL_RETRY, CALL_TIMEOUT

with workflow.unsafe.imports_passed_through():
    from activities.models import StartRepairRequest
    from activities.workflow_ops import WorkflowOps


def wake_summary(state: HealthCarry) -> str | None:
    retry = state.repair_retry
    if retry.next_at is None or state.repair_claim is not None:
        return None
    return f"repair failed: start attempt {retry.failed + 1} of {retry.max_attempts} at {iso(retry.next_at, 'seconds')}"


async def count_failure(health: InstanceHealth, group: CapacityGroup) -> None:
    """Count a failed attempt and decide what follows it: a retry after the backoff, or RepairsExhausted. `group`:
    the configuration the run loop has, used if the group cannot be read now."""
    state, retry = health.state, health.state.repair_retry
    workflow_id, retry.to_count = retry.to_count, None
    try:
        group = await read_group_config(health.group, "read group config: retry the failed repair?")
    except ActivityError as err:
        cause = activity_cause(err)
        workflow.logger.warning("group %s not re-read (%s): its last known config decides", health.group, cause)
    repair = state.repair
    retry.last_counted = workflow_id
    retry.failed += 1
    retry.max_attempts = group.max_repair_attempts
    retry.error = repair.error if repair is not None else None
    retry.reason = repair.reason if repair is not None else None
    if retry.failed < group.max_repair_attempts:
        retry.next_at = workflow.now() + group.repair_retry_wait(retry.failed)
        health.release_claim()  # the run loop starts the next attempt once next_at has come
        workflow.logger.warning("%s: %s", health.instance_id, retry.text())
        return
    retry.exhausted, retry.next_at = True, None
    workflow.logger.warning("%s: %s; waiting for an operator", health.instance_id, retry.text())
    health.instance_event(
        ev.RepairsExhausted(
            attempts=retry.failed,
            max_repair_attempts=group.max_repair_attempts,
            error=retry.error,
            reason=retry.reason,
            repair_workflow_id=workflow_id,
        )
    )


async def start(health: InstanceHealth, news_beside_steps: bool) -> None:
    """Start the instance's next repair attempt, unless its group's auto repair is DISABLED or it is excluded."""
    state = health.state
    report = health.is_impaired() and not state.impairment_reported
    if news_beside_steps and report:
        # The breaker counts the impairment whatever the group's switch says: both at once, one round trip.
        health.take_for_repair()
        group, _ = await asyncio.gather(
            read_group_config(health.group),
            breaker.report_impairment(state, health.instance_id, health.group, health.impairment()[0]),
        )
    else:
        # The switch is read at the moment of the decision, so turning repair off takes effect at once.
        group = await read_group_config(health.group)
        health.take_for_repair()
        if report:
            await breaker.report_impairment(state, health.instance_id, health.group, health.impairment()[0])
    if not health.withhold_unless_allowed(group.auto_repair):
        return
    retry = state.repair_retry
    reason, finding = health.repair_reason()
    if state.operator_repair is None and retry.next_at is not None and retry.reason:
        reason = retry.reason  # a retry repeats the failed attempt's reason
    attempt = state.repair_attempt + 1
    previous = state.repair
    gpu = f" on GPU {finding.gpu.pci}" if finding is not None and finding.gpu.pci else ""
    of = f" (attempt {attempt})" if attempt > 1 else ""
    repair = RepairInput(
        instance_id=health.instance_id,
        group=health.group,
        reason=reason,
        finding=finding,
        progress_token=str(workflow.uuid4()),
        critical=critical(state),
        attempt=attempt,
        last_in_place_fix=state.last_in_place_fix,  # the remediation ladder's (workflows/health_ladder.py)
        in_place_fixes=state.in_place_fixes,
        nvidia_verdicts=state.nvidia_verdicts,
        group_config=group,
        earlier_replacement=previous.replacement_instance_id
        if previous is not None and previous.phase in ENDED_UNREPAIRED
        else None,
    )
    started = await workflow.execute_activity_method(
        WorkflowOps.start_repair,
        StartRepairRequest(
            repair=repair,
            summary=f"repair {health.instance_id}{of}: {reason}{gpu}",
            previous_workflow_id=previous.workflow_id
            if previous is not None and previous.phase in ENDED_UNREPAIRED
            else "",
        ),
        summary=f"start repair of {health.instance_id}{of} ({reason})",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
    parsed = repair_attempt_of(started.workflow_id)
    state.repair_attempt = max(state.repair_attempt, parsed[1] if parsed is not None else attempt)
    # The token of the repair that runs: ours, or that of one an earlier run of this workflow started.
    state.repair_token = started.progress_token or None
    state.repair = RepairView(
        workflow_id=started.workflow_id,
        phase=RepairPhase.WAITING_FOR_PERMIT,
        reason=reason,
        started_at=workflow.now(),
    )
    state.operator_repair = None
    retry.next_at, retry.reason, retry.exhausted = None, None, False
