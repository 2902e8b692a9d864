"""What AWS says of an instance, and what its health workflow makes of it, as a plain model: the rules of
workflows/health_aws_checks.py (its runbook), on the carried state, with `now` from the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from contract.aws_status import EC2_IMPAIRED, EC2_INSUFFICIENT_DATA, AwsInstanceStatus, ScheduledEvent
from contract.event_types import ScheduledEventFound
from contract.formats import iso
from contract.groups import CapacityGroup
from contract.health import CheckType, HealthState
from contract.repair import FINISHED
from workflows import health_daemon_rules as daemon_rules
from workflows.health_checks import impaired as _impaired
from workflows.health_checks import set_check
from workflows.models import AwsChecks, HealthCarry

STATUS_PREFIX = "EC2"
ECS_AGENT_PREFIX = "ECS agent disconnected since"
# The probe heard again no longer sets OK a check the ECS agent still impairs: other commands (no upsert, no timer).
ECS_AGENT_OUTLASTS_PROBE = "ecs-agent-impairment-outlasts-probe-return"
MAX_EVENT_KEYS = 20


def apply(aws: AwsChecks, report: AwsInstanceStatus) -> None:
    """Keep the newest picture, and since when each part has been bad."""
    if aws.last is not None and report.observed_at < aws.last.observed_at:
        return  # another worker's reader told an older picture after a newer one
    if report.same_as(aws.last):
        aws.last = report  # told again (another worker's reader, or one that restarted): nothing new to decide
        return
    aws.last, aws.look = report, True
    daemon_rules.apply(aws, report)
    checks = (report.system, report.instance)
    if any(c.status == EC2_IMPAIRED for c in checks):
        if aws.status_bad_since is None:
            told = [c.impaired_since for c in checks if c.status == EC2_IMPAIRED and c.impaired_since is not None]
            aws.status_bad_since = min(told, default=report.observed_at)
    elif not any(c.status == EC2_INSUFFICIENT_DATA for c in checks):
        aws.status_bad_since = None
    if report.agent_connected is False:
        if aws.agent_down_since is None:
            aws.agent_down_since = report.agent_disconnected_since or report.observed_at
    else:
        aws.agent_down_since = None


def due(state: HealthCarry, now: datetime) -> bool:
    """Whether the run loop has something to decide here now."""
    aws, fix = state.aws, state.last_in_place_fix
    fixed = fix is not None and fix.fixed_at != aws.fix_seen and (aws.last is not None or aws.fix_seen is not None)
    return aws.look or fixed or _overridden(state) or (aws.next_at is not None and now >= aws.next_at)


def wake(state: HealthCarry, now: datetime) -> timedelta | None:
    next_at = state.aws.next_at
    return None if next_at is None else max(next_at - now, timedelta(0))


def wake_summary(state: HealthCarry) -> str | None:
    if state.aws.next_at is None:
        return None
    return state.aws.next_what or "what AWS says: look again"


def probe_heard_again(state: HealthCarry, patched: Callable[[str], bool]) -> tuple[HealthState, str | None]:
    """AGENT_CONNECTIVITY once the liveness tracker hears the probe again. OK, unless the ECS agent impaired it here
    and AWS still says it is disconnected: then its reason again, since when it went. Set OK, the check would look
    overridden and the agent's grace would restart (Karpenter #2833); only someone else's OK (a clear) restarts it.
    `patched` is asked only when the answer depends on it, as the workflow's patch marker must be."""
    aws = state.aws
    ecs = aws.agent_impaired_at is not None and aws.agent_down_since is not None
    if ecs and _impaired(state, CheckType.AGENT_CONNECTIVITY) and patched(ECS_AGENT_OUTLASTS_PROBE):
        return HealthState.IMPAIRED, _agent_reason(aws)
    return HealthState.OK, None


def planned_only(state: HealthCarry) -> bool:
    """The instance is IMPAIRED only because AWS scheduled an event for it: not for the breaker to count."""
    aws = state.aws
    impaired = {c.type for c in state.checks.values() if c.status is HealthState.IMPAIRED}
    return impaired == {CheckType.EC2_STATUS} and aws.event_impaired is not None and aws.status_impaired_at is None


def settle(state: HealthCarry, now: datetime) -> None:
    """Before deciding: a fix in place ends the bad periods that began before it; what someone else set OK is
    proven afresh."""
    state.aws.look = False
    _after_fix(state, now)
    _prove_overridden_afresh(state, now)


# --- deciding -----------------------------------------------------------------------------------------------------


