"""How often a repair waiting for its replacement asks ECS (activities/fleet.py's poll_cap): rarely enough that a
surge of waiting repairs stays under ECS's cluster-read rate, often enough that a registered replacement is soon
seen."""

from __future__ import annotations

from datetime import timedelta

from activities.fleet import poll_cap

FIRST = timedelta(seconds=2)


def test_at_the_default_twenty_minutes_polls_grow_to_thirty_seconds() -> None:
    assert poll_cap(timedelta(minutes=20), FIRST) == timedelta(seconds=30)
    # 200 repairs waiting at once ask ECS fewer than 7 times a second, under its published 20/s.
    assert 200 / poll_cap(timedelta(minutes=20), FIRST).total_seconds() < 7


def test_a_short_wait_polls_at_a_fortieth_of_it() -> None:
    assert poll_cap(timedelta(minutes=10), FIRST) == timedelta(seconds=15)


def test_the_first_interval_is_the_floor() -> None:
    # The demo's 60 s wait: a fortieth is 1.5 s, under the first interval, so it polls every 2 s throughout.
    assert poll_cap(timedelta(seconds=60), FIRST) == FIRST
