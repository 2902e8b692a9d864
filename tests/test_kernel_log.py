"""Kernel log parser: every record format and prefix in the reference, and lines that must not match."""

from __future__ import annotations

import calendar
import time
from collections.abc import Iterator
from typing import Any

import pytest

from node_probe.classify import kernel_log
from node_probe.classify.kernel_log import UUID_MEMORY, KernelLogParser, parse_lines
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


XID_CASES: list[tuple[str, dict[str, Any]]] = [
    (
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
        {
            "kind": "xid",
            "code": 79,
            "pci": "0000:3b:00",
            "pid": 1234,
            "process_name": "python3",
            "message": "GPU has fallen off the bus.",
        },
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        {
            "code": 79,
            "pci": "0000:3b:00",
            "pid": None,
            "process_name": None,
            "message": "GPU has fallen off the bus.",
        },
    ),
    (
        "NVRM: Xid (PCI:0000:C1:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double "
        "bit error (DBE) "
        "has been detected on GPU in the framebuffer at partition 1, subpartition 0.",
        {"code": 48, "pci": "0000:c1:00", "pid": None, "process_name": None},
    ),
    (
        "NVRM: Xid (PCI:0000:17:00): 13, pid=77, name=train.py, Graphics SM Warp Exception on (GPC "
        "0, TPC 1, SM 0): "
        "Out Of Range Address",
        {
            "code": 13,
            "pid": 77,
            "process_name": "train.py",
            "message": "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
        },
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:05): 13, pid=99, name=app, Graphics Exception: ESR 0x405840=0x80000000",
        {"pci": "0000:3b:00", "mig_gpu_instance": 5, "mig_compute_instance": None, "pid": 99},
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00 GPU-I:05 GPU-CI:01): 31, pid=99, name=app, Ch 00000008, intr 00000000. "
        "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f1a_00000000.",
        {"code": 31, "pci": "0000:3b:00", "mig_gpu_instance": 5, "mig_compute_instance": 1},
    ),
    (
        "NVRM: Xid (0000:03:00): 14, Channel 00000001",
        {"code": 14, "pci": "0000:03:00", "message": "Channel 00000001"},
    ),
    (
        "NVRM: Xid (PCI:...): 79, GPU has fallen off the bus.",
        {"code": 79, "pci": None, "message": "GPU has fallen off the bus."},
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=..., name=..., Graphics Exception",
        {"code": 13, "pid": None, "process_name": None, "message": "Graphics Exception"},
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 62",
        {"code": 62, "message": ""},
    ),
    (
        "NVRM: Xid (PCI:0000:01:00): 45, pid=9, name=x, Ch 00000010, caused by previous Xid 48",
        {"code": 45, "caused_by_xid": 48, "message": "Ch 00000010, caused by previous Xid 48"},
    ),
    (
        "NVRM: Xid (PCI:0000:01:00): 45, pid=2280636, name=python, Ch 00000010",
        {"code": 45, "caused_by_xid": None},
    ),
    (
        "NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
        {
            "code": 154,
            "pci": "0008:01:00",
            "recovery_action_from": "None",
            "recovery_action_to": "GPU Reset Required",
            "recovery_action_from_code": 0,
            "recovery_action_to_code": 1,
        },
    ),
    (
        "NVRM: Xid (PCI:0018:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)",
        {"recovery_action_to": "Drain and Reset", "recovery_action_to_code": 4},
    ),
    (
        "NVRM: Xid (PCI:0018:01:00): 154, GPU recovery action changed from 0x2 (Node Reboot Required) to 0x0 (None)",
        {"recovery_action_from": "Node Reboot Required", "recovery_action_to": "None"},
    ),
    (
        "NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. RST: Yes, D-RST: No",
        {"code": 95, "rst": True, "d_rst": False, "message": "Uncontained: FBHUB. RST: Yes, D-RST: No"},
    ),
    (
        "NVRM: Xid (PCI:0000:c1:00): 94, pid=31, name=a.out, Contained: SM (0x1). RST: No, D-RST: No",
        {"code": 94, "rst": False, "d_rst": False, "pid": 31},
    ),
    (
        "NVRM: Xid (PCI:0000:c1:00): 95, pid=31, name=a.out, Uncontained: LTC TAG (0x2,0x0). "
        "physAddr: 0x1234abcd RST: No, D-RST: Yes",
        {"code": 95, "rst": False, "d_rst": True},
    ),
    (
        "NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000 "
        "0x00000000 0x00000000 0x00000000 0x00000000)",
        {"code": 149, "nvlink_unit": "NETIR_LINK_EVT", "nvlink_fatal": True, "nvlink_link": 9},
    ),
    (
        "NVRM: Xid (PCI:0018:01:00): 149, NETIR_INT  Fatal   XC0 i0 Link -1",
        {"code": 149, "nvlink_unit": "NETIR_INT", "nvlink_link": -1},
    ),
    (
        "NVRM: Xid (PCI:0018:01:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 03 (0x004a8040 0x00000000 "
        "0x00000000 "
        "0x00000000 0x00000000 0x00000000)",
        {"code": 145, "nvlink_unit": "RLW_REMAP", "nvlink_fatal": False, "nvlink_link": 3},
    ),
    (
        "NVRM: Xid (PCI:0018:01:00): 144, pid=123, name=nccl, SAW_MVB Nonfatal XC1 i2 Link 17 (0x1 0x2 0x3)",
        {"code": 144, "pid": 123, "nvlink_unit": "SAW_MVB", "nvlink_fatal": False, "nvlink_link": 17},
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 140, pid='<unknown>', name=<unknown>, An uncorrectable ECC "
        "error detected "
        "(possible firmware handling failure) DRAM:-1840691462, LTC:0, MMU:0, PCIE:0",
        {"code": 140, "pci": "0000:3b:00"},
    ),
    (
        "NVRM: Xid (PCI:0000:3b:00): 119, pid=1, name=x, Timeout after 6s of waiting for RPC response from GPU0 GSP!",
        {"code": 119},
    ),
]


