"""An instance's operator controls, for its health workflow: exclude, include, repair now, clear.

The update handlers in workflows/health.py call into here. Each control
- is refused by its validator (`refuse_*`) when it cannot be done: a message for the operator, no trace in the
  history (a retired instance, another control in progress, nothing to clear, a repair already running, ...);
- otherwise records the change in the carried state (and with the update's input and result, in the history),
  publishes one event through the workflow's outbox, and answers with the instance's state after it.

A repair that only waits for its drain permit has not touched the instance: exclude and clear take it back
(`WorkflowOps.withdraw_repair`). The repair decides, so one that got its permit meanwhile is never stopped halfway
through a drain; one that is draining is left to finish.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

from contract import event_types as ev
from contract.formats import iso
from contract.health import HealthState
from contract.instances import (
    ClearedFinding,
    Exclusion,
    FindingsClear,
    InstanceControlResult,
    InstanceExclude,
    InstanceInclude,
    InstanceRepairNow,
)
from contract.repair import FINISHED, RepairPhase
from workflows.health_checks import CLEARABLE, impaired
from workflows.instance_health import InstanceHealth, excluded_text
from workflows.models import HealthCarry, RepairView
from workflows.options import CALL_TIMEOUT

with workflow.unsafe.imports_passed_through():
    from activities.models import WithdrawRepairRequest
    from activities.workflow_ops import WorkflowOps

# How long `repair now` waits for the run loop to start the repair, so that its answer can name it.
START_WAIT = timedelta(seconds=30)
# A withdrawal is one update of a repair on the same task queue: a few tries, then the control is refused, not stuck.
WITHDRAW_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)

# An operator repair's reason goes into Web UI summaries (the repair's, its start's), which the server keeps under
# 400 bytes (limit.userMetadataSummarySize): an oversized one would fail the workflow task for good.
MAX_REASON_BYTES = 200


# --- validators: refuse without a trace ---------------------------------------------------------------------------


def refuse_exclude(health: InstanceHealth, request: InstanceExclude) -> None:
    _refuse_any(health, "exclude")
    exclusion = health.state.excluded
    if exclusion is not None:
        raise _refused(
            f"{health.instance_id} is already {excluded_text(exclusion)} (since {iso(exclusion.since)}); "
            "include it first to change that"
        )


def refuse_include(health: InstanceHealth, request: InstanceInclude) -> None:
    _refuse_any(health, "include")
    if health.state.excluded is None:
        raise _refused(f"{health.instance_id} is not excluded")


def refuse_repair(health: InstanceHealth, request: InstanceRepairNow) -> None:
    _refuse_any(health, "repair")
    state = health.state
    if not request.reason.strip():
        raise _refused("give a reason (--reason TEXT): it goes into the repair's history and its events")
    if state.excluded is not None:
        raise _refused(f"{health.instance_id} is {excluded_text(state.excluded)}; include it first")
    if state.repair is not None and state.repair.phase not in FINISHED:
        raise _refused(
            f"{health.instance_id} is being repaired already: {state.repair.workflow_id} is {state.repair.phase.value}"
        )
    if state.operator_repair is not None:
        raise _refused(f"a repair of {health.instance_id} was requested already ({state.operator_repair})")


def refuse_clear(health: InstanceHealth, request: FindingsClear) -> None:
    _refuse_any(health, "clear")
    if not any(impaired(health.state, check) for check in CLEARABLE):
        raise _refused(f"nothing to clear: no check of {health.instance_id} is IMPAIRED")
    repair = health.state.repair
    if repair is not None and repair.phase not in FINISHED and repair.phase is not RepairPhase.WAITING_FOR_PERMIT:
        raise _refused(
            f"{repair.workflow_id} is {repair.phase.value} already: a repair that holds its drain permit is not "
            f"taken back, and {health.instance_id} will be replaced"
        )


def _refuse_any(health: InstanceHealth, action: str) -> None:
    if health.retired:
        why = health.state.retired_reason or "its repair completed"
        raise _refused(f"{health.instance_id} has retired ({why}): nothing to {action}", type="InstanceRetired")
    if health.control_in_progress is not None:
        raise _refused(
            f"another control of {health.instance_id} is in progress ({health.control_in_progress}); "
            "try again in a moment"
        )


def _refused(message: str, type: str = "InstanceControlRefused") -> ApplicationError:
    return ApplicationError(message, type=type, non_retryable=True)


# --- handlers -----------------------------------------------------------------------------------------------------


async def exclude(health: InstanceHealth, request: InstanceExclude) -> InstanceControlResult:
    async def apply() -> InstanceControlResult:
        state, who = health.state, _who(request.requested_by)
        exclusion = Exclusion(by=who, reason=request.reason, since=workflow.now())
        note, withdrawn = await _take_back_waiting_repair(health, excluded_text(exclusion))
        dropped = health.on_exclude(exclusion, took_back=withdrawn)
        notes = [note] if note else []
        if dropped:
            notes.append(f"the repair requested earlier ({dropped}) will not start")
        health.instance_event(
            ev.InstanceExcluded(
                requested_by=_who(request.requested_by),
                reason=request.reason,
                repair_workflow_id=_repair_id(state) if note else None,
                repair=note,
            )
        )
        return _result(health, "; ".join([f"{health.instance_id} excluded from repair by {who}", *notes]))

    return await _controlled(health, "exclude", apply)


async def include(health: InstanceHealth, request: InstanceInclude) -> InstanceControlResult:
    async def apply() -> InstanceControlResult:
        state, who = health.state, _who(request.requested_by)
        exclusion = state.excluded
        if exclusion is None:  # the validator saw it excluded; nothing else changes it while a control runs
            raise _refused(f"{health.instance_id} is not excluded")
        re_armed = health.on_include()
        impaired = health.health_status().overallStatus is HealthState.IMPAIRED
        health.instance_event(
            ev.InstanceIncluded(
                requested_by=_who(request.requested_by),
                reason=request.reason,
                excluded_by=exclusion.by,
                excluded_reason=exclusion.reason,
                excluded_since=exclusion.since,
                repair_re_armed=re_armed and impaired,
            )
        )
        message = f"{health.instance_id} included again by {who} (was {excluded_text(exclusion)})"
        if re_armed and impaired:
            message += "; it is IMPAIRED: its repair starts now, unless the group's auto repair is DISABLED"
        return _result(health, message)

    return await _controlled(health, "include", apply)


async def repair_now(health: InstanceHealth, request: InstanceRepairNow) -> InstanceControlResult:
    async def apply() -> InstanceControlResult:
        state, who = health.state, _who(request.requested_by)
        previous = state.repair
        # The run loop starts it (where every repair starts), through the drain cap, DISABLED group or not.
        health.on_repair_asked(_cut(f"operator {who}: {request.reason.strip()}", MAX_REASON_BYTES))
        health.instance_event(
            ev.RepairRequested(
                requested_by=_who(request.requested_by),
                reason=request.reason,
                overall_status=health.health_status().overallStatus,
            )
        )
        with contextlib.suppress(TimeoutError):  # then it says so: not started yet
            await workflow.wait_condition(
                lambda: state.operator_repair is None,
                timeout=START_WAIT,
                timeout_summary="wait for the repair to start",
            )
        repair = state.repair
        if repair is not None and repair is not previous:
            return _result(
                health,
                f"repair of {health.instance_id} started: {repair.workflow_id} ({repair.phase.value}), asked by {who}",
            )
        return _result(health, f"repair of {health.instance_id} requested by {who}; not started yet")

    return await _controlled(health, "repair", apply)


async def clear(health: InstanceHealth, request: FindingsClear) -> InstanceControlResult:
    async def apply() -> InstanceControlResult:
        state, who = health.state, _who(request.requested_by)
        note, withdrawn = await _take_back_waiting_repair(health, f"finding cleared as false by {who}")
        if _running(state.repair) and not withdrawn:
            raise _refused(f"{note}; nothing cleared")
        before = health.status_key()
        cleared = health.on_clear(who, request.reason, repair_running=_running(state.repair))
        health.instance_event(
            ev.FindingCleared(
                requested_by=_who(request.requested_by),
                reason=request.reason,
                cleared=list(cleared),
                repair_workflow_id=_repair_id(state) if note else None,
                repair=note,
            )
        )
        health.publish_if_changed(before)
        checks = ", ".join(dict.fromkeys(c.check.value for c in cleared))
        message = f"{checks} of {health.instance_id} back to OK, cleared by {who}" + (f"; {note}" if note else "")
        return _result(health, message, cleared)

    return await _controlled(health, "clear", apply)


async def _controlled(
    health: InstanceHealth, action: str, apply: Callable[[], Awaitable[InstanceControlResult]]
) -> InstanceControlResult:
    """One control at a time; whatever goes wrong fails this update, never the workflow task."""
    health.signals_this_run += 1  # an update is an event in the history like a signal: it counts towards a new run
    health.control_in_progress = action
    try:
        result = await apply()
    except ApplicationError:
        raise
    except Exception as err:
        workflow.logger.exception("%s of %s failed", action, health.instance_id)
        raise _refused(f"{action} of {health.instance_id} failed: {type(err).__name__}: {err}"[:500]) from err
    finally:
        health.control_in_progress = None
        workflow.set_current_details(health.details_markdown())
    workflow.logger.info("%s: %s", action, result.message)
    return result


async def _take_back_waiting_repair(health: InstanceHealth, why: str) -> tuple[str | None, bool]:
    """What became of the instance's running repair, in a phrase (None: there is none), and whether it was taken
    back: one still waiting for its permit is withdrawn, one past it left to finish."""
    repair = health.state.repair
    if repair is None or repair.phase in FINISHED:
        return None, False
    if repair.phase is not RepairPhase.WAITING_FOR_PERMIT:
        return f"{repair.workflow_id} is {repair.phase.value} already: it is left to finish", False
    try:
        answer = await workflow.execute_activity_method(
            WorkflowOps.withdraw_repair,
            WithdrawRepairRequest(workflow_id=repair.workflow_id, token=health.state.repair_token or "", reason=why),
            summary=_cut(f"withdraw {repair.workflow_id}: it waits for a drain permit ({why})", MAX_REASON_BYTES),
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=WITHDRAW_RETRY,
        )
    except ActivityError as err:
        raise _refused(
            f"could not withdraw {repair.workflow_id} ({err.cause or err}); nothing changed: look at "
            "`autorepair describe-instances` and try again"
        ) from err
    if not answer.withdrawn:
        return f"{repair.workflow_id} got its drain permit meanwhile ({answer.detail}): it is left to finish", False
    if repair.phase not in FINISHED:
        # Its own progress says the same a moment later; the answer to the operator must not wait for it.
        repair.phase = RepairPhase.CANCELLED
        repair.error = f"withdrawn: {why}"
    return f"{repair.workflow_id} withdrawn (it was waiting for a drain permit)", True


def _running(repair: RepairView | None) -> bool:
    return repair is not None and repair.phase not in FINISHED


def _cut(text: str, limit: int) -> str:
    data = text.encode()
    return text if len(data) <= limit else data[: limit - 3].decode(errors="ignore") + "…"


def _repair_id(state: HealthCarry) -> str | None:
    return state.repair.workflow_id if state.repair is not None else None


def _who(requested_by: str) -> str:
    return requested_by or "unknown"


def _result(health: InstanceHealth, message: str, cleared: Sequence[ClearedFinding] = ()) -> InstanceControlResult:
    state, repair = health.state, health.state.repair
    return InstanceControlResult(
        instance_id=health.instance_id,
        message=message,
        overall_status=health.health_status().overallStatus,
        excluded=state.excluded,
        repair_workflow_id=repair.workflow_id if repair is not None else None,
        repair_phase=repair.phase if repair is not None else None,
        repair_withheld=health.withheld_why,
        cleared=list(cleared),
    )
