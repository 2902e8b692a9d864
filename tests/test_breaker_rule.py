"""The breaker's rule as plain code: what trips it, what a resume forgets, maintenance windows. The workflows that
carry it are tested in tests/test_breaker_property.py (time-skipping server) and tests/test_breaker.py (end to end)."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta

import pytest
from pydantic import ValidationError

from contract.breaker import (
    OUTAGE_SPREAD,
    BreakerRule,
    HoldCause,
    ImpairmentReport,
    MaintenanceWindow,
    Weekday,
    in_maintenance,
    next_maintenance,
)
from contract.groups import CapacityGroup, GroupConfigUpdate
from workflows.breaker import BreakerBook

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)  # a Tuesday
RULE = BreakerRule()  # 30%, more than 3, 30 min


def report(instance: str, at: datetime = NOW, silent_since: datetime | None = None) -> ImpairmentReport:
    return ImpairmentReport(instance_id=instance, group="g", at=at, silent_since=silent_since)


def book_with(count: int, at: datetime = NOW) -> BreakerBook:
    book = BreakerBook()
    for k in range(count):
        assert book.record(report(f"i-{k}", at), NOW, RULE.impaired_window)
    return book


@pytest.mark.parametrize(
    ("size", "trips_at"),
    [
        (20, 7),  # 30% of 20 is 6: strictly more trips
        (10, 4),  # 30% of 10 is 3, and min_impaired is 3
        (4, 4),  # a small group: min_impaired decides
        (100, 31),
        (1000, 301),
    ],
)
def test_trips_when_strictly_more_than_percent_and_min(size: int, trips_at: int) -> None:
    assert BreakerBook().trip_if_over(RULE, size, NOW, "g") is None
    under = book_with(trips_at - 1)
    assert under.trip_if_over(RULE, size, NOW, "g") is None
    over = book_with(trips_at)
    hold = over.trip_if_over(RULE, size, NOW, "group g")
    assert hold is not None and hold.cause is HoldCause.IMPAIRED_PERCENT
    assert (hold.count, hold.tripped_at, len(hold.instances)) == (trips_at, NOW, min(trips_at, 100))
    assert "group g" in hold.message and "IMPAIRED" in hold.message
    # Held: it never trips twice, and never resets by itself, however much time passes.
    assert over.trip_if_over(RULE, size, NOW + timedelta(days=3), "g") is None
    assert over.held is hold


def test_an_instance_impaired_twice_counts_once_and_old_ones_age_out() -> None:
    book = BreakerBook()
    for _ in range(5):
        book.record(report("i-same"), NOW, RULE.impaired_window)
    assert len(book.impaired) == 1
    old = NOW - RULE.impaired_window - timedelta(seconds=1)
    assert not book.record(report("i-old", old), NOW, RULE.impaired_window)
    book = book_with(4, at=NOW - timedelta(minutes=29))
    assert book.trip_if_over(RULE, 10, NOW + timedelta(minutes=2), "g") is None  # they left the window
    assert book.impaired == {}


def test_resume_forgets_what_tripped_it_and_counts_afresh() -> None:
    book = book_with(7)
    hold = book.trip_if_over(RULE, 20, NOW, "g")
    assert hold is not None
    later = NOW + timedelta(minutes=5)
    record = book.resume(later, "alice", discard_held=True)
    assert (record.by, record.discard_held, record.held, book.held) == ("alice", True, hold, None)
    # A late report of an impairment from before the resume does not count again.
    assert not book.record(report("i-late", NOW), later, RULE.impaired_window)
    assert book.trip_if_over(RULE, 20, later, "g") is None
    for k in range(7):
        book.record(report(f"j-{k}", later), later, RULE.impaired_window)
    assert book.trip_if_over(RULE, 20, later, "g") is not None


def test_heartbeat_losses_that_began_together_are_one_outage() -> None:
    rule = BreakerRule(max_impaired_percent=100)  # the percentage never trips here: only the outage rule can
    together = BreakerBook()
    for k in range(4):
        silent = NOW - timedelta(minutes=10) + k * (OUTAGE_SPREAD / 4)
        together.record(report(f"i-{k}", silent_since=silent), NOW, rule.impaired_window)
    hold = together.trip_if_over(rule, 1000, NOW, "g")
    assert hold is not None and hold.cause is HoldCause.MONITORING_OUTAGE and hold.count == 4
    assert "outage" in hold.message
    spread = BreakerBook()
    for k in range(4):
        silent = NOW - timedelta(minutes=10) + k * OUTAGE_SPREAD * 2
        spread.record(report(f"i-{k}", silent_since=silent), NOW, rule.impaired_window)
    assert spread.trip_if_over(rule, 1000, NOW, "g") is None  # apart: each is its own loss
    three = BreakerBook()
    for k in range(3):
        three.record(report(f"i-{k}", silent_since=NOW - timedelta(minutes=10)), NOW, rule.impaired_window)
    assert three.trip_if_over(rule, 1000, NOW, "g") is None  # not more than min_impaired


def test_the_repair_budget_holds_once_spent() -> None:
    book = BreakerBook()
    for k in range(3):
        book.granted(NOW + timedelta(minutes=k))
    assert book.trip_if_over(RULE, 100, NOW, "g", budget=4) is None
    book.granted(NOW + timedelta(minutes=5))
    hold = book.trip_if_over(RULE, 100, NOW + timedelta(minutes=6), "g", budget=4)
    assert hold is not None and hold.cause is HoldCause.REPAIR_BUDGET and "4 repairs a day" in hold.message
    # Grants older than a day leave the budget.
    aged = BreakerBook()
    for _ in range(4):
        aged.granted(NOW)
    assert aged.trip_if_over(RULE, 100, NOW + timedelta(days=1, seconds=1), "g", budget=4) is None


def test_replacements_faulting_soon_after_taking_over_are_counted_once_and_hold_at_the_rule() -> None:
    book, day = BreakerBook(), RULE.replacement_fault_window
    for k in range(4):
        book.took_over(f"r-{k}", NOW, day)
    # An instance that is no replacement, or one that faulted after the window, is no early fault.
    assert book.faulted_early(report("i-other", NOW + timedelta(hours=1)), day) is None
    assert book.faulted_early(report("r-3", NOW + day + timedelta(seconds=1)), day) is None
    first = book.faulted_early(report("r-0", NOW + timedelta(hours=2)), day)
    assert first is not None and (first.instance_id, first.took_over_at) == ("r-0", NOW)
    assert book.faulted_early(report("r-0", NOW + timedelta(hours=3)), day) is None  # counted once
    assert book.faulted_early(report("r-1", NOW + timedelta(hours=4)), day) is not None
    assert book.trip_if_over(RULE, 100, NOW + timedelta(hours=4), "g") is None  # 2 of 3
    assert book.faulted_early(report("r-2", NOW + timedelta(hours=5)), day) is not None
    hold = book.trip_if_over(RULE, 100, NOW + timedelta(hours=5), "group g")
    assert hold is not None and hold.cause is HoldCause.EARLY_REPLACEMENT_FAULTS
    assert (hold.count, hold.threshold, hold.window, hold.instances) == (3, 3.0, day, ["r-0", "r-1", "r-2"])
    assert hold.message.startswith("repairs of group g held: 3 replacements faulted within 24 h of taking over")


def test_early_faults_age_out_and_a_resume_counts_afresh() -> None:
    book, day = BreakerBook(), RULE.replacement_fault_window
    for k in range(3):
        book.took_over(f"r-{k}", NOW + timedelta(hours=k), day)
        assert book.faulted_early(report(f"r-{k}", NOW + timedelta(hours=k, minutes=5)), day) is not None
    # A day after the first fault, two remain within the window: no hold.
    assert book.trip_if_over(RULE, 100, NOW + day + timedelta(minutes=6), "g") is None
    assert book.trip_if_over(RULE, 100, NOW + timedelta(hours=3), "g") is not None
    book.resume(NOW + timedelta(hours=3), "ops", False)
    assert book.faulted_early_within(NOW + timedelta(hours=3), day) == []
    assert book.trip_if_over(RULE, 100, NOW + timedelta(hours=3), "g") is None
    # A fault from before the resume, delivered after it, is not counted again.
    book.took_over("r-9", NOW, day)
    assert book.faulted_early(report("r-9", NOW + timedelta(hours=2)), day) is None


def test_a_replacement_is_remembered_only_for_the_window() -> None:
    book, day = BreakerBook(), RULE.replacement_fault_window
    book.took_over("r-old", NOW, day)
    book.took_over("r-new", NOW + day + timedelta(seconds=1), day)
    assert set(book.replacements) == {"r-new"}


def test_the_fleet_rule_trips_only_across_groups() -> None:
    rule = BreakerRule(min_impaired=5)
    one_group = book_with(7)
    assert one_group.trip_if_over(rule, 20, NOW, "fleet", groups_at_least=2) is None  # the group's own breaker's
    spread = BreakerBook()
    for k in range(7):
        spread.record(ImpairmentReport(instance_id=f"i-{k}", group=f"g{k % 3}", at=NOW), NOW, rule.impaired_window)
    hold = spread.trip_if_over(rule, 20, NOW, "the whole fleet", groups_at_least=2)
    assert hold is not None and hold.count == 7 and "the whole fleet" in hold.message


def test_the_book_stays_bounded() -> None:
    book = BreakerBook()
    for k in range(25_000):
        book.record(report(f"i-{k}", NOW + timedelta(microseconds=k)), NOW + timedelta(seconds=1), timedelta(hours=1))
    assert 18_000 <= len(book.impaired) <= 20_000
    assert "i-24999" in book.impaired and "i-0" not in book.impaired  # the newest are kept


def test_maintenance_windows() -> None:
    nights = MaintenanceWindow(days=[Weekday.SAT, Weekday.SUN], start=time(22), end=time(4))
    saturday_23 = datetime(2026, 12, 5, 23, 0, tzinfo=UTC)
    assert nights.contains(saturday_23)
    assert nights.contains(saturday_23 + timedelta(hours=4))  # Sunday 03:00, the window that began Saturday
    assert nights.contains(datetime(2026, 12, 7, 3, 0, tzinfo=UTC))  # Monday 03:00: Sunday's window
    assert not nights.contains(datetime(2026, 12, 7, 22, 30, tzinfo=UTC))  # Monday night: not a window day
    assert not nights.contains(NOW)
    assert nights.next_start(NOW) == datetime(2026, 12, 5, 22, 0, tzinfo=UTC)
    assert in_maintenance([], NOW) and next_maintenance([], NOW) is None
    daily = MaintenanceWindow(start=time(13), end=time(14))
    assert next_maintenance([nights, daily], NOW) == datetime(2026, 12, 1, 13, 0, tzinfo=UTC)
    with pytest.raises(ValidationError, match="empty"):
        MaintenanceWindow(start=time(1), end=time(1))


def test_group_settings_and_live_updates_validate_the_breaker() -> None:
    group = CapacityGroup(name="g", cluster="c")
    assert (group.max_impaired_percent, group.min_impaired, group.impaired_window) == (30, 3, timedelta(minutes=30))
    assert group.breaker_rule() == RULE
    assert GroupConfigUpdate(resume=True).problems() == []
    discard_alone = GroupConfigUpdate(discard_held=True).problems()
    assert discard_alone[0].startswith("nothing to change: give auto_repair")
    assert discard_alone[1] == "discard_held goes with resume: --resume --discard-held"
    problems = GroupConfigUpdate(max_impaired_percent=0, impaired_window=timedelta(days=8), max_repairs_per_day=0)
    assert [p.split(" ")[0] for p in problems.problems()] == [
        "max_impaired_percent",
        "impaired_window",
        "max_repairs_per_day",
    ]
