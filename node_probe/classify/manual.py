"""Findings from a fault an operator names (an Xid, or a kernel log line), built exactly as the probe builds them
from its own sources: the probe's parser, policy and finding ids. Used by `autorepair inject` (straight to
Temporal, game day) and `autorepair probe-report` (through the ingest, as the host itself)."""

from __future__ import annotations

import argparse
import re
import uuid
from datetime import datetime

from contract.probe import GpuFinding
from node_probe.classify.findings import make_finding
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.policy import Policy
from node_probe.classify.record import FaultRecord

DEFAULT_PCI = "0000:00:00"
_PCI = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}$")


def pci_address(text: str) -> str:
    """An argparse `type=` for `--pci`: a GPU's PCI address as the driver logs it (dddd:bb:dd)."""
    if not _PCI.match(text):
        raise argparse.ArgumentTypeError(f"not a PCI address like {DEFAULT_PCI}: {text!r}")
    return text.lower()


def xid_line(xid: int, pci: str = DEFAULT_PCI, *, by: str = "autorepair inject") -> str:
    """An Xid exactly in the driver's format, so the probe's own parser reads it."""
    return f"NVRM: Xid (PCI:{pci}): {xid}, pid=<unknown>, name=<unknown>, injected by {by}"


def records_from_text(text: str) -> list[FaultRecord]:
    """The fault records the probe would read in `text`; ValueError when there is none."""
    records = list(parse_lines(text.splitlines()))
    if not records:
        raise ValueError(f"not a GPU fault line the probe recognises: {' '.join(text.split())!r}")
    return records


def manual_findings(
    records: list[FaultRecord], policy: Policy, *, instance_id: str, group: str, source: str, now: datetime
) -> list[GpuFinding]:
    """One finding per record, classified by `policy` as the probe on that host would."""
    return [
        make_finding(
            record,
            policy.classify(record, now),
            instance_id=instance_id,
            group=group,
            source=source,
            observed_at=now,
            # A fresh position each time: the same line named twice is two faults, not a redelivery.
            position=f"{source}:{uuid.uuid4().hex}",
        )
        for record in records
    ]
