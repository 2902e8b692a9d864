"""`autorepair classify`: kernel log text classified as the probe would (its rows come from node_probe/cli.py), printed
as -o asks. On a GPU host too: nothing here loads a Temporal or AWS client."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.table import Table

from node_probe.classify.policy import POLICY_ECS, Policy
from node_probe.cli import CliError, add_policy_arguments, classified_rows, load_policy_config
from operator_cli.exit_codes import OK, USAGE
from operator_cli.output import Output, add_format_alias, add_output_arguments, emit, stdout_console

# Each table's columns; `-o wide` adds the row's other fields (a record's pid, process, timestamps; a finding's GPU).
RECORD_COLUMNS = ("line", "kind", "code", "pci", "impairs", "reason", "rule", "message")
SENT_COLUMNS = ("line", "kind", "code", "pci", "impairs", "reason", "rule", "count", "message")
# What the sent table shows in other words (line and count), or never as a column (raw is the whole line).
_SENT_SHOWN = {*SENT_COLUMNS, "rollup", "first_line", "raw"}


def add_classify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", default=None, metavar="FILE", help="kernel log text (default: stdin)")
    add_policy_arguments(parser)
    parser.add_argument(
        "--collapse",
        action="store_true",
        help="print what the probe would send for this log instead of every record: the first record of each "
        "burst, then one roll-up per burst with the count of the records it folded (repeat rules applied)",
    )
    add_output_arguments(parser, json_flag=False)
    # The older flag: its json was a line per row, so it stays jsonl (-o json is one document).
    add_format_alias(parser, {"json": Output.JSONL, "table": Output.TEXT}, "older spelling: json is -o jsonl")


def run_classify(args: argparse.Namespace) -> int:
    try:
        policy = Policy(getattr(args, "policy", POLICY_ECS), load_policy_config(getattr(args, "policy_config", None)))
        collapse = bool(getattr(args, "collapse", False))
        rows = classified_rows(getattr(args, "file", None), policy, collapse=collapse)
        printer = _print_sent_table if collapse else _print_table
        emit(args, rows, lambda wide: printer(list(rows), wide), rows=rows)
    except CliError as exc:
        print(f"autorepair classify: {exc}", file=sys.stderr)
        return USAGE
    return OK


def _extra_columns(rows: list[dict[str, Any]], shown: set[str]) -> list[str]:
    """The fields of any row that the table leaves out, in the order they first appear."""
    return list(dict.fromkeys(key for row in rows for key in row if key not in shown))


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def _print_table(rows: list[dict[str, Any]], wide: bool) -> None:
    table = Table(title="GPU fault records", show_lines=False)
    extra = _extra_columns(rows, set(RECORD_COLUMNS)) if wide else []
    # Fold rather than cut: on a narrow terminal a truncated PCI address or rule name would mislead.
    for column in (*RECORD_COLUMNS, *extra):
        table.add_column(column, overflow="fold")
    for row in rows:
        style = "bold red" if row["impairs"] else None
        table.add_row(
            *(_cell(row[c]) for c in ("line", "kind", "code", "pci")),
            "yes" if row["impairs"] else "no",
            row["reason"],
            row["rule"],
            row["message"],
            *(_cell(row.get(c)) for c in extra),
            style=style,
        )
    impairing = sum(1 for row in rows if row["impairs"])
    table.caption = f"{len(rows)} records, {impairing} impairing"
    stdout_console().print(table)


def _print_sent_table(rows: list[dict[str, Any]], wide: bool) -> None:
    table = Table(title="GPU findings the probe would send", show_lines=False)
    extra = _extra_columns(rows, _SENT_SHOWN) if wide else []
    for column in (*SENT_COLUMNS, *extra):
        table.add_column(column, overflow="fold")
    for row in rows:
        # A roll-up names the lines it spans: its count is of the records after the burst's first.
        line = f"{row['first_line']}..{row['line']}" if row["rollup"] else str(row["line"])
        table.add_row(
            line,
            *(_cell(row[c]) for c in ("kind", "code", "pci")),
            "yes" if row["impairs"] else "no",
            row["reason"],
            row["rule"],
            f"+{row['count']} (roll-up)" if row["rollup"] else str(row["count"]),
            row["message"],
            *(_cell(row.get(c)) for c in extra),
            style="bold red" if row["impairs"] else None,
        )
    rollups = [row for row in rows if row["rollup"]]
    records = len(rows) - len(rollups) + sum(row["count"] for row in rollups)
    impairing = sum(1 for row in rows if row["impairs"] and not row["rollup"])
    table.caption = (
        f"{len(rows)} findings for {records} records: {len(rows) - len(rollups)} first of a burst "
        f"({impairing} impairing), {len(rollups)} roll-up{'' if len(rollups) == 1 else 's'}"
    )
    stdout_console().print(table)
