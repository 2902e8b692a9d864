"""What the operator's commands print: a rich console for people, indented JSON for scripts, and the short time and
duration texts their tables use."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from typing import Any

from rich.console import Console

from contract import formats


def stdout_console() -> Console:
    """A console on the current sys.stdout."""
    # Made per call, not at import, so it writes to whatever sys.stdout is now.
    return Console(file=sys.stdout)


def print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


def iso(moment: datetime | None) -> str | None:
    """The wire form of a moment in JSON output; None stays null."""
    return None if moment is None else formats.iso(moment)


def short_time(moment: datetime | None) -> str:
    """A moment in a table cell: UTC to the second."""
    return "" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def seconds_text(seconds: float | None) -> str:
    """A duration in a table cell or a sentence: 90s, 12m05s, 3h07m; `?` when unknown."""
    if seconds is None:
        return "?"
    whole = round(seconds)
    if whole < 120:
        return f"{whole}s"
    if whole < 7200:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
