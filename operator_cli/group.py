"""`autorepair group describe | update`: a capacity group's configuration, read and changed live.

The live configuration is the group's drain semaphore's: the worker settings plus the overrides operators made
through its `update_group` update, kept across its runs.
"""

from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta
from typing import Any

from rich.table import Table
from temporalio.client import WithStartWorkflowOperation, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError

from activities.workflow_ops import live_group_config
from contract import names
from contract import search_attributes as sa
from contract.groups import (
    AutoRepair,
    CapacityGroup,
    GroupConfigOverrides,
    GroupConfigState,
    GroupConfigUpdate,
    Remediation,
)
from contract.health import SEARCH_STATUSES
from contract.ids import semaphore_workflow_id
from contract.semaphore import SemaphoreInput
from operator_cli.arguments import add_common_arguments, parse_duration, safe_name
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
from operator_cli.output import emit, iso, seconds_text, stdout_console
from worker.settings import Settings
from workflows.models import SemaphoreView


def add_group_arguments(parser: argparse.ArgumentParser) -> None:
    """`group describe` and `group update`, each with its own run; `group` alone runs group_usage."""
    actions = parser.add_subparsers(dest="group_command", metavar="{describe,update}")
    show = actions.add_parser("describe", help="effective configuration and live overrides")
    show.set_defaults(run=guarded(group_describe))
    show.add_argument("--name", type=safe_name("group name"), required=True)
    add_common_arguments(show)
    update = actions.add_parser(
        "update", help="change auto repair, the drain cap, the heartbeat threshold or the breaker now; resume repairs"
    )
    update.set_defaults(run=guarded(group_update))
    update.add_argument("--name", type=safe_name("group name"), required=True)
    update.add_argument("--auto-repair", type=str.upper, choices=[a.value for a in AutoRepair])
    update.add_argument("--max-draining-percent", type=int, metavar="P")
    update.add_argument("--heartbeat-loss-threshold", type=parse_duration, metavar="DURATION")
    update.add_argument("--max-impaired-percent", type=int, metavar="P", help="the breaker's percentage (30)")
    update.add_argument("--min-impaired", type=int, metavar="N", help="the breaker never trips at N or fewer (3)")
    update.add_argument("--impaired-window", type=parse_duration, metavar="DURATION", help="the breaker's window")
    update.add_argument("--max-repairs-per-day", type=int, metavar="N", help="hold repairs after N in 24 hours")
    update.add_argument(
        "--remediation",
        choices=[r.value for r in Remediation],
        help="replace every impaired instance, or reboot-first where NVIDIA says a reset or reboot clears the fault",
    )
    update.add_argument("--resume", action="store_true", help="let repairs held by the group's breaker through")
    update.add_argument(
        "--discard-held",
        action="store_true",
        help="with --resume: let the held repairs go instead; their instances must prove their fault again",
    )
    update.add_argument(
        "--reset", action="store_true", help="drop every live override (back to the settings), then apply the rest"
    )
    update.add_argument("--timeout", type=parse_duration, default=timedelta(seconds=60), help="wait this long (60s)")
    add_common_arguments(update)


async def group_usage(args: argparse.Namespace) -> int:
    """`autorepair group` without describe or update."""
    raise OpsError("choose describe or update: autorepair group describe --name G")


