"""Kernel log lines for the parser's tests (tests/test_kernel_log_*.py): the prefixes log tools put before a
line, the "fallen off the bus" banner as each log tool shows it, and the UUIDs of two GPUs."""

from __future__ import annotations

from typing import Any

from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.record import FaultRecord

PREFIXES = [
    "",
    "[ 1843.308145] ",
    "[    5.000001] ",
    "[Fri Aug 30 11:43:09 2024] ",
    "[Fri Aug  3 11:43:09 2024] ",
    "Nov 22 15:39:14 host kernel: ",
    "Nov  2 15:39:14 gpu-node-17.ec2.internal kernel: ",
    "Nov 22 15:39:14 host kernel: [ 1843.308145] ",
    "[ 1843.308145] gpu-host-3 kernel: ",
    "2024-01-15T10:31:00+0000 hostname kernel: ",
    "kern  :warn  : 2025-01-21T04:41:44,283302+00:00 ",
    "kern  :err   : [ 1843.308145] ",
    "kernel: ",
    "4,1234,1843308145,-;",
    "<4>,1234,1843308145,-;",
]


def one(line: str) -> FaultRecord:
    records = list(parse_lines([line]))
    assert len(records) == 1, (line, records)
    return records[0]


def check(record: FaultRecord, expected: dict[str, Any]) -> None:
    actual = {key: getattr(record, key) for key in expected}
    assert actual == expected


# --- the "fallen off the bus" banner as one printk, as each log tool shows it ----------------------------------

BANNER_PIECES = [
    "NVRM: The NVIDIA GPU 0000:b3:00.0",
    "NVRM: (PCI ID: 10de:26b5) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
]
# NVSentinel's tests also have the second line without the PCI ID.
BANNER_PIECES_NO_ID = [BANNER_PIECES[0], "NVRM: installed in this system has", BANNER_PIECES[2]]


def kmsg_banner(pieces: list[str]) -> list[str]:
    """/dev/kmsg: one record, the kernel escaping the newlines."""
    return ["3,1234,1843308145,-;" + "\\x0a".join(pieces)]


def dmesg_banner(pieces: list[str]) -> list[str]:
    """dmesg: the later lines indented, without the timestamp."""
    return ["[ 1843.308145] " + pieces[0], *("               " + piece for piece in pieces[1:])]


def journalctl_banner(pieces: list[str]) -> list[str]:
    """journalctl's short output: the later lines indented to the message's column."""
    head = "Nov 22 15:39:14 host kernel: "
    return [head + pieces[0], *(" " * len(head) + piece for piece in pieces[1:])]


def rsyslog_banner(pieces: list[str]) -> list[str]:
    """rsyslog (imjournal, or the kernel's MESSAGE): control characters escaped, the newline as #012."""
    return ["Nov 22 15:39:14 host kernel: " + "#012".join(pieces)]


def imkmsg_banner(pieces: list[str]) -> list[str]:
    """rsyslog's imkmsg: /dev/kmsg's text as it is, escapes included, behind the syslog header."""
    return ["Nov 22 15:39:14 host kernel: " + "\\x0a".join(pieces)]


def separate_banner(pieces: list[str]) -> list[str]:
    """Each line its own record (journald splits MESSAGE; old kernels' /proc/kmsg)."""
    return ["[ 1843.308145] " + piece for piece in pieces]


BANNER_FORMS = [kmsg_banner, dmesg_banner, journalctl_banner, rsyslog_banner, imkmsg_banner, separate_banner]

# --- the GPU's UUID -------------------------------------------------------------------------------------------------

UUID_18 = "GPU-8a2c6ec4-0e1b-7b33-5cdf-3a6d9c3a6b1f"
UUID_B3 = "GPU-1d2e3f40-5a6b-7c8d-9e0f-a1b2c3d4e5f6"
