"""Part A of the detection benchmark: the repair decision for every Xid in NVIDIA's catalog.

A real-format kernel line per code (under six log prefixes), parsed by node_probe.classify.kernel_log and
classified by node_probe.classify.policy.Policy ('ecs' and 'nvidia-catalog'), next to the decision rules peers
apply (ECS's list, the EKS node monitoring agent's fatal list, "any Xid replaces", "no Xid action"), scored
against NVIDIA's immediate resolution bucket; then the records that need more than the code (Xid 45's cause,
Xid 154's recovery action, Xid 94/95's RST flags, NVLink5 severity, the fallen-off-the-bus banner, RmInitAdapter,
SXid, a quoted line in an application log). Run through benchmarks.detection.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from benchmarks.support import REPO
from node_probe.classify.catalog import XidCatalog, XidInfo, default_catalog
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.policy import APPLICATION_BUCKETS, HARDWARE_BUCKETS, Policy, PolicyConfig, RepeatRule
from node_probe.classify.record import FaultRecord

REFERENCE_CATALOG = REPO.parent / "shared" / "reference" / "xid-catalog.tsv"
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


# The reference label, written out here from gpu-fault-signals.md section 4 rather than imported, so that the
# benchmark checks the policy's bucket sets instead of trusting them (part_a reports any difference).
# CHECK_MECHANICALS (Xid 54, auxiliary power not connected) is not named in that list, but it is a physical fault
# of the node, which is what "hardware side" means for a repair decision.
REFERENCE_HARDWARE = frozenset(
    {
        "RESET_GPU",
        "RESTART_BM",
        "RESTART_VM",
        "CONTACT_SUPPORT",
        "CHECK_MECHANICALS",
        "WORKFLOW_XID_48",
        "WORKFLOW_NVLINK_ERR",
        "WORKFLOW_NVLINK5_ERR",
    }
)
REFERENCE_APPLICATION = frozenset({"RESTART_APP", "IGNORE"})

# Message texts as the driver prints them, for the codes whose text the parser reads or that peers know well.
MESSAGES: dict[int, str] = {
    13: "Graphics SM Warp Exception on (GPC 1, TPC 0, SM 1): Out Of Range Address",
    31: "Ch 00000018, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_3 faulted @ 0x7f3c_5a000000",
    43: "Ch 00000010",
    45: "Ch 00000010",  # solo: no "caused by previous Xid"; the variants are in SPECIAL_RECORDS
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0",
    63: "Row Remapper: New row (0x00000000e800b6c0) marked for remapping, reset gpu to activate.",
    64: "Row Remapper Error: (0x00000000e800b6c0) - All reserved rows for bank are remapped",
    74: "NVLink: fatal error detected on link 2(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: LTC TAG (0x2,0x0). RST: No, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL)",
    140: "An uncorrectable ECC error detected (possible firmware handling failure) DRAM:-1840709432, LTC:0, MMU:0",
    154: "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
}
NVLINK5_MESSAGE = "{unit} Fatal XC0 i0 Link 09 (0x025525c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"
NVLINK5_UNITS = {
    144: "SAW_MVB",
    145: "RLW_REMAP",
    146: "TLW_ERR",
    147: "TREX_ERR",
    148: "NVLPW_CTRL",
    149: "NETIR_INT",
    150: "MSE_WATCHDOG",
}

# The log prefixes every line is parsed under (dmesg, dmesg -T, syslog, journalctl -o short-iso, dmesg -x, kmsg).
PREFIXES: tuple[Callable[[int], str], ...] = (
    lambda n: f"[{1843 + n:5d}.308145] ",
    lambda n: "[Fri Aug 30 11:43:09 2024] ",
    lambda n: f"Nov 22 15:{n % 60:02d}:14 gpu-node-17 kernel: ",
    lambda n: f"2026-11-30T10:{n % 60:02d}:00+0000 gpu-node-17 kernel: ",
    lambda n: f"kern  :err   : 2026-11-30T04:41:{n % 60:02d},283302+00:00 ",
    lambda n: f"4,{1000 + n},{1843308145 + n},-;",
)


def xid_body(code: int, info: XidInfo | None, pci: str) -> str:
    """One NVRM Xid line without prefix, in the driver's format; process context in the three shapes drivers use."""
    if code in NVLINK5_UNITS:
        message = NVLINK5_MESSAGE.format(unit=NVLINK5_UNITS[code])
    else:
        message = MESSAGES.get(code) or (info.description if info is not None else "Xid event")
    context = ("pid=4242, name=python3, ", "pid='<unknown>', name=<unknown>, ", "")[code % 3]
    return f"NVRM: Xid (PCI:{pci}): {code}, {context}{message}"


