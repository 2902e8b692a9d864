"""Kernel log parser: what a record learns beyond its own text: the UUID an earlier driver line gave its GPU, and
the wall-clock time its prefix says, read in the host's time zone."""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterator

import pytest

from node_probe.classify.kernel_log import UUID_MEMORY, KernelLogParser, parse_lines
from tests.kernel_log_lines import BANNER_PIECES, PREFIXES, UUID_18, UUID_B3, kmsg_banner

# --- the GPU's UUID -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", PREFIXES)
def test_records_carry_the_uuid_the_log_gave_their_gpu(prefix: str) -> None:
    xid = prefix + "NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, GPU has fallen off the bus."
    lines = [
        xid,  # before the identity line: unknown (and its text is now a cached template)
        prefix + f"NVRM: GPU at PCI:0000:18:00: {UUID_18}",
        prefix + "NVRM: GPU Board Serial Number: 1234567890123",
        xid,
        prefix + "NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.",
        prefix + "NVRM: GPU 0000:18:00.0: RmInitAdapter failed! (0x26:0x65:1239)",
        prefix + "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception",
        prefix + f"NVRM: GPU at PCI:0000:B3:00: {UUID_B3}",
        *(prefix + piece for piece in BANNER_PIECES),
        prefix + "nvidia-nvswitch0: SXid (PCI:0000:18:00.0): 12028, Severity 1",
        prefix + "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
        xid,  # the driver reloaded: the GPU at that address may be another one
    ]
    assert [(r.line, r.kind, r.pci, r.uuid) for r in parse_lines(lines)] == [
        (1, "xid", "0000:18:00", None),
        (4, "xid", "0000:18:00", UUID_18),
        (5, "gpu_fallen_off_bus", "0000:18:00", UUID_18),
        (6, "gpu_init_failed", "0000:18:00", UUID_18),
        (7, "xid", "0000:3b:00", None),
        (9, "gpu_fallen_off_bus", "0000:b3:00", UUID_B3),
        (12, "sxid", "0000:18:00.0", None),  # a switch, not the GPU
        (14, "xid", "0000:18:00", None),
    ]


def test_uuid_of_a_banner_printed_as_one_escaped_record() -> None:
    lines = [f"6,1,1000,-;NVRM: GPU at PCI:0000:b3:00: {UUID_B3}", *kmsg_banner(BANNER_PIECES)]
    (record,) = parse_lines(lines)
    assert (record.kind, record.uuid) == ("gpu_fallen_off_bus", UUID_B3)


def test_a_gpu_named_again_takes_its_new_uuid_and_memory_is_bounded() -> None:
    parser = KernelLogParser()
    for n in range(UUID_MEMORY + 6):
        parser.feed(f"NVRM: GPU at PCI:0000:{n:02x}:00: GPU-00000000-0000-0000-0000-{n:012x}")
    parser.feed(f"NVRM: GPU at PCI:0000:{UUID_MEMORY + 5:02x}:00: {UUID_18}")

    def uuid(bus: int) -> str | None:
        (record,) = parser.feed(f"NVRM: Xid (PCI:0000:{bus:02x}:00): 79, GPU has fallen off the bus.")
        return record.uuid

    assert [uuid(n) for n in range(6)] == [None] * 6  # the oldest forgotten
    assert uuid(6) == "GPU-00000000-0000-0000-0000-000000000006"
    assert uuid(UUID_MEMORY + 5) == UUID_18


# --- wall-clock time --------------------------------------------------------------------------------------------------