@dataclass
class Decision:
    ec2: HealthState | None = None  # None: leave EC2_STATUS as it is (a grace runs, or nothing was ever said)
    ec2_reason: str | None = None
    event: ScheduledEvent | None = None  # the event EC2_STATUS is impaired for
    agent_reason: str | None = None  # AGENT_CONNECTIVITY is to be IMPAIRED for the ECS agent
    agent_back: bool = False  # the ECS agent is connected again
    daemons: daemon_rules.DaemonDecision | None = None  # None: daemon tasks not decided (nothing told, or unpatched)
    deadlines: list[tuple[datetime, str]] = field(default_factory=list)

    @property
    def next_at(self) -> datetime | None:
        return min(self.deadlines)[0] if self.deadlines else None

    @property
    def next_what(self) -> str:
        return min(self.deadlines)[1] if self.deadlines else ""

    def impairs_anew(self, state: HealthCarry) -> bool:
        return (
            (self.ec2 is HealthState.IMPAIRED and not _impaired(state, CheckType.EC2_STATUS))
            or (self.agent_reason is not None and not _impaired(state, CheckType.AGENT_CONNECTIVITY))
            or (self.daemons is not None and bool(self.daemons.down) and not _impaired(state, CheckType.DAEMON))
        )


def decide(state: HealthCarry, group: CapacityGroup, now: datetime, daemons: bool = False) -> Decision:
    """What the pictures mean now; `daemons`: the ECS daemon tasks too (workflows/health_daemon_rules.py)."""
    aws, decision = state.aws, Decision()
    last = aws.last
    if last is None:
        return decision
    if daemons:
        decision.daemons = daemon_rules.decide(state, group, now)
        decision.deadlines += decision.daemons.deadlines
    checks = {"system": last.system, "instance": last.instance}
    impaired = [name for name, c in checks.items() if c.status == EC2_IMPAIRED]
    if impaired and aws.status_bad_since is not None:
        at = aws.status_bad_since + group.status_check_grace
        if now >= at:
            failed = sorted({d for name in impaired for d in checks[name].failed})
            decision.ec2, decision.ec2_reason = HealthState.IMPAIRED, _status_reason(impaired, failed, aws)
        else:
            decision.deadlines.append((at, f"EC2 {' and '.join(impaired)} status check impaired: grace ends"))
    event = next((e for e in last.events if e.key not in aws.events_dismissed), None)
    if event is not None and decision.ec2 is None:
        at = event.not_before - group.scheduled_event_lead
        if now >= at:
            decision.ec2, decision.event = HealthState.IMPAIRED, event
            decision.ec2_reason = f"EC2 scheduled {event.code} not before {iso(event.not_before, 'seconds')}"
        else:
            decision.deadlines.append((at, f"EC2 scheduled {event.code}: replace before {iso(event.not_before)}"))
    unknown = [name for name, c in checks.items() if c.status == EC2_INSUFFICIENT_DATA]
    if decision.ec2 is None and not impaired:
        if unknown:
            decision.ec2 = HealthState.INSUFFICIENT_DATA
            decision.ec2_reason = f"EC2 {' and '.join(unknown)} status check insufficient-data"
        elif state.checks.get(CheckType.EC2_STATUS) is not None:
            decision.ec2 = HealthState.OK
    if aws.agent_down_since is not None:
        at = aws.agent_down_since + group.agent_disconnect_grace
        if now >= at:
            decision.agent_reason = _agent_reason(aws)
        else:
            decision.deadlines.append((at, "ECS agent disconnected: grace ends"))
    else:
        decision.agent_back = aws.agent_impaired_at is not None
    return decision


def _status_reason(impaired: list[str], failed: list[str], aws: AwsChecks) -> str:
    since = iso(aws.status_bad_since, "seconds") if aws.status_bad_since else "?"
    what = f" ({', '.join(failed)} failed)" if failed else ""
    return f"{STATUS_PREFIX} {' and '.join(impaired)} status check impaired since {since}{what}"


def _agent_reason(aws: AwsChecks) -> str:
    return f"{ECS_AGENT_PREFIX} {iso(aws.agent_down_since, 'seconds') if aws.agent_down_since else '?'}"


