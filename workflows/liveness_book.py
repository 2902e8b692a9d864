"""A liveness tracker's decisions as a plain model: who was heard last when, who is lost, whether the pipeline
that reports them is silent, and when to look again. No Temporal here: `now` comes from the caller.
LivenessTrackerWorkflow (workflows/liveness.py) runs it: its signals, its one timer, EC2's answer, the health
workflows told. The runbook is there.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from activities.models import GoneCause, GoneInstance
from contract.formats import iso
from contract.groups import CapacityGroup, heartbeat_threshold_problem
from contract.ids import liveness_workflow_id
from contract.liveness import (
    MAX_INSTANCES_PER_SHARD,
    IgnoreHeartbeats,
    LivenessChange,
    LivenessReport,
    RecheckLoss,
    loss_grace,
)
from workflows.model_log import Log
from workflows.models import LivenessCarry, LivenessView, ReporterSeen
from workflows.signal_input import Rejected, worth_logging

FORGET_LOST_AFTER = timedelta(days=1)
MAX_CLOCK_AHEAD = timedelta(minutes=5)
MAX_REPORTERS = 64
DEFAULT_THRESHOLD: timedelta = CapacityGroup.model_fields["heartbeat_loss_threshold"].default
DETAILS_LOST = 20
LOST_NAMED = 5  # instances named in the log line of a declaration
MAX_LAST_HEARD = 1_000


def _epoch(at: datetime) -> int:
    return int(at.timestamp())


class LivenessBook:
    def __init__(self, group: str, shard: int, shards: int, carry: LivenessCarry | None, log: Log) -> None:
        self.group = group
        self.shard = shard
        self.shards = shards
        self.state = carry or LivenessCarry()
        self.lost = set(self.state.lost)
        self.outbox: list[LivenessChange] = []  # changes for health workflows, told by the workflow
        self.armed_for: datetime | None = None  # the deadline the workflow's timer is set for
        self.wake = False  # the loop should look again now (a deadline moved earlier, the pipeline is back)
        self._log = log

    def carried(self) -> LivenessCarry:
        self.state.lost = sorted(self.lost)
        return self.state

    # --- the timing -------------------------------------------------------------------------------------------

    def threshold(self) -> timedelta:
        # Before run() has read the group (signal-with-start delivers the first batch first), the default's.
        group = self.state.group
        return group.heartbeat_loss_threshold if group else DEFAULT_THRESHOLD

    def window(self) -> timedelta:
        """Silence this long is a loss: the threshold, unless a reporter promised to report less often."""
        every = max((r.report_every for r in self.state.reporters.values()), default=0.0)
        return max(self.threshold(), timedelta(seconds=every))

    def grace(self) -> timedelta:
        return loss_grace(self.threshold())

    def pipeline_silent(self, now: datetime) -> bool:
        """Relays were reporting, and none has sent a batch for longer than it promised: the ingest or Temporal
        was down. (Probes that signal directly are not a pipeline: their silence is their own loss.)"""
        relays = [seen for seen in self.state.reporters.values() if seen.relay]
        return bool(relays) and not any(
            now - seen.last_at <= timedelta(seconds=seen.report_every) + self.grace() for seen in relays
        )

    def next_check(self) -> datetime | None:
        live = [t for i, t in self.state.heard.items() if i not in self.lost]
        if not live or self.state.silent_since is not None:
            return None  # nothing to watch, or waiting for the pipeline: the next batch wakes the loop
        at = self._deadline(min(live))
        if self.state.floor is not None:
            at = max(at, self.state.floor)
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
            seen.last_at + timedelta(seconds=seen.report_every) for seen in self.state.reporters.values() if seen.relay
        ]
        return max(promises, default=None)

    def _deadline(self, heard: int) -> datetime:
        return datetime.fromtimestamp(heard, tz=UTC) + self.window() + self.grace()

    def timer_fired(self, now: datetime, armed_at: datetime | None) -> list[str]:
        """The deadline's timer fired: the instances lost as of now. A timer that fired late (Temporal or every worker
        was down) declares nothing for a full window: what probes said meanwhile may be on its way."""
        # Late against when it was due, or when it was set if that deadline had already passed.
        due = max(self.armed_for or now, armed_at or now)
        if now - due > self.grace():
            floor = self._no_loss_before(now + self.window() + self.grace())
            self._log.warning(
                "liveness of %s: woke %s late; no loss declared before %s", self.group, now - due, iso(floor)
            )
        return self.declare_losses(now)

    def handed_over_slowly(self, now: datetime) -> bool:
        """No batch reached the previous run for longer than a reporter's interval before this run began: Temporal
        refused them while that run closed for that long. (A continue-as-new that new batches overtake is retried,
        and Temporal refuses every batch until the retry completes: a workflow-task timeout if the worker running
        it died.) Reporters send refused batches again on their own schedule (a client's backoff, an RPC
        timeout), not within one interval of this run's start."""
        last = self.state.last_report_at
        return last is not None and now - last > timedelta(seconds=self._interval()) + self.grace()

    def resumed(self, now: datetime, *, slowly: bool = False) -> None:
        """This run continued another. While that one closed, Temporal refused the reporters' batches ("workflow is
        closing", for as long as its last task took under load), and they are being sent again now: nothing is
        declared lost before each reporter has had one interval to deliver its retried batch, or, after a slow
        hand-over (`handed_over_slowly`), a full window, as when a silent pipeline comes back."""
        if not slowly:
            self._no_loss_before(now + timedelta(seconds=self._interval()) + self.grace())
            return
        floor = self._no_loss_before(now + self.window() + self.grace())
        last = iso(self.state.last_report_at) if self.state.last_report_at else "never"
        self._log.warning(
            "liveness of %s: no batch arrived from %s until this run began; no loss declared before %s",
            self.group,
            last,
            iso(floor),
        )

    def _interval(self) -> float:
        """The longest interval a reporter promised, in seconds (the window's, before any reported)."""
        return max((r.report_every for r in self.state.reporters.values()), default=self.window().total_seconds())

    def _no_loss_before(self, at: datetime) -> datetime:
        """Declare nothing before `at`; a floor already later stays. Returns the floor."""
        self.state.floor = max(self.state.floor or at, at)
        return self.state.floor

    def declare_losses(self, now: datetime) -> list[str]:
        """The instances lost as of now (marked lost here; told by _tell_losses)."""
        if self.pipeline_silent(now):
            if self.state.silent_since is None:
                self.state.silent_since = self.state.last_report_at or now
                self._log.warning(
                    "liveness of %s: no batch from any reporter since %s; declaring nothing until they are back",
                    self.group,
                    iso(self.state.silent_since),
                )
            return []
        if self.state.floor is not None and now < self.state.floor:
            return []
        forget_before = _epoch(now - FORGET_LOST_AFTER)
        for instance_id in [i for i in self.lost if self.state.heard.get(i, 0) < forget_before]:
            self.forget(instance_id)
        cutoff = _epoch(now - self.window() - self.grace())
        lost = [i for i, heard in self.state.heard.items() if heard <= cutoff and i not in self.lost]
        self.lost.update(lost)
        self.state.declared_lost += len(lost)
        if lost:
            # Said once per declaration, with what a false loss is told apart by: when the last batch came, and
            # whether the lost were all last heard together (a stalled sender) or apart (hosts that went quiet).
            heard = [self.state.heard[i] for i in lost]
            self._log.info(
                "liveness of %s: %d lost (%s%s), last heard %s..%s; the last batch came at %s",
                self.group,
                len(lost),
                ", ".join(sorted(lost)[:LOST_NAMED]),
                ", ..." if len(lost) > LOST_NAMED else "",
                iso(datetime.fromtimestamp(min(heard), tz=UTC)),
                iso(datetime.fromtimestamp(max(heard), tz=UTC)),
                iso(self.state.last_report_at) if self.state.last_report_at else "never",
            )
        return lost

    def told_lost(self, lost: list[str], gone: dict[str, GoneInstance]) -> None:
        """Queue the losses for their health workflows, with what EC2 said of any that left on purpose."""
        for instance_id in lost:
            if instance_id not in self.lost:
                continue  # heard again while EC2 was asked: its recovery is already on its way
            left = gone.get(instance_id)
            self.outbox.append(
                LivenessChange(
                    instance_id=instance_id,
                    lost=True,
                    last_heard=datetime.fromtimestamp(self.state.heard[instance_id], tz=UTC),
                    threshold=self.threshold(),
                    gone=f"{left.state} in EC2: {left.reason or 'no reason given'}" if left else None,
                    for_good=left is None or for_good(left),
                )
            )

    def forget(self, instance_id: str) -> None:
        self.lost.discard(instance_id)
        self.state.ignored_until.pop(instance_id, None)
        if self.state.heard.pop(instance_id, None) is not None:
            self.state.forgotten += 1

    def reject(self, why: Rejected) -> None:
        self.state.rejected_signals += 1
        if worth_logging(self.state.rejected_signals):
            self._log.warning("liveness of %s: dropped signal: %s", self.group, why)

    def on_report(self, report: LivenessReport, now: datetime) -> None:
        if (report.group, report.shard, report.shards) != (self.group, self.shard, self.shards):
            where = f"{report.group} shard {report.shard} of {report.shards}"
            self.reject(Rejected(f"batch for {where} sent to {self.group} shard {self.shard} of {self.shards}"))
            return
        was_silent = self.state.silent_since is not None or self.pipeline_silent(now)
        if was_silent:
            self.state.last_silence_from = self.state.silent_since or self.state.last_report_at
            self.state.last_silence_to = now
        # When the batch was made, not when it arrived: one that waited out an outage in Temporal's hands must
        # not pass for a pipeline that kept working.
        made = min(max(report.at, now - FORGET_LOST_AFTER), now)
        self._note_reporter(report.reporter, made, report.report_every, report.relay, now)
        if was_silent:
            # Whatever probes said while the pipeline was down never arrived: give them a full window from now.
            self.state.floor = now + self.window() + self.grace()
            self.state.silent_since = None
            self.wake = True
            self._log.warning(
                "liveness of %s: reporters back; no loss declared before %s", self.group, iso(self.state.floor)
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
        check = self.next_check()
        if check is not None and (self.armed_for is None or check < self.armed_for):
            self.wake = True

    def _on_heard(self, instance_id: str, heard: int) -> None:
        if self.state.ignored_until.get(instance_id, 0) > heard:
            return  # a game day's silence: as if this receipt never happened
        previous = self.state.heard.get(instance_id)
        if previous is None:
            if len(self.state.heard) >= MAX_INSTANCES_PER_SHARD:
                self.state.dropped_instances += 1
                if worth_logging(self.state.dropped_instances):
                    self._log.warning(
                        "liveness of %s shard %d is full (%d instances): raise the group's liveness_shards",
                        self.group,
                        self.shard,
                        MAX_INSTANCES_PER_SHARD,
                    )
                return
        elif heard <= previous:
            return
        self.state.heard[instance_id] = heard
        if instance_id in self.lost:
            self.lost.discard(instance_id)
            self.state.recovered += 1
            last = datetime.fromtimestamp(heard, tz=UTC)
            self.outbox.append(LivenessChange(instance_id=instance_id, lost=False, last_heard=last))

    def _note_reporter(self, reporter: str, made: datetime, every: timedelta, relay: bool, now: datetime) -> None:
        self.state.last_report_at = max(self.state.last_report_at or made, made)
        before = self.state.reporters.get(reporter)
        last_at = max(before.last_at, made) if before else made
        self.state.reporters[reporter] = ReporterSeen(last_at=last_at, report_every=every.total_seconds(), relay=relay)
        # Reporters that stopped (a replica scaled in, a restart's old self) are let go after a few promises; never
        # the one just heard from, however late its batch arrived.
        for name, seen in list(self.state.reporters.items()):
            if name != reporter and now - seen.last_at > 3 * timedelta(seconds=seen.report_every) + self.grace():
                del self.state.reporters[name]
        while len(self.state.reporters) > MAX_REPORTERS:
            oldest = min(self.state.reporters, key=lambda name: self.state.reporters[name].last_at)
            del self.state.reporters[oldest]

    def on_ignore(self, ignore: IgnoreHeartbeats, now: datetime) -> None:
        instance_id = ignore.instance_id
        if instance_id not in self.state.heard:
            return
        # Receipts travel rounded up to the whole second: one stamped ceil(until) may still be from before `until`.
        self.state.ignored_until[instance_id] = math.ceil(ignore.until.timestamp()) + 1
        if ignore.since is not None and instance_id not in self.lost:
            # Silent from the start of the game day, as a probe that stopped then: a receipt from just before it,
            # still on its way, must not count as newer.
            since = min(max(ignore.since, now - FORGET_LOST_AFTER), now + MAX_CLOCK_AHEAD)
            self.state.heard[instance_id] = max(self.state.heard[instance_id], _epoch(since))

    def on_recheck(self, recheck: RecheckLoss, now: datetime) -> None:
        instance_id = recheck.instance_id
        if instance_id not in self.lost:
            return  # heard again meanwhile, or never lost: nothing to judge afresh
        self.lost.discard(instance_id)
        self.state.heard[instance_id] = max(self.state.heard.get(instance_id, 0), _epoch(now))
        self._wake_if_due_sooner()

    def on_group_changed(self, group: CapacityGroup) -> None:
        if group.name != self.group:
            self.reject(Rejected(f"configuration of group {group.name} sent to {self.group}'s tracker"))
            return
        # Lenient on the wire, so checked here: a threshold out of bounds would put deadlines past the calendar.
        problem = heartbeat_threshold_problem(group.heartbeat_loss_threshold, None)
        if problem:
            self.reject(Rejected(f"group_changed refused: {problem}"))
            return
        self.state.group = group
        self.wake = True  # a new threshold moves every deadline

    def view(self) -> LivenessView:
        known = self.state.group is not None
        return LivenessView(
            group=self.group,
            shard=self.shard,
            shards=self.shards,
            instances=len(self.state.heard),
            lost=sorted(self.lost),
            window_s=self.window().total_seconds() if known else None,
            grace_s=self.grace().total_seconds() if known else None,
            reporters=self.state.reporters,
            last_report_at=self.state.last_report_at,
            silent_since=self.state.silent_since,
            floor=self.state.floor,
            last_silence_from=self.state.last_silence_from,
            last_silence_to=self.state.last_silence_to,
            declared_lost=self.state.declared_lost,
            recovered=self.state.recovered,
            dropped_instances=self.state.dropped_instances,
            forgotten=self.state.forgotten,
            rejected_signals=self.state.rejected_signals,
        )

    def last_heard(self, instance_ids: list[str]) -> dict[str, datetime]:
        """When each of these instances was last heard (those this tracker knows; at most MAX_LAST_HEARD asked)."""
        heard = self.state.heard
        return {i: datetime.fromtimestamp(heard[i], tz=UTC) for i in instance_ids[:MAX_LAST_HEARD] if i in heard}

    def details_markdown(self, now: datetime) -> str:
        view = self.view()
        name = liveness_workflow_id(self.group, self.shard, self.shards)
        lines = [f"**{name}**: {view.instances} instances heard, **{len(view.lost)} lost**", ""]
        if view.window_s is not None:
            lines.append(f"Lost after {view.window_s:g}s without a heartbeat (+{view.grace_s:g}s grace)")
        if view.silent_since is not None:
            lines += ["", f"**No batch from any reporter since {iso(view.silent_since)}: declaring nothing**"]
        elif view.floor is not None and now < view.floor:
            lines += ["", f"No loss declared before {iso(view.floor)}: reporters' batches may still be on their way"]
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


def for_good(left: GoneInstance) -> bool:
    return left.state in ("shutting-down", "terminated") or left.cause in (
        GoneCause.SPOT_INTERRUPTION,
        GoneCause.CAPACITY_BLOCK_ENDING,
    )
