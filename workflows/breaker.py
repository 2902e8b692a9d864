"""The breaker's book: which instances became IMPAIRED within the window, whether that trips, and what a resume
forgets. Plain deterministic code over carried state, shared by a group's semaphore and the fleet breaker.

The rule (docs/operations.md, "The breaker"): it trips when strictly more than max(min_impaired, n x percent / 100)
instances of n became IMPAIRED within the window, or when more than min_impaired heartbeat losses began within
OUTAGE_SPREAD of each other (one outage, whatever the percentage), or when the day's repair budget is spent. It
never resets by itself; a resume counts afresh from that moment, so the impairments that tripped it do not trip it
again.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import BaseModel, Field

from contract.breaker import (
    OUTAGE_SPREAD,
    REPAIR_BUDGET_PERIOD,
    BreakerHold,
    BreakerRule,
    HoldCause,
    ImpairmentReport,
    ResumeRecord,
    hold_message,
    named,
)

# An impairment is remembered for the window only; this bounds the book even under a flood of reports.
MAX_IMPAIRMENTS = 20_000
MAX_GRANTS_REMEMBERED = 10_000
# Far above any replacement_faults_to_hold: the rest would only weigh on the semaphore's carried state.
MAX_EARLY_FAULTS = 1_000


class Impairment(BaseModel):
    at: datetime
    group: str = ""
    silent_since: datetime | None = None


class EarlyFault(BaseModel):
    """A replacement that became IMPAIRED within replacement_fault_window of taking over from a repaired instance."""

    instance_id: str
    took_over_at: datetime
    faulted_at: datetime
    reason: str = ""


class BreakerBook(BaseModel):
    """Carried across continue-as-new. One entry per instance: an instance impaired twice in a window is one."""

    impaired: dict[str, Impairment] = Field(default_factory=dict)
    counted_since: datetime | None = None
    held: BreakerHold | None = None
    grants: list[datetime] = Field(default_factory=list)  # permits granted within the budget period
    last_resume: ResumeRecord | None = None
    # A group's replacements, by when each took over (its repair completed), within replacement_fault_window; and those
    # of them that faulted within it, since the last resume.
    replacements: dict[str, datetime] = Field(default_factory=dict)
    early_faults: list[EarlyFault] = Field(default_factory=list)

    def took_over(self, instance_id: str, at: datetime, window: timedelta) -> None:
        self.replacements[instance_id] = at
        self.replacements = {i: t for i, t in self.replacements.items() if t > at - window}
        if len(self.replacements) > MAX_IMPAIRMENTS:
            newest = sorted(self.replacements, key=lambda i: self.replacements[i])[-MAX_IMPAIRMENTS * 9 // 10 :]
            self.replacements = {i: self.replacements[i] for i in newest}

    def faulted_early(self, report: ImpairmentReport, window: timedelta) -> EarlyFault | None:
        """The report's instance is a replacement that faulted within `window` of taking over: counted once (None:
        it is not, or was counted already, or before the last resume)."""
        took_over = self.replacements.get(report.instance_id)
        if took_over is None or not took_over <= report.at <= took_over + window:
            return None
        if self.counted_since is not None and report.at < self.counted_since:
            return None
        if any(f.instance_id == report.instance_id for f in self.early_faults):
            return None
        fault = EarlyFault(
            instance_id=report.instance_id, took_over_at=took_over, faulted_at=report.at, reason=report.reason
        )
        recent = [f for f in self.early_faults if f.faulted_at > report.at - window]
        self.early_faults = [*recent, fault][-MAX_EARLY_FAULTS:]
        return fault

    def faulted_early_within(self, now: datetime, window: timedelta) -> list[EarlyFault]:
        return [f for f in self.early_faults if f.faulted_at > now - window]

    def record(self, report: ImpairmentReport, now: datetime, window: timedelta) -> bool:
        """Count an impairment; False when it is outside what counts (before the last resume, or older than the
        window)."""
        at = min(report.at, now)
        if (self.counted_since is not None and at < self.counted_since) or at < now - window:
            return False
        previous = self.impaired.get(report.instance_id)
        if previous is not None and previous.at >= at:
            return False
        self.impaired[report.instance_id] = Impairment(at=at, group=report.group, silent_since=report.silent_since)
        if len(self.impaired) > MAX_IMPAIRMENTS:
            self.forget_old(now, window)
        return True

    def forget_old(self, now: datetime, window: timedelta) -> None:
        since = now - window
        if self.counted_since is not None:
            since = max(since, self.counted_since)
        self.impaired = {i: seen for i, seen in self.impaired.items() if seen.at >= since}
        if len(self.impaired) > MAX_IMPAIRMENTS:
            # A flood: keep the newest nine tenths at once, so that a stream of reports costs one sort per tenth.
            newest = sorted(self.impaired, key=lambda i: self.impaired[i].at)[-MAX_IMPAIRMENTS * 9 // 10 :]
            self.impaired = {i: self.impaired[i] for i in newest}
        self.grants = [g for g in self.grants if g > now - REPAIR_BUDGET_PERIOD][-MAX_GRANTS_REMEMBERED:]

    def trip_if_over(
        self,
        rule: BreakerRule,
        size: int,
        now: datetime,
        scope: str,
        budget: int | None = None,
        *,
        groups_at_least: int = 1,
    ) -> BreakerHold | None:
        """Trip (and return the new hold) when the book is over the rule; None when it is not, or already held.
        `groups_at_least`: the fleet breaker trips only on impairments across groups (one group's surge is its own
        breaker's, and a second hold that only `fleet resume` lifts would be a trap)."""
        if self.held is not None:
            return None
        self.forget_old(now, rule.impaired_window)
        count, threshold = len(self.impaired), rule.threshold(size)
        early = self.faulted_early_within(now, rule.replacement_fault_window)
        across = len({seen.group for seen in self.impaired.values()}) >= groups_at_least
        cause: HoldCause | None = None
        if across and count > threshold:
            cause = HoldCause.IMPAIRED_PERCENT
        elif across and (together := self._largest_outage()) and len(together) > rule.min_impaired:
            cause, count, threshold = HoldCause.MONITORING_OUTAGE, len(together), float(rule.min_impaired)
        elif budget is not None and len(self.grants) >= budget:
            cause, count, threshold = HoldCause.REPAIR_BUDGET, len(self.grants), float(budget)
        elif len(early) >= rule.replacement_faults_to_hold:
            cause, count, threshold = (
                HoldCause.EARLY_REPLACEMENT_FAULTS,
                len(early),
                float(rule.replacement_faults_to_hold),
            )
        if cause is None:
            return None
        early_hold = cause is HoldCause.EARLY_REPLACEMENT_FAULTS
        window = rule.replacement_fault_window if early_hold else rule.impaired_window
        self.held = BreakerHold(
            cause=cause,
            message=hold_message(cause, scope, count, threshold, window),
            tripped_at=now,
            count=count,
            threshold=threshold,
            window=window,
            instances=named([f.instance_id for f in early] if early_hold else list(self.impaired)),
        )
        return self.held

    def _largest_outage(self) -> list[str]:
        """The most heartbeat losses whose silences began within OUTAGE_SPREAD of one another."""
        losses = sorted(
            (seen.silent_since, instance) for instance, seen in self.impaired.items() if seen.silent_since is not None
        )
        best: list[str] = []
        start = 0
        for end in range(len(losses)):
            while losses[end][0] - losses[start][0] > OUTAGE_SPREAD:
                start += 1
            if end - start + 1 > len(best):
                best = [instance for _, instance in losses[start : end + 1]]
        return best

    def granted(self, now: datetime) -> None:
        self.grants.append(now)
        self.grants = self.grants[-MAX_GRANTS_REMEMBERED:]

    def resume(self, now: datetime, by: str, discard_held: bool) -> ResumeRecord:
        """Clear the hold and count afresh from now: what tripped it is forgotten, not replayed."""
        record = ResumeRecord(at=now, by=by, discard_held=discard_held, held=self.held)
        self.held = None
        self.counted_since = now
        self.impaired = {}
        self.grants = []
        self.early_faults = []
        self.last_resume = record
        return record
