"""`autorepair instance exclude | include | repair | clear`: an operator's controls of one instance.

Each is an update of the instance's health workflow (`health/<instance>`): refused with one line when it cannot be done
(then nothing changed), otherwise recorded in that workflow's history, published as an event, and answered with what
it did. An instance whose health workflow has closed (replaced, or left on purpose) has retired: nothing to control.
"""

from __future__ import annotations

import argparse
import asyncio
from datetime import timedelta
from typing import Any

from pydantic import BaseModel
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from contract import names
from contract.ids import health_workflow_id
from contract.instances import (
    FindingsClear,
    InstanceControlResult,
    InstanceExclude,
    InstanceInclude,
    InstanceRepairNow,
)
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
from workflows.models import InstanceHealthView

# action -> (update, its help, whether --reason is required)
ACTIONS: dict[str, tuple[str, str, bool]] = {
    "exclude": (
        names.UPDATE_EXCLUDE_INSTANCE,
        "watch and report the instance, never repair it (maintenance, investigation); a repair still waiting for "
        "its drain permit is withdrawn, one draining is left to finish",
        False,
    ),
    "include": (
        names.UPDATE_INCLUDE_INSTANCE,
        "repair the instance again; if it is impaired now, its repair starts",
        False,
    ),
    "repair": (
        names.UPDATE_REPAIR_INSTANCE,
        "repair the instance now, OK or not, through the group's drain cap like any repair",
        True,
    ),
    "clear": (
        names.UPDATE_CLEAR_FINDINGS,
        "the impairment was false: its checks back to OK, the findings kept as cleared by you; a repair still "
        "waiting for its drain permit is withdrawn",
        False,
    ),
}


def add_instance_arguments(parser: argparse.ArgumentParser) -> None:
    """`instance exclude|include|repair|clear`, each with its own run; `instance` alone runs instance_usage."""
    actions = parser.add_subparsers(dest="instance_command", metavar="{" + ",".join(ACTIONS) + "}")
    for action, (_, help, reason_required) in ACTIONS.items():
        sub = actions.add_parser(action, help=help, description=help)
        sub.set_defaults(run=guarded(instance_control))
        sub.add_argument("--instance", type=safe_name("instance id"), required=True)
        sub.add_argument(
            "--reason",
            required=reason_required,
            default="",
            help="why, for the history and the event" + (" (required)" if reason_required else ""),
        )
        sub.add_argument("--timeout", type=parse_duration, default=timedelta(seconds=60), help="wait this long (60s)")
        add_common_arguments(sub)


async def instance_usage(args: argparse.Namespace) -> int:
    """`autorepair instance` without an action."""
    raise OpsError(f"choose {', '.join(ACTIONS)}: autorepair instance exclude --instance I --reason TEXT")


def control_request(action: str, reason: str, who: str) -> BaseModel:
    if action == "exclude":
        return InstanceExclude(reason=reason, requested_by=who)
    if action == "include":
        return InstanceInclude(reason=reason, requested_by=who)
    if action == "repair":
        return InstanceRepairNow(reason=reason, requested_by=who)
    return FindingsClear(reason=reason, requested_by=who)


async def instance_control(args: argparse.Namespace) -> int:
    action = args.instance_command
    update, _, _ = ACTIONS[action]
    request = control_request(action, args.reason, requested_by())
    temporal = temporal_settings(args)
    client = await connect_client(temporal)
    workflow_id = health_workflow_id(args.instance)
    handle = client.get_workflow_handle(workflow_id)
    await _must_be_running(client, handle, args.instance)
    try:
        result = await asyncio.wait_for(
            handle.execute_update(update, request, result_type=InstanceControlResult),
            timeout=args.timeout.total_seconds(),
        )
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        message = cause.message if isinstance(cause, ApplicationError) else str(cause)
        raise OpsError(one_line(message)) from None
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:  # it closed since we looked
            await _must_be_running(client, handle, args.instance)
        raise
    except TimeoutError:
        raise OpsError(
            f"no worker completed the update within {seconds_text(args.timeout.total_seconds())}: is "
            f"`autorepair worker` running on task queue {temporal.task_queue}?",
            code=UNREACHABLE,
        ) from None
    if not isinstance(result, InstanceControlResult):
        raise OpsError(f"unexpected answer from {workflow_id}: {result!r}", code=UNREACHABLE)
    document = _document(result) | {"action": action, "workflowUrl": workflow_url(temporal, workflow_id, None)}
    emit(args, document, lambda wide: _print_result(result))
    return OK


async def _must_be_running(client: Client, handle: WorkflowHandle[Any, Any], instance: str) -> None:
    """Unknown and retired instances are refused here, in the operator's terms."""
    try:
        description = await handle.describe(rpc_timeout=QUERY_TIMEOUT)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise OpsError(
                f"unknown instance {instance}: no health workflow {handle.id} (its probe has never reported)"
            ) from None
        raise
    if description.status == WorkflowExecutionStatus.RUNNING:
        return
    status = description.status.name if description.status is not None else "closed"
    why = f"its health workflow is {status}"
    if description.status == WorkflowExecutionStatus.COMPLETED:
        try:
            typed = client.get_workflow_handle(handle.id, result_type=InstanceHealthView)
            view = await typed.result(rpc_timeout=QUERY_TIMEOUT)
        except Exception:  # the reason is a courtesy: the refusal stands without it
            view = None
        if view is not None and view.retired_reason:
            why = f"it left on purpose: {view.retired_reason}"
        elif view is not None and view.repair is not None and view.repair.replacement_instance_id:
            why = f"it was replaced by {view.repair.replacement_instance_id} ({view.repair.workflow_id})"
    raise OpsError(f"instance {instance} has retired ({why}): nothing to control")


def _document(result: InstanceControlResult) -> dict[str, Any]:
    excluded = result.excluded
    return {
        "ec2InstanceId": result.instance_id,
        "message": result.message,
        "overallStatus": result.overall_status.value,
        "excluded": None
        if excluded is None
        else {"by": excluded.by, "reason": excluded.reason, "since": iso(excluded.since)},
        "repair": None
        if result.repair_workflow_id is None
        else {
            "workflowId": result.repair_workflow_id,
            "phase": result.repair_phase.value if result.repair_phase else None,
        },
        "repairWithheld": result.repair_withheld,
        "cleared": [c.model_dump(mode="json") for c in result.cleared],
    }


def _print_result(result: InstanceControlResult) -> None:
    console = stdout_console()
    console.print(result.message, markup=False)
    console.print(f"overall status: {result.overall_status.value}", markup=False)
    if result.excluded is not None:
        console.print(f"excluded since {iso(result.excluded.since)}", markup=False)
    if result.repair_withheld:
        console.print(f"not repaired: {result.repair_withheld}", markup=False)
