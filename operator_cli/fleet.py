"""`autorepair fleet describe | resume`: the fleet-wide breaker, across every capacity group of the settings."""

from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta

from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from contract import names
from contract.breaker import FleetBreakerView, FleetResume
from contract.ids import fleet_breaker_workflow_id
from operator_cli.arguments import add_common_arguments, parse_duration
from operator_cli.client import (
    QUERY_TIMEOUT,
    OpsError,
    connect_client,
    guarded,
    one_line,
    requested_by,
    temporal_settings,
    workflow_url,
)
from operator_cli.exit_codes import OK, UNREACHABLE
from operator_cli.output import emit, seconds_text, stdout_console


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="fleet_command", metavar="{describe,resume}")
    show = actions.add_parser("describe", help="whether the fleet-wide breaker holds repairs, and why")
    show.set_defaults(run=guarded(fleet_describe))
    add_common_arguments(show)
    resume = actions.add_parser("resume", help="let repairs held by the fleet-wide breaker through")
    resume.set_defaults(run=guarded(fleet_resume))
    resume.add_argument(
        "--discard-held",
        action="store_true",
        help="let the held repairs go instead; their instances must prove their fault again",
    )
    resume.add_argument("--timeout", type=parse_duration, default=timedelta(seconds=60), help="wait this long (60s)")
    add_common_arguments(resume)


async def fleet_usage(args: argparse.Namespace) -> int:
    raise OpsError("choose describe or resume: autorepair fleet describe")


async def fleet_describe(args: argparse.Namespace) -> int:
    temporal = temporal_settings(args)
    client = await connect_client(temporal)
    handle = client.get_workflow_handle(fleet_breaker_workflow_id(temporal.task_queue))
    try:
        view = await handle.query(names.QUERY_FLEET_BREAKER, result_type=FleetBreakerView, rpc_timeout=QUERY_TIMEOUT)
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
        view = None  # no impairment so far: the fleet breaker starts with the first
    document = {
        "running": view is not None,
        "breaker": view.model_dump(mode="json") if view else None,
        "workflowUrl": workflow_url(temporal, fleet_breaker_workflow_id(temporal.task_queue), None) if view else None,
    }
    emit(args, document, lambda wide: _print_breaker(view))
    return OK


def _print_breaker(view: FleetBreakerView | None) -> None:
    console = stdout_console()
    if view is None:
        console.print("no fleet breaker running: no instance has been impaired since the worker started using it")
        return
    if view.held is not None:
        console.print(f"[bold red]HELD[/] since {view.held.tripped_at.isoformat()}: {view.held.message}")
    console.print(
        f"fleet breaker: {view.impaired_in_window} impaired within the window, trips above {view.threshold:g} "
        f"({view.fleet_size} instances in {len(view.groups)} groups)"
    )
    if view.last_resume is not None:
        console.print(f"last resumed {view.last_resume.at.isoformat()} by {view.last_resume.by or '?'}")


async def fleet_resume(args: argparse.Namespace) -> int:
    temporal = temporal_settings(args)
    client = await connect_client(temporal)
    handle = client.get_workflow_handle(fleet_breaker_workflow_id(temporal.task_queue))
    request = FleetResume(discard_held=args.discard_held, requested_by=requested_by())
    try:
        view = await asyncio.wait_for(
            handle.execute_update(names.UPDATE_FLEET_RESUME, request, result_type=FleetBreakerView),
            timeout=args.timeout.total_seconds(),
        )
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        raise OpsError(one_line(cause.message if isinstance(cause, ApplicationError) else str(cause))) from None
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise OpsError("the fleet-wide breaker is not running: nothing is held by it") from None
        raise
    except TimeoutError:
        raise OpsError(
            f"no worker completed the resume within {seconds_text(args.timeout.total_seconds())}: is "
            f"`autorepair worker` running on task queue {temporal.task_queue}?",
            code=UNREACHABLE,
        ) from None
    discarded = ", held repairs discarded" if args.discard_held else ""
    emit(
        args,
        view.model_dump(mode="json"),
        lambda wide: stdout_console().print(f"fleet-wide breaker resumed{discarded}"),
    )
    return OK
