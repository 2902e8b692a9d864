"""Token buckets: one per instance (bounded: the least recently used are forgotten) and one for the whole ingest.

A refused report takes no token, so a host that backs off by the Retry-After it was given gets through."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

# Buckets kept at most; a forgotten instance starts again with a full bucket, which only ever errs towards letting
# a report through. Far above a fleet's size, far below what would strain memory.
MAX_TRACKED_INSTANCES = 100_000


class TokenBucket:
    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def wait(self, now: float) -> float:
        """Seconds until a token is there (0: one is there now)."""
        self._refill(now)
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) / self.rate

    def take(self, now: float) -> float:
        """Take a token and return 0, or take none and return the seconds until one is there."""
        wait = self.wait(now)
        if wait == 0:
            self.tokens -= 1
        return wait


def retry_after(wait: float) -> int:
    """The Retry-After header's value: whole seconds, at least 1."""
    return max(1, math.ceil(wait))


class RateLimiter:
    def __init__(
        self,
        instance_rate: float,
        instance_burst: int,
        total_rate: float,
        total_burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_instances: int = MAX_TRACKED_INSTANCES,
    ) -> None:
        self._clock = clock
        self._instance_rate = instance_rate
        self._instance_burst = instance_burst
        self._max_instances = max_instances
        self._total = TokenBucket(total_rate, total_burst, clock())
        self._instances: OrderedDict[str, TokenBucket] = OrderedDict()

    def take_total(self) -> float:
        """A token of the whole ingest's bucket: 0, or the seconds to wait."""
        return self._total.take(self._clock())

    def take_instance(self, instance_id: str) -> float:
        """A token of this instance's bucket: 0, or the seconds to wait."""
        now = self._clock()
        bucket = self._instances.get(instance_id)
        if bucket is None:
            bucket = TokenBucket(self._instance_rate, self._instance_burst, now)
            self._instances[instance_id] = bucket
            self._forget_oldest()
        else:
            self._instances.move_to_end(instance_id)
        return bucket.take(now)

    def _forget_oldest(self) -> None:
        while len(self._instances) > self._max_instances:
            self._instances.popitem(last=False)

    def __len__(self) -> int:
        return len(self._instances)
