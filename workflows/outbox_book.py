"""The outbox's book: which events wait for a sink, which to send next, when to try again, and which to give up on.
Plain deterministic code over carried state (no Temporal imports); workflows/event_outbox.py is the thin workflow
around it.

The rules (docs/operations.md, "When a sink fails"):
- events are sent oldest first, a batch at a time; a failed try waits (doubling from FIRST_BACKOFF to MAX_BACKOFF)
  and starts again from the oldest, so an event never overtakes an older one in the same outbox;
- an event the sink rejects as malformed is given up on at once (no retry can help, and it would block the rest);
- an event still waiting `deadline` after it was queued is given up on at the next look;
- beyond `max_events`, or MAX_WAITING_BYTES of waiting events, the oldest gives way;
- an event already waiting, or delivered recently, is not queued again (a retried publish_event).
Every event given up on becomes a DeadLetter, handed out once through `take_dead_letters`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import datetime

from contract.event_outbox import (
    DEAD_LETTERS_KEPT,
    DELIVERY_BATCH,
    FIRST_BACKOFF,
    IDS_REMEMBERED,
    MAX_BACKOFF,
    MAX_WAITING_BYTES,
    SHOWN_WAITING,
    BuryReason,
    DeadLetter,
    Failure,
    OutboxEntry,
    OutboxRun,
    OutboxView,
    SinkTarget,
)


@dataclass(frozen=True)
class Send:
    entries: list[OutboxEntry]


@dataclass(frozen=True)
class Bury:
    letters: list[DeadLetter]


@dataclass(frozen=True)
class WaitUntil:
    at: datetime


@dataclass(frozen=True)
class Empty:
    pass


Step = Send | Bury | WaitUntil | Empty


class OutboxBook:
    def __init__(self, run: OutboxRun) -> None:
        self.target: SinkTarget = run.target
        self._max_events = run.max_events
        self._deadline = run.deadline
        self._waiting: deque[OutboxEntry] = deque()
        self._bytes = 0
        self._waiting_ids: set[str] = set()
        self._delivered_ids: deque[str] = deque(run.delivered_ids[-IDS_REMEMBERED:], maxlen=IDS_REMEMBERED)
        self._delivered_set = set(self._delivered_ids)
        self._to_bury: list[DeadLetter] = list(run.to_bury)
        self._dead_letters: deque[DeadLetter] = deque(run.dead_letters[-DEAD_LETTERS_KEPT:], maxlen=DEAD_LETTERS_KEPT)
        self.delivered = run.delivered
        self.dead_lettered = run.dead_lettered
        self._next_try: datetime | None = None
        self._backoff = FIRST_BACKOFF
        self.last_error: Failure | None = None
        for entry in run.waiting:
            self._append(entry)

    # --- what arrives -------------------------------------------------------------------------------------------

    def add(self, entry: OutboxEntry, now: datetime) -> bool:
        """Queue one event; False when it waits already or was delivered recently."""
        if entry.event_id in self._waiting_ids or entry.event_id in self._delivered_set:
            return False
        if entry.why is not None and entry.why.kind == "rejected":
            self._bury(entry, "rejected", entry.why.error, now)
            return True
        self._append(entry)
        while len(self._waiting) > self._max_events or (self._bytes > MAX_WAITING_BYTES and len(self._waiting) > 1):
            oldest = self._pop()
            limit = f"{self._max_events} events" if len(self._waiting) >= self._max_events else "its size limit"
            self._bury(oldest, "outbox_full", f"outbox full ({limit}): the oldest gave way", now)
        return True

    # --- what to do next ----------------------------------------------------------------------------------------

    def next_step(self, now: datetime) -> Step:
        if self._to_bury:
            return Bury(list(self._to_bury))
        expired = [e for e in self._waiting if now - e.queued_at >= self._deadline]
        if expired:
            error = self.last_error.error if self.last_error else "not delivered before the deadline"
            for _ in expired:
                self._bury(self._pop(), "deadline", error, now)
            return Bury(list(self._to_bury))
        if not self._waiting:
            return Empty()
        if self._next_try is not None and now < self._next_try:
            oldest_deadline = self._waiting[0].queued_at + self._deadline
            return WaitUntil(min(self._next_try, oldest_deadline))
        return Send([self._waiting[i] for i in range(min(DELIVERY_BATCH, len(self._waiting)))])

    def buried(self, letters: list[DeadLetter]) -> None:
        """The dead-letter step recorded these: they are handed out no more."""
        done = {id(letter) for letter in letters}
        self._to_bury = [letter for letter in self._to_bury if id(letter) not in done]

    def sent(self, count: int, failure: Failure | None, now: datetime) -> None:
        """The delivery step's answer: the first `count` of the batch were taken, then `failure` (if any)."""
        for _ in range(min(count, len(self._waiting))):
            self._delivered_ids.append(self._pop().event_id)
            self.delivered += 1
        self._delivered_set = set(self._delivered_ids)
        if failure is None:
            self._backoff = FIRST_BACKOFF
            self._next_try = None
            return
        self.last_error = failure
        if failure.kind == "rejected" and self._waiting:
            self._bury(self._pop(), "rejected", failure.error, now)
            return
        self._next_try = now + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF)

    # --- what is kept and shown ---------------------------------------------------------------------------------

    def is_idle(self) -> bool:
        return not self._waiting and not self._to_bury

    def waiting(self) -> int:
        return len(self._waiting)

    def view(self) -> OutboxView:
        return OutboxView(
            target=self.target,
            waiting=len(self._waiting),
            waiting_bytes=self._bytes,
            waiting_event_ids=[self._waiting[i].event_id for i in range(min(SHOWN_WAITING, len(self._waiting)))],
            oldest_queued_at=self._waiting[0].queued_at if self._waiting else None,
            next_try_at=self._next_try,
            last_error=self.last_error,
            delivered=self.delivered,
            dead_lettered=self.dead_lettered,
            dead_letters=list(self._dead_letters),
        )

    def carry(self, rejected_signals: int) -> OutboxRun:
        """What the next run starts from, dead letters not yet recorded among it."""
        return OutboxRun(
            target=self.target,
            max_events=self._max_events,
            deadline=self._deadline,
            waiting=list(self._waiting),
            to_bury=list(self._to_bury),
            delivered_ids=list(self._delivered_ids),
            dead_letters=list(self._dead_letters),
            delivered=self.delivered,
            dead_lettered=self.dead_lettered,
            rejected_signals=rejected_signals,
        )

    # --- the queue ----------------------------------------------------------------------------------------------

    def _append(self, entry: OutboxEntry) -> None:
        self._waiting.append(entry)
        self._waiting_ids.add(entry.event_id)
        self._bytes += entry.size()

    def _pop(self) -> OutboxEntry:
        entry = self._waiting.popleft()
        self._waiting_ids.discard(entry.event_id)
        self._bytes -= entry.size()
        return entry

    def _bury(self, entry: OutboxEntry, reason: BuryReason, error: str, now: datetime) -> None:
        letter = DeadLetter(entry=entry, reason=reason, error=error, at=now)
        self._to_bury.append(letter)
        self._dead_letters.append(letter)
        self.dead_lettered += 1
