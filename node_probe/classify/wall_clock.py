"""The wall-clock times that kernel log prefixes carry, as POSIX time.

A record's wall-clock time is how the probe tells this boot's faults from the history a kern.log keeps across
reboots, and the prefixes write it in host local time, often without a year (syslog) and in a repeated hour when
clocks go back. Getting that right is calendar work that has nothing to do with recognising NVIDIA's messages, so
it lives here, apart from the parser in kernel_log.py, which only picks the stamp's parts out of a prefix.

Storm lines differ only in their seconds (or fraction), so each distinct minute is parsed once per parser and the
seconds are added to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Final

_MONTHS: Final = {
    name: number
    for number, name in enumerate(
        ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), start=1
    )
}
_DAY_S = 86_400.0
_WALL_CACHE_SIZE = 256


def _latest_reading(local: datetime) -> float:
    """POSIX time of a host-local time. In the hour that repeats when clocks go back, the later of its two readings:
    a line is another boot's history only if every reading of its stamp is before this boot."""
    return max(local.timestamp(), local.replace(fold=1).timestamp())


def _local_minute(year: int, month: int, day: int, hour: int, minute: int) -> float | None:
    """POSIX time of a host-local minute; None for one that does not exist."""
    try:
        return _latest_reading(datetime(year, month, day, hour, minute))
    except (ValueError, OverflowError):
        return None


def _ctime_minute(key: str) -> float | None:
    """dmesg -T's `Fri Aug 30 11:43` + `2024`, host local time."""
    _, month, day, hour_minute, year = key.split()
    number = _MONTHS.get(month)
    if number is None:
        return None
    return _local_minute(int(year), number, int(day), int(hour_minute[:2]), int(hour_minute[3:5]))


def _iso_minute(key: str) -> float | None:
    """`2025-01-21T04:41` + an optional offset (`Z`, `+00:00`, `+0000`); without one, host local time."""
    offset = key[16:]
    try:
        when = datetime(int(key[0:4]), int(key[5:7]), int(key[8:10]), int(key[11:13]), int(key[14:16]))
        if not offset:
            return _latest_reading(when)
        if offset == "Z":
            return when.replace(tzinfo=UTC).timestamp()
        digits = offset[1:].replace(":", "")
        delta = timedelta(hours=int(digits[:2]), minutes=int(digits[2:4]))
        return when.replace(tzinfo=timezone(-delta if offset[0] == "-" else delta)).timestamp()
    except (ValueError, OverflowError):
        return None


def _syslog_minute(key: str, now: float) -> tuple[float, float, float] | None:
    """A syslog `Nov 22 15:39` (host local time, no year) in the latest year that puts it at most a day after
    `now`, with the range of `now` for which that year stays the answer; None for a date that does not exist."""
    month_name, day, hour_minute = key.split()
    month = _MONTHS.get(month_name)
    if month is None:
        return None
    hour, minute = int(hour_minute[:2]), int(hour_minute[3:5])
    latest = time.localtime(now).tm_year + 1
    found: float | None = None
    later = float("inf")  # the same date in the next year it exists (29 February: four years on)
    for year in range(latest, latest - 9, -1):
        seconds = _local_minute(year, month, int(day), hour, minute)
        if seconds is None:
            continue
        if seconds <= now + _DAY_S:
            found = seconds
            break
        later = seconds
    if found is None:
        return None
    if later == float("inf"):
        for year in range(latest + 1, latest + 9):
            seconds = _local_minute(year, month, int(day), hour, minute)
            if seconds is not None:
                later = seconds
                break
    return found, found - _DAY_S, later - _DAY_S


class WallClock:
    """One parser's wall-clock times: the minutes it parsed, and `now`, the clock a syslog time without a year is
    placed by. Each method takes a stamp's parts as its prefix regex captured them and returns POSIX time, or None
    for a time that does not exist."""

    __slots__ = ("_minutes", "_now", "_syslog_minutes")

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self._now = now
        self._minutes: dict[str, float | None] = {}
        # A syslog minute's year depends on `now`: kept with the range of `now` it holds for.
        self._syslog_minutes: dict[str, tuple[float, float, float]] = {}

    def ctime(self, minute: str, second: str, year: str) -> float | None:
        """dmesg -T's `Fri Aug 30 11:43`, `09`, `2024`."""
        key = minute + " " + year
        # The cache lookup is written out here and in iso(), not shared: this runs for every record of a storm.
        minutes = self._minutes
        base = minutes[key] if key in minutes else self._parse_minute(key, _ctime_minute)
        return None if base is None else base + int(second)

    def iso(self, minute: str, second: str, offset: str | None) -> float | None:
        """`2025-01-21T04:41`, `09.123` (or `09,123`), an optional UTC offset; without one, host local time."""
        key = minute + offset if offset else minute
        minutes = self._minutes
        base = minutes[key] if key in minutes else self._parse_minute(key, _iso_minute)
        return None if base is None else base + float(second.replace(",", ".") if "," in second else second)

    def syslog(self, minute: str, seconds: float) -> float | None:
        """A syslog `Nov 22 15:39` and its seconds, in the year that `now` makes most likely."""
        now = self._now()
        cached = self._syslog_minutes.get(minute)
        if cached is None or not cached[1] <= now < cached[2]:
            cached = _syslog_minute(minute, now)
            if cached is None:
                return None
            if len(self._syslog_minutes) >= _WALL_CACHE_SIZE:
                self._syslog_minutes.clear()
            self._syslog_minutes[minute] = cached
        return cached[0] + seconds

    def _parse_minute(self, key: str, parse: Callable[[str], float | None]) -> float | None:
        seconds = parse(key)
        minutes = self._minutes
        if len(minutes) >= _WALL_CACHE_SIZE:
            minutes.clear()
        minutes[key] = seconds
        return seconds
