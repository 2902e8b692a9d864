"""FreshRead: concurrent callers share a read, and no caller gets what was read before it asked (an operator's
`group update` that returned before a repair asked is what that repair sees)."""

from __future__ import annotations

import asyncio

import pytest

from activities.fresh_read import FreshRead


class Store:
    """A value that changes, read slowly; each read notes the version it started at."""

    def __init__(self) -> None:
        self.version = 0
        self.reads = 0
        self.in_flight = 0
        self.most_in_flight = 0
        self.release = asyncio.Event()
        self.fail_next = False

    async def read(self, key: str) -> tuple[str, int]:
        self.reads += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        seen = self.version
        try:
            await self.release.wait()
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("query buffer is full")
            return key, seen
        finally:
            self.in_flight -= 1


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_surge_shares_one_read_and_late_callers_the_next() -> None:
    store = Store()
    read = FreshRead(store.read)
    first = [asyncio.create_task(read("g")) for _ in range(50)]
    await settle()
    store.version = 1  # an update lands while the first read is in flight
    later = [asyncio.create_task(read("g")) for _ in range(50)]
    await settle()
    assert store.reads == 1, "the callers during a read wait for the next, which has not started"
    store.release.set()
    assert {await t for t in first} == {("g", 0)}
    assert {await t for t in later} == {("g", 1)}, "a caller after the update never gets the read from before it"
    assert store.reads == 2 and store.most_in_flight == 1


async def test_keys_are_read_apart_and_a_failed_read_fails_only_its_callers() -> None:
    store = Store()
    read = FreshRead(store.read)
    store.fail_next = True
    a = asyncio.create_task(read("a"))
    await settle()
    b = asyncio.create_task(read("b"))
    again = asyncio.create_task(read("a"))
    await settle()
    assert store.most_in_flight == 2  # one per key
    store.release.set()
    with pytest.raises(RuntimeError, match="buffer is full"):
        await a
    assert await again == ("a", 0)
    assert await b == ("b", 0)


async def test_a_cancelled_caller_leaves_the_read_to_the_others() -> None:
    store = Store()
    read = FreshRead(store.read)
    impatient = asyncio.create_task(read("g"))
    patient = asyncio.create_task(read("g"))
    await settle()
    impatient.cancel()
    await settle()
    store.release.set()
    assert await patient == ("g", 0)
    assert impatient.cancelled()
    assert store.reads == 1
    assert await read("g") == ("g", 0)  # nothing left behind: the next caller reads afresh
    assert store.reads == 2
