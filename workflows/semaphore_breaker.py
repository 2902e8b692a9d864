"""The drain semaphore's breaker duties: count what health workflows report, trip, hold, resume, discard. A part of
DrainSemaphoreWorkflow (workflows/drain_semaphore.py), kept here so that each file reads as one concern; the rule
itself is workflows/breaker.py."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import FailureError

from contract import names
from contract.breaker import BreakerHold, BreakerView, HoldNotice, ImpairmentReport, in_maintenance, next_maintenance
from contract.groups import CapacityGroup, GroupConfigState
from contract.ids import semaphore_workflow_id
from contract.semaphore import PermitDenial, PermitRequest
from workflows.breaker import BreakerBook
from workflows.group_events import publish_group_event
from workflows.holder_watch import next_look
from workflows.models import Permit
from workflows.options import CALL_RETRY, CALL_TIMEOUT

with workflow.unsafe.imports_passed_through():
    from activities.breaker_ops import BreakerOps
    from activities.fleet import FleetActivities
    from activities.models import EventType, GroupCapacityRequest


class SemaphoreBreaker:
    """Mixed into DrainSemaphoreWorkflow, whose state these are."""

    _group: str
    _holders: list[Permit]
    _waiters: list[PermitRequest]
    _config: GroupConfigState
    _breaker: BreakerBook
    _fleet_hold: BreakerHold | None
    _reported: list[ImpairmentReport]
    _capacity: int
    _out_of_service: int
    _unheld_draining: set[str]
    _group_size: int
    _changed: bool
    _fewer_round_trips: bool
    _fleet_reports_beside: bool
    _in_flight: set[asyncio.Task[None]]
    _measured_at: datetime | None
    _holder_left: bool

    def _show_state(self) -> None:
        raise NotImplementedError

    def _room(self) -> int:
        """Permits left: the cap counts instances out of service (DRAINING in ECS, a failed repair's or an
        operator's) as well as the repairs that hold permits."""
        return self._capacity - len(self._holders) - self._out_of_service

    def _fits(self, request: PermitRequest) -> bool:
        # A repair whose instance is already out of service (a failed attempt's, retried) takes no more capacity.
        return request.instance_id in self._unheld_draining or self._room() > 0

    def _fitting(self, ready: list[PermitRequest]) -> list[PermitRequest]:
        """The requests to grant now, in order: those whose instance is already DRAINING first, then as many others
        as there is room for."""
        first = [w for w in ready if w.instance_id in self._unheld_draining]
        others = [w for w in ready if w.instance_id not in self._unheld_draining]
        return first + others[: max(0, self._room())]

    def _take_out_of_service(self, instance_id: str) -> None:
        """Its DRAINING is now its permit's: counted once."""
        if instance_id in self._unheld_draining:
            self._unheld_draining.discard(instance_id)
            self._out_of_service -= 1

    def _holding(self) -> bool:
        return self._breaker.held is not None or self._fleet_hold is not None

    @staticmethod
    def _may_run_now(request: PermitRequest, group: CapacityGroup) -> bool:
        return request.critical or in_maintenance(group.maintenance_windows, workflow.now())

    def _next_wake(self, group: CapacityGroup) -> timedelta | None:
        """Holders are watched (their repairs could close without a release); repairs that wait for a maintenance
        window wake at its start. Otherwise no timer."""
        look = next_look(
            holders=len(self._holders),
            waiters=len(self._waiters),
            out_of_service=self._out_of_service,
            reclaim_interval=group.permit_reclaim_interval,
        )
        waits = [] if look is None else [look]
        if any(not self._may_run_now(w, group) for w in self._waiters) and not self._holding():
            opens = next_maintenance(group.maintenance_windows, workflow.now())
            if opens is not None:
                waits.append(max(opens - workflow.now(), timedelta(seconds=1)))
        return min(waits, default=None)

    def _wake_summary(self) -> str:
        if self._holders:
            return "check permit holders are alive"
        if self._waiters and self._out_of_service:
            return "look again at instances out of service"
        return "wait for the next maintenance window"

    async def _count_impairments(self, group: CapacityGroup) -> None:
        """Count what health workflows reported, pass each on to the fleet breaker, and trip if over the rule."""
        reports, self._reported = self._reported, []
        if not self._group_size:
            await self._measure()
        counted = [r for r in reports if self._breaker.record(r, workflow.now(), group.impaired_window)]
        await self._trip_if_over(group)
        if self._fleet_reports_beside:
            # Awaiting them would prove only that they arrived, not what the fleet breaker made of them (its hold comes
            # back as a signal either way): the grants need not wait. Many signals to one workflow take a while.
            for report in counted:
                self._beside(self._report_to_fleet(report))
        elif self._fewer_round_trips:
            # The fleet breaker counts them in any order: one round trip for a surge, not one per instance.
            await asyncio.gather(*(self._report_to_fleet(report) for report in counted))
        else:
            for report in counted:
                await self._report_to_fleet(report)
        self._changed = True

    def _beside(self, send: Coroutine[Any, Any, None]) -> None:
        """A send the loop need not wait for; awaited before continue-as-new (`_in_flight`)."""
        task = asyncio.create_task(send)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _report_to_fleet(self, report: ImpairmentReport) -> None:
        await workflow.execute_activity_method(
            BreakerOps.report_to_fleet_breaker,
            report.model_copy(update={"group_size": self._group_size}),
            summary=f"tell the fleet breaker {report.instance_id} became IMPAIRED",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )

    async def _measure(self) -> None:
        # Before the call: a holder that leaves while we count makes the next pass count again.
        self._measured_at = workflow.now()
        self._holder_left = False
        capacity = await workflow.execute_activity_method(
            FleetActivities.describe_group_capacity,
            # The cap follows from the settings as they are now, with this semaphore's live overrides applied.
            GroupCapacityRequest(
                group=self._group,
                overrides=self._config.overrides,
                held_instance_ids=sorted(p.instance_id for p in self._holders),
            ),
            summary=f"count instances in {self._group}",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        self._group_size = capacity.instance_count
        self._out_of_service = capacity.out_of_service
        self._unheld_draining = set(capacity.out_of_service_ids)
        # An update may have changed the cap while we counted: the cap is the one in force now.
        effective = self._config.effective
        self._capacity = effective.max_draining(self._group_size) if effective else capacity.max_draining

    async def _trip_if_over(self, group: CapacityGroup, *, budget: bool = False) -> bool:
        hold = self._breaker.trip_if_over(
            group.breaker_rule(),
            self._group_size,
            workflow.now(),
            f"group {self._group}",
            budget=group.max_repairs_per_day if budget else None,
        )
        if hold is None:
            return False
        workflow.logger.warning("drain semaphore %s: %s", self._group, hold.message)
        self._show_state()
        await publish_group_event(
            self._group,
            semaphore_workflow_id(self._group),
            EventType.REPAIRS_HELD,
            hold.model_dump(mode="json") | {"held_repairs": sorted(w.instance_id for w in self._waiters)[:100]},
        )
        return True

    async def _resume(self, by: str, discard_held: bool) -> None:
        record = self._breaker.resume(workflow.now(), by, discard_held)
        workflow.logger.warning(
            "drain semaphore %s resumed by %s%s",
            self._group,
            by or "unknown",
            " (held discarded)" if discard_held else "",
        )
        held = sorted(w.instance_id for w in self._waiters)
        if discard_held:
            await self._discard_waiters(f"held by the breaker; discarded on resume by {by or 'unknown'}")
        self._changed = True
        await publish_group_event(
            self._group,
            semaphore_workflow_id(self._group),
            EventType.REPAIRS_RESUMED,
            {
                "requested_by": by,
                "discard_held": discard_held,
                "held": record.held.model_dump(mode="json") if record.held else None,
                "repairs": held[:100],
            },
        )

    async def _discard_waiters(self, reason: str) -> None:
        """Let the waiting repairs go: they end without touching their instances, which must prove their fault
        again (a fresh finding, or a heartbeat loss that lasts) before another repair."""
        waiters, self._waiters = self._waiters, []
        for request in waiters:
            denial = PermitDenial(holder_workflow_id=request.holder_workflow_id, token=request.token, reason=reason)
            handle = workflow.get_external_workflow_handle(request.holder_workflow_id, run_id=request.holder_run_id)
            try:
                await handle.signal(names.SIGNAL_PERMIT_DENIED, denial)
            except FailureError as err:
                workflow.logger.info("held repair %s already gone: %s", request.holder_workflow_id, err)

    def _on_fleet_hold(self, notice: HoldNotice) -> None:
        self._fleet_hold = notice.held
        if notice.held is None and notice.discard_held:
            self._beside(self._discard_waiters(f"fleet resumed by {notice.by}; discarded"))
        self._changed = True

    def _breaker_view(self) -> BreakerView:
        group = self._config.effective
        rule = group.breaker_rule() if group else None
        now = workflow.now()
        windows = group.maintenance_windows if group else []
        return BreakerView(
            held=self._breaker.held,
            fleet_held=self._fleet_hold,
            impaired_in_window=len(self._breaker.impaired),
            threshold=rule.threshold(self._group_size) if rule else 0.0,
            window=rule.impaired_window if rule else BreakerView().window,
            counted_since=self._breaker.counted_since,
            repairs_today=len(self._breaker.grants),
            max_repairs_per_day=group.max_repairs_per_day if group else None,
            in_maintenance_window=in_maintenance(windows, now),
            next_maintenance_window=None if in_maintenance(windows, now) else next_maintenance(windows, now),
            last_resume=self._breaker.last_resume,
        )
