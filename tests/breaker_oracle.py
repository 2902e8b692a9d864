"""The properties of tests/test_breaker_property.py (its docstring lists them), checked against what an example
recorded: at rest after each step, and over the whole example once it wound down."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from temporalio.client import WorkflowHandle

from contract.breaker import OUTAGE_SPREAD, REPAIR_BUDGET_PERIOD, BreakerHold, HoldCause, ImpairmentReport, ResumeRecord
from contract.groups import CapacityGroup
from tests.breaker_history import Timeline
from tests.breaker_schedules import RECLAIM_INTERVAL, Impair, Schedule, Step
from tests.breaker_stubs import GroupStub, HolderView
from workflows.models import SemaphoreView


@dataclass
class Holder:
    instance_id: str
    token: str
    handle: WorkflowHandle[Any, Any]
    run_id: str
    view: HolderView | None = None
    crashed_at: datetime | None = None  # the server's time once the test had terminated it
    crashed_step: int | None = None
    finishing: bool = False
    closed: bool = False


@dataclass
class ConfigChange:
    at: datetime
    effective: CapacityGroup


@dataclass
class ExampleReport:
    """What an example did, for the benchmark's summary."""

    grants: int = 0
    holds: dict[str, int] = field(default_factory=dict)
    resumes: int = 0
    discarded: int = 0
    restarts: int = 0
    fleet_holds: int = 0
    late_reports: int = 0  # grants made while reports that were over the rule had arrived but were not yet counted
    replays: int = 0  # the semaphore's workflow tasks moved off a dead worker: its history replayed afresh
    refused_resumes: int = 0
    semaphore_events: int = 0
    # How often the semaphore had counted the group (describe_group_capacity) after each step.
    counted_after: list[int] = field(default_factory=list)
    fleet_reports: int = 0  # impairments the semaphore passed on to the fleet breaker
    fleet_report_activities: int = 0  # the activities that carried them