def apply_decision(state: HealthCarry, decision: Decision, now: datetime) -> None:
    aws = state.aws
    repairing = state.repair is not None and state.repair.phase not in FINISHED
    ec2 = state.checks.get(CheckType.EC2_STATUS)
    if decision.ec2 is HealthState.IMPAIRED:
        if ec2 is not None and ec2.status is HealthState.IMPAIRED:
            ec2.lastUpdated = now  # the first reason stays: alternating ones are the same impairment
        else:
            set_check(state, CheckType.EC2_STATUS, HealthState.IMPAIRED, decision.ec2_reason, now)
        if decision.event is not None:
            aws.event_impaired = aws.event_impaired or decision.event.key
        else:
            aws.status_impaired_at = aws.status_impaired_at or now
    elif decision.ec2 is not None and not (repairing and _impaired(state, CheckType.EC2_STATUS)):
        # Healthy again or unknown: unless its repair began (a repair that started finishes, as for DAEMON).
        set_check(state, CheckType.EC2_STATUS, decision.ec2, decision.ec2_reason, now)
        aws.status_impaired_at = aws.event_impaired = None
    agent = state.checks.get(CheckType.AGENT_CONNECTIVITY)
    if decision.agent_reason is not None:
        if agent is None or agent.status is not HealthState.IMPAIRED:
            set_check(state, CheckType.AGENT_CONNECTIVITY, HealthState.IMPAIRED, decision.agent_reason, now)
        aws.agent_impaired_at = aws.agent_impaired_at or now
    elif decision.agent_back:
        aws.agent_impaired_at = None
        ours = agent is not None and (agent.statusReason or "").startswith(ECS_AGENT_PREFIX)
        if ours and not repairing:  # the probe's own heartbeat loss, if that is the reason now, is not ours to end
            set_check(state, CheckType.AGENT_CONNECTIVITY, HealthState.OK, None, now)
    if decision.daemons is not None:
        daemon_rules.apply_decision(state, decision.daemons, now)


def _overridden(state: HealthCarry) -> bool:
    aws = state.aws
    ec2_ours = aws.status_impaired_at is not None or aws.event_impaired is not None
    return (
        (ec2_ours and not _impaired(state, CheckType.EC2_STATUS))
        or (aws.agent_impaired_at is not None and not _impaired(state, CheckType.AGENT_CONNECTIVITY))
        or daemon_rules.overridden(state)
    )


def _prove_overridden_afresh(state: HealthCarry, now: datetime) -> None:
    """Someone else set OK what was impaired here: what is still bad must last a full grace from now."""
    aws = state.aws
    if (aws.status_impaired_at is not None or aws.event_impaired is not None) and not _impaired(
        state, CheckType.EC2_STATUS
    ):
        if aws.status_impaired_at is not None and aws.status_bad_since is not None:
            aws.status_bad_since = now
        if aws.event_impaired is not None:
            aws.events_dismissed = [*aws.events_dismissed, aws.event_impaired][-MAX_EVENT_KEYS:]
        aws.status_impaired_at = aws.event_impaired = None
    if aws.agent_impaired_at is not None and not _impaired(state, CheckType.AGENT_CONNECTIVITY):
        if aws.agent_down_since is not None:
            aws.agent_down_since = now
        aws.agent_impaired_at = None
    daemon_rules.prove_overridden_afresh(state, now)


def _after_fix(state: HealthCarry, now: datetime) -> None:
    aws, fix = state.aws, state.last_in_place_fix
    if fix is None or fix.fixed_at == aws.fix_seen:
        return
    aws.fix_seen = fix.fixed_at
    if aws.status_bad_since is not None:
        aws.status_bad_since = max(aws.status_bad_since, fix.fixed_at)
    if aws.agent_down_since is not None:
        aws.agent_down_since = max(aws.agent_down_since, fix.fixed_at)
    if aws.status_impaired_at is not None and aws.event_impaired is None and _impaired(state, CheckType.EC2_STATUS):
        set_check(state, CheckType.EC2_STATUS, HealthState.OK, None, now)
        aws.status_impaired_at = None
    daemon_rules.after_fix(state, fix.fixed_at, now)


def events_to_tell(state: HealthCarry, group: CapacityGroup) -> list[ScheduledEventFound]:
    """Each scheduled event not told yet, once: its ScheduledEventFound."""
    aws, told = state.aws, []
    for event in aws.last.events if aws.last is not None else []:
        if event.key in aws.events_told:
            continue
        aws.events_told = [*aws.events_told, event.key][-MAX_EVENT_KEYS:]
        told.append(
            ScheduledEventFound(
                code=event.code,
                ec2_event_id=event.event_id,
                description=event.description,
                deadline=event.not_before,
                not_after=event.not_after,
                repair_at=event.not_before - group.scheduled_event_lead,
            )
        )
    return told
