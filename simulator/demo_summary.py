"""What the demo shows while it runs: the events the worker writes, and a live summary of the fleet.

On a terminal the summary is a table redrawn in place (rich); anywhere else (CI, a pipe) it is a plain line
every few seconds, so a log stays readable. Both are drawn from the fleet's snapshot and the event counts.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from contract.events import upgrade_v1
from contract.groups import AutoRepair
from simulator.fleet import FleetSnapshot


@dataclass
class EventLog:
    """Follows the events file the worker appends to, counting event types."""

    path: Path
    offset: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    # Instances whose repair completed without a replacement (a reset or reboot: the remediation ladder).
    fixed_in_place: set[str] = field(default_factory=set)
    # Replacements a repair gave up on (not ACTIVE in time) and terminated: expected terminations, not repairs.
    abandoned_replacements: set[str] = field(default_factory=set)
    # When each instance first had each event (HealthChanged: "IMPAIRED" when it said so), for `timings_line`.
    first_at: dict[tuple[str, str], datetime] = field(default_factory=dict)
    # Each completed repair's own steps (drain + launch + terminate), from its timeline: our overhead, apart from
    # the waits for a permit, a boot and the tasks' stop timeouts.
    own_steps: dict[str, float] = field(default_factory=dict)
    partial: str = ""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("r", encoding="utf-8") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
                self.offset = handle.tell()
        except FileNotFoundError:
            return []
        text = self.partial + chunk
        lines = text.split("\n")
        self.partial = lines.pop()  # an unfinished last line waits for the next read
        events: list[dict[str, Any]] = []
        for line in lines:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                # An older worker's flat line (schema_version 1) read as today's: benchmarks read older commits' runs.
                event = upgrade_v1(event)
                own = event.get("detail") or {}  # the type's own fields (contract/events.py)
                self.counts[str(event.get("type", "?"))] += 1
                if event.get("type") == "RepairCompleted" and own.get("action") in ("reboot", "gpu-reset"):
                    self.fixed_in_place.add(str(event.get("instance_id")))
                if event.get("type") == "RepairCompleted" and (took := own_steps_seconds(own.get("timeline"))):
                    self.own_steps.setdefault(str(event.get("instance_id")), took)
                if event.get("type") == "ReplacementAbandoned" and own.get("replacement_instance_id"):
                    self.abandoned_replacements.add(str(own["replacement_instance_id"]))
                self._note_time(event)
                events.append(event)
        return events

    def _note_time(self, event: dict[str, Any]) -> None:
        kind = str(event.get("type", "?"))
        if kind == "HealthChanged":
            kind = str((event.get("detail") or {}).get("overall_status", "?"))
        try:
            at = datetime.fromisoformat(str(event.get("time", "")).replace("Z", "+00:00"))
        except ValueError:
            return
        self.first_at.setdefault((kind, str(event.get("instance_id", ""))), at)


OWN_STEPS = ("Draining", "LaunchingReplacement", "Terminating")


def own_steps_seconds(timeline: Any) -> float | None:
    """Seconds a repair spent in its own steps (OWN_STEPS), each step lasting until the next began."""
    if not isinstance(timeline, list):
        return None
    try:
        steps = [
            (str(s["phase"]), datetime.fromisoformat(str(s["started_at"]).replace("Z", "+00:00"))) for s in timeline
        ]
    except (KeyError, TypeError, ValueError):
        return None
    spans = [(nxt - at).total_seconds() for (phase, at), (_, nxt) in itertools.pairwise(steps) if phase in OWN_STEPS]
    return sum(spans) if spans else None


def _spread(name: str, seconds: list[float], of: int) -> str:
    if not seconds:
        return f"{name} - (0/{of})"
    return (
        f"{name} p50 {statistics.median(seconds):.1f}s p90 {percentile(seconds, 90):.1f}s max {max(seconds):.1f}s "
        f"({len(seconds)}/{of})"
    )


def percentile(values: list[float], q: int) -> float:
    """Nearest rank: the smallest value with at least q% of the values at or below it."""
    ranked = sorted(values)
    return ranked[max(math.ceil(q / 100 * len(ranked)) - 1, 0)]


def timings(events: EventLog, faults_at: dict[str, datetime]) -> dict[str, list[float]]:
    """Seconds each faulted instance took, by measure, from the events so far: fault written -> IMPAIRED, then its
    repair's wait for a drain permit, its own steps (OWN_STEPS) and its whole length (RepairStarted ->
    RepairCompleted)."""

    def since(began: dict[str, datetime], end: str) -> list[float]:
        seconds = []
        for instance_id, start in began.items():
            ended = events.first_at.get((end, instance_id))
            if ended is not None:
                seconds.append((ended - start).total_seconds())
        return seconds

    started = {i: at for i in faults_at if (at := events.first_at.get(("RepairStarted", i))) is not None}
    return {
        "fault -> IMPAIRED": since(faults_at, "IMPAIRED"),
        "permit wait": since(started, "DrainPermitGranted"),
        "drain+launch+terminate": [events.own_steps[i] for i in faults_at if i in events.own_steps],
        "repair": since(started, "RepairCompleted"),
    }


def timings_line(events: EventLog, faults_at: dict[str, datetime]) -> str:
    return "; ".join(_spread(name, seconds, len(faults_at)) for name, seconds in timings(events, faults_at).items())


def describe_event(event: dict[str, Any]) -> str:
    """One event as one line: its time of day, type, instance and the one detail worth reading."""
    kind = event.get("type", "?")
    own = event.get("detail") or {}  # the type's own fields (contract/events.py)
    extra = ""
    if kind == "RepairStarted":
        extra = f"reason {own.get('reason')}"
    elif kind == "ReplacementLaunched":
        extra = f"replacement {own.get('replacement_instance_id')}"
    elif kind == "TasksStopped":
        extra = f"forced {own.get('forced')}"
    elif kind == "RepairFailed":
        extra = f"error {own.get('error')}"
    elif kind == "Escalated":
        extra = f"{own.get('from_action')} -> {own.get('to_action')}: {own.get('why')}"
    elif kind in ("EvidenceStored", "Quarantined"):
        extra = str(own.get("evidence") or "")
    elif kind == "EvidenceNotStored":
        extra = str(own.get("why") or "")
    elif kind == "RepairCompleted":
        extra = str(own.get("action") or "")
    elif kind == "HealthChanged":
        extra = str(own.get("overall_status", ""))
    elif kind in ("RepairsHeld", "RepairsResumed"):
        extra = str(own.get("message") or f"by {own.get('requested_by')}")
    stamp = str(event.get("time", ""))[11:19]
    return f"{stamp} {kind:<20} {event.get('instance_id', '')} {extra}".rstrip()


@dataclass(frozen=True)
class LiveSummary:
    """The live table's fixed parts: which group, in which mode, how many instances, where the Web UI is."""

    group: str
    auto_repair: AutoRepair
    instances: int
    workflows_url: str

    def render(self, snap: FleetSnapshot | None, events: Counter[str], elapsed: float, status: str) -> RenderableType:
        table = Table(
            title=f"gpu-autorepair demo: group {self.group}, auto repair {self.auto_repair.value}",
            caption=f"Web UI: {self.workflows_url}",
            expand=False,
        )
        for column in ("time", "running", "healthy", "impaired", "other", "draining", "replaced", "repairs"):
            table.add_column(column, justify="right")
        if snap is None:
            table.add_row(f"{elapsed:4.0f}s", *["-"] * 7)
        else:
            unknown = len(snap.health) - snap.healthy - snap.impaired
            booting = f" (+{len(snap.booting)} booting)" if snap.booting else ""
            failed = f" ({events['RepairFailed']} failed)" if events["RepairFailed"] else ""
            table.add_row(
                f"{elapsed:4.0f}s",
                f"{snap.running}/{self.instances}",
                str(snap.healthy),
                str(snap.impaired),
                str(unknown),
                str(snap.container_draining),
                f"{len(snap.replacements_running)}{booting}",
                f"{events['RepairCompleted']} done{failed}",
            )
        lines: list[RenderableType] = [table]
        if snap is not None and snap.repair_phase:
            phases = ", ".join(f"{iid} {phase.value}" for iid, phase in sorted(snap.repair_phase.items()))
            lines.append(Text(f"repairing: {phases}", style="yellow"))
        if snap is not None and snap.probe_errors:
            lines.append(Text(f"probe errors: {snap.probe_errors}", style="red"))
        lines.append(Text(status, style="bold"))
        return Group(*lines)


def summary_line(snap: FleetSnapshot | None, events: Counter[str], elapsed: float) -> str:
    """The summary as one plain line, for output that is not a terminal."""
    if snap is None:
        return f"[{elapsed:5.0f}s] starting"
    return (
        f"[{elapsed:5.0f}s] running={snap.running} healthy={snap.healthy} impaired={snap.impaired} "
        f"draining={snap.container_draining} replacements={len(snap.replacements_running)} "
        f"booting={len(snap.booting)} repairs_completed={events['RepairCompleted']}"
    )