class ExampleOracle:
    """What an example recorded (the repairs it started, the configurations, holds and resumes it saw, the
    impairments it reported) and the properties checked against it; Example drives the steps and records."""

    def __init__(self, schedule: Schedule, group_name: str) -> None:
        self.s = schedule
        self.group_name = group_name
        self.group = CapacityGroup(
            name=self.group_name,
            cluster=self.group_name,
            max_draining_percent=schedule.draining_percent,
            permit_reclaim_interval=RECLAIM_INTERVAL,
        )
        self.stub = GroupStub(group=self.group, size=schedule.size, latency=dict(schedule.latency))
        self.holders: list[Holder] = []
        self.changes: list[ConfigChange] = []
        self.effective = self.group
        self.holds: dict[datetime, BreakerHold] = {}
        self.resumes: list[ResumeRecord] = []
        # Impairments as the test reported them: the latest of each instance, (at, silent_since), as the breaker's
        # book keeps them; and every report, since a hold may trip on a book that later reports changed.
        self.impaired: dict[str, tuple[datetime, datetime | None]] = {}
        self.reports: list[ImpairmentReport] = []
        self.last_resume_at: datetime | None = None
        # Repairs waiting when a --discard-held resume was sent, with the step's index: each must be denied (unless
        # it had crashed before: the denial cannot reach it), and never granted.
        self.discarded: dict[tuple[str, str], int] = {}
        self.cap_lowered = False
        self.problems: list[str] = []
        self.step_index = -1
        self.report = ExampleReport()

    def describe_step(self) -> str:
        if 0 <= self.step_index < len(self.s.steps):
            return repr(self.s.steps[self.step_index])
        return "start" if self.step_index < 0 else "wind-down"

    def check_at_rest(self, view: SemaphoreView, step: Step | None) -> None:
        """What must be true of the semaphore's view once settled; and what it holds."""
        where = f"step {self.step_index} ({self.describe_step()})"
        held = view.breaker.held
        if held is not None:
            self.holds.setdefault(held.tripped_at, held)
        cap = self.effective.max_draining(self.s.size)
        if view.group_size:
            if view.group_size != self.s.size:
                self.problems.append(f"{where}: group size {view.group_size}, expected {self.s.size}")
            if view.capacity != cap:
                self.problems.append(f"{where}: the semaphore's cap is {view.capacity}, the one in force {cap}")
        if not self.cap_lowered and len(view.holders) > cap:
            self.problems.append(f"{where}: {len(view.holders)} holders over the cap of {cap}")
        if held is None and view.breaker.fleet_held is None and view.waiters and len(view.holders) < view.capacity:
            self.problems.append(
                f"{where}: {len(view.waiters)} waiting while {len(view.holders)} of {view.capacity} permits are "
                "held and nothing holds repairs"
            )
        if isinstance(step, Impair):
            self.check_trip(view, where)

    def check_trip(self, view: SemaphoreView, where: str) -> None:
        """Must the breaker hold now? Counted conservatively: impairments clearly after the last resume and clearly
        within the window, against the rule in force (the count happened after the update returned)."""
        if view.breaker.held is not None:
            return
        rule = self.effective.breaker_rule()
        now = max(at for at, _ in self.impaired.values())
        since = now - rule.impaired_window + timedelta(minutes=1)
        if self.last_resume_at is not None:
            since = max(since, self.last_resume_at + timedelta(seconds=1))
        counted = {instance: seen for instance, seen in self.impaired.items() if seen[0] >= since}
        threshold = rule.threshold(self.s.size)
        outage = largest_outage([silent for _, silent in counted.values() if silent is not None])
        if len(counted) > threshold:
            self.problems.append(
                f"{where}: not held with {len(counted)} of {self.s.size} impaired in the window, over the "
                f"threshold {threshold:g}"
            )
        elif outage > rule.min_impaired:
            self.problems.append(
                f"{where}: not held with {outage} heartbeat losses that began within {OUTAGE_SPREAD.seconds}s "
                f"(min_impaired {rule.min_impaired})"
            )

    # -- the properties over the whole example --

    def check_grants(self) -> None:
        granted = [h for h in self.holders if h.view is not None and h.view.granted_at is not None]
        self.report.grants = len(granted)
        for holder in self.holders:
            view = holder.view
            if view is None:
                self.problems.append(f"{holder.handle.id}: no record of what it saw")
                continue
            key = (holder.handle.id, holder.run_id)
            if view.foreign_tokens:
                self.problems.append(f"{key[0]}: {view.foreign_tokens} grants or denials with another's token")
            if view.denied_after_grant or view.granted_after_denial or (view.denied and view.granted_at):
                self.problems.append(f"{key[0]}: both granted (at {view.granted_at}) and denied")
            gone = holder.crashed_step is not None and holder.crashed_step < self.discarded.get(key, -1)
            if key in self.discarded and not view.denied and not gone:
                self.problems.append(f"{key[0]}: waiting at a --discard-held resume, never denied")
            if key in self.discarded and view.granted_at is not None:
                self.problems.append(f"{key[0]}: discarded, then granted at {view.granted_at}")
        for holder in granted:
            self.check_cap_at_grant(holder, granted)
            self.check_budget_at_grant(holder, granted)
            self.check_not_held_at_grant(holder)

    def check_grants_in_order(self, timeline: Timeline) -> None:
        """What the semaphore knew when it granted, from the order of its history: a signal recorded before the
        completion of the workflow task that sent a grant had been handed to that task or an earlier one.

        - No grant after a fleet hold notice had arrived, until a resume notice had.
        - No grant after impairments over the rule had arrived (the semaphore counts what arrived before any grant:
          "never a grant past the rule"): the latest report of each instance handed over since the last resume
          (one handed to the resume's own task is left out: it may have come first), within the window, against
          the highest threshold in force."""
        for task, grant in timeline.grants:
            where = f"grant to {grant.holder_workflow_id} at {grant.granted_at.isoformat()} (workflow task {task})"
            notices = [notice for at, notice in timeline.fleet if at <= task]
            if notices and notices[-1].held is not None:
                self.problems.append(f"{where}: the fleet's hold notice had arrived, and no resume")
            resumed = max((at for at in timeline.resumes if at <= task), default=0)
            window = max(group.impaired_window for group in self.in_force(grant.granted_at))
            known: dict[str, ImpairmentReport] = {}
            for at, report in timeline.reports:
                if resumed < at <= task and report.at >= grant.granted_at - window + timedelta(minutes=1):
                    known[report.instance_id] = report
            rules = [group.breaker_rule() for group in self.in_force(grant.granted_at)]
            threshold = max(rule.threshold(self.s.size) for rule in rules)
            outage = largest_outage([r.silent_since for r in known.values() if r.silent_since is not None])
            if len(known) > threshold or outage > max(rule.min_impaired for rule in rules):
                self.report.late_reports += 1
                self.problems.append(
                    f"{where}: {len(known)} impairments had arrived since the last resume (threshold "
                    f"{threshold:g}; {outage} heartbeat losses together), not yet counted"
                )

    def ending(self, holder: Holder) -> datetime | None:
        """No earlier than this the semaphore let the permit go (None: not before the example's end)."""
        assert holder.view is not None
        if holder.crashed_at is not None:
            return holder.crashed_at
        return holder.view.released_at

    def in_force(self, at: datetime) -> list[CapacityGroup]:
        """The configurations that may have been in force at `at`: the latest before it, and any made at that very
        millisecond (which of the two the semaphore saw is not known)."""
        before = [change.effective for change in self.changes if change.at < at]
        same = [change.effective for change in self.changes if change.at == at]
        return [before[-1] if before else self.group, *same]

    def check_cap_at_grant(self, holder: Holder, granted: Sequence[Holder]) -> None:
        assert holder.view is not None and holder.view.granted_at is not None
        at = holder.view.granted_at
        holding = [
            other
            for other in granted
            if other is not holder
            and other.view is not None
            and other.view.granted_at is not None
            and other.view.granted_at <= at
            and ((end := self.ending(other)) is None or end > at)
        ]
        cap = max(group.max_draining(self.s.size) for group in self.in_force(at))
        if len(holding) + 1 > cap:
            self.problems.append(
                f"{holder.handle.id} granted at {at.isoformat()} with {len(holding)} others holding "
                f"({', '.join(sorted(o.instance_id for o in holding))}): over the cap of {cap}"
            )

    def check_budget_at_grant(self, holder: Holder, granted: Sequence[Holder]) -> None:
        assert holder.view is not None and holder.view.granted_at is not None
        at = holder.view.granted_at
        budgets = [group.max_repairs_per_day for group in self.in_force(at)]
        if any(budget is None for budget in budgets):
            return
        budget = max(b for b in budgets if b is not None)
        since = at - REPAIR_BUDGET_PERIOD
        resumed = [record.at for record in self.resumes if record.at < at]
        if resumed:
            since = max(since, resumed[-1])
        day = [
            other
            for other in granted
            if other.view is not None and other.view.granted_at is not None and since < other.view.granted_at <= at
        ]
        if len(day) > budget:
            self.problems.append(
                f"{holder.handle.id} granted at {at.isoformat()}: {len(day)} grants within a day, over the budget "
                f"of {budget}"
            )

    def check_not_held_at_grant(self, holder: Holder) -> None:
        assert holder.view is not None and holder.view.granted_at is not None
        at = holder.view.granted_at
        for tripped_at, hold in self.holds.items():
            ended = next((r.at for r in self.resumes if r.held is not None and r.held.tripped_at == tripped_at), None)
            if tripped_at < at and (ended is None or at < ended):
                until = ended.isoformat() if ended else "the end"
                self.problems.append(
                    f"{holder.handle.id} granted at {at.isoformat()} while held ({hold.cause}, tripped at "
                    f"{tripped_at.isoformat()}, resumed at {until})"
                )

    def check_events(self) -> None:
        held_events = [e for e in self.stub.events if e.type.value == "RepairsHeld"]
        resumed_events = [e for e in self.stub.events if e.type.value == "RepairsResumed"]
        published = {BreakerHold.model_validate(e.detail).tripped_at for e in held_events}
        for tripped_at, hold in self.holds.items():
            if tripped_at not in published:
                self.problems.append(f"hold tripped at {tripped_at.isoformat()} ({hold.cause}): no RepairsHeld event")
            self.report.holds[hold.cause.value] = self.report.holds.get(hold.cause.value, 0) + 1
            self.check_hold_counts(hold)
        for event in held_events:
            hold = BreakerHold.model_validate(event.detail)
            self.holds.setdefault(hold.tripped_at, hold)
        if len(resumed_events) != len(self.resumes):
            self.problems.append(f"{len(self.resumes)} resumes, {len(resumed_events)} RepairsResumed events")
        for event, record in zip(resumed_events, self.resumes, strict=False):
            if event.detail.get("discard_held") != record.discard_held:
                self.problems.append(f"RepairsResumed at {event.time.isoformat()} says discard_held wrongly")
        self.report.resumes = len(self.resumes)

    def check_hold_counts(self, hold: BreakerHold) -> None:
        """A hold never counts more than was reported since the resume before it: an upper bound (the window is not
        applied, and every instance with any such report counts, whatever later reports replaced)."""
        resumed = [record.at for record in self.resumes if record.at <= hold.tripped_at]
        since = resumed[-1] - timedelta(seconds=1) if resumed else None
        reports = [r for r in self.reports if (since is None or r.at >= since) and r.at <= hold.tripped_at]
        impaired = {r.instance_id for r in reports}
        silent = {r.instance_id for r in reports if r.silent_since is not None}
        if hold.cause is HoldCause.IMPAIRED_PERCENT and not hold.threshold < hold.count <= len(impaired):
            self.problems.append(
                f"hold at {hold.tripped_at.isoformat()} counts {hold.count} impaired (threshold {hold.threshold:g}); "
                f"{len(impaired)} instances were reported since the last resume"
            )
        if hold.cause is HoldCause.MONITORING_OUTAGE and not hold.threshold < hold.count <= len(silent):
            self.problems.append(
                f"hold at {hold.tripped_at.isoformat()} counts an outage of {hold.count} (min_impaired "
                f"{hold.threshold:g}); {len(silent)} heartbeat losses were reported since the last resume"
            )


def largest_outage(silences: Sequence[datetime]) -> int:
    """The most silences that began within OUTAGE_SPREAD of one another (the breaker's outage rule)."""
    ordered = sorted(silences)
    best = start = 0
    for end in range(len(ordered)):
        while ordered[end] - ordered[start] > OUTAGE_SPREAD:
            start += 1
        best = max(best, end - start + 1)
    return best
