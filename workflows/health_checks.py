"""An instance's health checks as data: one row per check says what impairs it, what it does to a repair, and
whether an operator may clear it. The health workflow and its modules read this table; none of them names a check's
properties in code of its own.

A new check is one row here (and its source: a finding kind from the probe, or the run loop's AWS reader), plus the
code that sets its status from that source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from contract.health import SEVERITY, CheckType, HealthState
from contract.instances import ClearedFinding
from contract.probe import (
    KIND_CONTAINER_RUNTIME,
    KIND_CONTAINER_RUNTIME_RECOVERED,
    KIND_DAEMON,
    KIND_DAEMON_RECOVERED,
    GpuFinding,
)
from workflows.models import ContainerInstanceHealthStatus, HealthCarry, HealthCheckResult

MAX_CLEARED = 20  # impairments cleared as false, kept in the carried state: the newest


@dataclass(frozen=True)
class Check:
    type: CheckType
    # Finding kinds that impair it (the probe's). A GPU finding of any other kind is the ACCELERATED_COMPUTE's.
    finding_kinds: frozenset[str]
    # Watched from the instance's registration: INITIALIZING until its source first says something.
    from_start: bool
    # Repaired outside maintenance windows too: the instance is broken now, not degraded.
    critical: bool
    # An operator may clear it as a false finding (`autorepair instance clear`).
    clearable: bool
    # Finding kinds that say what impaired it is back (a host service up again): then the check is OK again, unless
    # a repair began (workflows/health_services.py). None: it stays impaired until the instance is replaced.
    recovered_kinds: frozenset[str] = frozenset()


# In the order an impaired check names its repair's reason: the most specific first (a GPU finding names the Xid and
# the GPU). AGENT_CONNECTIVITY is last: a heartbeat loss says least of what is wrong.
CHECKS: tuple[Check, ...] = (
    Check(CheckType.ACCELERATED_COMPUTE, frozenset(), from_start=True, critical=True, clearable=True),
    # DAEMON: also the group's ECS daemon tasks, told by the AWS reader (workflows/health_daemon_rules.py).
    Check(
        CheckType.DAEMON,
        frozenset({KIND_DAEMON}),
        from_start=False,
        critical=False,
        clearable=True,
        recovered_kinds=frozenset({KIND_DAEMON_RECOVERED}),
    ),
    Check(
        CheckType.CONTAINER_RUNTIME,
        frozenset({KIND_CONTAINER_RUNTIME}),
        from_start=False,
        critical=False,
        clearable=True,
        recovered_kinds=frozenset({KIND_CONTAINER_RUNTIME_RECOVERED}),
    ),
    Check(CheckType.EC2_STATUS, frozenset(), from_start=False, critical=True, clearable=True),
    Check(CheckType.AGENT_CONNECTIVITY, frozenset(), from_start=True, critical=True, clearable=True),
)
BY_TYPE = {check.type: check for check in CHECKS}
CLEARABLE = tuple(check.type for check in CHECKS if check.clearable)
FROM_START = tuple(check.type for check in CHECKS if check.from_start)
_BY_KIND = {kind: check.type for check in CHECKS for kind in check.finding_kinds}
# Host services: checks that come back by themselves, by the kinds that impair them and the kinds that end it.
SERVICE_DOWN = {kind: check.type for check in CHECKS if check.recovered_kinds for kind in check.finding_kinds}
SERVICE_BACK = {kind: check.type for check in CHECKS for kind in check.recovered_kinds}


def check_of(finding: GpuFinding) -> CheckType:
    """The check a finding impairs."""
    return _BY_KIND.get(finding.kind, CheckType.ACCELERATED_COMPUTE)


def impaired(state: HealthCarry, check: CheckType) -> bool:
    current = state.checks.get(check)
    return current is not None and current.status is HealthState.IMPAIRED


def critical(state: HealthCarry) -> bool:
    """A GPU fault, a lost agent or an instance EC2 finds broken or is taking away: repaired outside maintenance
    windows too. A DAEMON-only impairment, or an operator's repair of a healthy instance, waits for a window."""
    return any(check.critical and impaired(state, check.type) for check in CHECKS)


def set_check(state: HealthCarry, check: CheckType, status: HealthState, reason: str | None, now: datetime) -> None:
    current = state.checks.get(check)
    if current is not None and current.status is status:
        # ECS's lastStatusChange is when the status changed: a new reason for it (dcgmi failing one way, then
        # another) is an update, else a grace or age read from it would restart (Karpenter #2833).
        current.statusReason, current.lastUpdated = reason, now
        return
    state.checks[check] = HealthCheckResult(
        type=check, status=status, statusReason=reason, lastUpdated=now, lastStatusChange=now
    )


def health_status(state: HealthCarry) -> ContainerInstanceHealthStatus:
    details = sorted(state.checks.values(), key=lambda d: d.type.value)
    overall = min((d.status for d in details), key=SEVERITY.index, default=HealthState.INITIALIZING)
    return ContainerInstanceHealthStatus(overallStatus=overall, details=details)


def impairment(state: HealthCarry) -> tuple[str, GpuFinding | None]:
    """The reason to repair, preferring the GPU finding that caused it (it names the Xid and the GPU)."""
    for check in CHECKS:
        current = state.checks.get(check.type)
        if current is not None and current.status is HealthState.IMPAIRED:
            finding = next((f for f in state.findings if f.impairs and f.reason == current.statusReason), None)
            return current.statusReason or check.type.value, finding
    agent = state.checks.get(CheckType.AGENT_CONNECTIVITY)
    return (agent.statusReason if agent and agent.statusReason else CheckType.AGENT_CONNECTIVITY.value), None


def clear_impaired(state: HealthCarry, who: str, reason: str, now: datetime) -> list[ClearedFinding]:
    """Each impaired check back to OK; the findings behind it kept, listed as cleared by whom (bounded)."""
    done = {c.finding_id for c in state.cleared_findings if c.finding_id}
    cleared: list[ClearedFinding] = []
    for check in CLEARABLE:
        current = state.checks.get(check)
        if current is None or current.status is not HealthState.IMPAIRED:
            continue
        behind: Sequence[GpuFinding | None] = [
            f for f in state.findings if f.impairs and f.finding_id not in done and check_of(f) is check
        ] or [None]
        cleared += [
            ClearedFinding(
                check=check,
                status_reason=finding.reason if finding is not None else current.statusReason,
                finding_id=finding.finding_id if finding is not None else "",
                cleared_by=who,
                cleared_at=now,
                reason=reason,
            )
            for finding in behind
        ]
        state.checks[check] = HealthCheckResult(
            type=check, status=HealthState.OK, lastUpdated=now, lastStatusChange=now
        )
        if check is CheckType.DAEMON:
            state.daemons_down = []
        elif check is CheckType.CONTAINER_RUNTIME:
            state.runtimes_down = []
    state.cleared_findings = [*state.cleared_findings, *cleared][-MAX_CLEARED:]
    return cleared
