"""Reads that share one call among concurrent callers, yet never answer a caller with what was read before it asked.

Every workflow of a group reads the group's live configuration from its drain semaphore (a query). When a fleet
registers or a surge of faults arrives, hundreds of activities ask at once, and the server refuses queries past a
small buffer per workflow ("consistent query buffer is full"). Coalescing them must not cost freshness: an operator's
`group update auto_repair=DISABLED` that returned before a repair asked must be what that repair sees. So a caller
joins a read only if the read has not started yet; while one is in flight, the callers that arrive meanwhile share the
next one, started as soon as it ends. At most one read per key is in flight, and at most one waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class FreshRead(Generic[K, V]):
    def __init__(self, read: Callable[[K], Awaitable[V]]) -> None:
        self._read = read
        self._running: dict[K, asyncio.Task[V]] = {}
        self._pending: dict[K, asyncio.Task[V]] = {}  # not started yet: a caller may still join it

    async def __call__(self, key: K) -> V:
        read = self._pending.get(key)
        if read is None:
            read = self._pending[key] = asyncio.ensure_future(self._after(key, self._running.get(key)))
        # Shielded: one caller cancelled (its activity timed out) must not cancel the read the others wait for.
        return await asyncio.shield(read)

    async def _after(self, key: K, running: asyncio.Task[V] | None) -> V:
        if running is not None:
            await asyncio.wait([running])  # its outcome is its own callers'; ours starts after it
        self._running[key] = self._pending.pop(key)
        try:
            return await self._read(key)
        finally:
            del self._running[key]  # the next read of the key waits for this one to end before it starts
