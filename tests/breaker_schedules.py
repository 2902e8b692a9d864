"""The schedules of tests/test_breaker_property.py: the steps an example applies to one capacity group, and the
hypothesis strategy that draws them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from hypothesis import strategies as st

MAX_GROUP = 200
MAX_STEPS = 8
# A holder's permit is checked every reclaim interval while it holds (1 minute by default): long enough here that a
# day's skip wakes the semaphore 50 times, not 1,440, and short enough that a 31-minute skip reclaims a crashed
# repair's permit.
RECLAIM_INTERVAL = timedelta(minutes=30)
# Time skips: seconds, minutes (short of the reclaim interval), past the reclaim interval and the breaker's 30-minute
# window, past the repair budget's day.
SKIPS = (10, 21 * 60, 31 * 60, 25 * 3600)


@dataclass(frozen=True)
class Impair:
    """`share` percent of the group (rounded up) becomes IMPAIRED now, from instance `start` on; with `outage`, as
    heartbeat losses whose silences began within seconds of each other."""

    share: int
    start: int
    outage: bool
    settle: bool = True


@dataclass(frozen=True)
class Request:
    """Stub repairs start for `count` instances from `start` on (those without a running repair) and ask for a
    permit."""

    count: int
    start: int
    settle: bool = True


@dataclass(frozen=True)
class Finish:
    """`count` running repairs from `start` on (in start order) finish: each releases its permit (or its place in
    line) and completes."""

    count: int
    start: int
    settle: bool = True


@dataclass(frozen=True)
class Crash:
    """`count` running repairs are terminated without a release: the semaphore must reclaim their permits. Always
    at rest (Example.quiet says why)."""

    count: int
    start: int
    settle: bool = True


@dataclass(frozen=True)
class Skip:
    seconds: int
    settle: bool = True


@dataclass(frozen=True)
class SetCap:
    percent: int
    settle: bool = True


@dataclass(frozen=True)
class SetBreaker:
    percent: int
    min_impaired: int
    settle: bool = True


@dataclass(frozen=True)
class SetBudget:
    per_day: int
    settle: bool = True


@dataclass(frozen=True)
class Reset:
    settle: bool = True


@dataclass(frozen=True)
class Pause:
    """Real seconds without a step: lets a pinned schedule put its next step in the middle of the semaphore's work.
    Never drawn (the drawn schedules get there by not settling, and by the activities' latency)."""

    seconds: float
    settle: bool = False


@dataclass(frozen=True)
class FleetHold:
    """The fleet breaker tells the semaphore that it holds every group (its HoldNotice)."""

    settle: bool = True


@dataclass(frozen=True)
class FleetResume:
    """The fleet breaker, holding, tells the semaphore it resumed, with or without --discard-held (at rest first, as
    Resume). Nothing is sent when the fleet breaker does not hold: it never sends a resume then."""

    discard: bool


@dataclass(frozen=True)
class Resume:
    """Always settles afterwards (the resume's exact time is read from the semaphore then); with `discard` also
    before (which repairs wait, and must all be let go, is only known at rest)."""

    discard: bool


@dataclass(frozen=True)
class Restart:
    """Both workers shut down and start afresh: sticky caches dropped, every history replayed. Always at rest."""


Step = (
    Impair
    | Request
    | Finish
    | Crash
    | Skip
    | SetCap
    | SetBreaker
    | SetBudget
    | Reset
    | Resume
    | Restart
    | FleetHold
    | FleetResume
    | Pause
)


@dataclass(frozen=True)
class Schedule:
    size: int
    draining_percent: int
    steps: tuple[Step, ...]
    # Seconds a stubbed activity takes, by name (the real ones call ECS, EC2 and Temporal, in tens or hundreds of
    # milliseconds): a quarter of the drawn schedules look the group and its repairs up in 50 ms, so that steps
    # that do not wait land in the middle of a grant pass; a pinned race takes longer, to be certain.
    latency: tuple[tuple[str, float], ...] = ()


def schedules(max_steps: int = MAX_STEPS) -> st.SearchStrategy[Schedule]:
    # Mostly settled, so that the checks at rest apply; now and then the next step lands while the semaphore works.
    settle = st.sampled_from([True, True, True, False])
    index = st.integers(0, MAX_GROUP - 1)
    # Impairments of up to 45% of the group at once: over the default 30% in one step, or in two; every one costs
    # the semaphore an activity (its report to the fleet breaker), so a whole group of 200 would only be slower.
    kinds: dict[str, tuple[int, st.SearchStrategy[Step]]] = {
        # kind: (weight, steps); faults, repairs and resumes are what the properties are about.
        "impair": (4, st.builds(Impair, st.integers(1, 45), index, st.booleans(), settle)),
        "request": (4, st.builds(Request, st.integers(1, 10), index, settle)),
        "finish": (3, st.builds(Finish, st.integers(1, 8), index, settle)),
        "resume": (3, st.builds(Resume, st.booleans())),
        "skip": (1, st.builds(Skip, st.sampled_from(SKIPS), settle)),
        "cap": (1, st.builds(SetCap, st.integers(1, 100), settle)),
        "breaker": (1, st.builds(SetBreaker, st.integers(1, 100), st.integers(0, 10), settle)),
        "budget": (1, st.builds(SetBudget, st.integers(1, 20), settle)),
        "crash": (1, st.builds(Crash, st.integers(1, 3), index, settle)),
        "reset": (1, st.builds(Reset, settle)),
        "restart": (1, st.just(Restart())),
        "fleet hold": (1, st.builds(FleetHold, settle)),
        "fleet resume": (1, st.builds(FleetResume, st.booleans())),
    }
    # one_of would treat repeated branches as one: weigh by repeating the kind's name instead.
    step = st.sampled_from([kind for kind, (weight, _) in kinds.items() for _ in range(weight)]).flatmap(
        lambda kind: kinds[kind][1]
    )
    lookups = (("describe_group_capacity", 0.05), ("find_running_repairs", 0.05))
    return st.builds(
        Schedule,
        st.integers(1, MAX_GROUP),
        st.integers(1, 100),
        st.lists(step, min_size=1, max_size=max_steps).map(tuple),
        st.sampled_from([(), (), (), lookups]),
    )