@pytest.fixture
def utc_plus_3(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The host's local time: a fixed offset, three hours east of UTC (a POSIX TZ needs no zoneinfo)."""
    monkeypatch.setenv("TZ", "XXX-3")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def utc(*fields: int) -> float:
    return float(calendar.timegm((*fields, 0, 0, 0)))


def local(*fields: int) -> float:  # in utc_plus_3
    return utc(*fields) - 3 * 3600


NOW = utc(2024, 12, 1, 0, 0, 0)
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."


@pytest.mark.parametrize(
    "prefix",
    [
        "Nov  1 01:20:00 host kernel: ",
        "[Sun Nov  1 01:20:00 2026] ",
        "kern  :err   : 2026-11-01T01:20:00,000000 ",
    ],
)
def test_a_local_time_in_the_hour_that_repeats_reads_as_its_later_reading(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """US Eastern time goes back from 02:00 EDT to 01:00 EST on 2026-11-01: 01:20 happens twice. The later reading
    (06:20 UTC) keeps a host that booted at 01:10 EST from taking its own faults for an earlier boot's history."""
    monkeypatch.setenv("TZ", "EST5EDT,M3.2.0,M11.1.0")  # a POSIX rule: no zoneinfo needed
    time.tzset()
    try:
        (record,) = parse_lines([prefix + XID_79], now=lambda: utc(2026, 11, 2, 0, 0, 0))
        assert record.wall_s == utc(2026, 11, 1, 6, 20, 0)
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.usefixtures("utc_plus_3")
@pytest.mark.parametrize(
    ("prefix", "wall", "uptime"),
    [
        ("[Fri Aug 30 11:43:09 2024] ", local(2024, 8, 30, 11, 43, 9), None),
        ("[Sat Aug  3 11:43:09 2024] ", local(2024, 8, 3, 11, 43, 9), None),
        ("Nov 22 15:39:14 host kernel: ", local(2024, 11, 22, 15, 39, 14), None),
        ("Nov  2 15:39:14 gpu-node-17.ec2.internal kernel: ", local(2024, 11, 2, 15, 39, 14), None),
        ("Nov 22 15:39:14 host kernel: [ 1843.308145] ", local(2024, 11, 22, 15, 39, 14), 1843.308145),
        ("Nov 22 15:39:14.250 host kernel: ", local(2024, 11, 22, 15, 39, 14) + 0.25, None),
        ("Nov 22 15:39:14 host kernel: [Fri Aug 30 11:43:09 2024] ", local(2024, 11, 22, 15, 39, 14), None),
        ("2024-01-15T10:31:00+0000 hostname kernel: ", utc(2024, 1, 15, 10, 31, 0), None),  # journalctl short-iso
        ("2024-01-15T10:31:00-0500 hostname kernel: ", utc(2024, 1, 15, 15, 31, 0), None),
        ("2025-01-21T04:41:44.283302+02:00 host kernel: ", utc(2025, 1, 21, 2, 41, 44) + 0.283302, None),  # rsyslog
        ("2025-01-21T04:41:44Z host kernel: ", utc(2025, 1, 21, 4, 41, 44), None),
        ("2025-01-21 04:41:44 host kernel: ", local(2025, 1, 21, 4, 41, 44), None),  # no offset: local time
        ("kern  :warn  : 2025-01-21T04:41:44,283302+00:00 ", utc(2025, 1, 21, 4, 41, 44) + 0.283302, None),
        ("kern  :warn  : 2025-01-21T04:41:44,283302 ", local(2025, 1, 21, 4, 41, 44) + 0.283302, None),
        ("kern  :err   : [ 1843.308145] ", None, 1843.308145),
        ("[ 1843.308145] gpu-host-3 kernel: ", None, 1843.308145),
        ("4,1234,1843308145,-;", None, 1843.308145),
        ("[ 1843.308145] ", None, 1843.308145),
        ("kernel: ", None, None),
        ("", None, None),
        ("[Fri Feb 30 11:43:09 2024] ", None, None),  # no such day: no time, still a record
        ("2025-13-21T04:41:44+00:00 host kernel: ", None, None),
        ("Feb 30 15:39:14 host kernel: ", None, None),
    ],
)
def test_wall_clock_time_from_the_prefix(prefix: str, wall: float | None, uptime: float | None) -> None:
    (record,) = parse_lines([prefix + XID_79], now=lambda: NOW)
    assert (record.code, record.uptime_s) == (79, uptime)
    assert record.wall_s == (pytest.approx(wall) if wall is not None else None)


@pytest.mark.usefixtures("utc_plus_3")
@pytest.mark.parametrize(
    ("now", "stamp", "wall"),
    [
        (local(2024, 11, 22, 16, 0, 0), "Nov 22 15:39:14", local(2024, 11, 22, 15, 39, 14)),
        (local(2025, 1, 1, 0, 30, 0), "Dec 31 23:59:00", local(2024, 12, 31, 23, 59, 0)),  # read after new year
        (local(2024, 12, 31, 23, 50, 0), "Jan  1 00:10:00", local(2025, 1, 1, 0, 10, 0)),  # host clock a bit behind
        (local(2024, 11, 21, 12, 0, 0), "Nov 22 15:39:14", local(2023, 11, 22, 15, 39, 14)),  # over a day ahead
        (local(2025, 3, 1, 12, 0, 0), "Feb 29 12:00:00", local(2024, 2, 29, 12, 0, 0)),
    ],
)
def test_syslog_time_takes_the_latest_year_not_a_day_ahead(now: float, stamp: str, wall: float) -> None:
    (record,) = parse_lines([f"{stamp} host kernel: {XID_79}"], now=lambda: now)
    assert record.wall_s == wall


@pytest.mark.usefixtures("utc_plus_3")
def test_a_long_lived_parser_places_the_same_syslog_time_in_the_new_year() -> None:
    now = [utc(2024, 12, 1, 0, 0, 0)]
    parser = KernelLogParser(now=lambda: now[0])
    line = f"Nov 22 15:39:14 host kernel: {XID_79}"
    assert parser.feed(line)[0].wall_s == local(2024, 11, 22, 15, 39, 14)
    now[0] = utc(2025, 12, 1, 0, 0, 0)
    assert parser.feed(line)[0].wall_s == local(2025, 11, 22, 15, 39, 14)


@pytest.mark.usefixtures("utc_plus_3")
def test_storm_lines_keep_their_own_wall_times() -> None:
    """Times are cached per minute: each line still gets its own seconds and fraction."""
    lines = [
        f"kern  :warn  : 2025-01-21T04:{41 + n // 60:02d}:{n % 60:02d},{n:06d}+00:00 {XID_79}" for n in range(150)
    ] + [f"Nov 22 15:{n // 60:02d}:{n % 60:02d} host kernel: {XID_79}" for n in range(150)]
    walls = [r.wall_s for r in parse_lines(lines, now=lambda: NOW)]
    assert walls[:150] == [pytest.approx(utc(2025, 1, 21, 4, 41, 0) + n + n / 1e6) for n in range(150)]
    assert walls[150:] == [local(2024, 11, 22, 15, 0, 0) + n for n in range(150)]
