"""A health workflow's part in the breaker (workflows/breaker.py): it tells its group's semaphore of each impairment,
and asks the liveness tracker to judge a silence afresh. Whether its repair is critical is the check table's
(workflows/health_checks.py); going back to proving its fault is InstanceHealth.prove_again."""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

from contract import names
from contract.breaker import ImpairmentReport
from contract.health import CheckType, HealthState
from contract.liveness import RecheckLoss
from workflows import health_aws_rules as aws_rules
from workflows.health_checks import impaired
from workflows.models import HealthCarry
from workflows.options import CALL_RETRY, CALL_TIMEOUT

with workflow.unsafe.imports_passed_through():
    from activities.breaker_ops import BreakerOps


async def report_impairment(state: HealthCarry, instance_id: str, group: str, reason: str) -> None:
    """Tell the group's semaphore, whose breaker counts impairments whether repair is ENABLED or not; never of an
    instance AWS scheduled an event for (a retirement says nothing of the fleet's health)."""
    if aws_rules.planned_only(state):
        state.impairment_reported = True
        return
    since: list[datetime] = [c.lastStatusChange for c in state.checks.values() if c.status is HealthState.IMPAIRED]
    silent = impaired(state, CheckType.AGENT_CONNECTIVITY)
    report = ImpairmentReport(
        instance_id=instance_id,
        group=group,
        at=min(since, default=workflow.now()),
        reason=reason[:128],
        # When the silence began: heartbeat losses that began together are one outage, not many faults.
        silent_since=(state.last_heartbeat or state.started_at) if silent else None,
    )
    await workflow.execute_activity_method(
        BreakerOps.report_impairment,
        report,
        summary=f"tell the breaker of {group} that {instance_id} is IMPAIRED",
        start_to_close_timeout=CALL_TIMEOUT,
        retry_policy=CALL_RETRY,
    )
    state.impairment_reported = True


async def recheck_loss(state: HealthCarry, instance_id: str, tracker_id: str | None) -> None:
    """Ask the tracker to judge the silence afresh: a loss it declared is forgotten, and told again only if the
    instance stays silent a full window from now."""
    state.recheck_loss = False
    if tracker_id is None:
        return
    try:
        recheck = RecheckLoss(instance_id=instance_id)
        await workflow.get_external_workflow_handle(tracker_id).signal(names.SIGNAL_RECHECK_LOSS, recheck)
    except Exception as err:  # no tracker running: one that starts judges every instance afresh anyway
        workflow.logger.info("tracker %s not asked to recheck %s: %s", tracker_id, instance_id, err)
