"""`autorepair`: the worker, the demo, the node probe and the operator's tools, behind one command."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from pydantic import ValidationError

from worker.logging_setup import configure_logging
from worker.settings import Settings

log = structlog.get_logger(__name__)


async def _run_worker_command(args: argparse.Namespace) -> int:
    from worker.client import connect
    from worker.main import run_worker
    from worker.setup import ensure_search_attributes
    from worker.telemetry import runtime, tracing_interceptors

    settings = Settings()
    client = await connect(settings.temporal, runtime=runtime(settings), interceptors=tracing_interceptors(settings))
    await ensure_search_attributes(client)
    log.info(
        "worker starting",
        address=settings.temporal.address,
        namespace=settings.temporal.namespace,
        task_queue=settings.temporal.task_queue,
        groups=[g.name for g in settings.groups],
        metrics=settings.metrics_bind_address,
    )
    await run_worker(settings, client)
    return 0


async def _run_setup_command(args: argparse.Namespace) -> int:
    from worker.client import connect
    from worker.setup import ensure_search_attributes

    settings = Settings()
    added = await ensure_search_attributes(await connect(settings.temporal))
    print(f"search attributes added: {', '.join(added)}" if added else "search attributes already registered")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from node_probe.cli import add_classify_arguments, add_probe_arguments, run_classify, run_probe_command
    from worker.demo import add_demo_arguments, run_demo

    parser = argparse.ArgumentParser(prog="autorepair", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, run: Callable[[argparse.Namespace], Any]) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(run=run)
        return sub

    command("worker", "run the repair workers (workflows and activities) on this host", _run_worker_command)
    command("setup", "register the custom search attributes in the Temporal namespace", _run_setup_command)
    add_demo_arguments(command("demo", "run a simulated GPU fleet that heals itself, locally", run_demo))
    add_probe_arguments(command("probe", "run the node probe on a GPU host", run_probe_command))
    add_classify_arguments(command("classify", "classify kernel log text under a repair policy", run_classify))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings_format = Settings().log_format
    except ValidationError as err:
        print(f"autorepair: invalid configuration: {err}", file=sys.stderr)
        return 2
    configure_logging(settings_format)
    try:
        outcome = args.run(args)
        if isinstance(outcome, Coroutine):
            outcome = asyncio.run(outcome)
        return int(outcome or 0)
    except KeyboardInterrupt:
        return 130
    except (ValidationError, FileNotFoundError, KeyError) as err:
        print(f"autorepair: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        if "Failed client connect" in str(err) or "connect" in str(err).lower():
            print(f"autorepair: cannot reach Temporal: {err}", file=sys.stderr)
            return 3
        raise


if __name__ == "__main__":
    sys.exit(main())
