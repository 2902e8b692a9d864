"""Every event a test's worker published follows its type's JSON Schema (docs/events/schemas/): the conftest checks
each test's event files (`events*.jsonl` under its tmp_path) when the test ends, so every end-to-end test checks the
events it caused, whichever it reads."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from contract.event_schemas import DEFAULT_DIR


@functools.cache
def validator(type: str) -> Draft202012Validator:
    path = DEFAULT_DIR / f"{type}.json"
    if not path.exists():
        raise AssertionError(f"an event of type {type!r}, which has no schema in {DEFAULT_DIR}")
    return Draft202012Validator(json.loads(path.read_text()), format_checker=Draft202012Validator.FORMAT_CHECKER)


def problems(event: dict[str, Any]) -> list[str]:
    """Why the event does not follow its type's schema (none: it does)."""
    type = event.get("type")
    if not isinstance(type, str):
        return [f"no type: {event!r}"[:300]]
    return [
        f"{type} {event.get('event_id')}: {'/'.join(map(str, e.absolute_path)) or '(event)'}: {e.message}"[:500]
        for e in validator(type).iter_errors(event)
    ]


def check_events_files(root: Path) -> tuple[int, list[str]]:
    """How many events the event files under `root` hold, and what is wrong with them."""
    checked, wrong = 0, []
    for path in sorted(root.rglob("events*.jsonl")):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError as err:
                # A line cut short by a worker killed mid-write is not an event's fault, only the last one may be.
                wrong.append(f"{path.name}:{number}: not JSON: {err}")
                continue
            checked += 1
            wrong += [f"{path.name}:{number}: {p}" for p in problems(event)]
    return checked, wrong
