"""Kernel log lines as real hosts printed them, each with where it was published, and the prefixes and wrappers log
tools put around them. A line made here (a documented prefix around a published body) says so."""

from __future__ import annotations

import calendar
import json
from typing import Any

import pytest

from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.log_prefix import PrefixReader, parse_prefix
from node_probe.classify.record import FaultRecord

NOW = float(calendar.timegm((2025, 6, 1, 0, 0, 0, 0, 0, 0)))


def records(*lines: str) -> list[FaultRecord]:
    return list(parse_lines(lines, now=lambda: NOW))


def check(record: FaultRecord, expected: dict[str, Any]) -> None:
    assert {key: getattr(record, key) for key in expected} == expected


# --- real lines, one published sample each -------------------------------------------------------------------------

# (source, line, what the record says); a None expectation: the line is no fault record.
REAL: list[tuple[str, str, dict[str, Any] | None]] = [
    (
        # NVIDIA's own example; `[...]` is how the page elides the prefix. The old driver's address has no `PCI:`.
        "https://docs.nvidia.com/deploy/xid-errors/index.html",
        "[...] NVRM: Xid (0000:03:00): 14, Channel 00000001",
        {"kind": "xid", "code": 14, "pci": "0000:03:00", "message": "Channel 00000001"},
    ),
    (
        "https://pastebin.com/NGng33SB",
        "Nov 22 18:29:55 hostname kernel: [ 966.503025] NVRM: Xid (0000:01:00): 31, Ch 0000000b, engmask 00000120, "
        "intr 10000000",
        {
            "code": 31,
            "pci": "0000:01:00",
            "uptime_s": 966.503025,
            "message": "Ch 0000000b, engmask 00000120, intr 10000000",
        },
    ),
    (
        "https://github.com/Bumblebee-Project/Bumblebee/issues/677",
        "[24128.828315] NVRM: Xid (PCI:0000:01:00): 32, Channel ID 00000000 intr 00004000",
        {"code": 32, "pci": "0000:01:00", "uptime_s": 24128.828315, "pid": None},
    ),
    (
        "https://github.com/Bumblebee-Project/Bumblebee/issues/677",
        "[24128.834365] NVRM: Xid (PCI:0000:01:00): 31, Ch 00000003, engmask 00000101, intr 10000000",
        {"code": 31, "message": "Ch 00000003, engmask 00000101, intr 10000000"},
    ),
    (
        "leptonai/gpud components/accelerator/nvidia/error/xid/README.md (dmesg --ctime)",
        "[Fri Aug 30 11:43:09 2024] NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM "
        "Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
        {"code": 13, "pci": "0000:cb:00", "pid": None, "process_name": None, "uptime_s": None},
    ),
    (
        "leptonai/gpud components/accelerator/nvidia/error/xid/README.md (dmesg --ctime)",
        "[Fri Aug 30 11:43:14 2024] NVRM: Xid (PCI:0000:cb:00): 109, pid=1797828, name=pt_main_thread, Ch 00000008, "
        "errorString CTX SWITCH TIMEOUT, Info 0x58005",
        {"code": 109, "pid": 1797828, "process_name": "pt_main_thread"},
    ),
    (
        "https://dredyson.com/how-xid109-ctx-switch-timeout-driver-crashes-in-many-applications-is-impacting-the-"
        "development-of-automotive-software-a-complete-step-by-step-debugging-and-fix-guide-for-embedded-gpu-"
        "systems-in-conn/",
        "NVRM: Xid (PCI:0000:01:00): 109, pid=168149, name=r5apex_dx12.exe, Ch 00000076, errorString CTX SWITCH "
        "TIMEOUT, Info 0x3c046",
        {"code": 109, "pid": 168149, "process_name": "r5apex_dx12.exe"},
    ),
    (
        "https://github.com/NVIDIA/open-gpu-kernel-modules/issues/1150 (journalctl, host and time cut by the poster)",
        "kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",
        {"code": 45, "pci": "0000:dc:00", "caused_by_xid": 149, "pid": 1818990},
    ),
    (
        "https://github.com/leptonai/gpud/pull/870 (gpud's fault injector through /dev/kmsg, read with dmesg -x)",
        "syslog:err   : 2025-05-27T04:18:56,089671+00:00 NVRM: Xid (PCI:0000:04:00): 79, GPU has fallen off the bus",
        {"code": 79, "pci": "0000:04:00", "wall_s": calendar.timegm((2025, 5, 27, 4, 18, 56)) + 0.089671},
    ),
    (
        "https://forums.developer.nvidia.com/t/bug-xid-62-gsp-watchdog-timeout-on-rtx-5080-during-high-context-llm-"
        "inference/371272",
        "NVRM: Xid (PCI:0000:01:00): 62, 323f0f30 0000c3d8 00000000 206dae68 206da022 206da190 206d85f6 206d8d86",
        {"code": 62, "pid": None, "message": "323f0f30 0000c3d8 00000000 206dae68 206da022 206da190 206d85f6 206d8d86"},
    ),
    (
        "https://forums.developer.nvidia.com/t/bug-xid-62-gsp-watchdog-timeout-on-rtx-5080-during-high-context-llm-"
        "inference/371272",
        "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
        {"code": 154, "recovery_action_to": "GPU Reset Required", "recovery_action_to_code": 1},
    ),
    (
        "https://forums.developer.nvidia.com/t/bug-xid-62-gsp-watchdog-timeout-on-rtx-5080-during-high-context-llm-"
        "inference/371272",
        "NVRM: GPU0 _kgspRpcGspEventPmuHalted: Received signal from GSP that PMU has halted.",
        None,
    ),
    (
        # `pid=` without `name=`: the process name is not printed for this Xid.
        "https://huggingface.co/datasets/LHRS-UM-FERI/MENTHOS-dataset-rootcause",
        "NVRM: Xid (PCI:0000:0f:00): 64, pid=57530, Row Remapper Error: (0x00000005d28c03a0) - All reserved rows for "
        "bank are remapped",
        {
            "code": 64,
            "pid": 57530,
            "process_name": None,
            "message": "Row Remapper Error: (0x00000005d28c03a0) - All reserved rows for bank are remapped",
        },
    ),
    (
        "https://huggingface.co/datasets/LHRS-UM-FERI/MENTHOS-dataset-rootcause",
        "nvidia-nvswitch4: SXid (PCI:0000:c6:00.0): 19084, Non-fatal, Link 29 AN1 Heartbeat Timeout Error (First)",
        {"kind": "sxid", "code": 19084, "pci": "0000:c6:00.0", "nvswitch": 4},
    ),
    (
        "https://huggingface.co/datasets/LHRS-UM-FERI/MENTHOS-dataset-rootcause",
        "nvidia-nvswitch2: SXid (PCI:0000:c4:00.0): 10002, Severity 5 Engine instance 00 Sub-engine instance 00",
        {"kind": "sxid", "code": 10002, "message": "Severity 5 Engine instance 00 Sub-engine instance 00"},
    ),
    (
        "https://github.com/NVIDIA/nvtrust/issues/124",
        "[   25.948274] nvidia-nvswitch1: SXid (PCI:0000:02:00.0): 22013, Non-fatal, Link 00 Minion Link DLREQ "
        "interrupt",
        {"kind": "sxid", "code": 22013, "pci": "0000:02:00.0", "nvswitch": 1, "uptime_s": 25.948274},
    ),
    (
        "https://github.com/NVIDIA/nvtrust/issues/124",
        "[   25.952303] nvidia-nvswitch1: SXid (PCI:0000:02:00.0): 22013, Data {0x00000000, 0x00000000, 0x00000000, "
        "0x00000000, 0x80005302, 0x00000000, 0x00000000, 0x00000000, 0x00000000}",
        {
            "kind": "sxid",
            "code": 22013,
            "message": "Data {0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x80005302, "
            "0x00000000, 0x00000000, 0x00000000, 0x00000000}",
        },
    ),
    (
        "https://github.com/leptonai/gpud/pull/338",
        "kern  :err   : 2025-01-25T10:34:54,859532+00:00 nvidia-nvswitch1: SXid (PCI:0000:84:00.0): 12028, Data "
        "{0x000001c0, 0x00bd5c8a, 0x00000500, 0x00000064, 0x00000000, 0x40008000, 0x5a001100, 0x00000000, 0x00000000}",
        {
            "kind": "sxid",
            "code": 12028,
            "pci": "0000:84:00.0",
            "wall_s": calendar.timegm((2025, 1, 25, 10, 34, 54)) + 0.859532,
        },
    ),
    (
        "https://github.com/NVIDIA/open-gpu-kernel-modules/issues/976",
        "Nov 26 22:38:10 Android kernel: NVRM: memdescPrintMemdesc: Has additional IOMMU mapping for IOVA space 0x100 "
        "starting @ 0xff4df000",
        None,
    ),
    (
        "https://github.com/NVIDIA/NVSentinel/issues/155",
        "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).",
        None,
    ),
    (
        "https://github.com/Bumblebee-Project/Bumblebee/issues/550 (an application naming a GPU, not the driver)",
        "Mar 05 23:33:35 ivosung bumblebeed[1734]: [91063.874832] [ERROR][XORG] (EE) NVIDIA(GPU-0): Failed to "
        "initialize the NVIDIA GPU at PCI:1:0:0.  Please",
        None,
    ),
]