@pytest.mark.parametrize(("line", "expected"), XID_CASES)
@pytest.mark.parametrize("prefix", PREFIXES)
def test_xid_lines_with_every_prefix(prefix: str, line: str, expected: dict[str, Any]) -> None:
    record = one(prefix + line)
    check(record, {"kind": "xid", "line": 1, "raw": prefix + line, **expected})


@pytest.mark.parametrize(
    ("prefix", "uptime", "seq"),
    [
        ("[ 1843.308145] ", 1843.308145, None),
        ("4,1234,1843308145,-;", 1843.308145, 1234),
        ("6,99,5000000,c;", 5.0, 99),
        ("Nov 22 15:39:14 host kernel: [ 12.5] ", 12.5, None),
        ("Nov 22 15:39:14 host kernel: ", None, None),
    ],
)
def test_prefix_metadata(prefix: str, uptime: float | None, seq: int | None) -> None:
    record = one(prefix + "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")
    assert record.uptime_s == uptime
    assert record.kmsg_seq == seq


@pytest.mark.parametrize("prefix", PREFIXES)
def test_fallen_off_the_bus_line_after_xid_79(prefix: str) -> None:
    lines = [
        prefix + "NVRM: Xid (PCI:0000:01:00): 79, pid=1, name=x, GPU has fallen off the bus.",
        prefix + "NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.",
        prefix + "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot "
        "Required)",
    ]
    records = list(parse_lines(lines))
    assert [(r.line, r.kind, r.code, r.pci) for r in records] == [
        (1, "xid", 79, "0000:01:00"),
        (2, "gpu_fallen_off_bus", None, "0000:01:00"),
        (3, "xid", 154, "0000:01:00"),
    ]
    assert records[1].message == "GPU has fallen off the bus."


@pytest.mark.parametrize("prefix", PREFIXES)
def test_three_line_banner_is_one_record_at_its_first_line(prefix: str) -> None:
    lines = [
        prefix + "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
        prefix + "NVRM: The NVIDIA GPU 0000:B3:00.0",
        prefix + "NVRM: (PCI ID: 10de:26b5) installed in this system has",
        prefix + "NVRM: fallen off the bus and is not responding to commands.",
        prefix + "NVRM: Xid (PCI:0000:17:00): 13, pid=1, name=x, Graphics Exception",
    ]
    records = list(parse_lines(lines))
    assert [(r.line, r.kind, r.pci) for r in records] == [
        (2, "gpu_fallen_off_bus", "0000:b3:00"),
        (5, "xid", "0000:17:00"),
    ]
    banner = records[0]
    assert banner.code is None
    assert banner.raw == "\n".join(lines[1:4])
    assert "fallen off the bus" in banner.message and "10de:26b5" in banner.message


def test_banner_survives_interleaved_non_nvidia_lines() -> None:
    lines = [
        "[ 10.1] NVRM: The NVIDIA GPU 0000:b3:00.0",
        "[ 10.1] usb 1-1: new high-speed USB device number 2 using xhci_hcd",
        "[ 10.1] NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "[ 10.1] NVRM: fallen off the bus and is not responding to commands.",
    ]
    assert [(r.line, r.kind) for r in parse_lines(lines)] == [(1, "gpu_fallen_off_bus")]


def test_incomplete_banner_yields_nothing_and_does_not_swallow_the_next_record() -> None:
    lines = [
        "NVRM: The NVIDIA GPU 0000:b3:00.0",
        "NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "NVRM: Xid (PCI:0000:b3:00): 79, GPU has fallen off the bus.",
        "NVRM: fallen off the bus and is not responding to commands.",
    ]
    assert [(r.line, r.kind, r.code) for r in parse_lines(lines)] == [(3, "xid", 79)]


