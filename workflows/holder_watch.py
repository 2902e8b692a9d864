"""How often the drain semaphore looks again at what no signal tells it: permit holders whose repairs may have closed
without a release, and instances out of service that may come back. A plain decision, no Temporal."""

from __future__ import annotations

from datetime import timedelta

# While no repair waits for a permit, holders are looked at this many reclaim intervals apart: 15 minutes at the
# default minute, so a repair that boots its replacement in 10 and lets its tasks stop in 2 releases its permit before
# the first look (each a timer and an activity, 2 billed actions). A stale permit (a repair terminated by an operator)
# nobody waits behind is reclaimed within that; once a repair waits, within a reclaim interval.
IDLE_HOLDER_LOOKS = 15


def next_look(*, holders: int, waiters: int, out_of_service: int, reclaim_interval: timedelta) -> timedelta | None:
    """The wait before the next look; None when nothing needs one. Each look is a timer and an activity, both billed
    actions: a permit that nobody waits for costs nothing while it is held a little longer."""
    if waiters and (holders or out_of_service):
        return reclaim_interval
    if holders:
        return reclaim_interval * IDLE_HOLDER_LOOKS
    return None
