"""Burst collapse: one hardware event often logs the same fault thousands of times (NVSentinel#1120 saw 800K
lines of Xid 95 with 29 distinct texts). The first record of a burst goes out at once; the rest of the burst
within the window only count, and are reported as one roll-up when the window closes. Memory is
O(distinct keys), capped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

DEFAULT_MAX_KEYS = 1024


@dataclass(slots=True)
class Burst(Generic[T]):
    first: T
    last: T
    started: datetime
    count: int = 1  # including the first, which was already emitted
    # started + window, kept so that a storm's every item costs one comparison, not a subtraction and a comparison.
    closes: datetime | None = None

    @property
    def suppressed(self) -> int:
        return self.count - 1


class BurstCollapser(Generic[K, T]):
    """Per key, a window that opens at the first item. Call `expire` regularly to collect closed bursts."""

    def __init__(self, window: timedelta, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if window < timedelta(0):
            raise ValueError("window must not be negative")
        self._window = window
        self._max_keys = max_keys
        self._open: OrderedDict[K, Burst[T]] = OrderedDict()  # oldest-started first
        self._closed: list[Burst[T]] = []

    def __len__(self) -> int:
        return len(self._open)

    def offer(self, key: K, item: T, now: datetime) -> bool:
        """True when `item` opens a burst (emit it now); False when it only adds to an open one."""
        burst = self._open.get(key)
        closes = None if burst is None else burst.closes
        if burst is not None and (now < closes if closes is not None else now - burst.started < self._window):
            burst.count += 1
            burst.last = item
            return False
        if burst is not None:
            self._close(key)
        self._open[key] = Burst(first=item, last=item, started=now, closes=self._closes(now))
        if len(self._open) > self._max_keys:
            self._close(next(iter(self._open)))
        return True

    def offer_run(self, key: K, first: T, last: T, count: int, now: datetime) -> bool:
        """`count` items that share `key`, from `first` to `last`, all at `now`: exactly what offering each in turn
        would do, in one step. True when `first` opens a burst. Needs a window and room for a key: without them
        each item would be a burst of its own."""
        if not self._window or self._max_keys < 1:
            raise ValueError("offer_run needs a window longer than zero and max_keys of at least 1")
        opened = self.offer(key, first, now)
        if count > 1:  # the burst `first` opened or joined is open at `now`: the others only count
            burst = self._open[key]
            burst.count += count - 1
            burst.last = last
        return opened

    def _closes(self, now: datetime) -> datetime | None:
        try:
            return now + self._window
        except OverflowError:  # near datetime.max: compare by subtraction instead
            return None

    def expire(self, now: datetime) -> list[Burst[T]]:
        """Bursts whose window closed and that suppressed at least one item (lone items need no roll-up)."""
        for key in [k for k, b in self._open.items() if now - b.started >= self._window]:
            self._close(key)
        closed, self._closed = self._closed, []
        return closed

    def flush(self) -> list[Burst[T]]:
        """Close everything, e.g. at shutdown or at the end of a finite input."""
        for key in list(self._open):
            self._close(key)
        closed, self._closed = self._closed, []
        return closed

    def _close(self, key: K) -> None:
        burst = self._open.pop(key)
        if burst.count > 1:
            self._closed.append(burst)
            # Bounded even if nobody calls expire(): keep the newest, the oldest counts are the least useful.
            if len(self._closed) > self._max_keys:
                del self._closed[0]
