"""`autorepair worker`: start the worker process. operator_cli/main.py wires it into the `autorepair` command
(`autorepair setup`, which registers the search attributes alone, is an operator command: operator_cli/setup.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import structlog

from contract.temporal_options import add_temporal_arguments, load_settings
from worker.settings import Settings

log = structlog.get_logger(__name__)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    add_temporal_arguments(parser)


async def run_worker_command(args: argparse.Namespace) -> int:
    """Run the workers until interrupted, registering any missing search attribute first."""
    # Imported here, not at the top: every other `autorepair` command (and --help) would otherwise load all the
    # workflows, activities and telemetry exporters for nothing.
    from contract.temporal_client import connect
    from worker.main import run_worker
    from worker.setup import ensure_search_attributes
    from worker.telemetry import runtime, tracing_interceptors

    settings = load_settings(Settings.load, args)
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
    # SIGTERM (a rolling update, `docker stop`, systemd) and SIGINT end the worker gracefully: it stops polling, lets
    # in-flight activities finish within graceful_shutdown_timeout, and exits 0.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    await run_worker(settings, client, stop)
    log.info("worker stopped")
    return 0
