"""The blast-radius breaker: when too many instances of a group (or of the fleet) became IMPAIRED within a window,
no new drain permits are granted until an operator has looked and resumed.

A bad driver roll-out, a kernel-log format change or a monitoring outage looks exactly like many instances failing
at once; replacing them all is the worst thing this system could do on scarce GPU capacity. Karpenter (20% of a
NodePool), EKS (maxUnhealthyNodeThreshold) and NVSentinel (a breaker that stays tripped until a human resets it)
hold for the same reason.
"""

from __future__ import annotations

from datetime import datetime, time, timedelta
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from contract.config import SettingsSection
from contract.limits import Id, Name, Text, Timestamp

MIN_IMPAIRED_PERCENT, MAX_IMPAIRED_PERCENT = 1, 100
ImpairedPercent = Annotated[int, Field(ge=MIN_IMPAIRED_PERCENT, le=MAX_IMPAIRED_PERCENT)]
MinImpaired = Annotated[int, Field(ge=0, le=100_000)]
MAX_IMPAIRED_WINDOW = timedelta(days=7)
# Heartbeat losses whose silences began this close together are one event (a monitoring outage, a network
# partition), not that many failing instances.
OUTAGE_SPREAD = timedelta(seconds=30)
# What a hold names (the RepairsHeld event, the details in the Web UI): bounded like every carried list.
MAX_NAMED_INSTANCES = 100
REPAIR_BUDGET_PERIOD = timedelta(days=1)
MAX_REPAIRS_PER_DAY = 10_000


class HoldCause(StrEnum):
    IMPAIRED_PERCENT = "impaired_percent"  # more than max_impaired_percent became IMPAIRED within the window
    MONITORING_OUTAGE = "monitoring_outage"  # heartbeat losses that began together: one outage, not N faults
    REPAIR_BUDGET = "repair_budget"  # max_repairs_per_day reached
    FLEET = "fleet"  # the fleet-wide breaker holds every group
    # replacement_faults_to_hold replacements faulted within replacement_fault_window of taking over: a bad capacity
    # pool (a bad batch of hosts, a broken AMI) that replacing only feeds
    EARLY_REPLACEMENT_FAULTS = "early_replacement_faults"


class Weekday(StrEnum):
    MON = "Mon"
    TUE = "Tue"
    WED = "Wed"
    THU = "Thu"
    FRI = "Fri"
    SAT = "Sat"
    SUN = "Sun"


WEEK = list(Weekday)


class MaintenanceWindow(SettingsSection):
    """A weekly window, in UTC, in which any repair may run; outside every window only critical ones do. `end`
    before `start` wraps past midnight into the next day."""

    days: list[Weekday] = Field(default_factory=lambda: list(WEEK), min_length=1, max_length=7)
    start: time
    end: time

    @model_validator(mode="after")
    def _not_empty(self) -> MaintenanceWindow:
        if self.start == self.end:
            raise ValueError(f"maintenance window {self.start}-{self.end} is empty: give an end other than its start")
        return self

    def contains(self, at: datetime) -> bool:
        day = WEEK[at.weekday()]
        now = at.time().replace(tzinfo=None)
        if self.start < self.end:
            return day in self.days and self.start <= now < self.end
        yesterday = WEEK[(at.weekday() - 1) % 7]
        return (day in self.days and now >= self.start) or (yesterday in self.days and now < self.end)

    def next_start(self, after: datetime) -> datetime:
        """The first start of this window strictly after `after` (UTC)."""
        midnight = after.replace(hour=0, minute=0, second=0, microsecond=0)
        for offset in range(8):
            day = midnight + timedelta(days=offset)
            at = day.replace(hour=self.start.hour, minute=self.start.minute, second=self.start.second)
            if at > after and WEEK[day.weekday()] in self.days:
                return at
        raise AssertionError("a window with at least one day starts within 8 days")


def in_maintenance(windows: list[MaintenanceWindow], at: datetime) -> bool:
    """No windows configured means any time is fine."""
    return not windows or any(w.contains(at) for w in windows)


def next_maintenance(windows: list[MaintenanceWindow], after: datetime) -> datetime | None:
    return min((w.next_start(after) for w in windows), default=None)


class BreakerRule(BaseModel):
    """One breaker's thresholds: a group's (from its settings) or the fleet's."""

    max_impaired_percent: ImpairedPercent = 30
    min_impaired: MinImpaired = 3
    impaired_window: timedelta = timedelta(minutes=30)
    # A group's replacements (the fleet breaker launches none): this many that fault within the window of taking over
    # hold the group's repairs.
    replacement_fault_window: timedelta = timedelta(days=1)
    replacement_faults_to_hold: int = Field(default=3, ge=1)

    def threshold(self, size: int) -> float:
        """Trip when strictly more than this many became IMPAIRED within the window."""
        return max(float(self.min_impaired), size * self.max_impaired_percent / 100)