async def group_describe(args: argparse.Namespace) -> int:
    temporal = temporal_settings(args)
    client = await connect_client(temporal)
    handle = client.get_workflow_handle(semaphore_workflow_id(args.name))
    # A semaphore that is not running still has the overrides its last run left: the next one takes them over.
    state, running = await live_group_config(client, args.name, QUERY_TIMEOUT)
    view = (
        await handle.query(names.QUERY_STATE, result_type=SemaphoreView, rpc_timeout=QUERY_TIMEOUT) if running else None
    )
    instances = {
        status: (await client.count_workflows(sa.health_count_query(args.name, status))).count
        for status in SEARCH_STATUSES
    }
    local = _local_group(args.name)
    effective, source = (
        (state.effective, "drain semaphore (worker settings + live overrides)")
        if state is not None and state.effective is not None
        else (local, "local settings (no live overrides)")
        if local is not None
        else (None, None)
    )
    document = {
        "name": args.name,
        "semaphoreRunning": running,
        "effective": effective.model_dump(mode="json") if effective is not None else None,
        "effectiveSource": source,
        "overrides": state.overrides.model_dump(mode="json", exclude_none=True) if state else {},
        "revision": state.revision if state else 0,
        "updatedAt": iso(state.updated_at) if state else None,
        "updatedBy": state.updated_by if state else "",
        "draining": None
        if view is None
        else {
            "capacity": view.capacity,
            "groupSize": view.group_size,
            "outOfService": view.out_of_service,
            "holders": [p.instance_id for p in view.holders],
            "waiting": [w.instance_id for w in view.waiters],
        },
        "breaker": None if view is None else view.breaker.model_dump(mode="json"),
        # Running health workflows by HealthStatus; UNMONITORED: no report from its probe since it registered.
        "instances": instances,
        "workflowUrl": workflow_url(temporal, semaphore_workflow_id(args.name), None) if state else None,
    }
    emit(args, document, lambda wide: _print_group(document, wide))
    return OK


# The settings other than the live ones that the table shows; `-o wide` shows all.
SHOWN_SETTINGS = (
    "cluster",
    "launch_template",
    "auto_scaling_group",
    "replacement_ready_timeout",
    "gpu_reset",
    "reboot_timeout",
    "escalation_window",
    "max_fixes_in_place",
    "fix_window",
)


def _default(key: str) -> str:
    field = CapacityGroup.model_fields.get(key)
    if field is None or field.is_required():
        return ""
    return str(field.get_default(call_default_factory=True))


def _local_group(name: str) -> CapacityGroup | None:
    try:
        return Settings().group(name)
    except KeyError:
        return None


def _print_group(document: dict[str, Any], wide: bool) -> None:
    """The live-changeable settings and the chief others; wide: every setting, with its default beside it."""
    console = stdout_console()
    table = Table(title=f"Capacity group {document['name']}")
    for column in ("setting", "value", "live override", *(("default",) if wide else ())):
        table.add_column(column, overflow="fold")
    overrides = document["overrides"]
    effective = document["effective"] or {}
    for key in (*GroupConfigOverrides.model_fields,):
        value = effective.get(key, "?")
        table.add_row(
            key,
            str(value),
            "yes" if key in overrides else "",
            *((_default(key),) if wide else ()),
            style="bold" if key in overrides else None,
        )
    shown = (*SHOWN_SETTINGS, *(k for k in effective if k not in SHOWN_SETTINGS)) if wide else SHOWN_SETTINGS
    for key in shown:
        if key in GroupConfigOverrides.model_fields:
            continue
        if wide or effective.get(key) is not None:
            table.add_row(key, str(effective.get(key)), "", *((_default(key),) if wide else ()))
    if document["effectiveSource"]:
        table.caption = f"from {document['effectiveSource']}"
    console.print(table)
    if document["revision"]:
        console.print(
            f"revision {document['revision']}, changed {document['updatedAt']} by {document['updatedBy'] or '?'}"
        )
    counted = ", ".join(f"{n} {status}" for status, n in document["instances"].items() if n)
    console.print(f"instances: {counted or 'none'}")
    draining = document["draining"]
    if draining is not None:
        console.print(
            f"draining {len(draining['holders'])} / {draining['capacity']} ({draining['groupSize']} instances)"
            + (f", {draining['outOfService']} more out of service" if draining["outOfService"] else "")
            + (f", waiting: {', '.join(draining['waiting'])}" if draining["waiting"] else "")
        )
    breaker = document["breaker"]
    if breaker is not None:
        _print_breaker(breaker)
    elif not document["semaphoreRunning"]:
        kept = " (its last run's overrides apply, and the next run takes them over)" if document["revision"] else ""
        console.print(f"no drain semaphore running for this group now{kept}")


