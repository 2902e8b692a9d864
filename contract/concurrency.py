"""Many awaits at once, but not all of them: for a batch of calls to one server (the frontend, an AWS API)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def gather_at_most(limit: int, calls: Iterable[Awaitable[T]]) -> list[T]:
    """Await every call, at most `limit` at a time; their results in the calls' order. The first failure is raised
    (as asyncio.gather raises it); the others still run to their end."""
    gate = asyncio.Semaphore(limit)

    async def one(call: Awaitable[T]) -> T:
        async with gate:
            return await call

    return list(await asyncio.gather(*(one(call) for call in calls)))
