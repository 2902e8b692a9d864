"""The gate a fix in place must pass before work returns to the instance, as a plain model: each check is one row of
GATE_CHECKS, read from one look at the instance (its probe's reports through its health workflow) once it is back.

A reset or a reboot that brought the instance back with a GPU missing, with NVIDIA still asking for something, or
with memory still waiting for a remap is no fix: the repair goes on to replace it (workflows/repair_reboot.py). What
the checks read is what the probe reports anyway, so the gate costs one look. No Temporal here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel

from activities.models import HealthViewExcerpt
from contract.probe import STATE_TRANSITION_KINDS

# The probe's NVML warnings that say a fix is still owed (node_probe/sources/nvml_poll.py): memory rows or pages
# waiting for a reset to be remapped or retired.
PENDING_REASONS = frozenset({"NVML_REMAP_PENDING", "NVML_RETIRED_PAGES_PENDING"})


class GateCheck(BaseModel):
    name: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class Look:
    """What a check reads: the instance as its health workflow sees it, and since when the fix runs."""

    probe: HealthViewExcerpt
    since: datetime


@dataclass(frozen=True)
class GateRow:
    name: str
    what: str  # for the runbook and the docs
    check: Callable[[Look], str | None]  # None: passed; else what failed


def _gpus(look: Look) -> str | None:
    seen, expected = look.probe.gpu_count, look.probe.expected_gpus
    if seen is None or expected is None:
        return None  # not knowing is never a failure here either: the GPU sources were OK
    return None if seen >= expected else f"{seen} of the {expected} GPUs of its type visible"


def _verdicts(look: Look) -> str | None:
    held = [f"{v.verdict} {v.action} on {v.gpu or 'the instance'}" for v in look.probe.nvidia_verdicts]
    return f"NVIDIA still asks: {'; '.join(held)}" if held else None


def _pending(look: Look) -> str | None:
    pending = sorted(
        {
            f"{f.reason} on {f.gpu.pci or 'a GPU'}"
            for f in look.probe.recent_findings
            if f.reason in PENDING_REASONS and f.observed_at >= look.since
        }
    )
    return "; ".join(pending) or None


def _faults(look: Look) -> str | None:
    faults = [
        f"{f.reason} on {f.gpu.pci or 'a GPU'}"
        for f in look.probe.recent_findings
        if f.impairs and f.kind not in STATE_TRANSITION_KINDS and f.observed_at >= look.since
    ]
    return f"faulted since the fix: {'; '.join(faults)}" if faults else None


GATE_CHECKS: tuple[GateRow, ...] = (
    GateRow("gpus", "every GPU of its instance type visible", _gpus),
    GateRow("nvidia", "no standing NVIDIA verdict (recovery action none, no repair pending)", _verdicts),
    GateRow("memory", "no row remap or page retirement pending", _pending),
    GateRow("faults", "no GPU fault since the fix began", _faults),
)


def run_gate(probe: HealthViewExcerpt, since: datetime) -> list[GateCheck]:
    look = Look(probe, since)
    results = []
    for row in GATE_CHECKS:
        failed = row.check(look)
        results.append(GateCheck(name=row.name, passed=failed is None, detail=failed or row.what))
    return results


def failures(checks: list[GateCheck]) -> str | None:
    """Why the gate failed, in one line; None: it passed."""
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    return "; ".join(failed) or None
