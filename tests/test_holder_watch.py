"""When the drain semaphore looks again at holders and instances out of service (workflows/holder_watch.py)."""

from __future__ import annotations

from datetime import timedelta

from workflows.holder_watch import next_look

MINUTE = timedelta(minutes=1)


def test_a_waiting_repair_has_holders_and_out_of_service_instances_looked_at_every_reclaim_interval() -> None:
    assert next_look(holders=3, waiters=1, out_of_service=0, reclaim_interval=MINUTE) == MINUTE
    assert next_look(holders=0, waiters=2, out_of_service=1, reclaim_interval=MINUTE) == MINUTE


def test_holders_nobody_waits_behind_are_looked_at_fifteen_times_less_often() -> None:
    assert next_look(holders=1, waiters=0, out_of_service=0, reclaim_interval=MINUTE) == 15 * MINUTE
    assert next_look(holders=1, waiters=0, out_of_service=4, reclaim_interval=MINUTE) == 15 * MINUTE


def test_nothing_held_and_nobody_waiting_sets_no_timer() -> None:
    assert next_look(holders=0, waiters=0, out_of_service=5, reclaim_interval=MINUTE) is None
    # Waiters alone (no room is taken by anyone): nothing to look at; a signal wakes the semaphore.
    assert next_look(holders=0, waiters=3, out_of_service=0, reclaim_interval=MINUTE) is None
