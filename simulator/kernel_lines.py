"""What the NVIDIA driver writes to a simulated node's kernel log: a clean boot, and Xid lines in its own words.

Faults reach the probe the way they reach it on a real host, as NVRM lines appended to the kernel log it
follows, so the probe's real parser and policy decide what they mean. Which Xids to write is the fleet's
choice (simulator.fleet); this module only knows how the driver spells them.

The message texts below are the driver's printed wording, which NVIDIA's Xid catalog does not carry (its
descriptions are a summary: "Double Bit ECC Error" where the driver prints a sentence about the framebuffer),
so they are kept here by hand; every code in them must be known to the catalog.
"""

from __future__ import annotations

import random

from node_probe.classify.catalog import default_catalog
from node_probe.classify.verdicts import RECOVERY_ACTIONS
from simulator.nodes import SimNode

# PCI bus addresses of the 8 H100s in a p5.48xlarge.
P5_GPU_PCI: tuple[str, ...] = (
    "0000:53:00",
    "0000:64:00",
    "0000:75:00",
    "0000:86:00",
    "0000:97:00",
    "0000:a8:00",
    "0000:b9:00",
    "0000:ca:00",
)

# Message texts as the NVIDIA driver prints them after "NVRM: Xid (PCI:...): <code>, pid=..., name=..., ".
_XID_MESSAGES: dict[int, str] = {
    13: "Graphics SM Warp Exception on (GPC 1, TPC 0, SM 1): Out Of Range Address",
    31: (
        "Ch 00000018, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_3 faulted @ 0x7f3c_5a000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ"
    ),
    43: "Ch 00000010",
    46: "GPU stopped processing",
    48: (
        "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, "
        "subpartition 1."
    ),
    54: "Auxiliary power is not connected to the GPU board",
    62: "Internal micro-controller halt",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink: fatal error detected on link 2(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    95: "Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No",
    109: "Context Switch Timeout Error",
    110: "Security Fault Error",
    140: "Unrecovered ECC Error",
}
# An Xid without a transcribed message still gets a line the parser reads; only the free text is generic.
_GENERIC_MESSAGE = "Xid event, see the NVIDIA Xid catalog"
# Hardware faults are usually reported outside any process context.
_NO_PROCESS_XIDS = frozenset({48, 54, 62, 64, 74, 95, 110, 140})


def _require_catalogued() -> None:
    # A typo in the hand-kept tables would otherwise only show as a line the probe classifies as unknown.
    unknown = sorted(code for code in (*_XID_MESSAGES, *_NO_PROCESS_XIDS) if code not in default_catalog())
    if unknown:
        raise RuntimeError(f"simulated driver messages name Xids the catalog does not know: {unknown}")


_require_catalogued()


def append(node: SimNode, lines: list[str]) -> None:
    """Append whole lines to the node's kernel log."""
    node.kernel_log.parent.mkdir(parents=True, exist_ok=True)
    # One write of whole lines: the probe never sees half a line.
    with node.kernel_log.open("a", encoding="utf-8") as handle:
        handle.write("".join(f"{line}\n" for line in lines))
    if node.kernel_news is not None:
        node.kernel_news.put_nowait(list(lines))


def stamp(node: SimNode) -> str:
    """The node's uptime as dmesg prints it, e.g. `[86400.123456]`."""
    uptime = node.uptime()
    seconds = int(uptime)
    micros = int((uptime - seconds) * 1_000_000)
    return f"[{seconds:5d}.{micros:06d}]"


def xid_line(node: SimNode, rng: random.Random, xid: int, pci: str | None = None) -> str:
    """One NVRM Xid line exactly as the driver writes it to the kernel log (GPU and process drawn from `rng`)."""
    pci = pci or rng.choice(P5_GPU_PCI)
    if xid in _NO_PROCESS_XIDS:
        process = "pid='<unknown>', name=<unknown>"
    else:
        process = f"pid={rng.randint(1000, 65000)}, name={rng.choice(['python3', 'pt_main_thread'])}"
    message = _XID_MESSAGES.get(xid, _GENERIC_MESSAGE)
    return f"{stamp(node)} NVRM: Xid (PCI:{pci}): {xid}, {process}, {message}"


def fault_lines(node: SimNode, rng: random.Random, xid: int, pci: str | None = None) -> tuple[str, list[str]]:
    """The lines one GPU fault adds to the kernel log, and the GPU it hit (`pci`, or one drawn from `rng`)."""
    pci = pci or rng.choice(P5_GPU_PCI)
    lines = [xid_line(node, rng, xid, pci)]
    if xid == 79:
        # The driver repeats the news in its own words right after the Xid: a probe must not count the one fault
        # twice.
        lines.append(f"{stamp(node)} NVRM: GPU {pci}.0: GPU has fallen off the bus.")
    return pci, lines


def recovery_action_line(node: SimNode, pci: str, to: int, frm: int = 0) -> str:
    """Xid 154 as the driver writes it after the Xid whose recovery it names: NVIDIA's verdict on the GPU."""
    return (
        f"{stamp(node)} NVRM: Xid (PCI:{pci}): 154, GPU recovery action changed from "
        f"{frm:#x} ({RECOVERY_ACTIONS[frm].name}) to {to:#x} ({RECOVERY_ACTIONS[to].name})"
    )


def boot_lines(gpu_uuids: dict[str, str]) -> list[str]:
    """What dmesg holds after a clean boot: the probe must read it as history and find nothing to report."""
    lines = [
        "[    4.812345] nvidia: loading out-of-tree module taints kernel.",
        "[    4.913020] nvidia-nvlink: Nvlink Core is being initialized, major device number 510",
        "[    5.104871] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024",
    ]
    lines += [f"[    9.{200000 + i:06d}] NVRM: GPU at PCI:{pci}: {gpu_uuids[pci]}" for i, pci in enumerate(P5_GPU_PCI)]
    return lines
