"""One liveness tracker per capacity group (or per shard of a large one): who was heard last when, and who is lost.

Runbook it automates:
  1. Reporters (the ingest's replicas, or a trusted-lab probe) send batches: each instance they heard and when, by
     their receipt time. A heartbeat costs Temporal nothing per instance; a batch costs one signal per reporter.
  2. One timer, set for the earliest deadline: an instance not heard for the group's threshold (or the reporters'
     interval, if that is longer) plus a grace is lost. Its health workflow is told, once; it is told again when
     the instance is heard again.
  3. A silent pipeline is not silent hosts. If no reporter has sent a batch for longer than it promised (the ingest
     or Temporal was down), nothing is declared lost, and once batches come again, not for another full window:
     probes get a whole threshold to be heard again. Nor while a run hands over to the next: batches refused
     meanwhile get one reporting interval to arrive.
  4. Game days: an instance's health workflow can ask the tracker to ignore its receipts for a while.
  5. Before telling of a loss, EC2 is asked (once per batch of losses) whether the instance was terminated: one
     that left on purpose (scaled in, by an operator, a Spot interruption) retires instead of being repaired.
  6. State stays bounded: at most 20,000 instances per shard; an instance lost for a day, or whose health workflow
     is gone (it was replaced), is forgotten.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError

from contract import names
from contract.groups import CapacityGroup
from contract.ids import health_workflow_id
from contract.liveness import IgnoreHeartbeats, LivenessChange, LivenessReport, RecheckLoss
from workflows.group_config import read_group_config
from workflows.liveness_book import LivenessBook
from workflows.models import LivenessRun, LivenessView
from workflows.options import CALL_TIMEOUT
from workflows.signal_input import Route, dispatch

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import GoneInstance, InstancesGoneRequest

SIGNALS_PER_RUN = 2_000
RESUME_FLOOR = "liveness-resume-floor"
SLOW_HANDOVER_FLOOR = "liveness-slow-handover-floor"
# Health workflows told at once: bounded so a mass loss does not put thousands of commands in one task.
SIGNALS_IN_FLIGHT = 100


@workflow.defn(name=names.LIVENESS_WORKFLOW)
class LivenessTrackerWorkflow:
    @workflow.init
    def __init__(self, input: LivenessRun) -> None:
        self._book = LivenessBook(input.group, input.shard, input.shards, input.carry, workflow.logger)
        self._armed_at: datetime | None = None
        self._telling = 0  # health workflows being told right now: continue-as-new waits for them
        self._signals_this_run = 0

    @workflow.run
    async def run(self, input: LivenessRun) -> None:
        book = self._book
        if book.state.group is None:
            book.state.group = await read_group_config(book.group, "read the group's heartbeat-loss threshold")
        if input.carry is not None and workflow.patched(RESUME_FLOOR):
            # Asked only where it decides: a marker in the rare run that took over slowly, none in the others.
            slowly = book.handed_over_slowly(workflow.now()) and workflow.patched(SLOW_HANDOVER_FLOOR)
            book.resumed(workflow.now(), slowly=slowly)
        sender = asyncio.create_task(self._tell_health_workflows())
        while not self._time_to_continue():
            book.armed_for = book.next_check()
            self._armed_at = workflow.now()
            book.wake = False
            workflow.set_current_details(book.details_markdown(workflow.now()))
            timeout = None if book.armed_for is None else max(book.armed_for - workflow.now(), timedelta(0))
            try:
                await workflow.wait_condition(
                    lambda: book.wake or self._time_to_continue(),
                    timeout=timeout,
                    timeout_summary="earliest heartbeat deadline",
                )
            except TimeoutError:
                lost = book.timer_fired(workflow.now(), self._armed_at)
                if lost:
                    await self._tell_losses(lost)
        # Cancelled only while idle: cancelling it mid-signal would lose changes already taken from the outbox.
        await workflow.wait_condition(
            lambda: not book.outbox and not self._telling and workflow.all_handlers_finished()
        )
        sender.cancel()
        workflow.continue_as_new(
            LivenessRun(group=book.group, shard=book.shard, shards=book.shards, carry=book.carried())
        )

    async def _tell_losses(self, lost: list[str]) -> None:
        """Lost, or gone on purpose: EC2 is asked once for the whole batch whether any was terminated (scaled in,
        by an operator, a Spot interruption), so that those retire instead of being repaired."""
        gone: dict[str, GoneInstance] = {}
        try:
            answer = await workflow.execute_activity_method(
                FleetActivities.instances_gone,
                InstancesGoneRequest(group=self._book.group, instance_ids=lost),
                summary=f"did {len(lost)} silent instance(s) leave on purpose? (EC2 state)",
                start_to_close_timeout=CALL_TIMEOUT,
                # Bounded: a loss is not held back for long because EC2 cannot be asked.
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=2), maximum_attempts=3),
            )
            gone = {g.instance_id: g for g in answer.gone}
        except ActivityError as err:
            workflow.logger.warning("liveness of %s: EC2 not asked (%s); told as lost", self._book.group, err.cause)
        self._book.told_lost(lost, gone)

    async def _tell_health_workflows(self) -> None:
        book = self._book
        while True:
            await workflow.wait_condition(lambda: bool(book.outbox))
            batch, book.outbox = book.outbox[:SIGNALS_IN_FLIGHT], book.outbox[SIGNALS_IN_FLIGHT:]
            self._telling = len(batch)
            try:
                results = await asyncio.gather(*(self._tell(change) for change in batch), return_exceptions=True)
            finally:
                self._telling = 0
            for change, result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    # Its health workflow is closed: the instance was replaced or retired. Nothing left to tell.
                    workflow.logger.info("liveness of %s not told (%s); forgetting it", change.instance_id, result)
                    book.forget(change.instance_id)

    async def _tell(self, change: LivenessChange) -> None:
        handle = workflow.get_external_workflow_handle(health_workflow_id(change.instance_id))
        await handle.signal(names.SIGNAL_LIVENESS, change)

    # --- signals and query ------------------------------------------------------------------------------------

    @workflow.signal(dynamic=True)
    def on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        self._signals_this_run += 1
        book = self._book
        routes: dict[str, Route[Any]] = {
            names.SIGNAL_LIVENESS_REPORT: Route(LivenessReport, self._on_report),
            names.SIGNAL_IGNORE_HEARTBEATS: Route(IgnoreHeartbeats, self._on_ignore),
            names.SIGNAL_GROUP_CHANGED: Route(CapacityGroup, book.on_group_changed),
            names.SIGNAL_RECHECK_LOSS: Route(RecheckLoss, self._on_recheck),
        }
        dispatch(name, payloads, routes, book.reject)

    def _on_report(self, report: LivenessReport) -> None:
        self._book.on_report(report, workflow.now())

    def _on_ignore(self, ignore: IgnoreHeartbeats) -> None:
        self._book.on_ignore(ignore, workflow.now())

    def _on_recheck(self, recheck: RecheckLoss) -> None:
        self._book.on_recheck(recheck, workflow.now())

    @workflow.query(name=names.QUERY_LIVENESS)
    def liveness(self) -> LivenessView:
        return self._book.view()

    @workflow.query(name=names.QUERY_LAST_HEARD)
    def last_heard(self, instance_ids: list[str]) -> dict[str, datetime]:
        return self._book.last_heard(instance_ids)

    def _time_to_continue(self) -> bool:
        return workflow.info().is_continue_as_new_suggested() or self._signals_this_run >= SIGNALS_PER_RUN
