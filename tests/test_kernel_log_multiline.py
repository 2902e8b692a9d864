"""Kernel log parser: the "fallen off the bus" banner printed as one printk, as each log tool shows it (indented
lines, escaped newlines, separate records), look-alikes that are not records, and kmsg's escapes."""

from __future__ import annotations

from typing import Any

import pytest

from node_probe.classify.kernel_log import KernelLogParser, parse_lines
from tests.kernel_log_lines import (
    BANNER_FORMS,
    BANNER_PIECES,
    BANNER_PIECES_NO_ID,
    dmesg_banner,
    kmsg_banner,
    one,
    rsyslog_banner,
)


@pytest.mark.parametrize("pieces", [BANNER_PIECES, BANNER_PIECES_NO_ID], ids=["pci-id", "no-pci-id"])
@pytest.mark.parametrize("form", BANNER_FORMS, ids=lambda form: form.__name__)
def test_banner_printed_as_one_printk_is_one_record_in_every_form(form: Any, pieces: list[str]) -> None:
    lines = ["[ 1800.000000] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15", *form(pieces)]
    parser = KernelLogParser()
    records = [record for line in lines for record in parser.feed(line)]
    assert [(r.line, r.kind, r.code, r.pci) for r in records] == [(2, "gpu_fallen_off_bus", None, "0000:b3:00")]
    (record,) = records
    assert record.raw == "\n".join(lines[1:])  # an escaped one-line banner's raw is that one line
    assert record.message.startswith("The NVIDIA GPU 0000:b3:00.0 ")
    assert record.message.endswith("installed in this system has fallen off the bus and is not responding to commands.")
    assert ("10de:26b5" in record.message) == (pieces is BANNER_PIECES)
    assert parser.pending_banner_line is None


def test_banner_metadata_comes_from_its_lines_that_carry_it() -> None:
    (kmsg,) = parse_lines(kmsg_banner(BANNER_PIECES))
    assert (kmsg.kmsg_seq, kmsg.uptime_s, kmsg.wall_s) == (1234, 1843.308145, None)
    (dmesg,) = parse_lines(dmesg_banner(BANNER_PIECES))  # indented lines carry no stamp: the first line's
    assert (dmesg.kmsg_seq, dmesg.uptime_s) == (None, 1843.308145)
    (syslog,) = parse_lines(rsyslog_banner(BANNER_PIECES))
    assert syslog.uptime_s is None and syslog.wall_s is not None


def test_a_banner_split_between_an_escaped_record_and_a_following_line() -> None:
    lines = [
        "Nov 22 15:39:14 host kernel: " + "#012".join(BANNER_PIECES[:2]),
        "Nov 22 15:39:14 host kernel: " + BANNER_PIECES[2],
    ]
    parser = KernelLogParser()
    assert parser.feed(lines[0]) == []
    assert parser.pending_banner_line == 1  # a source must resume before it
    (record,) = parser.feed(lines[1])
    assert (record.line, record.kind, record.pci, record.raw) == (
        1,
        "gpu_fallen_off_bus",
        "0000:b3:00",
        "\n".join(lines),
    )
    assert parser.pending_banner_line is None


def test_escaped_pieces_share_their_line_with_the_records_around_them() -> None:
    lines = [
        "4,1000,1000000000,-;NVRM: Xid (PCI:0000:17:00): 13, pid=1, name=x, Graphics Exception",
        "3,1001,1843308145,-;" + "\\x0a".join(BANNER_PIECES),
        "4,1002,1843308200,-;NVRM: Xid (PCI:0000:b3:00): 79, pid=1, name=x, GPU has fallen off the bus.",
    ]
    records = list(parse_lines(lines))
    assert [(r.line, r.kind, r.kmsg_seq) for r in records] == [
        (1, "xid", 1000),
        (2, "gpu_fallen_off_bus", 1001),
        (3, "xid", 1002),
    ]


def test_an_escaped_record_cut_short_does_not_swallow_the_next_record() -> None:
    lines = [
        "3,1001,1843308145,-;" + "\\x0a".join(BANNER_PIECES[:2]),
        "4,1002,1843308200,-;NVRM: Xid (PCI:0000:b3:00): 79, GPU has fallen off the bus.",
        "4,1003,1843308300,-;" + BANNER_PIECES[2],
    ]
    assert [(r.line, r.kind, r.code) for r in parse_lines(lines)] == [(2, "xid", 79)]


@pytest.mark.parametrize(
    "lines",
    [
        # An indented line that is not NVIDIA's (a stack trace, kmsg metadata naming NVRM), alone or in a banner.
        ["    nvidia_NVRM_isr+0x12/0x40 [nvidia]"],
        [" SUBSYSTEM=pci NVRM_TAG=1"],
        [BANNER_PIECES[0], "               usb 1-1: NVRM? installed in this system has", BANNER_PIECES[2]],
        # An indented banner line with no banner before it.
        ["               NVRM: (PCI ID: 10de:26b5) installed in this system has"],
        ["               NVRM: fallen off the bus and is not responding to commands."],
        # An application quoting the banner as rsyslog writes it: its tag is not `kernel:`.
        ["Nov 22 15:39:14 host app[12]: " + "#012".join(BANNER_PIECES)],
        ["Nov 22 15:39:14 host app[12]: some text #012NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."],
        # A kernel record whose first line is not NVIDIA's: an embedded NVRM line is quoted text, not a record.
        ["Nov 22 15:39:14 host kernel: mydriver: saw#012NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."],
        ["6,5,1000,-;mydriver: saw\\x0aNVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."],
        # The "not supported" banner, escaped.
        [
            "4,7,1000,-;NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:1234)\\x0aNVRM: installed in this system is "
            "not supported by the\\x0aNVRM: NVIDIA 550.54.15 driver release."
        ],
    ],
)
def test_multi_line_look_alikes_that_are_not_records(lines: list[str]) -> None:
    assert list(parse_lines(lines)) == []


def test_an_indented_nvidia_line_is_a_body_of_its_own() -> None:
    """dmesg and journalctl indent every later line of a record; an NVIDIA one is kernel text, not a quote."""
    (record,) = parse_lines(["[ 10.5] NVRM: something", "          NVRM: Xid (PCI:0000:3b:00): 79, GPU lost."])
    assert (record.line, record.code, record.pci, record.uptime_s) == (2, 79, "0000:3b:00", None)


def test_kmsg_escapes_are_undone_in_the_message_but_not_in_raw() -> None:
    line = (
        "4,12,5000000,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a\\x5cb, "
        "Graphics Exception \\xe2\\x82\\xac 100\\x09%"
    )
    record = one(line)
    assert (record.code, record.pid, record.process_name) == (13, 7, "a\\b")
    assert record.message == "Graphics Exception \u20ac 100\t%"
    assert record.raw == line
    assert one(line.replace("\\xe2\\x82\\xac", "\\xzz")).message == "Graphics Exception \\xzz 100\t%"  # not an escape


def test_escaped_storm_lines_parse_identically() -> None:
    lines = [f"4,{seq},{seq * 1000},-;NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=a\\x5cb, x" for seq in range(600)]
    records = list(parse_lines(lines))
    assert [r.kmsg_seq for r in records] == list(range(600))
    assert {(r.process_name, r.message) for r in records} == {("a\\b", "x")}