def pci_for(code: int) -> str:
    return f"0000:{(code % 200) + 16:02x}:00"


@dataclass(frozen=True)
class Rule:
    name: str
    note: str
    impairs: Callable[[FaultRecord, XidInfo | None], bool]


def rules() -> list[Rule]:
    # One Policy per name: they hold repeat-rule state (none configured here, so sharing across codes is harmless).
    ecs, nvidia = Policy("ecs"), Policy("nvidia-catalog")
    return [
        Rule("gpu-autorepair `ecs` (real Policy, default)", "ECS's 18 Xids", lambda r, i: ecs.classify(r, NOW).impairs),
        Rule(
            "gpu-autorepair `nvidia-catalog` (real Policy)",
            "NVIDIA's bucket, so equal to the reference by construction for plain lines",
            lambda r, i: nvidia.classify(r, NOW).impairs,
        ),
        Rule(
            "ECS Managed Instances (ecs_replaces column)",
            "what AWS replaces on",
            lambda r, i: i is not None and i.ecs_replaces,
        ),
        Rule(
            "EKS node monitoring agent (eks_fatal column)",
            "fatal conditions; others are warnings",
            lambda r, i: i is not None and i.eks_fatal,
        ),
        Rule("any Xid replaces", "a log grep for 'Xid'", lambda r, i: r.kind == "xid"),
        Rule("no Xid action", "EC2 status checks only: GPUs are passed through", lambda r, i: False),
    ]


def reference_label(info: XidInfo) -> str:
    bucket = info.immediate_bucket
    if not bucket:
        return "unassigned"
    if bucket in REFERENCE_HARDWARE:
        return "hardware"
    if bucket in REFERENCE_APPLICATION:
        return "application"
    return "other"  # WORKFLOW_XID_45, XID_154 (depend on another Xid), UPDATE_SWFW, CHECK_UVM


def parse_check(catalog: XidCatalog) -> tuple[dict[str, Any], dict[int, FaultRecord]]:
    """Every code under every prefix must come back as exactly one xid record with its code and GPU."""
    wrong: list[str] = []
    total = 0
    records: dict[int, FaultRecord] = {}
    for info in catalog:
        pci = pci_for(info.code)
        body = xid_body(info.code, info, pci)
        for index, prefix in enumerate(PREFIXES):
            line = prefix(info.code) + body
            total += 1
            parsed = list(parse_lines([line]))
            if len(parsed) != 1 or parsed[0].kind != "xid" or parsed[0].code != info.code or parsed[0].pci != pci:
                wrong.append(line)
            elif index == 0:
                records[info.code] = parsed[0]
    return {"lines": total, "parsed_correctly": total - len(wrong), "wrong": wrong}, records