@pytest.mark.parametrize(("source", "line", "expected"), REAL, ids=[f"{n}" for n in range(len(REAL))])
def test_real_lines(source: str, line: str, expected: dict[str, Any] | None) -> None:
    found = records(line)
    if expected is None:
        assert found == [], source
    else:
        (record,) = found
        check(record, {"raw": line, **expected})


def test_a_published_xid_79_with_its_companions_and_the_switches_that_followed() -> None:
    """leptonai/gpud components/accelerator/nvidia/error/sxid/README.md: the GPU's identity (with `PCI:`), its Xid
    79, the driver's own fallen-off-the-bus line, and the NVSwitch SXids in both layouts (the error, then its
    Severity and Data lines)."""
    lines = [
        "[6781741.548768] NVRM: GPU at PCI:0000:91:00: GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b",
        "[6781741.548776] NVRM: GPU Board Serial Number: 1653723052734",
        "[6781741.548779] NVRM: Xid (PCI:0000:91:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
        "[6781741.548783] NVRM: GPU 0000:91:00.0: GPU has fallen off the bus.",
        "[6781741.548786] NVRM: GPU 0000:91:00.0: GPU serial number is 1653723052734.",
        "[6781753.400584] nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
        "[6781753.404848] nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Severity 1 Engine instance 60 Sub-engine "
        "instance 00",
        "[6781753.406566] nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Data {0x10000000, 0x10000000, 0x00000000, "
        "0x10000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}",
    ]
    uuid = "GPU-b6c3b2be-c55b-d076-fa0e-d464e4c7e08b"
    assert [(r.line, r.kind, r.code, r.pci, r.uuid, r.nvswitch) for r in records(*lines)] == [
        (3, "xid", 79, "0000:91:00", uuid, None),
        (4, "gpu_fallen_off_bus", None, "0000:91:00", uuid, None),
        (6, "sxid", 20034, "0000:06:00.0", None, 1),
        (7, "sxid", 20034, "0000:07:00.0", None, 2),
        (8, "sxid", 20034, "0000:05:00.0", None, 0),
    ]


