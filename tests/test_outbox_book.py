"""The event outbox's decisions (workflows/outbox_book.py), on the plain model with a fake clock: what is sent next,
when a failed sink is tried again, what is given up on and why, and what a continue-as-new carries."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from contract.event_outbox import (
    DELIVERY_BATCH,
    FIRST_BACKOFF,
    MAX_BACKOFF,
    MAX_WAITING_BYTES,
    Failure,
    OutboxEntry,
    OutboxRun,
    Sink,
    SinkTarget,
)
from workflows.outbox_book import Bury, Empty, OutboxBook, Send, WaitUntil

T0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
BUS = SinkTarget(sink=Sink.EVENTBRIDGE, region="us-east-1", bus_name="gpu-autorepair", source="gpu-autorepair")
DOWN = Failure(error="events:PutEvents on event bus gpu-autorepair failed: ThrottlingException")


def entry(n: int, at: datetime = T0, why: Failure | None = DOWN, padding: int = 0) -> OutboxEntry:
    return OutboxEntry(
        event_id=f"evt-{n:04d}",
        queued_at=at,
        time=at,
        detail_type="gpu-autorepair Repair Step",
        event={"event_id": f"evt-{n:04d}", "type": "Draining", "step": n, "pad": "x" * padding},
        why=why,
    )


def book(max_events: int = 1_000, deadline: timedelta = timedelta(hours=24)) -> OutboxBook:
    return OutboxBook(OutboxRun(target=BUS, max_events=max_events, deadline=deadline))


def ids(step: Send | Bury) -> list[str]:
    if isinstance(step, Send):
        return [e.event_id for e in step.entries]
    return [letter.entry.event_id for letter in step.letters]


def test_an_empty_outbox_has_nothing_to_do() -> None:
    assert book().next_step(T0) == Empty()


def test_events_go_oldest_first_a_batch_at_a_time_and_leave_once_taken() -> None:
    b = book()
    for n in range(DELIVERY_BATCH + 3):
        assert b.add(entry(n), T0)
    step = b.next_step(T0)
    assert isinstance(step, Send) and ids(step) == [f"evt-{n:04d}" for n in range(DELIVERY_BATCH)]
    b.sent(DELIVERY_BATCH, None, T0)
    step = b.next_step(T0)
    assert isinstance(step, Send) and ids(step) == [f"evt-{n:04d}" for n in range(DELIVERY_BATCH, DELIVERY_BATCH + 3)]
    b.sent(3, None, T0)
    assert b.next_step(T0) == Empty() and b.is_idle() and b.delivered == DELIVERY_BATCH + 3


def test_a_failed_try_waits_doubling_to_the_cap_and_starts_again_from_the_oldest() -> None:
    b = book(deadline=timedelta(days=7))
    for n in range(3):
        b.add(entry(n), T0)
    now, waits = T0, []
    for _ in range(12):
        step = b.next_step(now)
        assert isinstance(step, Send) and ids(step)[0] == "evt-0000"
        b.sent(0, DOWN, now)
        wait = b.next_step(now)
        assert isinstance(wait, WaitUntil)
        waits.append(wait.at - now)
        now = wait.at
    assert waits[:4] == [FIRST_BACKOFF, FIRST_BACKOFF * 2, FIRST_BACKOFF * 4, FIRST_BACKOFF * 8]
    assert waits[-1] == MAX_BACKOFF and max(waits) == MAX_BACKOFF
    # Part of a batch taken before the sink failed: those leave, the rest wait, and success resets the backoff.
    b.sent(1, DOWN, now)
    assert b.waiting() == 2 and b.last_error == DOWN
    later = b.next_step(now)
    assert isinstance(later, WaitUntil)
    b.sent(2, None, later.at)
    b.add(entry(9), later.at)
    b.sent(0, DOWN, later.at)
    assert b.next_step(later.at) == WaitUntil(later.at + FIRST_BACKOFF)


def test_an_event_past_the_deadline_is_dead_lettered_with_the_last_error_then_no_more() -> None:
    b = book(deadline=timedelta(minutes=10))
    b.add(entry(0, T0), T0)
    b.add(entry(1, T0 + timedelta(minutes=5)), T0 + timedelta(minutes=5))
    for _ in range(9):  # the backoff grows to minutes
        b.sent(0, DOWN, T0)
    nine = T0 + timedelta(minutes=9)
    b.sent(0, DOWN, nine)
    # The wait never outlasts the oldest event's deadline.
    assert b.next_step(nine) == WaitUntil(T0 + timedelta(minutes=10))
    step = b.next_step(T0 + timedelta(minutes=10))
    assert isinstance(step, Bury) and ids(step) == ["evt-0000"]
    [letter] = step.letters
    assert letter.reason == "deadline" and letter.error == DOWN.error
    b.buried(step.letters)
    assert b.dead_lettered == 1 and b.view().dead_letters == [letter]
    assert not isinstance(b.next_step(T0 + timedelta(minutes=10)), Bury)
    assert b.waiting() == 1


def test_a_rejected_event_is_dead_lettered_at_once_and_does_not_block_the_rest() -> None:
    b = book()
    rejected = Failure(error="MalformedDetail", kind="rejected")
    b.add(entry(0, why=rejected), T0)  # publish_event's own try was rejected
    b.add(entry(1), T0)
    b.add(entry(2), T0)
    step = b.next_step(T0)
    assert isinstance(step, Bury) and ids(step) == ["evt-0000"] and step.letters[0].reason == "rejected"
    b.buried(step.letters)
    step = b.next_step(T0)
    assert isinstance(step, Send) and ids(step) == ["evt-0001", "evt-0002"]
    b.sent(0, rejected, T0)  # the outbox's try: the head is rejected too
    step = b.next_step(T0)
    assert isinstance(step, Bury) and ids(step) == ["evt-0001"]
    b.buried(step.letters)
    step = b.next_step(T0)
    assert isinstance(step, Send) and ids(step) == ["evt-0002"]


def test_a_full_outbox_gives_the_oldest_up_by_count_and_by_size() -> None:
    b = book(max_events=3)
    for n in range(5):
        b.add(entry(n), T0)
    step = b.next_step(T0)
    assert isinstance(step, Bury) and ids(step) == ["evt-0000", "evt-0001"]
    assert all(letter.reason == "outbox_full" for letter in step.letters)
    b.buried(step.letters)
    assert b.waiting() == 3

    big = book()
    size = entry(0, padding=400_000).size()
    for n in range(MAX_WAITING_BYTES // size + 2):
        big.add(entry(n, padding=400_000), T0)
    assert big.view().waiting_bytes <= MAX_WAITING_BYTES
    step = big.next_step(T0)
    assert isinstance(step, Bury) and step.letters[0].entry.event_id == "evt-0000"


def test_an_event_waiting_or_delivered_recently_is_not_queued_again() -> None:
    b = book()
    assert b.add(entry(0), T0)
    assert not b.add(entry(0), T0)  # a retried publish_event
    b.sent(1, None, T0)
    assert not b.add(entry(0), T0)  # delivered already
    assert b.waiting() == 0 and b.delivered == 1


def test_a_continue_as_new_carries_everything_that_matters() -> None:
    b = book(max_events=5, deadline=timedelta(hours=1))
    b.add(entry(0, why=Failure(error="bad", kind="rejected")), T0)
    for n in range(1, 4):
        b.add(entry(n), T0)
    b.sent(1, DOWN, T0)
    carried = b.carry(rejected_signals=7)
    assert [e.event_id for e in carried.waiting] == ["evt-0002", "evt-0003"]
    assert [letter.entry.event_id for letter in carried.to_bury] == ["evt-0000"]  # not yet recorded: recorded next
    assert carried.delivered_ids == ["evt-0001"] and carried.delivered == 1 and carried.dead_lettered == 1
    assert carried.rejected_signals == 7 and carried.max_events == 5 and carried.deadline == timedelta(hours=1)
    again = OutboxBook(OutboxRun.model_validate_json(carried.model_dump_json()))
    step = again.next_step(T0)
    assert isinstance(step, Bury) and ids(step) == ["evt-0000"]
    again.buried(step.letters)
    assert not again.add(entry(1), T0)
    step = again.next_step(T0)
    assert isinstance(step, Send) and ids(step) == ["evt-0002", "evt-0003"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 30)),
            st.tuples(st.just("ok"), st.integers(0, DELIVERY_BATCH)),
            st.tuples(st.just("fail"), st.integers(0, DELIVERY_BATCH)),
            st.tuples(st.just("tick"), st.integers(0, 4_000)),
        ),
        max_size=80,
    )
)
def test_no_event_is_lost_duplicated_or_reordered(ops: list[tuple[str, int]]) -> None:
    """Whatever arrives, fails and times out: every event queued is delivered once or dead-lettered once, delivered
    events go in the order they were queued, and nothing exceeds the bounds."""
    b = book(max_events=8, deadline=timedelta(minutes=30))
    now, queued, delivered, buried = T0, [], [], []
    for op, n in ops:
        if op == "add":
            if b.add(entry(n, now), now):
                queued.append(f"evt-{n:04d}")
        elif op == "tick":
            now += timedelta(seconds=n)
        step = b.next_step(now)
        if isinstance(step, Bury):
            buried += ids(step)
            b.buried(step.letters)
        elif isinstance(step, Send) and op in ("ok", "fail"):
            taken = min(n, len(step.entries))
            delivered += ids(step)[:taken]
            b.sent(taken, DOWN if op == "fail" else None, now)
        assert b.waiting() <= 8
    while not b.is_idle():  # the sink comes back
        step = b.next_step(now)
        if isinstance(step, Bury):
            buried += ids(step)
            b.buried(step.letters)
        elif isinstance(step, Send):
            delivered += ids(step)
            b.sent(len(step.entries), None, now)
        elif isinstance(step, WaitUntil):
            now = step.at
    assert sorted(delivered + buried) == sorted(queued)
    assert len(set(delivered)) == len(delivered)
    order = {event_id: i for i, event_id in enumerate(queued)}
    assert [order[e] for e in delivered] == sorted(order[e] for e in delivered)
