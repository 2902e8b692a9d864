"""The JSON Schema of each event type, generated from its model (contract/event_types.py) inside the envelope
(contract/events.py). The checked-in copies are in docs/events/schemas/, one `<Type>.json` each;
`python -m contract.event_schemas` writes them again after a model changes, and `--check` says whether they are
current (tests/test_event_schemas.py runs it).

Each schema describes exactly what this version sends: a key it does not name is refused. A later version may add
keys to `detail` without changing `schema_version`; a consumer should ignore keys it does not know rather than
validate with an older schema.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from contract.event_types import DETAILS, EventType
from contract.events import SCHEMA_VERSION, detail_type

DRAFT = "https://json-schema.org/draft/2020-12/schema"
DEFAULT_DIR = Path(__file__).resolve().parents[1] / "docs" / "events" / "schemas"

_ENVELOPE: dict[str, dict[str, Any]] = {
    "event_id": {
        "type": "string",
        "minLength": 1,
        "description": "Fixed per workflow step: a redelivery carries the same one, so drop duplicates by it",
    },
    "time": {"type": "string", "format": "date-time", "description": "When the step happened, UTC"},
    "group": {"type": "string", "description": "The capacity group; `*` for the fleet breaker's events"},
    "instance_id": {"type": "string", "description": "The EC2 instance; empty for a group's or the fleet's event"},
    "workflow_id": {"type": "string", "description": "The Temporal workflow that published it"},
    "workflow_url": {
        "type": "string",
        "description": "That workflow's page in the Temporal Web UI; present where the worker knows the UI's address",
    },
}


def event_schema(type: EventType) -> dict[str, Any]:
    """The schema of one type's events, as every sink receives them."""
    model = DETAILS[type]
    detail = model.model_json_schema(mode="serialization")
    defs = detail.pop("$defs", {})
    properties: dict[str, Any] = {
        "schema_version": {"const": SCHEMA_VERSION},
        "type": {"const": type.value},
        **_ENVELOPE,
        "detail": detail,
    }
    schema: dict[str, Any] = {
        "$schema": DRAFT,
        "$id": f"{type.value}.json",
        "title": type.value,
        "description": f"EventBridge detail-type: {detail_type(type)}. " + " ".join((model.__doc__ or "").split()),
        "type": "object",
        "properties": properties,
        "required": [key for key in properties if key != "workflow_url"],
        "additionalProperties": False,
    }
    if defs:
        schema["$defs"] = defs
    return schema


def rendered() -> dict[str, str]:
    """File name -> its text, for every type."""
    return {f"{t.value}.json": json.dumps(event_schema(t), indent=2) + "\n" for t in EventType}


def differences(directory: Path) -> list[str]:
    """What differs between the files in `directory` and the generated ones (none: current)."""
    expected = rendered()
    found = {p.name for p in directory.glob("*.json")} if directory.is_dir() else set()
    problems = [f"{name}: missing" for name in sorted(set(expected) - found)]
    problems += [f"{name}: no such event type" for name in sorted(found - set(expected))]
    problems += [
        f"{name}: differs from its model"
        for name in sorted(set(expected) & found)
        if (directory / name).read_text() != expected[name]
    ]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write (or --check) the JSON Schema of every event type")
    parser.add_argument("directory", nargs="?", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--check", action="store_true", help="exit 1 when the files differ from the models")
    args = parser.parse_args(argv)
    directory: Path = args.directory
    if args.check:
        problems = differences(directory)
        for problem in problems:
            print(f"{directory / problem}", file=sys.stderr)
        if problems:
            print("regenerate them: python -m contract.event_schemas", file=sys.stderr)
        return 1 if problems else 0
    directory.mkdir(parents=True, exist_ok=True)
    for stale in {p.name for p in directory.glob("*.json")} - set(rendered()):
        (directory / stale).unlink()
    for name, text in rendered().items():
        (directory / name).write_text(text)
    print(f"wrote {len(EventType)} schemas to {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
