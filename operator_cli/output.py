"""What the operator's commands print, decided in one place: `-o text|json|jsonl|wide` (`--json` is `-o json`), a
rich console for people, JSON for scripts, a progress bar on stderr for long waits, and the short time and duration
texts their tables use."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from contract import formats

if TYPE_CHECKING:
    from rich.console import Console


class Output(StrEnum):
    """`-o`: `text` is the table a person reads; `wide` that table with the columns it leaves out; `json` one JSON
    document; `jsonl` one JSON object per line, a line per row (per instance, repair, record)."""

    TEXT = "text"
    JSON = "json"
    JSONL = "jsonl"
    WIDE = "wide"


# Where every command keeps its choice (args.output): `-o`, `--json` and classify's `--format` all write it.
OUTPUT_DEST = "output"
# Text printers take whether the output is wide; json and jsonl never reach them.
TextPrinter = Callable[[bool], None]


class _Alias(argparse.Action):
    """An older flag whose values are spellings of `-o`'s (classify's `--format json|table`)."""

    def __init__(self, *args: Any, meaning: dict[str, Output], **kwargs: Any) -> None:
        kwargs["choices"] = sorted(meaning)
        super().__init__(*args, **kwargs)
        self.meaning = meaning

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any, *_: Any) -> None:
        setattr(namespace, self.dest, self.meaning[str(value)])


def add_output_arguments(parser: argparse.ArgumentParser, *, json_flag: bool = True) -> None:
    """`-o/--output`, and `--json` (the older flag, kept: the same as `-o json`) unless the command never had it."""
    parser.add_argument(
        "-o",
        "--output",
        dest=OUTPUT_DEST,
        type=str.lower,
        choices=[o.value for o in Output],
        default=Output.TEXT.value,
        help="text (a table, the default), wide (with every column), json (one document) or jsonl (a line per row)",
    )
    if json_flag:
        parser.add_argument(
            "--json", dest=OUTPUT_DEST, action="store_const", const=Output.JSON.value, help="the same as -o json"
        )


def add_format_alias(parser: argparse.ArgumentParser, meaning: dict[str, Output], help: str) -> None:
    """An older `--format` flag of a command, now a spelling of `-o`."""
    parser.add_argument("--format", dest=OUTPUT_DEST, action=_Alias, meaning=meaning, help=help)


def output_of(args: argparse.Namespace) -> Output:
    return Output(getattr(args, OUTPUT_DEST, None) or Output.TEXT)


def emit(args: argparse.Namespace, document: Any, text: TextPrinter, rows: Iterable[Any] | None = None) -> None:
    """Print a command's answer as its -o asks: `document` whole for json; `rows` (the document itself where it
    has no rows) a line each for jsonl, written as they come, so a long stream starts at once; `text(wide)` else."""
    mode = output_of(args)
    if mode is Output.JSON:
        print_json(list(document) if isinstance(document, Iterator) else document)
    elif mode is Output.JSONL:
        write = sys.stdout.write
        for row in [document] if rows is None else rows:
            write(json.dumps(row) + "\n")
    else:
        text(mode is Output.WIDE)


def stdout_console() -> Console:
    """A console on the current sys.stdout."""
    # Imported here: `autorepair healthcheck` (run every few seconds) takes -o, and prints no table.
    from rich.console import Console

    # Made per call, not at import, so it writes to whatever sys.stdout is now.
    return Console(file=sys.stdout)


@contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr, only when stderr is a terminal (never in what a script reads, never on stdout);
    yields the function that counts one step done. Gone once done."""
    if not sys.stderr.isatty() or total < 1:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(file=sys.stderr), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda: bar.advance(task)


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
