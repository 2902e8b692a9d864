"""The group's ECS daemon tasks, for an instance's health workflow, as a plain model: AWS's reader tells which of the
group's `daemon_services` has no RUNNING (or an UNHEALTHY) task on the instance (AwsInstanceStatus
`daemon_tasks_missing`); one missing for the group's daemon_task_grace goes on DAEMON's down list, as a systemd unit
the probe reports down does (workflows/health_services.py), with the reason `ECS_DAEMON_<service>`; its task back
takes it off again. Part of the AWS runbook (workflows/health_aws_checks.py): the same picture, the same confirming
read before impairing, the same proof afresh after someone else's OK, the same fresh start after a fix in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from contract.aws_status import AwsInstanceStatus
from contract.groups import CapacityGroup
from contract.health import CheckType
from workflows import health_services as services
from workflows.models import AwsChecks, HealthCarry

REASON_PREFIX = "ECS_DAEMON_"
# A patch id: histories recorded before the AWS reader told ECS daemon tasks.
ECS_DAEMON_TASKS = "ecs-daemon-tasks"


def reason(service: str) -> str:
    return f"{REASON_PREFIX}{service}"


@dataclass
class DaemonDecision:
    down: list[str] = field(default_factory=list)  # services to put on DAEMON's down list now
    back: list[str] = field(default_factory=list)  # services of ours whose task is back
    deadlines: list[tuple[datetime, str]] = field(default_factory=list)


def apply(aws: AwsChecks, report: AwsInstanceStatus) -> None:
    """Since when each service told missing has been missing; one no longer told is there again."""
    since = aws.daemons_missing_since
    aws.daemons_missing_since = {s: since.get(s, report.observed_at) for s in report.daemon_tasks_missing}


def relevant(aws: AwsChecks) -> bool:
    """Whether there is anything of daemon tasks to decide (only then is the workflow's patch marker asked)."""
    return bool(aws.daemons_missing_since or aws.daemons_impaired)


def decide(state: HealthCarry, group: CapacityGroup, now: datetime) -> DaemonDecision:
    aws, decision = state.aws, DaemonDecision()
    listed = services.listed_down(state, CheckType.DAEMON)
    for service, since in sorted(aws.daemons_missing_since.items(), key=lambda item: (item[1], item[0])):
        if service in aws.daemons_impaired and reason(service) in listed:
            continue
        at = since + group.daemon_task_grace
        if now >= at:
            decision.down.append(service)
        else:
            decision.deadlines.append((at, f"ECS daemon task {service} missing: grace ends"))
    decision.back = [s for s in aws.daemons_impaired if s not in aws.daemons_missing_since]
    return decision


def apply_decision(state: HealthCarry, decision: DaemonDecision, now: datetime) -> None:
    aws = state.aws
    for service in decision.down:
        services.down(state, CheckType.DAEMON, reason(service), now)
        if service not in aws.daemons_impaired:
            aws.daemons_impaired = [*aws.daemons_impaired, service]
    for service in decision.back:
        services.back(state, CheckType.DAEMON, reason(service), now)
        aws.daemons_impaired = [s for s in aws.daemons_impaired if s != service]


def overridden(state: HealthCarry) -> bool:
    """Someone else took one of ours off DAEMON's down list (an operator's clear)."""
    listed = services.listed_down(state, CheckType.DAEMON)
    return any(reason(s) not in listed for s in state.aws.daemons_impaired)


def prove_overridden_afresh(state: HealthCarry, now: datetime) -> None:
    """A cleared daemon task still missing must be missing a full grace from now to impair again."""
    aws = state.aws
    listed = services.listed_down(state, CheckType.DAEMON)
    cleared = [s for s in aws.daemons_impaired if reason(s) not in listed]
    for service in cleared:
        if service in aws.daemons_missing_since:
            aws.daemons_missing_since[service] = now
    aws.daemons_impaired = [s for s in aws.daemons_impaired if s not in cleared]


def after_fix(state: HealthCarry, fixed_at: datetime, now: datetime) -> None:
    """A fix in place (a reboot, a GPU reset) ends every bad period that began before it, as for EC2's checks: what
    this workflow impaired is taken back, and a daemon task still missing counts from the fix (a reboot stops every
    task, and ECS starts its daemons again shortly after)."""
    aws = state.aws
    for service in aws.daemons_impaired:
        services.back(state, CheckType.DAEMON, reason(service), now, fixed=True)
    aws.daemons_impaired = []
    aws.daemons_missing_since = {s: max(since, fixed_at) for s, since in aws.daemons_missing_since.items()}
