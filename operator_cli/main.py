"""`autorepair`: the worker, the demo, the node probe and the operator's tools, behind one command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn

from pydantic import ValidationError

from contract.config import ConfigError, temporal_profile
from operator_cli import exit_codes
from operator_cli.extras import PROBE_SIDE, missing_extra, version
from worker.logging_setup import configure_logging

Runner = Callable[[argparse.Namespace], Any]
# Adds a command's arguments to its parser and gives the function that runs it.
Setup = Callable[[argparse.ArgumentParser], Runner]


class OneLineErrorParser(argparse.ArgumentParser):
    """Bad arguments are one line naming the fix, not a usage block: scripts and logs keep it whole."""

    def error(self, message: str) -> NoReturn:
        self.exit(exit_codes.USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class CommandParser(OneLineErrorParser):
    """One command of `autorepair`. Its arguments, and with them its modules, are added only when it is the command
    parsed (or its help is asked for): `autorepair probe` on a GPU host then carries the probe's imports and not the
    worker's, the ingest's or the operator's Temporal client (tens of MiB, benchmarks/RESULTS.md)."""

    def __init__(self, *args: Any, setup: Setup | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._setup = setup

    def _ready(self) -> None:
        if self._setup is not None:
            setup, self._setup = self._setup, None
            self.set_defaults(run=setup(self))

    def ready(self) -> None:
        """Add the command's arguments now, not when it is parsed: shell completion lists every command's."""
        self._ready()

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:
        self._ready()
        return super().parse_known_args(*args, **kwargs)

    def format_usage(self, *args: Any, **kwargs: Any) -> str:
        self._ready()
        return super().format_usage(*args, **kwargs)

    def format_help(self, *args: Any, **kwargs: Any) -> str:
        self._ready()
        return super().format_help(*args, **kwargs)


def _one_line(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}" if where else f"{first['msg']}{more}"


# --- each command's setup: the imports are inside, so only the command that runs pays for them ------------------


def _worker(parser: argparse.ArgumentParser) -> Runner:
    from worker.commands import add_worker_arguments, run_worker_command

    add_worker_arguments(parser)
    return run_worker_command


def _setup(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.client import guarded
    from operator_cli.setup import add_setup_arguments, run_setup

    add_setup_arguments(parser)
    return guarded(run_setup)


def _demo(parser: argparse.ArgumentParser) -> Runner:
    from simulator.demo import add_demo_arguments, run_demo

    add_demo_arguments(parser)
    return run_demo


def _sim(parser: argparse.ArgumentParser) -> Runner:
    from simulator.sim import add_sim_arguments, run_sim

    add_sim_arguments(parser)
    return run_sim


def _probe(parser: argparse.ArgumentParser) -> Runner:
    from node_probe.cli import add_probe_arguments, run_probe_command

    add_probe_arguments(parser)
    return run_probe_command


def _probe_report(parser: argparse.ArgumentParser) -> Runner:
    from node_probe.cli import add_probe_report_arguments, run_probe_report
    from operator_cli.output import add_output_arguments

    add_probe_report_arguments(parser)
    add_output_arguments(parser, json_flag=False)  # the probe's side reads args.output; the flag is spelled here
    return run_probe_report


def _ingest(parser: argparse.ArgumentParser) -> Runner:
    from ingest.cli import add_ingest_arguments, run_ingest

    add_ingest_arguments(parser)
    return run_ingest


def _healthcheck(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.healthcheck import add_healthcheck_arguments, run_healthcheck

    add_healthcheck_arguments(parser)
    return run_healthcheck


def _classify(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.classify import add_classify_arguments, run_classify

    add_classify_arguments(parser)
    return run_classify


def _completion(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.completion import add_completion_arguments, completion_runner

    add_completion_arguments(parser)
    # Passed, not imported there: the script is made from this very parser, every command's arguments added.
    return completion_runner(lambda: build_parser(every_command=True))


# The operator's commands read and change the fleet through Temporal; guarded() turns what the operator can fix (a
# bad argument, an unreachable server, an unknown instance) into one line and an exit status.


def _describe(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.client import guarded
    from operator_cli.describe import add_describe_arguments, describe_instances

    add_describe_arguments(parser)
    return guarded(describe_instances)


def _history(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.client import guarded
    from operator_cli.history import add_history_arguments, repair_history

    add_history_arguments(parser)
    return guarded(repair_history)


def _inject(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.client import guarded
    from operator_cli.inject import add_inject_arguments, inject_fault

    add_inject_arguments(parser)
    return guarded(inject_fault)


def _group(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.client import guarded
    from operator_cli.group import add_group_arguments, group_usage

    add_group_arguments(parser)
    return guarded(group_usage)


def _fleet(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.client import guarded
    from operator_cli.fleet import add_fleet_arguments, fleet_usage

    add_fleet_arguments(parser)
    return guarded(fleet_usage)


def _instance(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.client import guarded
    from operator_cli.instance import add_instance_arguments, instance_usage

    add_instance_arguments(parser)
    return guarded(instance_usage)


def _doctor(parser: argparse.ArgumentParser) -> Runner:
    from operator_cli.client import guarded
    from operator_cli.doctor import add_doctor_arguments, run_doctor

    add_doctor_arguments(parser)
    return guarded(run_doctor)


def build_parser(every_command: bool = False) -> argparse.ArgumentParser:
    """`autorepair`'s parser; each command's arguments are added when it is parsed, or all at once (every_command)."""
    parser = OneLineErrorParser(prog="autorepair", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)

    def command(name: str, help: str, setup: Setup) -> None:
        added = commands.add_parser(name, help=help, description=help, setup=setup)
        if every_command and isinstance(added, CommandParser):
            # A command whose extra is not installed here is left without its flags, as it cannot run here either.
            with contextlib.suppress(ModuleNotFoundError):
                added.ready()

    command("worker", "run the repair workers (workflows and activities) on this host", _worker)
    command("setup", "register the custom search attributes in the Temporal namespace", _setup)
    # The simulator is only for trying it out: an image without it (the probe's) still runs every other command.
    if importlib.util.find_spec("simulator") is not None:
        command("demo", "run a simulated GPU fleet that heals itself, locally", _demo)
        command("sim", "play a simulated GPU fleet against moto, beside the worker and the ingest", _sim)
    command("probe", "run the node probe on a GPU host", _probe)
    command(
        "probe-report",
        "send one GPU finding through the ingest, as this host's probe would, and say whether it was accepted",
        _probe_report,
    )
    command("ingest", "serve the ingest: GPU hosts report here over HTTPS, proven by AWS identity", _ingest)
    command("classify", "classify kernel log text under a repair policy", _classify)
    command("healthcheck", "GET a /healthz URL: exit 0 on 200, else 1 and why (container health checks)", _healthcheck)
    command("describe-instances", "health status, GPU findings and repair of instances", _describe)
    command("history", "past and running repairs, phase by phase, from Temporal", _history)
    command("inject", "game day: inject a GPU fault or a heartbeat loss, as a real one arrives", _inject)
    command("group", "a capacity group's configuration, changed live", _group)
    command("fleet", "the fleet-wide breaker: describe it, resume held repairs", _fleet)
    command(
        "instance",
        "an operator's controls of one instance: exclude from repair, include, repair now, clear a false finding",
        _instance,
    )
    command(
        "doctor",
        "check the setup before the first repair: Temporal, each group's AWS resources, the worker's IAM, the ingest",
        _doctor,
    )
    command("completion", "print the shell completion script of autorepair: bash, zsh or tcsh", _completion)
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


# The commands that run on a GPU host (PROBE_SIDE) read only the probe's part of the shared settings ([temporal],
# log_format): the worker's sections there are the worker's to check, and an older probe must not refuse a newer
# worker's key.


def _log_format(command: str) -> str:
    """The command's settings, read for their log format; each side's settings class is imported only by its own
    commands (the worker's would bring the groups' and breaker's models onto a GPU host)."""
    # healthcheck: an orchestrator runs it every few seconds; completion: a shell's setup. No settings to read (or to
    # fail on) for either.
    if command in ("healthcheck", "completion"):
        return "auto"
    if command in PROBE_SIDE:
        from node_probe.cli import ProbeSettings

        return ProbeSettings.load().log_format
    from worker.settings import Settings

    return Settings.load().log_format


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # Every command's settings are read here first: a missing file, bad TOML or a bad value is one line naming
        # the file (or environment variable), the key and the fix, and exit status 2, before the command starts.
        # Read as the command will read them: with the profile its --profile names, if it takes one.
        with temporal_profile(getattr(args, "profile", None)):
            settings_format = _log_format(args.command)
    except ConfigError as err:
        print(f"autorepair {args.command}: invalid configuration: {err}", file=sys.stderr)
        return exit_codes.USAGE
    configure_logging(settings_format)
    try:
        outcome = args.run(args)
        if isinstance(outcome, Coroutine):
            outcome = asyncio.run(outcome)
        return _finish(args, int(outcome or 0), argv)
    except KeyboardInterrupt:
        return exit_codes.INTERRUPTED
    except ConfigError as err:
        print(f"autorepair {args.command}: invalid configuration: {err}", file=sys.stderr)
        return exit_codes.USAGE
    except ValidationError as err:
        print(f"autorepair: {_one_line(err)}", file=sys.stderr)
        return exit_codes.USAGE
    except (FileNotFoundError, KeyError) as err:
        print(f"autorepair: {err}", file=sys.stderr)
        return exit_codes.USAGE
    except RuntimeError as err:
        if "Failed client connect" in str(err) or "connect" in str(err).lower():
            print(f"autorepair: cannot reach Temporal: {err}", file=sys.stderr)
            return exit_codes.UNREACHABLE
        raise


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except ModuleNotFoundError as err:
        # A command whose extra is not installed here (the probe's image has no Temporal SDK): one line naming it.
        hint = missing_extra(err, sys.argv[1:] if argv is None else argv)
        if hint is None:
            raise
        print(hint, file=sys.stderr)
        return exit_codes.USAGE


if __name__ == "__main__":
    sys.exit(main())
