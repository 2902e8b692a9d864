"""The drain semaphore's breaker duties: count what health workflows report, trip, hold, resume, discard; and when
the semaphore next looks again. They act on the semaphore's state (workflows/semaphore_state.py), which
DrainSemaphoreWorkflow (workflows/drain_semaphore.py) hands them; the rule itself is workflows/breaker.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import FailureError

from contract import event_types as ev
from contract import names
from contract.breaker import BreakerView, HoldNotice, ImpairmentReport, in_maintenance, next_maintenance
from contract.config import format_seconds
from contract.groups import CapacityGroup
from contract.ids import semaphore_workflow_id
from contract.semaphore import PermitDenial, PermitRequest
from workflows.breaker import EarlyFault
from workflows.group_events import publish_group_event
from workflows.holder_watch import next_look
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.semaphore_state import SemaphoreState
from workflows.side_tasks import SideTasks

with workflow.unsafe.imports_passed_through():
    from activities.breaker_ops import BreakerOps
    from activities.fleet import FleetActivities
    from activities.models import FLEET_REPORTS_AT_ONCE, FleetReports, GroupCapacityRequest


class SemaphoreBreaker:
    def __init__(self, state: SemaphoreState, side: SideTasks, show: Callable[[], None]) -> None:
        self.state = state
        self._side = side
        self._show = show  # the semaphore's details and gauges, after a trip
        # Patches, set by the workflow's run(): see drain_semaphore.py.
        self.fewer_round_trips = False
        self.fleet_reports_beside = False
        self.fleet_reports_together = False

    @staticmethod
    def may_run_now(request: PermitRequest, group: CapacityGroup) -> bool:
        return request.critical or in_maintenance(group.maintenance_windows, workflow.now())

    def next_wake(self, group: CapacityGroup) -> timedelta | None:
        """Holders are watched (their repairs could close without a release); repairs that wait for a maintenance
        window wake at its start. Otherwise no timer."""
        state = self.state
        look = next_look(
            holders=len(state.holders),
            waiters=len(state.waiters),
            out_of_service=state.out_of_service,
            reclaim_interval=group.permit_reclaim_interval,
        )
        waits = [] if look is None else [look]
        if any(not self.may_run_now(w, group) for w in state.waiters) and not state.holding():
            opens = next_maintenance(group.maintenance_windows, workflow.now())
            if opens is not None:
                waits.append(max(opens - workflow.now(), timedelta(seconds=1)))
        return min(waits, default=None)

    def wake_summary(self) -> str:
        if self.state.holders:
            return "check permit holders are alive"
        if self.state.waiters and self.state.out_of_service:
            return "look again at instances out of service"
        return "wait for the next maintenance window"

    async def count_impairments(self, group: CapacityGroup) -> None:
        """Count what health workflows reported, pass each on to the fleet breaker, and trip if over the rule."""
        state = self.state
        reports, state.reported = state.reported, []
        if not state.group_size:
            await self.measure()
        counted = [r for r in reports if state.breaker.record(r, workflow.now(), group.impaired_window)]
        for report in reports:
            early = state.breaker.faulted_early(report, group.replacement_fault_window)
            if early is not None:
                await self._faulted_early(early, group)
        await self.trip_if_over(group)
        if self.fleet_reports_together and len(counted) > 1:
            # A surge's reports by one activity: each its own would be 200 activities on this one hot history at
            # 1,000 / 200, and a workflow task for each that completes.
            for at in range(0, len(counted), FLEET_REPORTS_AT_ONCE):
                self._side.start(self._reports_to_fleet(counted[at : at + FLEET_REPORTS_AT_ONCE]))
        elif self.fleet_reports_beside:
            # Awaiting them would prove only that they arrived, not what the fleet breaker made of them (its hold comes
            # back as a signal either way): the grants need not wait. Many signals to one workflow take a while.
            for report in counted:
                self._side.start(self._report_to_fleet(report))
        elif self.fewer_round_trips:
            # The fleet breaker counts them in any order: one round trip for a surge, not one per instance.
            await asyncio.gather(*(self._report_to_fleet(report) for report in counted))
        else:
            for report in counted:
                await self._report_to_fleet(report)
        state.changed = True

    async def _faulted_early(self, early: EarlyFault, group: CapacityGroup) -> None:
        state = self.state
        counted = len(state.breaker.faulted_early_within(workflow.now(), group.replacement_fault_window))
        workflow.logger.warning(
            "drain semaphore %s: replacement %s faulted %s after taking over",
            state.group,
            early.instance_id,
            early.faulted_at - early.took_over_at,
        )
        await publish_group_event(
            state.group,
            semaphore_workflow_id(state.group),
            ev.ReplacementFaultedEarly(
                replacement_instance_id=early.instance_id,
                took_over_at=early.took_over_at,
                faulted_at=early.faulted_at,
                reason=early.reason,
                faulted_early=counted,
                replacement_faults_to_hold=group.replacement_faults_to_hold,
                replacement_fault_window=format_seconds(group.replacement_fault_window),
            ),
        )

    async def _report_to_fleet(self, report: ImpairmentReport) -> None:
        await workflow.execute_activity_method(
            BreakerOps.report_to_fleet_breaker,
            report.model_copy(update={"group_size": self.state.group_size}),
            summary=f"tell the fleet breaker {report.instance_id} became IMPAIRED",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )

    async def _reports_to_fleet(self, reports: list[ImpairmentReport]) -> None:
        sized = [report.model_copy(update={"group_size": self.state.group_size}) for report in reports]
        await workflow.execute_activity_method(
            BreakerOps.report_many_to_fleet_breaker,
            FleetReports(reports=sized),
            summary=f"tell the fleet breaker {len(sized)} instances became IMPAIRED",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )

    async def measure(self) -> None:
        state = self.state
        # Before the call: a holder that leaves while we count makes the next pass count again.
        state.measured_at = workflow.now()
        state.holder_left = False
        capacity = await workflow.execute_activity_method(
            FleetActivities.describe_group_capacity,
            # The cap follows from the settings as they are now, with this semaphore's live overrides applied.
            GroupCapacityRequest(
                group=state.group,
                overrides=state.config.overrides,
                held_instance_ids=sorted(p.instance_id for p in state.holders),
            ),
            summary=f"count instances in {state.group}",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        state.group_size = capacity.instance_count
        state.out_of_service = capacity.out_of_service
        state.unheld_draining = set(capacity.out_of_service_ids)
        # An update may have changed the cap while we counted: the cap is the one in force now.
        effective = state.config.effective
        state.capacity = effective.max_draining(state.group_size) if effective else capacity.max_draining

    async def trip_if_over(self, group: CapacityGroup, *, budget: bool = False) -> bool:
        state = self.state
        hold = state.breaker.trip_if_over(
            group.breaker_rule(),
            state.group_size,
            workflow.now(),
            f"group {state.group}",
            budget=group.max_repairs_per_day if budget else None,
        )
        if hold is None:
            return False
        workflow.logger.warning("drain semaphore %s: %s", state.group, hold.message)
        self._show()
        await publish_group_event(
            state.group,
            semaphore_workflow_id(state.group),
            ev.RepairsHeld.of(hold, held_repairs=sorted(w.instance_id for w in state.waiters)[:100]),
        )
        return True

    async def resume(self, by: str, discard_held: bool) -> None:
        state = self.state
        record = state.breaker.resume(workflow.now(), by, discard_held)
        workflow.logger.warning(
            "drain semaphore %s resumed by %s%s",
            state.group,
            by or "unknown",
            " (held discarded)" if discard_held else "",
        )
        held = sorted(w.instance_id for w in state.waiters)
        if discard_held:
            await self._discard_waiters(f"held by the breaker; discarded on resume by {by or 'unknown'}")
        state.changed = True
        await publish_group_event(
            state.group,
            semaphore_workflow_id(state.group),
            ev.RepairsResumed(requested_by=by, discard_held=discard_held, held=record.held, repairs=held[:100]),
        )

    async def _discard_waiters(self, reason: str) -> None:
        """Let the waiting repairs go: they end without touching their instances, which must prove their fault
        again (a fresh finding, or a heartbeat loss that lasts) before another repair."""
        waiters, self.state.waiters = self.state.waiters, []
        for request in waiters:
            denial = PermitDenial(holder_workflow_id=request.holder_workflow_id, token=request.token, reason=reason)
            handle = workflow.get_external_workflow_handle(request.holder_workflow_id, run_id=request.holder_run_id)
            try:
                await handle.signal(names.SIGNAL_PERMIT_DENIED, denial)
            except FailureError as err:
                workflow.logger.info("held repair %s already gone: %s", request.holder_workflow_id, err)

    def on_fleet_hold(self, notice: HoldNotice) -> None:
        self.state.fleet_hold = notice.held
        if notice.held is None and notice.discard_held:
            self._side.start(self._discard_waiters(f"fleet resumed by {notice.by}; discarded"))
        self.state.changed = True

    def view(self) -> BreakerView:
        state = self.state
        group = state.config.effective
        rule = group.breaker_rule() if group else None
        now = workflow.now()
        windows = group.maintenance_windows if group else []
        return BreakerView(
            held=state.breaker.held,
            fleet_held=state.fleet_hold,
            impaired_in_window=len(state.breaker.impaired),
            threshold=rule.threshold(state.group_size) if rule else 0.0,
            window=rule.impaired_window if rule else BreakerView().window,
            counted_since=state.breaker.counted_since,
            repairs_today=len(state.breaker.grants),
            max_repairs_per_day=group.max_repairs_per_day if group else None,
            in_maintenance_window=in_maintenance(windows, now),
            next_maintenance_window=None if in_maintenance(windows, now) else next_maintenance(windows, now),
            last_resume=state.breaker.last_resume,
            replacements_faulted_early=len(state.breaker.faulted_early_within(now, rule.replacement_fault_window))
            if rule
            else 0,
        )
