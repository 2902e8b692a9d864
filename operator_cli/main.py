"""`autorepair`: the worker, the demo, the node probe and the operator's tools, behind one command."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

from pydantic import ValidationError

from contract.config import ConfigError
from ingest.cli import add_ingest_arguments, run_ingest
from node_probe.cli import (
    ProbeSettings,
    add_classify_arguments,
    add_probe_arguments,
    add_probe_report_arguments,
    run_classify,
    run_probe_command,
    run_probe_report,
)
from operator_cli.client import guarded
from operator_cli.describe import add_describe_arguments, describe_instances
from operator_cli.fleet import add_fleet_arguments, fleet_usage
from operator_cli.group import add_group_arguments, group_usage
from operator_cli.history import add_history_arguments, repair_history
from operator_cli.inject import add_inject_arguments, inject_fault
from operator_cli.instance import add_instance_arguments, instance_usage
from worker.commands import run_setup_command, run_worker_command
from worker.logging_setup import configure_logging
from worker.settings import Settings


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments are one line naming the fix, not a usage block: scripts and logs keep it whole."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}" if where else f"{first['msg']}{more}"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="autorepair", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, run: Callable[[argparse.Namespace], Any]) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(run=run)
        return sub

    command("worker", "run the repair workers (workflows and activities) on this host", run_worker_command)
    command("setup", "register the custom search attributes in the Temporal namespace", run_setup_command)
    # The simulator is only for trying it out: an image without it (the probe's) still runs every other command.
    if importlib.util.find_spec("simulator") is not None:
        from simulator.demo import add_demo_arguments, run_demo

        add_demo_arguments(command("demo", "run a simulated GPU fleet that heals itself, locally", run_demo))
    add_probe_arguments(command("probe", "run the node probe on a GPU host", run_probe_command))
    add_probe_report_arguments(
        command(
            "probe-report",
            "send one GPU finding through the ingest, as this host's probe would, and say whether it was accepted",
            run_probe_report,
        )
    )
    add_ingest_arguments(
        command("ingest", "serve the ingest: GPU hosts report here over HTTPS, proven by AWS identity", run_ingest)
    )
    add_classify_arguments(command("classify", "classify kernel log text under a repair policy", run_classify))
    # The operator's commands read and change the fleet through Temporal; guarded() turns what the operator can
    # fix (a bad argument, an unreachable server, an unknown instance) into one line and an exit status.
    add_describe_arguments(
        command(
            "describe-instances", "health status, GPU findings and repair of instances", guarded(describe_instances)
        )
    )
    add_history_arguments(
        command("history", "past and running repairs, phase by phase, from Temporal", guarded(repair_history))
    )
    add_inject_arguments(
        command(
            "inject", "game day: inject a GPU fault or a heartbeat loss, as a real one arrives", guarded(inject_fault)
        )
    )
    add_group_arguments(command("group", "a capacity group's configuration, changed live", guarded(group_usage)))
    add_fleet_arguments(
        command("fleet", "the fleet-wide breaker: describe it, resume held repairs", guarded(fleet_usage))
    )
    add_instance_arguments(
        command(
            "instance",
            "an operator's controls of one instance: exclude from repair, include, repair now, clear a false finding",
            guarded(instance_usage),
        )
    )
    return parser


def _finish(args: argparse.Namespace, code: int, argv: list[str] | None) -> int:
    """End a short-lived Temporal client command (`hard_exit`) without interpreter finalization when run as the
    program (argv None): temporalio's Rust threads can abort CPython's teardown after such a command
    (sdk-python#300), which would turn exit status 0 or 3 into 134. In-process callers get the code back."""
    if argv is None and getattr(args, "hard_exit", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# The commands that run on a GPU host read only the probe's part of the shared settings ([temporal], log_format):
# the worker's sections there are the worker's to check, and an older probe must not refuse a newer worker's key.
_PROBE_SIDE = frozenset({"probe", "probe-report", "classify"})


def _settings_class(command: str) -> type[Settings] | type[ProbeSettings]:
    return ProbeSettings if command in _PROBE_SIDE else Settings


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # Every command's settings are read here first: a missing file, bad TOML or a bad value is one line naming
        # the file (or environment variable), the key and the fix, and exit status 2, before the command starts.
        settings_format = _settings_class(args.command).load().log_format
    except ConfigError as err:
        print(f"autorepair {args.command}: invalid configuration: {err}", file=sys.stderr)
        return 2
    configure_logging(settings_format)
    try:
        outcome = args.run(args)
        if isinstance(outcome, Coroutine):
            outcome = asyncio.run(outcome)
        return _finish(args, int(outcome or 0), argv)
    except KeyboardInterrupt:
        return 130
    except ConfigError as err:
        print(f"autorepair {args.command}: invalid configuration: {err}", file=sys.stderr)
        return 2
    except ValidationError as err:
        print(f"autorepair: {_one_line(err)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, KeyError) as err:
        print(f"autorepair: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        if "Failed client connect" in str(err) or "connect" in str(err).lower():
            print(f"autorepair: cannot reach Temporal: {err}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