def test_unsupported_gpu_banner_is_not_a_fault() -> None:
    lines = [
        "NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:1234)",
        "NVRM: installed in this system is not supported by the",
        "NVRM: NVIDIA 550.54.15 driver release.",
    ]
    assert list(parse_lines(lines)) == []


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize(
    ("line", "pci", "message"),
    [
        (
            "NVRM: GPU 0000:09:00.0: RmInitAdapter failed! (0x26:0x65:1239)",
            "0000:09:00",
            "RmInitAdapter failed! (0x26:0x65:1239)",
        ),
        (
            "NVRM: GPU 0000:3B:00.0: RmInitAdapter failed! (0x22:0x56:889)",
            "0000:3b:00",
            "RmInitAdapter failed! (0x22:0x56:889)",
        ),
        ("NVRM: RmInitAdapter failed! (0x31:0xffff:1225)", None, "RmInitAdapter failed! (0x31:0xffff:1225)"),
    ],
)
def test_rm_init_adapter_failed(prefix: str, line: str, pci: str | None, message: str) -> None:
    check(one(prefix + line), {"kind": "gpu_init_failed", "code": None, "pci": pci, "message": message})


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize(
    ("line", "code", "pci", "switch", "message"),
    [
        (
            "nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
            20034,
            "0000:c5:00.0",
            3,
            "Fatal, Link 30 LTSSM Fault Up",
        ),
        (
            "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 01004, Non-fatal, Link 02 Ingress invalid ACL",
            1004,
            "0000:05:00.0",
            0,
            "Non-fatal, Link 02 Ingress invalid ACL",
        ),
        (
            "nvidia-nvswitch11: SXid (PCI:0000:8a:00.1): 12028, Severity 1 Engine instance 30 Sub-engine instance 00",
            12028,
            "0000:8a:00.1",
            11,
            "Severity 1 Engine instance 30 Sub-engine instance 00",
        ),
    ],
)
def test_nvswitch_sxid(prefix: str, line: str, code: int, pci: str, switch: int, message: str) -> None:
    check(one(prefix + line), {"kind": "sxid", "code": code, "pci": pci, "nvswitch": switch, "message": message})


NON_MATCHES = [
    "",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
    "[    4.123456] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  595.45.04",
    "NVRM: GPU at PCI:0000:3b:00: GPU-9f6e2a3c-1d2e-4f5a-8b7c-0d1e2f3a4b5c",
    "NVRM: GPU Board Serial Number: 1650223012345",
    "NVRM: nvGpuOpsReportFatalError: uvm encountered global fatal error 0x60, requiring os reboot to recover.",
    "NVRM: Xid : 32, pid=2280636",
    "NVRM: Xid (PCI:0000:66:00): abc, pid=2280636",
    "NVRM: Xid (62): GPU has fallen off the bus",
    "Nov 22 15:39:14 host python3[1234]: RuntimeError: saw Xid 79 on GPU 0",
    "Nov 22 15:39:14 host app[12]: NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
    "2024-05-01 12:00:00 INFO trainer: NCCL error, check dmesg for NVRM: Xid (PCI:0000:01:00): 79, lost",
    "myapp: grep 'NVRM: Xid' /var/log/kern.log",
    "[ 1843.308145] nvidia-uvm: Loaded the UVM driver, major device number 510.",
    "[ 1843.308145] nvidia-nvswitch0: probe of 0000:05:00.0 failed with error -1",
    " SUBSYSTEM=pci",
    " DEVICE=+pci:0000:3b:00.0",
    "kernel: NVRM: API mismatch: the client has the version 550.54.15, but",
    "NVRM: The NVIDIA probe routine failed for 1 device(s).",
    "NVRM: None of the NVIDIA devices were initialized.",
]


@pytest.mark.parametrize("line", NON_MATCHES)
def test_lines_that_are_not_fault_records(line: str) -> None:
    assert list(parse_lines([line])) == []


def test_kmsg_records_with_continuation_lines() -> None:
    lines = [
        "6,1000,1843308145,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, An uncorrectable double bit error",
        " SUBSYSTEM=pci",
        " DEVICE=+pci:0000:3b:00.0",
        "4,1001,1843308200,-;nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
        " SUBSYSTEM=nvswitch",
    ]
    records = list(parse_lines(lines))
    assert [(r.line, r.kind, r.code, r.kmsg_seq) for r in records] == [
        (1, "xid", 48, 1000),
        (4, "sxid", 20034, 1001),
    ]