def _print_breaker(breaker: dict[str, Any]) -> None:
    console = stdout_console()
    for key, scope in (("held", "the group's breaker"), ("fleet_held", "the fleet-wide breaker")):
        hold = breaker.get(key)
        if hold:
            console.print(f"[bold red]HELD by {scope}[/] since {hold['tripped_at']}: {hold['message']}")
    console.print(
        f"breaker: {breaker['impaired_in_window']} impaired within the window, trips above {breaker['threshold']:g}"
        + (
            f"; repairs in 24 h: {breaker['repairs_today']} / {breaker['max_repairs_per_day']}"
            if breaker.get("max_repairs_per_day")
            else ""
        )
    )
    if not breaker.get("in_maintenance_window", True):
        console.print(
            f"outside the maintenance windows: only critical repairs until {breaker['next_maintenance_window']}"
        )
    resumed = breaker.get("last_resume")
    if resumed:
        discarded = ", held repairs discarded" if resumed.get("discard_held") else ""
        console.print(f"last resumed {resumed['at']} by {resumed.get('by') or '?'}{discarded}")


async def group_update(args: argparse.Namespace) -> int:
    update = GroupConfigUpdate(
        auto_repair=AutoRepair(args.auto_repair) if args.auto_repair else None,
        max_draining_percent=args.max_draining_percent,
        heartbeat_loss_threshold=args.heartbeat_loss_threshold,
        max_impaired_percent=args.max_impaired_percent,
        min_impaired=args.min_impaired,
        impaired_window=args.impaired_window,
        max_repairs_per_day=args.max_repairs_per_day,
        remediation=Remediation(args.remediation) if args.remediation else None,
        reset=args.reset,
        resume=args.resume,
        discard_held=args.discard_held,
        requested_by=requested_by(),
    )
    problems = update.problems()
    if problems:
        raise OpsError("; ".join(problems))
    settings_groups = [g.name for g in Settings().groups]
    if settings_groups and args.name not in settings_groups:
        # Only when this host has the groups configured; otherwise the worker (which always has) decides.
        raise OpsError(f"unknown capacity group {args.name!r} (configured: {', '.join(settings_groups)})")
    temporal = temporal_settings(args)
    client = await connect_client(temporal)
    start: WithStartWorkflowOperation[Any, Any] = WithStartWorkflowOperation(
        names.SEMAPHORE_WORKFLOW,
        SemaphoreInput(group=args.name),
        id=semaphore_workflow_id(args.name),
        task_queue=temporal.task_queue,
        # The semaphore may not be running yet (no repair so far): start it, the update is its first act.
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary=f"drain cap for capacity group {args.name}",
    )
    try:
        state = await asyncio.wait_for(
            client.execute_update_with_start_workflow(
                names.UPDATE_GROUP, update, start_workflow_operation=start, result_type=GroupConfigState
            ),
            timeout=args.timeout.total_seconds(),
        )
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        message = cause.message if isinstance(cause, ApplicationError) else str(cause)
        raise OpsError(one_line(message)) from None
    except TimeoutError:
        raise OpsError(
            f"no worker completed the update within {seconds_text(args.timeout.total_seconds())}: is "
            f"`autorepair worker` running on task queue {temporal.task_queue}?",
            code=UNREACHABLE,
        ) from None
    if not isinstance(state, GroupConfigState):
        raise OpsError(f"unexpected answer from the drain semaphore: {state!r}", code=UNREACHABLE)
    document = {
        "name": args.name,
        "effective": state.effective.model_dump(mode="json") if state.effective else None,
        "overrides": state.overrides.model_dump(mode="json", exclude_none=True),
        "revision": state.revision,
        "updatedAt": iso(state.updated_at),
        "updatedBy": state.updated_by,
    }

    def text(wide: bool) -> None:
        changed = ", ".join(f"{k}={v}" for k, v in document["overrides"].items())
        overrides = f"live overrides now {changed}" if changed else "no live overrides (the settings apply)"
        if args.resume:
            discarded = ", held repairs discarded" if args.discard_held else ""
            stdout_console().print(f"capacity group {args.name}: repairs resumed{discarded}")
        stdout_console().print(f"capacity group {args.name}: revision {state.revision}, {overrides}")

    emit(args, document, text)
    return OK
