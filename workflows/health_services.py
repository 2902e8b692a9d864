"""An instance's host-service checks, for its health workflow: DAEMON and CONTAINER_RUNTIME, from the probe's
findings about systemd units (node_probe/sources/daemons.py) and the container runtime (container_runtime.py).

The probe reports a service down (a critical daemon inactive; docker or containerd down, or up but not answering its
API) once it has been so past its threshold, and back up. A critical one down impairs its check; back up, the check
is OK again unless a repair began (a repair that started finishes: the service failed once, it may again). Several
may be down at once: the check stays IMPAIRED, for the oldest still down, until the last is back. A service not
marked critical is a warning, which the workflow counts like any other finding.

The group's ECS daemon tasks go down and come back the same way (`down` and `back`), told by the AWS reader
(workflows/health_daemon_rules.py): the down list holds both kinds, each under its own reason.
"""

from __future__ import annotations

from datetime import datetime

from contract.health import CheckType, HealthState
from contract.probe import GpuFinding
from workflows.health_checks import SERVICE_BACK, SERVICE_DOWN, set_check
from workflows.models import HealthCarry

# Services down kept in the carried state, per check; past it one is counted as dropped, not kept.
MAX_DOWN = 32


def took(state: HealthCarry, finding: GpuFinding, now: datetime) -> bool:
    """Apply a host-service finding to its check. False for a GPU finding and for a service's warning: the
    workflow deals with those itself."""
    check = SERVICE_BACK.get(finding.kind)
    if check is not None:
        back(state, check, finding.reason, now)
        return True
    check = SERVICE_DOWN.get(finding.kind)
    if check is None or not finding.impairs:
        return False
    down(state, check, finding.reason, now)
    return True


def down(state: HealthCarry, check: CheckType, reason: str, now: datetime) -> None:
    """A critical service down (its reason): on the check's down list, and the check IMPAIRED."""
    listed = _down_list(state, check)
    if reason not in listed:
        if len(listed) < MAX_DOWN:
            _set_down_list(state, check, [*listed, reason])
        else:
            state.dropped_entries += 1
    current = state.checks.get(check)
    if current is not None and current.status is HealthState.IMPAIRED:
        current.lastUpdated = now  # the first service down stays the reason
    else:
        set_check(state, check, HealthState.IMPAIRED, reason, now)


def listed_down(state: HealthCarry, check: CheckType) -> list[str]:
    """The reasons of the check's services down now."""
    return list(_down_list(state, check))


def back(state: HealthCarry, check: CheckType, reason: str, now: datetime, *, fixed: bool = False) -> None:
    """A service back up: off the down list; the check OK once none is down, unless a repair began. `fixed`: a fix in
    place ended its outage (the repair that began is over, the instance kept)."""
    down = [other for other in _down_list(state, check) if other != reason]
    _set_down_list(state, check, down)
    current = state.checks.get(check)
    if current is None or current.status is not HealthState.IMPAIRED or (state.repair is not None and not fixed):
        return
    if down:
        set_check(state, check, HealthState.IMPAIRED, down[0], now)
    else:
        set_check(state, check, HealthState.OK, None, now)


def _down_list(state: HealthCarry, check: CheckType) -> list[str]:
    return state.runtimes_down if check is CheckType.CONTAINER_RUNTIME else state.daemons_down


def _set_down_list(state: HealthCarry, check: CheckType, down: list[str]) -> None:
    if check is CheckType.CONTAINER_RUNTIME:
        state.runtimes_down = down
    else:
        state.daemons_down = down
