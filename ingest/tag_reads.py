"""Many instances' group tags in one EC2 call. Hosts' membership answers expire one by one, a minute's worth of
heartbeats apart; asked one DescribeInstances each, 50,000 hosts at a 5-minute `membership_ttl` would make about 170
calls a second per ingest replica, several times EC2's published rate for DescribeInstances (docs/scaling.md,
section 6).

A read somebody waits for (a host not seen before) goes out at once, with whatever else is queued; reads nobody waits
for (refreshing an answer that is still being served) are gathered for up to `refresh_every_s`. Either way one call
carries up to `max_ids` instances."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# DescribeInstances takes many InstanceIds in one request; a few hundred keep its answer small.
MAX_IDS_PER_CALL = 200
REFRESH_EVERY_S = 1.0

ReadTags = Callable[[Sequence[str]], dict[str, str | None]]


@dataclass
class _Pending:
    waiters: list[asyncio.Future[str | None]] = field(default_factory=list)
    urgent: bool = False


class TagReads:
    """`read` answers {instance_id: its tag value or None} for a batch, blocking (it runs in a thread); it raises for
    an AWS error, which fails every read of that batch."""

    def __init__(
        self,
        read: ReadTags,
        *,
        max_ids: int = MAX_IDS_PER_CALL,
        refresh_every_s: float = REFRESH_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._max_ids = max_ids
        self._refresh_every_s = refresh_every_s
        self._clock = clock
        self._pending: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._last_call = float("-inf")
        self.calls = 0  # EC2 calls made, for the tests and the benchmarks

    async def tag(self, instance_id: str, *, urgent: bool = True) -> str | None:
        pending = self._pending.setdefault(instance_id, _Pending())
        pending.urgent = pending.urgent or urgent
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        pending.waiters.append(future)
        self._wake.set()
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        return await future

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner

    async def _run(self) -> None:
        while self._pending:
            if not any(p.urgent for p in self._pending.values()):
                # Only refreshes: gather them, unless a read somebody waits for arrives meanwhile.
                left = self._last_call + self._refresh_every_s - self._clock()
                if left > 0:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), left)
                    continue
            # Urgent reads first, then the oldest refreshes: dicts keep insertion order.
            ids = sorted(self._pending, key=lambda i: not self._pending[i].urgent)[: self._max_ids]
            batch = {instance_id: self._pending.pop(instance_id) for instance_id in ids}
            self._last_call = self._clock()
            self.calls += 1
            try:
                tags = await asyncio.to_thread(self._read, ids)
            except Exception as err:  # every waiter gets the error: an unknown answer, never a wrong one
                for pending in batch.values():
                    for waiter in pending.waiters:
                        if not waiter.done():
                            waiter.set_exception(err)
                continue
            for instance_id, pending in batch.items():
                for waiter in pending.waiters:
                    if not waiter.done():
                        waiter.set_result(tags.get(instance_id))