def test_line_numbers_count_every_input_line_and_crlf_is_tolerated() -> None:
    parser = KernelLogParser()
    assert parser.feed("unrelated\n") == []
    assert parser.feed("also unrelated\r\n") == []
    (record,) = parser.feed("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.\r\n")
    assert record.line == 3
    assert record.raw == "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."
    assert parser.lines_seen == 3


def test_storm_lines_parse_identically_and_keep_their_own_positions() -> None:
    """Cached texts must still carry each line's own number, raw text, sequence and uptime."""
    lines = [
        f"6,{seq},{seq * 1000},-;NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, "
        "Uncontained: FBHUB. RST: Yes, D-RST: No"
        for seq in range(1, 2001)
    ]
    records = list(parse_lines(lines))
    assert len(records) == 2000
    assert {(r.code, r.pci, r.rst, r.d_rst, r.message) for r in records} == {
        (95, "0000:c1:00", True, False, "Uncontained: FBHUB. RST: Yes, D-RST: No")
    }
    assert [r.line for r in records] == list(range(1, 2001))
    assert [r.kmsg_seq for r in records] == list(range(1, 2001))
    assert records[41].raw == lines[41]
    assert records[41].uptime_s == pytest.approx(0.042)


def test_many_distinct_texts_beyond_the_cache_still_parse() -> None:
    lines = [f"NVRM: Xid (PCI:0000:3b:00): 13, pid={i}, name=x, Graphics Exception {i}" for i in range(3000)]
    records = list(parse_lines(lines))
    assert [r.pid for r in records] == list(range(3000))


def test_record_to_dict_has_every_field() -> None:
    record = one("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")
    as_dict = record.to_dict()
    assert as_dict["code"] == 79 and as_dict["kind"] == "xid" and "caused_by_xid" in as_dict
    assert "wall_s" in as_dict and "uuid" in as_dict


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


# --- SXid addresses -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("location", "pci"),
    [
        ("PCI:...", None),
        ("...", None),
        ("PCI:0000:c5:00", None),  # not the printed form: the function is missing
        ("PCI:0000:C5:00.0", "0000:C5:00.0"),  # kept as printed
        ("0000:c5:00.1", "0000:c5:00.1"),
    ],
)
def test_sxid_pci_address_is_the_whole_address_or_none(location: str, pci: str | None) -> None:
    record = one(f"nvidia-nvswitch0: SXid ({location}): 12028, Severity 1 Engine instance 30")
    assert (record.kind, record.code, record.pci, record.nvswitch) == ("sxid", 12028, pci, 0)


# --- the GPU's UUID -------------------------------------------------------------------------------------------------

UUID_18 = "GPU-8a2c6ec4-0e1b-7b33-5cdf-3a6d9c3a6b1f"
UUID_B3 = "GPU-1d2e3f40-5a6b-7c8d-9e0f-a1b2c3d4e5f6"


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


def test_template_field_slices_match_the_record_fields() -> None:
    fields = FaultRecord._fields
    assert fields[:2] == ("line", "raw")
    assert fields[kernel_log._BODY_FIELDS] == ("kind", "code", "pci", "message")
    assert fields[kernel_log._BODY_FIELDS.stop : kernel_log._DETAIL_FIELDS.start] == ("kmsg_seq", "uptime_s", "wall_s")
    assert fields[kernel_log._UUID_FIELD] == "uuid"
    assert fields[kernel_log._AFTER_UUID_FIELDS] == ("reason", "critical")


def test_cached_records_keep_every_detail_around_the_per_line_fields() -> None:
    lines = [
        "kern  :warn  : 2025-01-21T04:41:44,283302+00:00 " + f"NVRM: GPU at PCI:0008:01:00: {UUID_18}",
        *(
            f"kern  :warn  : 2025-01-21T04:41:4{n},5+00:00 NVRM: Xid (PCI:0008:01:00 GPU-I:02 GPU-CI:01): 154, "
            "pid=9, name=x, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
            for n in range(3)
        ),
    ]
    records = list(parse_lines(lines))
    expected = {
        "kind": "xid",
        "code": 154,
        "pci": "0008:01:00",
        "message": "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
        "kmsg_seq": None,
        "uptime_s": None,
        "mig_gpu_instance": 2,
        "mig_compute_instance": 1,
        "pid": 9,
        "process_name": "x",
        "recovery_action_from": "None",
        "recovery_action_to": "GPU Reset Required",
        "recovery_action_from_code": 0,
        "recovery_action_to_code": 1,
        "nvswitch": None,
        "uuid": UUID_18,
        "reason": None,
        "critical": None,
    }
    for n, record in enumerate(records):
        check(record, {**expected, "line": n + 2, "raw": lines[n + 1]})
        assert record.wall_s == pytest.approx(calendar.timegm((2025, 1, 21, 4, 41, 40 + n)) + 0.5)


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