def test_the_gpu_identity_line_without_pci_names_the_gpu_of_the_next_xid() -> None:
    """https://docs.nvidia.com/deploy/xid-errors/index.html prints the identity line of old drivers, without `PCI:`
    (`[...]` is the page's elision of the prefix)."""
    (record,) = records(
        "[...] NVRM: GPU at 0000:03:00: GPU-b850f46d-d5ea-c752-ddf3-c4453e44d3f7",
        "[...] NVRM: Xid (0000:03:00): 14, Channel 00000001",
    )
    assert (record.code, record.pci, record.uuid) == (14, "0000:03:00", "GPU-b850f46d-d5ea-c752-ddf3-c4453e44d3f7")


def test_the_banner_without_an_xid_as_published() -> None:
    """https://github.com/NVIDIA/NVSentinel/issues/155: dmesg's banner, the probe routine's failure, the reload."""
    lines = [
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
        "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "               NVRM: fallen off the bus and is not responding to commands.",
        "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).",
        "[ 1843.439669] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  570.158.01  Release Build  "
        "(dvs-builder@U22-I3-B10-02-5)  Mon Jun  2 13:13:04 UTC 2025",
    ]
    assert [(r.line, r.kind, r.pci, r.uptime_s) for r in records(*lines)] == [
        (1, "gpu_fallen_off_bus", "0000:b3:00", 1843.308145)
    ]


