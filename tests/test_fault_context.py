"""The kernel-log lines around an impairing fault travel with its finding (node_probe/classify/context.py), for the
incident's evidence; a warning carries none, and the ring stays bounded however long the log."""

from __future__ import annotations

from pathlib import Path

from node_probe.classify.context import AFTER, BEFORE, RING_LINES, RecentLines
from node_probe.probe import Probe
from tests.test_probe import XID_13, FakeReporter, append, config, eventually, running

# A PCIe Advanced Error Reporting burst before the GPU fell off the bus: the kernel's own AER wording
# (drivers/pci/pcie/aer.c, "AER: %s error message received from %s" and the per-device detail lines).
AER = (
    "[ 1845.111111] pcieport 0000:3a:00.0: AER: Uncorrectable (Fatal) error message received from 0000:3b:00.0\n"
    "[ 1845.111200] nvidia 0000:3b:00.0: PCIe Bus Error: severity=Uncorrectable (Fatal), type=Inaccessible, "
    "(Unregistered Agent ID)\n"
)
XID_79_LATER = "[ 1850.000000] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n"
# Another GPU's, later: a fault of its own, not a repeat of the first.
XID_79_AGAIN = XID_79_LATER.replace("1850", "1860").replace("0000:3b:00", "0000:5e:00")
AFTER_LINES = "[ 1850.000001] NVRM: GPU 0000:3b:00.0: RmInitAdapter failed! (0x26:0xffff:1474)\n"
NOISE = "".join(f"[ {1000 + i}.000000] systemd[1]: unit-{i}.service: Succeeded.\n" for i in range(40))


async def test_an_impairing_fault_carries_the_lines_around_it_and_a_warning_none(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    text = NOISE + XID_13 + AER + XID_79_LATER + AFTER_LINES
    log.write_text(text)
    reporter = FakeReporter()
    async with running(Probe(config(tmp_path), reporter)):
        await eventually(lambda: len(reporter.findings) >= 2)
    warning, fault = reporter.findings[:2]
    assert (warning.reason, warning.impairs, warning.context) == ("XID_13", False, [])
    assert fault.reason == "XID_79" and fault.impairs
    # BEFORE lines before it (the AER burst and the warning among them), the fault's own line, the line after.
    lines = text.splitlines()
    at = lines.index(XID_79_LATER.rstrip("\n"))
    assert fault.context == lines[at - BEFORE : at + AFTER + 1]
    assert AER.splitlines()[0] in fault.context and XID_13.rstrip("\n") in fault.context
    assert fault.context[-1] == AFTER_LINES.rstrip("\n") and len(fault.context) <= 20

    # Lines appended later are read into the same ring: a later fault has its own surroundings.
    append(log, AER.replace("1845", "1859") + XID_79_AGAIN)
    async with running(Probe(config(tmp_path), reporter)):
        await eventually(lambda: any(f.raw == XID_79_AGAIN.rstrip("\n") for f in reporter.findings))
    again = next(f for f in reporter.findings if f.raw == XID_79_AGAIN.rstrip("\n"))
    assert again.context[-3:] == (AER.replace("1845", "1859") + XID_79_AGAIN).splitlines()


def test_the_ring_is_bounded_and_forgets_what_a_storm_pushed_out() -> None:
    fault = "[1.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."
    ring = RecentLines()
    ring.append(fault)
    assert ring.around(fault) == [fault]
    for i in range(RING_LINES):
        ring.append(f"[{i + 2}.0] storm line {i}")
    assert ring.around(fault) == []  # pushed out: no context rather than the wrong lines
    # A banner's raw text is its lines joined: found by its first line; a huge line is cut.
    ring.append("x" * 10_000)
    around = ring.around("x" * 10_000 + "\nthe banner's second line")
    assert around[-1] == "x" * 512
    assert around[:-1] == [f"[{i + 2}.0] storm line {i}" for i in range(RING_LINES - BEFORE, RING_LINES)]
    assert ring.around("") == [] and ring.around("never logged") == []
