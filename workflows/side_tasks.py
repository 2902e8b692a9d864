"""Sends a workflow's loop need not wait for (signals to other workflows, activities whose answer comes back as a
signal): kept here so that they are not garbage collected mid-flight, and awaited before continue-as-new."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class SideTasks:
    def __init__(self) -> None:
        self._running: set[asyncio.Task[None]] = set()

    def start(self, send: Coroutine[Any, Any, None]) -> None:
        # Deterministic in a workflow: its event loop runs tasks in the order they were created.
        task = asyncio.create_task(send)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    @property
    def idle(self) -> bool:
        return not self._running