# --- prefixes and wrappers without a published NVRM sample: made here, each around a published body ---------------

BODY = "NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. RST: Yes, D-RST: No"
# (prefix, where its format is documented, uptime, kmsg sequence, wall clock); BODY is NVSentinel#1120's storm line
# as the reference quotes it, the combinations are constructed.
MADE: list[tuple[str, str, float | None, int | None, float | None]] = [
    ("", "no prefix: dmesg -t, journalctl -o cat", None, None, None),
    ("<4>[ 1843.308145] ", "dmesg -r: the raw priority before the stamp (dmesg(1))", 1843.308145, None, None),
    ("[ 1843.308145 <    0.000123>] ", "dmesg -d: the delta after the uptime (dmesg(1))", 1843.308145, None, None),
    ("[  +0.000123] ", "dmesg -e: the delta alone on later lines (dmesg(1))", None, None, None),
    ("[Jun01 00:00] ", "dmesg -e: a minute, no year (dmesg(1))", None, None, None),
    ("[ 1843] ", "an integer uptime", 1843.0, None, None),
    ("1843.308145 ", "a bare fractional uptime", 1843.308145, None, None),
    ("1843 ", "a bare integer: its unit is not known, so no uptime", None, None, None),
    ("6,1234,1843308145,-,caller=T1;", "/dev/kmsg with the caller id of newer kernels", 1843.308145, 1234, None),
    ("Jun  1 00:00:00.250000 host kernel: ", "journalctl -o short-precise", None, None, NOW + 0.25),
    ("2025-06-01T00:00:00+0000 host kernel: ", "journalctl -o short-iso", None, None, NOW),
    ("2025-06-01T00:00:00.250000+00:00 host kernel: ", "journalctl -o short-iso-precise", None, None, NOW + 0.25),
    ("1748736000.250000 host kernel: ", "journalctl -o short-unix", None, None, NOW + 0.25),
    ("[ 1843.308145] host kernel: ", "journalctl -o short-monotonic", 1843.308145, None, None),
    ("2025-06-01T00:00:00,250000+00:00 ", "dmesg --time-format=iso", None, None, NOW + 0.25),
    (
        "<4>1 2025-06-01T00:00:00.25Z host kernel - - - ",
        "RFC 5424 syslog (rsyslog's protocol-23 format)",
        None,
        None,
        NOW + 0.25,
    ),
    (
        "2025-06-01T00:00:00.250000000Z stdout F ",
        "CRI container log (kubelet; Grafana's promtail cri stage documents it)",
        None,
        None,
        NOW + 0.25,
    ),
    (
        "2025-06-01T00:00:00.250000000Z stderr F [ 1843.308145] ",
        "CRI container log of a container that runs dmesg",
        1843.308145,
        None,
        NOW + 0.25,
    ),
    (
        "2025-06-01T00:00:00.250000000Z stdout F Jun  1 00:00:09 host kernel: ",
        "CRI container log of a container that tails kern.log: the outermost time wins",
        None,
        None,
        NOW + 0.25,
    ),
]


@pytest.mark.parametrize(("prefix", "form", "uptime", "seq", "wall"), MADE, ids=[m[1] for m in MADE])
def test_made_prefixes(prefix: str, form: str, uptime: float | None, seq: int | None, wall: float | None) -> None:
    (record,) = records(prefix + BODY)
    check(record, {"code": 95, "pci": "0000:c1:00", "rst": True, "uptime_s": uptime, "kmsg_seq": seq})
    assert record.wall_s == (pytest.approx(wall) if wall is not None else None), form