class FleetBreakerSettings(SettingsSection):
    """`[fleet_breaker]`: the same rule across every group of the worker's settings, since a driver roll-out hits
    every group at once."""

    max_impaired_percent: ImpairedPercent = 30
    min_impaired: MinImpaired = 5
    impaired_window: timedelta = timedelta(minutes=30)

    def rule(self) -> BreakerRule:
        return BreakerRule.model_validate(self.model_dump())


class ImpairmentReport(BaseModel):
    """The `impaired` signal: a health workflow tells its group's semaphore that its instance became IMPAIRED (auto
    repair ENABLED or not); the semaphore passes it on to the fleet breaker with the group's size."""

    instance_id: Id
    group: Id
    at: Timestamp
    reason: Name = ""
    # Heartbeat loss: when the silence began (the tracker's last receipt), to recognise a monitoring outage.
    silent_since: Timestamp | None = None
    group_size: int = Field(default=0, ge=0, le=10_000_000)


class BreakerHold(BaseModel):
    """Why repairs are held: what tripped, when, by how much. Stays until an operator resumes."""

    cause: HoldCause
    message: Text
    tripped_at: Timestamp
    count: int
    threshold: float
    window: timedelta
    instances: list[Id] = Field(default_factory=list, max_length=MAX_NAMED_INSTANCES)


class ResumeRecord(BaseModel):
    at: Timestamp
    by: Name = ""
    discard_held: bool = False
    held: BreakerHold | None = None  # the hold it ended


class BreakerView(BaseModel):
    """A breaker as `group describe`, the health API and the Web UI show it."""

    held: BreakerHold | None = None
    fleet_held: BreakerHold | None = None
    impaired_in_window: int = 0
    threshold: float = 0.0
    window: timedelta = timedelta(minutes=30)
    counted_since: Timestamp | None = None
    repairs_today: int = 0
    max_repairs_per_day: int | None = None
    # Replacements that faulted within replacement_fault_window of taking over, counted since the last resume.
    replacements_faulted_early: int = 0
    in_maintenance_window: bool = True
    next_maintenance_window: Timestamp | None = None
    last_resume: ResumeRecord | None = None


class FleetResume(BaseModel):
    """`autorepair fleet resume`: the fleet breaker's update."""

    discard_held: bool = False
    requested_by: Name = ""


class FleetBreakerView(BaseModel):
    held: BreakerHold | None = None
    impaired_in_window: int = 0
    threshold: float = 0.0
    fleet_size: int = 0
    groups: dict[str, int] = Field(default_factory=dict)  # group -> its size, as its semaphore last said
    last_resume: ResumeRecord | None = None


class HoldNotice(BaseModel):
    """The fleet breaker tells each group's semaphore that it holds (or resumed, and whether to discard)."""

    held: BreakerHold | None = None
    discard_held: bool = False
    by: Name = ""


def named(instances: list[str]) -> list[str]:
    return sorted(instances)[:MAX_NAMED_INSTANCES]


def hold_message(cause: HoldCause, scope: str, count: int, threshold: float, window: timedelta) -> str:
    minutes = window.total_seconds() / 60
    if cause is HoldCause.MONITORING_OUTAGE:
        return (
            f"repairs of {scope} held: {count} instances lost their heartbeats within {OUTAGE_SPREAD.seconds}s of "
            "each other, which looks like one monitoring or network outage, not that many failures"
        )
    if cause is HoldCause.REPAIR_BUDGET:
        return f"repairs of {scope} held: the budget of {int(threshold)} repairs a day is spent"
    if cause is HoldCause.EARLY_REPLACEMENT_FAULTS:
        return (
            f"repairs of {scope} held: {count} replacements faulted within {minutes / 60:g} h of taking over "
            f"(replacement_faults_to_hold {int(threshold)}): the capacity they come from may be bad, and replacing "
            "from it again would make things worse"
        )
    return (
        f"repairs of {scope} held: {count} instances became IMPAIRED within {minutes:g} min, more than "
        f"{threshold:g} (the breaker's threshold)"
    )


class FleetBreakerConfig(BaseModel):
    """What the fleet breaker reads from the worker's settings: its rule and the groups it speaks for."""

    rule: BreakerRule = Field(default_factory=BreakerRule)
    groups: list[Id] = Field(default_factory=list)


class FleetBreakerInput(BaseModel):
    """What starts the fleet breaker; its carried state is the workflow's own (workflows.models)."""


class FleetHoldQuery(BaseModel):
    group: Id


class FleetHoldAnswer(BaseModel):
    held: BreakerHold | None = None
