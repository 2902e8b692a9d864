"""Argument types and options shared by the operator's commands: durations, moments, safe names, and the options
every command that talks to Temporal takes (`-o/--json`, `--address`, `-n/--namespace`, `--profile`, `--api-key`)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import TypeAdapter, ValidationError

from contract.temporal_options import add_temporal_arguments
from operator_cli.output import add_output_arguments

# main.py's `command(name, help, run)`: adds a subcommand that runs `run` and returns its parser.
Command = Callable[[str, str, Callable[[argparse.Namespace], Any]], argparse.ArgumentParser]

# Names go into visibility queries between single quotes; anything else would need escaping rules we avoid.
SAFE_NAME = re.compile(r"^[A-Za-z0-9._:/@+-]{1,255}$")

_SHORT_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d)?$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
_ISO_DURATION = TypeAdapter(timedelta)


def parse_duration(text: str) -> timedelta:
    """Seconds (`90`), a number with a unit (`90s`, `10m`, `2h`, `1d`) or ISO-8601 (`PT10M`)."""
    cleaned = text.strip()
    short = _SHORT_DURATION.match(cleaned)
    if short is not None:
        return timedelta(seconds=float(short.group("n")) * _UNIT_SECONDS[short.group("unit")])
    if cleaned.upper().startswith("P"):
        try:
            return _ISO_DURATION.validate_python(cleaned.upper())
        except ValidationError:
            pass
    raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use seconds, 90s, 10m, 2h, or ISO-8601 like PT10M)")


def parse_since(text: str) -> datetime:
    """A moment (ISO-8601, e.g. 2025-05-01T12:00:00Z; UTC when no zone is given) or a duration ago (`2h`, `PT30M`)."""
    try:
        return datetime.now(UTC) - parse_duration(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (use ISO-8601 like 2025-05-01T12:00:00Z, or a duration ago like 2h)"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def safe_name(kind: str) -> Callable[[str], str]:
    """An argument type for a group name or instance id that may go into a visibility query unescaped."""

    def parse(text: str) -> str:
        if not SAFE_NAME.match(text):
            raise argparse.ArgumentTypeError(f"not a valid {kind}: {text!r}")
        return text

    return parse


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every operator command; added last, so they close each command's --help."""
    # A short-lived Temporal client: operator_cli/main.py ends the process without finalization (see its _finish).
    parser.set_defaults(hard_exit=True)
    add_output_arguments(parser)
    add_temporal_arguments(parser)
