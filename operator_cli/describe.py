"""`autorepair describe-instances`: each instance's health status, the GPU findings behind it and its repair.

Health comes from the instances' health workflows through their `health` query, never from a worker's memory; a
group's instances are found through visibility (running health workflows with its CapacityGroup). Answered like `aws
ecs describe-container-instances`: the instances described, and those that could not be in `failures`.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from datetime import datetime
from enum import StrEnum
from typing import Any, TypeVar

from pydantic import BaseModel
from rich.table import Table
from temporalio.client import Client, WorkflowQueryFailedError, WorkflowQueryRejectedError
from temporalio.service import RPCError, RPCStatusCode

from contract import names
from contract import search_attributes as sa
from contract.config import TemporalSettings
from contract.health import HealthState
from contract.ids import health_workflow_id, semaphore_workflow_id
from contract.repair import RepairPhase
from operator_cli.arguments import add_common_arguments, safe_name
from operator_cli.client import (
    QUERY_TIMEOUT,
    OpsError,
    bounded,
    connect_client,
    list_workflows,
    one_line,
    rpc_reason,
    temporal_settings,
    workflow_url,
)
from operator_cli.exit_codes import OK
from operator_cli.output import emit, iso, progress, short_time, stdout_console
from workflows.models import InstanceHealthView, SemaphoreView

T = TypeVar("T")

LAST_HEARD_BATCH = 1_000
# The answer's two lists, named as ECS DescribeContainerInstances names them.
CONTAINER_INSTANCES = "containerInstances"
FAILURES = "failures"
STATUS_STYLES = {"IMPAIRED": "bold red", "INSUFFICIENT_DATA": "yellow", "INITIALIZING": "cyan", "OK": "green"}


def add_describe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--group", type=safe_name("group name"), help="capacity group (lists its running instances)")
    parser.add_argument(
        "--instance", type=safe_name("instance id"), action="append", default=[], help="instance id (repeatable)"
    )
    parser.add_argument(
        "--status",
        type=str.upper,
        choices=[state.value for state in HealthState],
        help="with --group: only instances whose overall status is this (e.g. IMPAIRED)",
    )
    add_common_arguments(parser)


class FailureReason(StrEnum):
    MISSING = "MISSING"  # no health workflow: its probe has never reported (ECS's word for an unknown instance)
    UNAVAILABLE = "UNAVAILABLE"  # it exists, but its health query went unanswered (no worker) or failed


class Failure(BaseModel):
    """An instance that could not be described, shaped as a failure of ECS DescribeContainerInstances. `arn` is the
    instance id: an instance known only by its id has no ARN here."""

    arn: str
    reason: FailureReason
    detail: str


async def describe_instances(args: argparse.Namespace) -> int:
    """Exit status OK even when some instances could not be described, as the aws CLI does: they are the answer's
    `failures` (in the table, a line each). Only a command that could not run at all exits otherwise."""
    if not args.group and not args.instance:
        raise OpsError("give --group G (all its running instances) or --instance I (repeatable)")
    temporal = temporal_settings(args)
    client = await connect_client(temporal)
    if args.instance:
        instances: list[tuple[str, str | None]] = [(i, None) for i in dict.fromkeys(args.instance)]
    else:
        query = (
            f"WorkflowType = '{names.HEALTH_WORKFLOW}' AND CapacityGroup = {sa.quoted(args.group)} "
            "AND ExecutionStatus = 'Running'"
        )
        if args.status:
            query += f" AND {sa.HEALTH_STATUS.name} = {sa.quoted(args.status)}"
        executions = await list_workflows(client, query)
        instances = sorted(
            (
                execution.typed_search_attributes.get(sa.INSTANCE_ID) or execution.id.removeprefix("health/"),
                execution.run_id,
            )
            for execution in executions
        )
    # One query per instance, CONCURRENCY at a time: a large group takes a while, so a person sees it move.
    with progress("describing instances", len(instances)) as advance:
        described = await bounded(
            _counted(_describe_one(client, temporal, instance, run_id), advance) for instance, run_id in instances
        )
    entries = [entry for entry, _ in described if isinstance(entry, dict)]
    failures = [entry for entry, _ in described if isinstance(entry, Failure)]
    views = [view for _, view in described if view is not None]
    await _add_last_heard(client, views, entries)
    await _add_held(client, views, entries)
    document = {CONTAINER_INSTANCES: entries, FAILURES: [f.model_dump(mode="json") for f in failures]}
    emit(
        args,
        document,
        lambda wide: _print_instances(entries, failures, args.group, wide),
        rows=[*document[CONTAINER_INSTANCES], *document[FAILURES]],
    )
    return OK


async def _counted(call: Awaitable[T], done: Callable[[], None]) -> T:
    try:
        return await call
    finally:
        done()


async def _describe_one(
    client: Client, temporal: TemporalSettings, instance_id: str, run_id: str | None
) -> tuple[dict[str, Any] | Failure, InstanceHealthView | None]:
    workflow_id = health_workflow_id(instance_id)
    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    try:
        if run_id is None:
            run_id = (await handle.describe(rpc_timeout=QUERY_TIMEOUT)).run_id
        view = await handle.query(names.QUERY_HEALTH, result_type=InstanceHealthView, rpc_timeout=QUERY_TIMEOUT)
    except RPCError as err:
        reason = FailureReason.MISSING if err.status == RPCStatusCode.NOT_FOUND else FailureReason.UNAVAILABLE
        return Failure(arn=instance_id, reason=reason, detail=rpc_reason(err, names.QUERY_HEALTH)), None
    except (WorkflowQueryFailedError, WorkflowQueryRejectedError) as err:
        return Failure(arn=instance_id, reason=FailureReason.UNAVAILABLE, detail=one_line(str(err))), None
    return health_entry(view, workflow_url(temporal, workflow_id, run_id)), view


async def _add_last_heard(client: Client, views: list[InstanceHealthView], entries: list[dict[str, Any]]) -> None:
    """`lastHeard`: when the ingest last heard each instance, from its liveness tracker (one query per tracker);
    the health workflow itself hears heartbeats only when they change. Left out where the tracker cannot say."""
    by_tracker: dict[str, list[str]] = {}
    for view in views:
        if view.liveness_workflow_id:
            by_tracker.setdefault(view.liveness_workflow_id, []).append(view.instance_id)
    heard: dict[str, datetime] = {}
    for tracker, instance_ids in by_tracker.items():
        handle = client.get_workflow_handle(tracker)
        for start in range(0, len(instance_ids), LAST_HEARD_BATCH):
            try:
                heard |= await handle.query(
                    names.QUERY_LAST_HEARD,
                    instance_ids[start : start + LAST_HEARD_BATCH],
                    result_type=dict[str, datetime],
                    rpc_timeout=QUERY_TIMEOUT,
                )
            except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError):
                break  # no tracker yet, or none that answers: the health workflow's own time stands
    for entry in entries:
        if entry["ec2InstanceId"] in heard:
            entry["lastHeard"] = iso(heard[entry["ec2InstanceId"]])


async def _add_held(client: Client, views: list[InstanceHealthView], entries: list[dict[str, Any]]) -> None:
    """`repairHeld`: why a repair waiting for its permit waits, when a breaker holds its group (one query per group
    with a waiting repair)."""
    waiting = {v.instance_id: v.group for v in views if v.repair and v.repair.phase is RepairPhase.WAITING_FOR_PERMIT}
    holds: dict[str, str] = {}
    for group in set(waiting.values()):
        try:
            handle = client.get_workflow_handle(semaphore_workflow_id(group))
            state = await handle.query(names.QUERY_STATE, result_type=SemaphoreView, rpc_timeout=QUERY_TIMEOUT)
        except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError):
            continue  # no semaphore that answers: nothing to say
        hold = state.breaker.held or state.breaker.fleet_held
        if hold is not None:
            holds[group] = hold.message
    for entry in entries:
        held = holds.get(waiting.get(entry["ec2InstanceId"], ""))
        if held is not None:
            entry["repairHeld"] = held


def health_entry(view: InstanceHealthView, url: str | None = None) -> dict[str, Any]:
    """One instance shaped like an entry of ECS DescribeContainerInstances (`ec2InstanceId`, `healthStatus`),
    extended with the findings behind the status and the repair in progress."""
    return {
        "ec2InstanceId": view.instance_id,
        "capacityGroup": view.group,
        "healthStatus": view.healthStatus.model_dump(mode="json"),
        "findings": [f.model_dump(mode="json") for f in view.recent_findings],
        "warningCounts": view.warning_counts,
        "repair": view.repair.model_dump(mode="json") if view.repair is not None else None,
        "repairWithheld": view.repair_withheld,
        # Why it is, or is not, being repaired, in one word and a phrase (workflows/models.py RepairStance).
        "repairDecision": view.repair_decision.model_dump(mode="json") if view.repair_decision is not None else None,
        # Failed repairs retried by the health workflow: "repair failed (...), next try at T (attempt n of N)" or
        # "repairs exhausted after N attempts" (then only `autorepair instance repair` starts another).
        "repairRetry": _retry_entry(view),
        # An activity that failed and is tried again (the health workflow never fails on one): what it said.
        "lastActivityError": view.last_activity_error,
        # `autorepair instance`: excluded from repair (who, why, since), and impairments cleared as false.
        "excluded": None
        if view.excluded is None
        else {"by": view.excluded.by, "reason": view.excluded.reason, "since": iso(view.excluded.since)},
        "clearedFindings": [c.model_dump(mode="json") for c in view.cleared_findings],
        "lastHeartbeat": iso(view.last_heartbeat),
        "heartbeatsIgnoredUntil": iso(view.heartbeats_ignored_until),
        "rejectedSignals": view.rejected_signals,
        "retired": view.retired,
        "probeSources": [s.model_dump(mode="json") for s in view.probe_sources],
        "workflowUrl": url,
    }


def _retry_entry(view: InstanceHealthView) -> dict[str, Any] | None:
    retry = view.repair_retry
    text = retry.text()
    if text is None:
        return None
    return {
        "text": text,
        "failedAttempts": retry.failed,
        "maxAttempts": retry.max_attempts,
        "nextTryAt": iso(retry.next_at),
        "exhausted": retry.exhausted,
        "error": retry.error,
    }


# The columns `-o wide` adds to each table: what the text table leaves out to fit a terminal.
WIDE_CHECK_COLUMNS = ("group", "last heard", "Web UI")
WIDE_FINDING_COLUMNS = ("finding id", "source", "verdict")
WIDE_REPAIR_COLUMNS = ("started",)


def _table(title: str, columns: tuple[str, ...], wide: tuple[str, ...] | None) -> Table:
    table = Table(title=title)
    for column in (*columns, *(wide or ())):
        table.add_column(column, overflow="fold")
    return table


def _print_instances(entries: list[dict[str, Any]], failures: list[Failure], group: str | None, wide: bool) -> None:
    console = stdout_console()
    checks = _table(
        f"Instance health{f' in {group}' if group else ''}",
        ("instance", "overall", "check", "status", "reason", "last updated", "last change"),
        WIDE_CHECK_COLUMNS if wide else None,
    )
    findings = _table(
        "GPU findings behind it",
        ("instance", "observed", "reason", "impairs", "gpu", "count", "rule", "message"),
        WIDE_FINDING_COLUMNS if wide else None,
    )
    repairs = _table(
        "Repairs",
        ("instance", "repair", "phase", "reason", "replacement", "error"),
        WIDE_REPAIR_COLUMNS if wide else None,
    )
    sources = _table("Probe sources that are down", ("instance", "source", "state", "reason"), None)
    controls = _table("Operator controls", ("instance", "control", "by", "at", "what", "reason"), None)
    retries: list[tuple[str, dict[str, Any]]] = []
    for entry in entries:
        instance = entry["ec2InstanceId"]
        health = entry["healthStatus"]
        overall = health["overallStatus"]
        heard = entry.get("lastHeard") or entry["lastHeartbeat"]
        for index, detail in enumerate(health["details"]):
            first = index == 0
            extra = (entry["capacityGroup"], short_time(_moment(heard)), entry["workflowUrl"] or "")
            checks.add_row(
                instance if first else "",
                f"[{STATUS_STYLES.get(overall, '')}]{overall}[/]" if first else "",
                detail["type"],
                f"[{STATUS_STYLES.get(detail['status'], '')}]{detail['status']}[/]",
                detail.get("statusReason") or "",
                short_time(datetime.fromisoformat(detail["lastUpdated"])),
                short_time(datetime.fromisoformat(detail["lastStatusChange"])),
                *((extra if first else ("", "", "")) if wide else ()),
            )
        for finding in entry["findings"]:
            findings.add_row(
                instance,
                short_time(datetime.fromisoformat(finding["observed_at"])),
                finding["reason"],
                "yes" if finding["impairs"] else "no",
                (finding.get("gpu") or {}).get("pci") or "",
                str(finding["count"]),
                finding["rule"],
                finding["message"],
                *((finding["finding_id"], finding.get("source") or "", finding.get("verdict") or "") if wide else ()),
                style="bold red" if finding["impairs"] else None,
            )
        repair = entry["repair"]
        if repair is not None:
            repairs.add_row(
                instance,
                repair["workflow_id"],
                repair["phase"] + (" (HELD by the breaker)" if entry.get("repairHeld") else ""),
                repair["reason"],
                repair.get("replacement_instance_id") or "",
                repair.get("error") or "",
                *((short_time(_moment(repair["started_at"])),) if wide else ()),
            )
        elif entry["repairWithheld"]:
            repairs.add_row(instance, "", "not repaired", entry["repairWithheld"], "", "", *(("",) if wide else ()))
        elif (decision := entry.get("repairDecision")) and decision["stance"] != "NotNeeded":
            repairs.add_row(instance, "", decision["stance"], decision["why"], "", "", *(("",) if wide else ()))
        if entry.get("repairRetry"):
            retries.append((instance, entry["repairRetry"]))
        for source in entry["probeSources"]:
            if source["state"] != "OK":
                sources.add_row(instance, source["name"], source["state"], source.get("reason") or "")
        _add_controls(controls, instance, entry)
    if checks.row_count:
        console.print(checks)
    if findings.row_count:
        console.print(findings)
    if repairs.row_count:
        console.print(repairs)
    for instance, retry in retries:
        # One line each, never folded: the whole sentence is what an operator greps for.
        style = "bold red" if retry["exhausted"] else "yellow"
        console.print(f"{instance}: {retry['text']}", style=style, markup=False, soft_wrap=True)
    if sources.row_count:
        console.print(sources)
    if controls.row_count:
        console.print(controls)
    if not entries and not failures:
        console.print("no running health workflows found")
    for failure in failures:
        console.print(f"{failure.arn}: {failure.reason}: {failure.detail}", style="yellow", markup=False)


def _moment(text: str | None) -> datetime | None:
    return None if text is None else datetime.fromisoformat(text)


def _add_controls(table: Table, instance: str, entry: dict[str, Any]) -> None:
    excluded = entry.get("excluded")
    if excluded:
        since = short_time(datetime.fromisoformat(excluded["since"]))
        table.add_row(instance, "excluded from repair", excluded["by"], since, "", excluded["reason"], style="yellow")
    for cleared in entry.get("clearedFindings") or []:
        what = f"{cleared['check']} {cleared.get('status_reason') or ''}".strip()
        if cleared.get("finding_id"):
            what += f" (finding {cleared['finding_id']})"
        at = short_time(datetime.fromisoformat(cleared["cleared_at"]))
        table.add_row(instance, "cleared as false", cleared["cleared_by"], at, what, cleared.get("reason") or "")
