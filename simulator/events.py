"""The JSON-lines event file the worker appends to (`events.jsonl_path`): how the demo, the end-to-end tests and
the benchmarks see a simulated fleet's health changes and repairs, exactly as a consumer of the stream would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every line so far (none while the file does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def group_events(
    path: Path, group: str, type: str | None = None, instance_id: str | None = None
) -> list[dict[str, Any]]:
    """The group's events, each once: delivery is at least once, and a retried publish repeats its event_id."""
    unique = {e["event_id"]: e for e in read_events(path) if e["group"] == group}
    return [e for e in unique.values() if type in (None, e["type"]) and instance_id in (None, e["instance_id"])]


def repaired_instances(path: Path, group: str) -> list[str]:
    """Instances whose repair completed and handed its drain permit back."""
    released = {e["instance_id"] for e in group_events(path, group, "DrainPermitReleased")}
    return [e["instance_id"] for e in group_events(path, group, "RepairCompleted") if e["instance_id"] in released]
