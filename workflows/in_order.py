"""Sends a workflow makes about its steps (events, progress signals) go out in the order they were made, beside the
steps rather than in front of them: each costs a round trip to the server, and a repair's next step need not wait for
the news of its last one."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from temporalio import workflow


class InOrder:
    """A queue of sends, drained one at a time by a task of the workflow's own. `flush()` before the workflow closes:
    a send still queued when it closes would never go out."""

    def __init__(self) -> None:
        self._queue: deque[Callable[[], Awaitable[None]]] = deque()
        self._busy = False

    def send(self, make: Callable[[], Awaitable[None]]) -> None:
        self._queue.append(make)
        if not self._busy:
            self._busy = True
            # Deterministic: the workflow's event loop runs its tasks in the order they were created.
            asyncio.get_running_loop().create_task(self._drain())

    async def flush(self) -> None:
        await workflow.wait_condition(lambda: not self._busy)

    async def _drain(self) -> None:
        try:
            while self._queue:
                try:
                    await self._queue.popleft()()
                except Exception as err:  # the news of a step is never worth the step: log, and send the rest
                    workflow.logger.warning("a send about a step failed: %s: %s", type(err).__name__, err)
        finally:
            self._busy = False
