"""Kernel log parser: every record format and prefix in the reference, lines that must not match, and the cache
of parsed texts that keeps each line's own fields."""

from __future__ import annotations

import calendar
from typing import Any

import pytest

from node_probe.classify import kernel_log
from node_probe.classify.kernel_log import KernelLogParser, parse_lines
from node_probe.classify.record import FaultRecord
from tests.kernel_log_lines import PREFIXES, UUID_18, check, one

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


# --- the cache of parsed texts ---------------------------------------------------------------------------------------


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