def score_rules(catalog: XidCatalog, records: dict[int, FaultRecord]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for rule in rules():
        # A line the parser did not turn into a record cannot start a repair: it counts as "does not impair".
        decisions = {info.code: info.code in records and rule.impairs(records[info.code], info) for info in catalog}
        results.append({"rule": rule.name, "note": rule.note, **tally(catalog, decisions)})
    return results


def tally(catalog: XidCatalog, decisions: dict[int, bool]) -> dict[str, Any]:
    def part(infos: list[XidInfo]) -> dict[str, Any]:
        hardware = [i.code for i in infos if reference_label(i) == "hardware"]
        application = [i.code for i in infos if reference_label(i) == "application"]
        return {
            "hardware_side": len(hardware),
            "caught": sum(decisions[c] for c in hardware),
            "misses": [c for c in hardware if not decisions[c]],
            "application_side": len(application),
            "false_replacements": [c for c in application if decisions[c]],
            "agreements": sum(decisions[c] for c in hardware) + sum(not decisions[c] for c in application),
            "scored": len(hardware) + len(application),
        }

    every = list(catalog)
    current = [i for i in every if i.h100 or i.gb200]
    out: dict[str, Any] = {"all_codes": part(every), "h100_or_gb200": part(current)}
    out["unassigned_impaired"] = [i.code for i in every if reference_label(i) == "unassigned" and decisions[i.code]]
    out["unassigned"] = sum(reference_label(i) == "unassigned" for i in every)
    out["other_bucket"] = {
        f"{i.code} {i.immediate_bucket}": decisions[i.code] for i in every if reference_label(i) == "other"
    }
    return out


# Records whose decision needs more than the code. (name, lines, policy config or None)
SPECIAL_RECORDS: list[tuple[str, list[str], PolicyConfig | None]] = [
    ("Xid 45 alone (job teardown)", ["NVRM: Xid (PCI:0000:3b:00): 45, pid=77, name=python3, Ch 00000010"], None),
    *[
        (
            f"Xid 45 caused by previous Xid {cause}",
            [f"NVRM: Xid (PCI:0000:3b:00): 45, pid=77, name=python3, Ch 00000010, caused by previous Xid {cause}"],
            None,
        )
        for cause in (13, 48, 79, 95)
    ],
    *[
        (
            f"Xid 154 -> {action}",
            [f"NVRM: Xid (PCI:0018:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x{index:x} ({action})"],
            None,
        )
        for index, action in enumerate(
            (
                "None",
                "GPU Reset Required",
                "Node Reboot Required",
                "Drain P2P",
                "Drain and Reset",
                "Recover IMEX Domain",
                "Unknown",
            )
        )
    ],
    *[
        (
            f"Xid {code} RST: {rst}, D-RST: {drst}",
            [
                f"NVRM: Xid (PCI:0000:c1:00): {code}, pid='<unknown>', name=<unknown>, "
                f"{'Contained' if code == 94 else 'Uncontained'}: SM (0x1). RST: {rst}, D-RST: {drst}"
            ],
            None,
        )
        for code in (94, 95)
        for rst, drst in (("No", "No"), ("Yes", "No"), ("No", "Yes"))
    ],
    (
        "Xid 94 under MIG (GPU-I/GPU-CI), RST: No",
        ["NVRM: Xid (PCI:0000:c1:00 GPU-I:01 GPU-CI:00): 94, pid=9, name=x, Contained: SM (0x1). RST: No, D-RST: No"],
        None,
    ),
    (
        "Xid 145 NVLink5 Nonfatal",
        ["NVRM: Xid (PCI:0018:01:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 03 (0x004a8040 0x00000000 0x00000000)"],
        None,
    ),
    (
        "Xid 149 NVLink5 Fatal",
        ["NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000)"],
        None,
    ),
    (
        "fallen-off-the-bus banner (3 lines, no Xid)",
        [
            "NVRM: The NVIDIA GPU 0000:b3:00.0",
            "NVRM: (PCI ID: 10de:26b5) installed in this system has",
            "NVRM: fallen off the bus and is not responding to commands.",
        ],
        None,
    ),
    (
        "the same banner as /dev/kmsg records it (one record, newlines escaped)",
        [
            "3,1234,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: (PCI ID: 10de:26b5) installed in this "
            "system has\\x0aNVRM: fallen off the bus and is not responding to commands."
        ],
        None,
    ),
    (
        "the same banner as dmesg prints it (later lines indented)",
        [
            "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
            "               NVRM: (PCI ID: 10de:26b5) installed in this system has",
            "               NVRM: fallen off the bus and is not responding to commands.",
        ],
        None,
    ),
    (
        "the same banner as rsyslog writes it (#012)",
        [
            "Nov 22 15:39:14 gpu-node-17 kernel: NVRM: The NVIDIA GPU 0000:b3:00.0#012NVRM: (PCI ID: 10de:26b5) "
            "installed in this system has#012NVRM: fallen off the bus and is not responding to commands."
        ],
        None,
    ),
    ("'GPU has fallen off the bus' line (no Xid)", ["NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus."], None),
    ("RmInitAdapter failed (no Xid)", ["NVRM: GPU 0000:09:00.0: RmInitAdapter failed! (0x26:0x65:1239)"], None),
    ("NVSwitch SXid, Fatal", ["nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"], None),
    (
        "NVSwitch SXid, Fatal, operator add_sxids={20034}",
        ["nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"],
        PolicyConfig(add_sxids={20034}),
    ),
    (
        "an application's log quoting an Xid 79 line",
        ["Nov 22 15:39:14 gpu-node-17 python3[4242]: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."],
        None,
    ),
    (
        "Xid 13 three times in 10 min, operator repeat rule 3/600s",
        [
            f"[{1000 + 60 * n}.000000] NVRM: Xid (PCI:0000:17:00): 13, pid=77, name=x, Graphics Exception"
            for n in range(3)
        ],
        PolicyConfig(repeat=[RepeatRule(code=13, count=3, within=timedelta(seconds=600))]),
    ),
]


def naive_any_xid(lines: Sequence[str]) -> bool:
    # What a monitor that greps for "Xid" would do: it replaces on any such line, quoted or not, and never on a
    # fault that the driver reports without the word.
    return any("Xid" in line and "SXid" not in line for line in lines)


def special_records() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name, lines, config in SPECIAL_RECORDS:
        records = list(parse_lines(lines))
        row: dict[str, Any] = {"record": name, "parsed": [f"{r.kind}:{r.code}" if r.code else r.kind for r in records]}
        for policy_name in ("ecs", "nvidia-catalog"):
            policy = Policy(policy_name, config)
            verdicts = [policy.classify(r, NOW) for r in records]
            # The instance is impaired if any record of the sequence impairs (the health workflow's rule).
            row[policy_name] = any(v.impairs for v in verdicts)
            row[f"{policy_name}_rule"] = verdicts[-1].rule if verdicts else "no record"
        row["any_xid"] = naive_any_xid(lines)
        out.append(row)
    return out


def part_a(catalog_path: Path | None) -> dict[str, Any]:
    shipped = default_catalog()
    if catalog_path is not None and catalog_path.exists():
        catalog = XidCatalog.from_text(catalog_path.read_text(encoding="utf-8"))
        source = str(catalog_path)
    else:
        catalog, source = shipped, "node_probe/xid_catalog.tsv (no reference copy found)"
    same = [(i.code, i.immediate_bucket, i.ecs_replaces) for i in catalog] == [
        (i.code, i.immediate_bucket, i.ecs_replaces) for i in shipped
    ]
    parsing, records = parse_check(catalog)
    labels = Counter(reference_label(i) for i in catalog)
    return {
        "catalog": source,
        "catalog_codes": len(catalog),
        "shipped_catalog_matches_reference": same,
        "policy_bucket_sets_match_reference": HARDWARE_BUCKETS == REFERENCE_HARDWARE
        and APPLICATION_BUCKETS == REFERENCE_APPLICATION,
        "labels": dict(labels),
        "labels_h100_or_gb200": dict(Counter(reference_label(i) for i in catalog if i.h100 or i.gb200)),
        "parsing": parsing,
        # The real `ecs` policy must be exactly ECS's list, code by code (a parse or policy bug would show here).
        "ecs_policy_equals_ecs_column": all(
            Policy("ecs").classify(record, NOW).impairs == (code in catalog.ecs_codes)
            for code, record in records.items()
        ),
        "hardware_codes_described_unused": [
            i.code for i in catalog if reference_label(i) == "hardware" and i.description == "Unused"
        ],
        "rules": score_rules(catalog, records),
        "special_records": special_records(),
    }
