"""The fleet-wide breaker: the group breaker's rule across every capacity group of the worker's settings.

A driver roll-out or a kernel-log format change hits every group at once, and may stay under each group's own
threshold while the fleet as a whole is far over it. Each semaphore passes on the impairments it counts, with its
group's size; when the fleet is over the rule, this workflow tells every group's semaphore to hold, publishes
`RepairsHeld` (group `*`), and waits for `autorepair fleet resume`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ApplicationError

from contract import event_types as ev
from contract import names
from contract.breaker import (
    BreakerRule,
    FleetBreakerConfig,
    FleetBreakerView,
    FleetResume,
    HoldNotice,
    ImpairmentReport,
)
from contract.formats import iso
from contract.ids import semaphore_workflow_id
from workflows.breaker import BreakerBook
from workflows.group_events import publish_group_event
from workflows.models import FleetBreakerRun
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.signal_input import Rejected, Route, dispatch, worth_logging

with workflow.unsafe.imports_passed_through():
    from activities.breaker_ops import BreakerOps

SIGNALS_PER_RUN = 2_000
MAX_GROUPS = 1_000
FLEET = "*"  # the `group` of the fleet breaker's events


@workflow.defn(name=names.FLEET_BREAKER_WORKFLOW)
class FleetBreakerWorkflow:
    @workflow.init
    def __init__(self, input: FleetBreakerRun) -> None:
        self._book = input.book or BreakerBook()
        self._sizes: dict[str, int] = dict(input.group_sizes)
        self._rejected = input.rejected_signals
        self._reported: list[ImpairmentReport] = []
        self._config: FleetBreakerConfig | None = None
        self._signals_this_run = 0
        self._lock = asyncio.Lock()

    @workflow.run
    async def run(self, input: FleetBreakerRun) -> None:
        self._config = await workflow.execute_activity_method(
            BreakerOps.fleet_breaker_config,
            summary="read the fleet breaker's rule and the groups",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        while not self._time_to_continue():
            workflow.set_current_details(self._details_markdown())
            await workflow.wait_condition(lambda: bool(self._reported) or self._time_to_continue())
            async with self._lock:
                await self._count()
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(
            FleetBreakerRun(book=self._book, group_sizes=self._sizes, rejected_signals=self._rejected)
        )

    def _rule(self) -> BreakerRule:
        return self._config.rule if self._config else BreakerRule(min_impaired=5)

    def _fleet_size(self) -> int:
        return sum(self._sizes.values())

    async def _count(self) -> None:
        reports, self._reported = self._reported, []
        rule = self._rule()
        for report in reports:
            if report.group in self._sizes or len(self._sizes) < MAX_GROUPS:
                self._sizes[report.group] = report.group_size
            self._book.record(report, workflow.now(), rule.impaired_window)
        hold = self._book.trip_if_over(rule, self._fleet_size(), workflow.now(), "the whole fleet", groups_at_least=2)
        if hold is None:
            return
        workflow.logger.warning("fleet breaker: %s", hold.message)
        workflow.set_current_details(self._details_markdown())
        await self._tell_groups(HoldNotice(held=hold))
        await publish_group_event(
            FLEET,
            workflow.info().workflow_id,
            ev.RepairsHeld.of(hold, groups=sorted(self._sizes)),
        )

    async def _tell_groups(self, notice: HoldNotice) -> None:
        """Every group the settings name or that reported: a semaphore not running now asks when it starts."""
        groups = sorted(set(self._sizes) | set(self._config.groups if self._config else []))
        for group in groups:
            try:
                await workflow.get_external_workflow_handle(semaphore_workflow_id(group)).signal(
                    names.SIGNAL_FLEET_HOLD, notice
                )
            except Exception as err:  # no semaphore running for it: it asks the fleet breaker when it starts
                workflow.logger.info("semaphore of %s not told: %s", group, err)

    @workflow.signal(dynamic=True)
    def on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        self._signals_this_run += 1
        dispatch(name, payloads, {names.SIGNAL_IMPAIRED: Route(ImpairmentReport, self._on_impaired)}, self._reject)

    def _on_impaired(self, report: ImpairmentReport) -> None:
        if len(self._reported) < SIGNALS_PER_RUN:
            self._reported.append(report)

    def _reject(self, why: Rejected) -> None:
        self._rejected += 1
        if worth_logging(self._rejected):
            workflow.logger.warning("fleet breaker dropped a signal: %s", why)

    @workflow.update(name=names.UPDATE_FLEET_RESUME)
    async def resume(self, request: FleetResume) -> FleetBreakerView:
        self._signals_this_run += 1
        async with self._lock:
            record = self._book.resume(workflow.now(), request.requested_by, request.discard_held)
            workflow.logger.warning("fleet breaker resumed by %s", request.requested_by or "unknown")
            await self._tell_groups(HoldNotice(held=None, discard_held=request.discard_held, by=request.requested_by))
            await publish_group_event(
                FLEET,
                workflow.info().workflow_id,
                ev.RepairsResumed(
                    requested_by=request.requested_by, discard_held=request.discard_held, held=record.held
                ),
            )
            workflow.set_current_details(self._details_markdown())
            return self.state()

    @resume.validator
    def _validate_resume(self, request: FleetResume) -> None:
        if self._book.held is None:
            raise ApplicationError(
                "the fleet-wide breaker does not hold repairs: nothing to resume "
                "(a group's own breaker is resumed with autorepair group update --name G --resume)",
                type="NotHeld",
                non_retryable=True,
            )

    @workflow.query(name=names.QUERY_FLEET_BREAKER)
    def state(self) -> FleetBreakerView:
        return FleetBreakerView(
            held=self._book.held,
            impaired_in_window=len(self._book.impaired),
            threshold=self._rule().threshold(self._fleet_size()),
            fleet_size=self._fleet_size(),
            groups=dict(self._sizes),
            last_resume=self._book.last_resume,
        )

    def _time_to_continue(self) -> bool:
        return workflow.info().is_continue_as_new_suggested() or self._signals_this_run >= SIGNALS_PER_RUN

    def _details_markdown(self) -> str:
        view = self.state()
        lines = [
            f"Fleet breaker: **{view.impaired_in_window}** impaired within the window, trips above "
            f"{view.threshold:g} ({view.fleet_size} instances in {len(view.groups)} groups)"
        ]
        if view.held is not None:
            lines += ["", f"**HELD since {iso(view.held.tripped_at)}**: {view.held.message}"]
        if view.last_resume is not None:
            by = view.last_resume.by or "unknown"
            lines += ["", f"Last resumed {iso(view.last_resume.at)} by {by}"]
        return "\n".join(lines)
