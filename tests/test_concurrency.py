"""contract.concurrency.gather_at_most: every call awaited, never more than the limit at once, results in order."""

from __future__ import annotations

import asyncio

import pytest

from contract.concurrency import gather_at_most


async def test_at_most_the_limit_at_once_and_the_results_in_the_calls_order() -> None:
    in_flight = peak = 0

    async def call(n: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01 * (n % 3))  # finishing out of order
        in_flight -= 1
        return n

    assert await gather_at_most(4, (call(n) for n in range(20))) == list(range(20))
    assert peak == 4


async def test_a_failure_is_raised() -> None:
    async def call(n: int) -> int:
        if n == 3:
            raise ValueError("three")
        return n

    with pytest.raises(ValueError, match="three"):
        await gather_at_most(2, (call(n) for n in range(5)))