def docker(log: str, stream: str = "stderr", stamp: str = "2025-06-01T00:00:00.250000000Z") -> str:
    """Docker's json-file line (https://docs.docker.com/engine/logging/drivers/json-file/), written as Go's encoder
    writes it: `<` and `>` escaped."""
    line = json.dumps({"log": log + "\n", "stream": stream, "time": stamp}, separators=(",", ":"))
    return line.replace("<", "\\u003c").replace(">", "\\u003e")


def test_docker_json_lines_are_unwrapped() -> None:
    """Made here: the json-file wrapper around a dmesg line and around a bare body."""
    wrapped = docker("[ 1843.308145] " + BODY)
    (record,) = records(wrapped)
    check(record, {"code": 95, "pid": None, "uptime_s": 1843.308145, "raw": wrapped})
    assert record.wall_s == pytest.approx(NOW + 0.25)
    (bare,) = records(docker(BODY, stream="stdout"))
    assert (bare.code, bare.rst, bare.uptime_s) == (95, True, None)


@pytest.mark.parametrize(
    "line",
    [
        # Made here: an application's own output in each wrapper quotes an NVRM message; it is not the kernel's.
        "2025-06-01T00:00:00.250000000Z stdout F INFO trainer: saw " + BODY,
        docker("INFO trainer: saw " + BODY),
        '{"log":"not a docker line"} ' + BODY,
        '{"message": "' + BODY + '"}',
        "2025-06-01T00:00:00.250000000Z stdout X " + BODY,
        "[INFO] " + BODY,
        "[ 1843.308145] [worker 3] " + BODY,
        "Jun  1 00:00:00 host python3[99]: " + BODY,
        "<4>1 2025-06-01T00:00:00Z host python3 99 - - " + BODY,
        "1843.308145 host python3: " + BODY,
        "   [ 12.5] " + BODY,
    ],
)
def test_wrapped_application_lines_are_not_records(line: str) -> None:
    assert records(line) == []


def test_a_body_is_found_wherever_the_prefix_ends() -> None:
    """The same published body after each prefix stack the reference lists, stacked two and three deep."""
    stacks = [
        "Jun  1 00:00:00 host kernel: [ 1843.308145] ",
        "2025-06-01T00:00:00.250000000Z stderr F kern  :warn  : 2025-06-01T00:00:00,250000+00:00 ",
        "2025-06-01T00:00:00.250000000Z stderr F Jun  1 00:00:00 host kernel: [ 1843.308145] ",
    ]
    assert [(r.code, r.uptime_s) for r in records(*(s + BODY for s in stacks))] == [
        (95, 1843.308145),
        (95, None),
        (95, 1843.308145),
    ]


@pytest.mark.parametrize(
    "prefix",
    [
        "[ 1843.308145] ",
        "[1843.308145] ",
        "[ 1843.] ",
        "[ .5] ",
        "[ 1e5] ",
        "[ 1843.30\uff18145] ",  # a full-width digit: the quick reader leaves it to the grammar
        "6,1234,1843308145,-;",
        "<6>,1234,1843308145,c;",
        "6,1234,1843308145,-,caller=T1;",
        "6,12a4,1843308145,-;",
        "6,1234;",
    ],
)
def test_the_quick_prefix_readers_agree_with_the_grammar(prefix: str) -> None:
    """dmesg's uptime and the kmsg header are read without a regex; whatever they accept, the grammar reads alike."""
    assert PrefixReader().read(prefix) == parse_prefix(prefix)


def test_more_distinct_prefixes_than_the_cache_holds_still_parse() -> None:
    lines = [f"kern  :err   : 2025-06-01T00:{n // 60 % 60:02d}:{n % 60:02d},{n:06d}+00:00 {BODY}" for n in range(2000)]
    walls = [record.wall_s for record in records(*lines)]
    assert walls == [pytest.approx(NOW + n + n / 1e6) for n in range(2000)]
