"""One liveness tracker per capacity group (or per shard of a large one): who was heard last when, and who is lost.

Runbook it automates:
  1. Reporters (the ingest's replicas, or a trusted-lab probe) send batches: each instance they heard and when, by
     their receipt time. A heartbeat costs Temporal nothing per instance; a batch costs one signal per reporter.
  2. One timer, set for the earliest deadline: an instance not heard for the group's threshold (or the reporters'
     interval, if that is longer) plus a grace is lost. Its health workflow is told, once; it is told again when
     the instance is heard again.
  3. A silent pipeline is not silent hosts. If no reporter has sent a batch for longer than it promised (the ingest
     or Temporal was down), nothing is declared lost, and once batches come again, not for another full window:
     probes get a whole threshold to be heard again.
  4. Game days: an instance's health workflow can ask the tracker to ignore its receipts for a while.
  5. Before telling of a loss, EC2 is asked (once per batch of losses) whether the instance was terminated: one
     that left on purpose (scaled in, by an operator, a Spot interruption) retires instead of being repaired.
  6. State stays bounded: at most 20,000 instances per shard; an instance lost for a day, or whose health workflow
     is gone (it was replaced), is forgotten.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError

from contract import names
from contract.formats import iso
from contract.groups import CapacityGroup, heartbeat_threshold_problem
from contract.ids import health_workflow_id, liveness_workflow_id
from contract.liveness import (
    MAX_INSTANCES_PER_SHARD,
    IgnoreHeartbeats,
    LivenessChange,
    LivenessReport,
    RecheckLoss,
    loss_grace,
)
from workflows.group_config import read_group_config
from workflows.models import LivenessCarry, LivenessRun, LivenessView, ReporterSeen
from workflows.options import CALL_TIMEOUT
from workflows.signal_input import Rejected, Route, dispatch, worth_logging

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import GoneCause, GoneInstance, InstancesGoneRequest

SIGNALS_PER_RUN = 2_000
# Health workflows told at once: bounded so a mass loss does not put thousands of commands in one task.
SIGNALS_IN_FLIGHT = 100
FORGET_LOST_AFTER = timedelta(days=1)
MAX_CLOCK_AHEAD = timedelta(minutes=5)
MAX_REPORTERS = 64
DEFAULT_THRESHOLD: timedelta = CapacityGroup.model_fields["heartbeat_loss_threshold"].default
DETAILS_LOST = 20
MAX_LAST_HEARD = 1_000


def _epoch(at: datetime) -> int:
    return int(at.timestamp())


@workflow.defn(name=names.LIVENESS_WORKFLOW)
class LivenessTrackerWorkflow:
    @workflow.init
    def __init__(self, input: LivenessRun) -> None:
        self._group = input.group
        self._shard = input.shard
        self._shards = input.shards
        self._state = input.carry or LivenessCarry()
        self._lost = set(self._state.lost)
        self._outbox: list[LivenessChange] = []
        self._armed_for: datetime | None = None
        self._armed_at: datetime | None = None
        self._wake = False
        self._telling = 0  # health workflows being told right now: continue-as-new waits for them
        self._signals_this_run = 0

    @workflow.run
    async def run(self, input: LivenessRun) -> None:
        if self._state.group is None:
            self._state.group = await read_group_config(self._group, "read the group's heartbeat-loss threshold")
        sender = asyncio.create_task(self._tell_health_workflows())
        while not self._time_to_continue():
            self._armed_for = self._next_check()
            self._armed_at = workflow.now()
            self._wake = False
            workflow.set_current_details(self._details_markdown())
            timeout = None if self._armed_for is None else max(self._armed_for - workflow.now(), timedelta(0))
            try:
                await workflow.wait_condition(
                    lambda: self._wake or self._time_to_continue(),
                    timeout=timeout,
                    timeout_summary="earliest heartbeat deadline",
                )
            except TimeoutError:
                now = workflow.now()
                # Late against when it was due, or when it was set if that deadline had already passed.
                due = max(self._armed_for or now, self._armed_at or now)
                if now - due > self._grace():
                    # The timer fired late: Temporal or every worker was down. What probes said meanwhile may be
                    # on its way; give them a full window from now.
                    self._state.floor = max(self._state.floor or now, now + self._window() + self._grace())
                    workflow.logger.warning(
                        "liveness of %s: woke %s late; no loss declared before %s",
                        self._group,
                        now - due,
                        iso(self._state.floor),
                    )
                lost = self._declare_losses(now)
                if lost:
                    await self._tell_losses(lost)
        # Cancelled only while idle: cancelling it mid-signal would lose changes already taken from the outbox.
        await workflow.wait_condition(
            lambda: not self._outbox and not self._telling and workflow.all_handlers_finished()
        )
        sender.cancel()
        self._state.lost = sorted(self._lost)
        workflow.continue_as_new(
            LivenessRun(group=self._group, shard=self._shard, shards=self._shards, carry=self._state)
        )

    # --- the timing -------------------------------------------------------------------------------------------

    def _threshold(self) -> timedelta:
        # Before run() has read the group (signal-with-start delivers the first batch first), the default's.
        group = self._state.group
        return group.heartbeat_loss_threshold if group else DEFAULT_THRESHOLD

    def _window(self) -> timedelta:
        """Silence this long is a loss: the threshold, unless a reporter promised to report less often."""
        every = max((r.report_every for r in self._state.reporters.values()), default=0.0)
        return max(self._threshold(), timedelta(seconds=every))

    def _grace(self) -> timedelta:
        return loss_grace(self._threshold())

    def _pipeline_silent(self, now: datetime) -> bool:
        """Relays were reporting, and none has sent a batch for longer than it promised: the ingest or Temporal
        was down. (Probes that signal directly are not a pipeline: their silence is their own loss.)"""
        relays = [seen for seen in self._state.reporters.values() if seen.relay]
        return bool(relays) and not any(
            now - seen.last_at <= timedelta(seconds=seen.report_every) + self._grace() for seen in relays
        )

    def _next_check(self) -> datetime | None:
        live = [t for i, t in self._state.heard.items() if i not in self._lost]
        if not live or self._state.silent_since is not None:
            return None  # nothing to watch, or waiting for the pipeline: the next batch wakes the loop
        at = self._deadline(min(live))
        if self._state.floor is not None:
            at = max(at, self._state.floor)
        promised = self._relays_promise()
        if promised is not None and at > promised:
            # Every relay promised a batch before this deadline: one that keeps its promise wakes the loop first
            # (and if none does, the pipeline is silent and nothing may be declared). So a healthy group behind
            # its ingest sets no timer at all; one is set only when a deadline comes before the batches.
            return None
        return at

    def _relays_promise(self) -> datetime | None:
        """By when every relay promised its next batch (None: no relay reports here)."""
        promises = [
            seen.last_at + timedelta(seconds=seen.report_every) for seen in self._state.reporters.values() if seen.relay
        ]
        return max(promises, default=None)

    def _deadline(self, heard: int) -> datetime:
        return datetime.fromtimestamp(heard, tz=UTC) + self._window() + self._grace()

    def _declare_losses(self, now: datetime) -> list[str]:
        """The instances lost as of now (marked lost here; told by _tell_losses)."""
        if self._pipeline_silent(now):
            if self._state.silent_since is None:
                self._state.silent_since = self._state.last_report_at or now
                workflow.logger.warning(
                    "liveness of %s: no batch from any reporter since %s; declaring nothing until they are back",
                    self._group,
                    iso(self._state.silent_since),
                )
            return []
        if self._state.floor is not None and now < self._state.floor:
            return []
        forget_before = _epoch(now - FORGET_LOST_AFTER)
        for instance_id in [i for i in self._lost if self._state.heard.get(i, 0) < forget_before]:
            self._forget(instance_id)
        cutoff = _epoch(now - self._window() - self._grace())
        lost = [i for i, heard in self._state.heard.items() if heard <= cutoff and i not in self._lost]
        self._lost.update(lost)
        self._state.declared_lost += len(lost)
        return lost

    async def _tell_losses(self, lost: list[str]) -> None:
        """Lost, or gone on purpose: EC2 is asked once for the whole batch whether any was terminated (scaled in,
        by an operator, a Spot interruption), so that those retire instead of being repaired."""
        gone: dict[str, GoneInstance] = {}
        try:
            answer = await workflow.execute_activity_method(
                FleetActivities.instances_gone,
                InstancesGoneRequest(group=self._group, instance_ids=lost),
                summary=f"did {len(lost)} silent instance(s) leave on purpose? (EC2 state)",
                start_to_close_timeout=CALL_TIMEOUT,
                # Bounded: a loss is not held back for long because EC2 cannot be asked.
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=2), maximum_attempts=3),
            )
            gone = {g.instance_id: g for g in answer.gone}
        except ActivityError as err:
            workflow.logger.warning("liveness of %s: EC2 not asked (%s); told as lost", self._group, err.cause)
        for instance_id in lost:
            if instance_id not in self._lost:
                continue  # heard again while EC2 was asked: its recovery is already on its way
            left = gone.get(instance_id)
            self._outbox.append(
                LivenessChange(
                    instance_id=instance_id,
                    lost=True,
                    last_heard=datetime.fromtimestamp(self._state.heard[instance_id], tz=UTC),
                    threshold=self._threshold(),
                    gone=f"{left.state} in EC2: {left.reason or 'no reason given'}" if left else None,
                    for_good=left is None or _for_good(left),
                )
            )

    def _forget(self, instance_id: str) -> None:
        self._lost.discard(instance_id)
        self._state.ignored_until.pop(instance_id, None)
        if self._state.heard.pop(instance_id, None) is not None:
            self._state.forgotten += 1

    async def _tell_health_workflows(self) -> None:
        while True:
            await workflow.wait_condition(lambda: bool(self._outbox))
            batch, self._outbox = self._outbox[:SIGNALS_IN_FLIGHT], self._outbox[SIGNALS_IN_FLIGHT:]
            self._telling = len(batch)
            try:
                results = await asyncio.gather(*(self._tell(change) for change in batch), return_exceptions=True)
            finally:
                self._telling = 0
            for change, result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):
                    # Its health workflow is closed: the instance was replaced or retired. Nothing left to tell.
                    workflow.logger.info("liveness of %s not told (%s); forgetting it", change.instance_id, result)
                    self._forget(change.instance_id)

    async def _tell(self, change: LivenessChange) -> None:
        handle = workflow.get_external_workflow_handle(health_workflow_id(change.instance_id))
        await handle.signal(names.SIGNAL_LIVENESS, change)

    # --- signals and query ------------------------------------------------------------------------------------

    @workflow.signal(dynamic=True)
    def on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        self._signals_this_run += 1
        routes: dict[str, Route[Any]] = {
            names.SIGNAL_LIVENESS_REPORT: Route(LivenessReport, self._on_report),
            names.SIGNAL_IGNORE_HEARTBEATS: Route(IgnoreHeartbeats, self._on_ignore),
            names.SIGNAL_GROUP_CHANGED: Route(CapacityGroup, self._on_group_changed),
            names.SIGNAL_RECHECK_LOSS: Route(RecheckLoss, self._on_recheck),
        }
        dispatch(name, payloads, routes, self._reject)

    def _reject(self, why: Rejected) -> None:
        self._state.rejected_signals += 1
        if worth_logging(self._state.rejected_signals):
            workflow.logger.warning("liveness of %s: dropped signal: %s", self._group, why)

    def _on_report(self, report: LivenessReport) -> None:
        if (report.group, report.shard, report.shards) != (self._group, self._shard, self._shards):
            where = f"{report.group} shard {report.shard} of {report.shards}"
            self._reject(Rejected(f"batch for {where} sent to {self._group} shard {self._shard} of {self._shards}"))
            return
        now = workflow.now()
        was_silent = self._state.silent_since is not None or self._pipeline_silent(now)
        if was_silent:
            self._state.last_silence_from = self._state.silent_since or self._state.last_report_at
            self._state.last_silence_to = now
        # When the batch was made, not when it arrived: one that waited out an outage in Temporal's hands must
        # not pass for a pipeline that kept working.
        made = min(max(report.at, now - FORGET_LOST_AFTER), now)
        self._note_reporter(report.reporter, made, report.report_every, report.relay)
        if was_silent:
            # Whatever probes said while the pipeline was down never arrived: give them a full window from now.
            self._state.floor = now + self._window() + self._grace()
            self._state.silent_since = None
            self._wake = True
            workflow.logger.warning(
                "liveness of %s: reporters back; no loss declared before %s", self._group, iso(self._state.floor)
            )
        at = _epoch(report.at)
        # A reporter's clock is its own, and its receipt times are rounded up: one further ahead than clocks drift
        # counts as that far ahead, one older than a day is no news.
        newest, oldest = _epoch(now + MAX_CLOCK_AHEAD), _epoch(now - FORGET_LOST_AFTER)
        for instance_id, ago in report.heard.items():
            heard = min(at - ago, newest)
            if heard >= oldest:
                self._on_heard(instance_id, heard)
        self._wake_if_due_sooner()

    def _wake_if_due_sooner(self) -> None:
        """Re-arm only when the next check moved earlier than the timer (or there is none): a batch that merely
        pushes deadlines back costs no new timer."""
        check = self._next_check()
        if check is not None and (self._armed_for is None or check < self._armed_for):
            self._wake = True

    def _on_heard(self, instance_id: str, heard: int) -> None:
        if self._state.ignored_until.get(instance_id, 0) > heard:
            return  # a game day's silence: as if this receipt never happened
        previous = self._state.heard.get(instance_id)
        if previous is None:
            if len(self._state.heard) >= MAX_INSTANCES_PER_SHARD:
                self._state.dropped_instances += 1
                if worth_logging(self._state.dropped_instances):
                    workflow.logger.warning(
                        "liveness of %s shard %d is full (%d instances): raise the group's liveness_shards",
                        self._group,
                        self._shard,
                        MAX_INSTANCES_PER_SHARD,
                    )
                return
        elif heard <= previous:
            return
        self._state.heard[instance_id] = heard
        if instance_id in self._lost:
            self._lost.discard(instance_id)
            self._state.recovered += 1
            last = datetime.fromtimestamp(heard, tz=UTC)
            self._outbox.append(LivenessChange(instance_id=instance_id, lost=False, last_heard=last))

    def _note_reporter(self, reporter: str, made: datetime, every: timedelta, relay: bool) -> None:
        self._state.last_report_at = max(self._state.last_report_at or made, made)
        before = self._state.reporters.get(reporter)
        last_at = max(before.last_at, made) if before else made
        self._state.reporters[reporter] = ReporterSeen(last_at=last_at, report_every=every.total_seconds(), relay=relay)
        now = workflow.now()
        # Reporters that stopped (a replica scaled in, a restart's old self) are let go after a few promises; never
        # the one just heard from, however late its batch arrived.
        for name, seen in list(self._state.reporters.items()):
            if name != reporter and now - seen.last_at > 3 * timedelta(seconds=seen.report_every) + self._grace():
                del self._state.reporters[name]
        while len(self._state.reporters) > MAX_REPORTERS:
            oldest = min(self._state.reporters, key=lambda name: self._state.reporters[name].last_at)
            del self._state.reporters[oldest]

    def _on_ignore(self, ignore: IgnoreHeartbeats) -> None:
        instance_id = ignore.instance_id
        if instance_id not in self._state.heard:
            return
        # Receipts travel rounded up to the whole second: one stamped ceil(until) may still be from before `until`.
        self._state.ignored_until[instance_id] = math.ceil(ignore.until.timestamp()) + 1
        if ignore.since is not None and instance_id not in self._lost:
            # Silent from the start of the game day, as a probe that stopped then: a receipt from just before it,
            # still on its way, must not count as newer.
            now = workflow.now()
            since = min(max(ignore.since, now - FORGET_LOST_AFTER), now + MAX_CLOCK_AHEAD)
            self._state.heard[instance_id] = max(self._state.heard[instance_id], _epoch(since))

    def _on_recheck(self, recheck: RecheckLoss) -> None:
        instance_id = recheck.instance_id
        if instance_id not in self._lost:
            return  # heard again meanwhile, or never lost: nothing to judge afresh
        self._lost.discard(instance_id)
        self._state.heard[instance_id] = max(self._state.heard.get(instance_id, 0), _epoch(workflow.now()))
        self._wake_if_due_sooner()

    def _on_group_changed(self, group: CapacityGroup) -> None:
        if group.name != self._group:
            self._reject(Rejected(f"configuration of group {group.name} sent to {self._group}'s tracker"))
            return
        # Lenient on the wire, so checked here: a threshold out of bounds would put deadlines past the calendar.
        problem = heartbeat_threshold_problem(group.heartbeat_loss_threshold, None)
        if problem:
            self._reject(Rejected(f"group_changed refused: {problem}"))
            return
        self._state.group = group
        self._wake = True  # a new threshold moves every deadline

    @workflow.query(name=names.QUERY_LIVENESS)
    def liveness(self) -> LivenessView:
        known = self._state.group is not None
        return LivenessView(
            group=self._group,
            shard=self._shard,
            shards=self._shards,
            instances=len(self._state.heard),
            lost=sorted(self._lost),
            window_s=self._window().total_seconds() if known else None,
            grace_s=self._grace().total_seconds() if known else None,
            reporters=self._state.reporters,
            last_report_at=self._state.last_report_at,
            silent_since=self._state.silent_since,
            floor=self._state.floor,
            last_silence_from=self._state.last_silence_from,
            last_silence_to=self._state.last_silence_to,
            declared_lost=self._state.declared_lost,
            recovered=self._state.recovered,
            dropped_instances=self._state.dropped_instances,
            forgotten=self._state.forgotten,
            rejected_signals=self._state.rejected_signals,
        )

    @workflow.query(name=names.QUERY_LAST_HEARD)
    def last_heard(self, instance_ids: list[str]) -> dict[str, datetime]:
        """When each of these instances was last heard (those this tracker knows; at most MAX_LAST_HEARD asked)."""
        heard = self._state.heard
        return {i: datetime.fromtimestamp(heard[i], tz=UTC) for i in instance_ids[:MAX_LAST_HEARD] if i in heard}

    def _time_to_continue(self) -> bool:
        return workflow.info().is_continue_as_new_suggested() or self._signals_this_run >= SIGNALS_PER_RUN

    def _details_markdown(self) -> str:
        view = self.liveness()
        name = liveness_workflow_id(self._group, self._shard, self._shards)
        lines = [f"**{name}**: {view.instances} instances heard, **{len(view.lost)} lost**", ""]
        if view.window_s is not None:
            lines.append(f"Lost after {view.window_s:g}s without a heartbeat (+{view.grace_s:g}s grace)")
        if view.silent_since is not None:
            lines += ["", f"**No batch from any reporter since {iso(view.silent_since)}: declaring nothing**"]
        elif view.floor is not None and workflow.now() < view.floor:
            lines += ["", f"Reporters were silent; no loss declared before {iso(view.floor)}"]
        if view.last_silence_from is not None and view.last_silence_to is not None:
            lines += [
                "",
                f"Last silence of the reporters: {iso(view.last_silence_from)} to {iso(view.last_silence_to)}",
            ]
        if view.lost:
            shown = ", ".join(view.lost[:DETAILS_LOST])
            more = f" and {len(view.lost) - DETAILS_LOST} more" if len(view.lost) > DETAILS_LOST else ""
            lines += ["", f"Lost: {shown}{more}"]
        last = iso(view.last_report_at) if view.last_report_at else "never"
        lines += ["", f"{len(view.reporters)} reporters; last batch {last}"]
        if view.dropped_instances:
            lines += ["", f"**{view.dropped_instances} instances not tracked: shard full, raise liveness_shards**"]
        return "\n".join(lines)


def _for_good(left: GoneInstance) -> bool:
    return left.state in ("shutting-down", "terminated") or left.cause in (
        GoneCause.SPOT_INTERRUPTION,
        GoneCause.CAPACITY_BLOCK_ENDING,
    )
