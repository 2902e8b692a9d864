"""`autorepair history`: past and running repairs, phase by phase, from Temporal.

Repairs are found through visibility (search attributes InstanceId, CapacityGroup, Outcome); each one's phases come
from the repair itself: its result when it completed (no worker needed), else its `status` query. The attempts at
repairing one instance (`repair/<instance>/<n>`, and a legacy `repair/<instance>` before them: contract/ids.py) are
listed together, in order, the instance whose latest attempt started last first.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from rich.table import Table
from temporalio.client import (
    Client,
    WorkflowExecution,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.exceptions import TemporalError
from temporalio.service import RPCError

from contract import names
from contract import search_attributes as sa
from contract.config import TemporalSettings
from contract.ids import repair_attempt_of
from contract.repair import PhaseStep, RepairInput, RepairPhase
from operator_cli.arguments import add_common_arguments, parse_since, safe_name
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
from operator_cli.output import emit, iso, seconds_text, short_time, stdout_console
from workflows.models import RepairResult, RepairStatus

TERMINAL_PHASES = frozenset({RepairPhase.COMPLETED, RepairPhase.FAILED, RepairPhase.CANCELLED, RepairPhase.DISCARDED})
COLUMNS = (
    "instance",
    "attempt",
    "reason",
    "action",
    "replacement",
    "outcome",
    "started",
    "took",
    "phases",
    "evidence",
    "Web UI",
)
# `-o wide`: the record's fields the table leaves out.
WIDE_COLUMNS = ("group", "workflow id", "run id", "xid", "execution status", "closed", "error")
STATUS_WORDS = {
    WorkflowExecutionStatus.RUNNING: "Running",
    WorkflowExecutionStatus.COMPLETED: "Completed",
    WorkflowExecutionStatus.FAILED: "Failed",
    WorkflowExecutionStatus.CANCELED: "Cancelled",
    WorkflowExecutionStatus.TERMINATED: "Terminated",
    WorkflowExecutionStatus.CONTINUED_AS_NEW: "ContinuedAsNew",
    WorkflowExecutionStatus.TIMED_OUT: "TimedOut",
}


def add_history_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--group", type=safe_name("group name"), help="only this capacity group")
    parser.add_argument("--instance", type=safe_name("instance id"), help="only repairs of this instance")
    parser.add_argument("--since", type=parse_since, help="started at or after: ISO-8601 time or a duration ago")
    parser.add_argument("--limit", type=int, default=50, help="at most this many repairs, newest first (50)")
    add_common_arguments(parser)


async def repair_history(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise OpsError("--limit must be at least 1")
    temporal = temporal_settings(args)
    client = await connect_client(temporal)
    clauses = [f"WorkflowType = '{names.REPAIR_WORKFLOW}'"]
    if args.group:
        clauses.append(f"CapacityGroup = {sa.quoted(args.group)}")
    if args.instance:
        clauses.append(f"InstanceId = {sa.quoted(args.instance)}")
    if args.since:
        clauses.append(f"StartTime >= '{iso(args.since)}'")
    executions = await list_workflows(client, " AND ".join(clauses), limit=args.limit)
    executions.sort(key=lambda e: e.start_time, reverse=True)
    records = by_incident(await bounded(_repair_record(client, temporal, e) for e in executions))
    emit(args, records, lambda wide: _print_history(records, wide), rows=records)
    return OK


def by_incident(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each instance's attempts together and in order (the legacy id first), instances by their latest start."""

    def started(record: dict[str, Any]) -> datetime:
        return datetime.fromisoformat(record["startTime"]) if record["startTime"] else datetime.min.replace(tzinfo=UTC)

    latest: dict[str, datetime] = {}
    for record in records:
        latest[record["instanceId"]] = max(latest.get(record["instanceId"], started(record)), started(record))
    ordered = sorted(records, key=lambda r: (r["attempt"] or 0, started(r)))
    # Stable, and stable in reverse too: the attempts keep their order within an instance.
    ordered.sort(key=lambda r: (latest[r["instanceId"]], r["instanceId"]), reverse=True)
    return ordered


async def _repair_record(client: Client, temporal: TemporalSettings, execution: WorkflowExecution) -> dict[str, Any]:
    attrs = execution.typed_search_attributes
    instance_id, attempt = repair_attempt_of(execution.id) or (execution.id, 0)
    handle = client.get_workflow_handle(execution.id, run_id=execution.run_id, result_type=RepairResult)
    status, timeline, note = await _repair_progress(handle, execution)
    started = await _repair_input(client, handle) if status is None else None
    reason = status.reason if status else (started.reason if started else None)
    replacement = status.replacement_instance_id if status else None
    action = status.action if status else None
    escalated = status.escalated if status else None
    evidence = status.evidence if status else None
    if status is None and isinstance(timeline, RepairResult):
        replacement = timeline.replacement_instance_id
        action, escalated, evidence = timeline.action, timeline.escalated, timeline.evidence
    steps = timeline.timeline if isinstance(timeline, RepairResult) else timeline
    execution_status = STATUS_WORDS.get(execution.status or WorkflowExecutionStatus.RUNNING, "Unknown")
    # The repair writes its own outcome (Completed, Failed, Cancelled); one terminated by an operator or timed out
    # never could, and then Temporal's execution status says what happened.
    outcome = attrs.get(sa.OUTCOME) or execution_status
    end = execution.close_time
    return {
        "workflowId": execution.id,
        "runId": execution.run_id,
        "instanceId": attrs.get(sa.INSTANCE_ID) or (status.instance_id if status else instance_id),
        # Which attempt at repairing the instance (repair/<instance>/<n>); null for a legacy repair/<instance>.
        "attempt": attempt or None,
        "group": attrs.get(sa.CAPACITY_GROUP) or (status.group if status else None),
        "reason": reason,
        "xid": attrs.get(sa.XID),
        "replacementInstanceId": replacement,
        # The remediation ladder: replace, reboot or gpu-reset (None: not known yet), and why it escalated if it did.
        "action": action.value if action is not None else None,
        "escalated": escalated,
        # Where the incident's evidence is in S3 (docs/operations.md §15); null when none was stored.
        "evidence": evidence,
        "phase": status.phase.value if status else attrs.get(sa.REPAIR_PHASE),
        "outcome": outcome,
        "executionStatus": execution_status,
        "error": status.error if status else None,
        "startTime": iso(execution.start_time),
        "closeTime": iso(end),
        "durationSeconds": ((end or datetime.now(UTC)) - execution.start_time).total_seconds(),
        "phases": phase_durations(steps, end) if steps is not None else None,
        "durationsAvailable": steps is not None,
        "note": note,
        "webUiUrl": workflow_url(temporal, execution.id, execution.run_id),
    }


async def _repair_progress(
    handle: WorkflowHandle[Any, Any], execution: WorkflowExecution
) -> tuple[RepairStatus | None, RepairResult | list[PhaseStep] | None, str | None]:
    """The repair's own account: its `status` query, or for a completed one its result (no worker needed)."""
    if execution.status == WorkflowExecutionStatus.COMPLETED:
        try:
            result = await handle.result(follow_runs=False, rpc_timeout=QUERY_TIMEOUT)
            return None, result if isinstance(result, RepairResult) else None, None
        except (TemporalError, RPCError):
            pass
    try:
        status = await handle.query(names.QUERY_STATUS, result_type=RepairStatus, rpc_timeout=QUERY_TIMEOUT)
        return status, status.timeline, None
    except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError, TimeoutError) as err:
        text = rpc_reason(err, names.QUERY_STATUS) if isinstance(err, RPCError) else one_line(str(err)) or "timeout"
        return None, None, f"durations unavailable: {text}"


async def _repair_input(client: Client, handle: WorkflowHandle[Any, Any]) -> RepairInput | None:
    """The repair's input (reason, instance), from the first event of its history: no worker needed."""
    try:
        async for event in handle.fetch_history_events(page_size=1, rpc_timeout=QUERY_TIMEOUT):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            [value] = await client.data_converter.decode(payloads, [RepairInput])
            return value if isinstance(value, RepairInput) else None
    except (RPCError, TemporalError, ValueError):
        return None
    return None


def phase_durations(steps: Sequence[PhaseStep], closed_at: datetime | None) -> list[dict[str, Any]]:
    """Each phase with how long it lasted; the phase in progress counts until now, an end state has none."""
    now = datetime.now(UTC)
    phases: list[dict[str, Any]] = []
    for index, step in enumerate(steps):
        following = steps[index + 1].started_at if index + 1 < len(steps) else None
        ongoing = following is None and step.phase not in TERMINAL_PHASES and closed_at is None
        if following is not None:
            seconds: float | None = (following - step.started_at).total_seconds()
        elif ongoing:
            seconds = (now - step.started_at).total_seconds()
        else:
            seconds = None
        phases.append(
            {
                "phase": step.phase.value,
                "startedAt": iso(step.started_at),
                "durationSeconds": seconds,
                "ongoing": ongoing,
            }
        )
    return phases


def _print_history(records: list[dict[str, Any]], wide: bool) -> None:
    console = stdout_console()
    table = Table(title="Repairs")
    for column in (*COLUMNS, *(WIDE_COLUMNS if wide else ())):
        table.add_column(column, overflow="fold")
    for record in records:
        if record["phases"] is None:
            phases = record["note"] or "durations unavailable"
        else:
            phases = ", ".join(
                f"{p['phase']} {seconds_text(p['durationSeconds'])}" + ("…" if p["ongoing"] else "")
                for p in record["phases"]
                if p["durationSeconds"] is not None
            )
        outcome = record["outcome"]
        style = (
            "green"
            if outcome == "Completed"
            else ("bold red" if outcome in ("Failed", "Terminated", "TimedOut") else None)
        )
        table.add_row(
            record["instanceId"],
            str(record["attempt"] or "-"),
            record["reason"] or "",
            (record["action"] or "") + (f" (escalated: {record['escalated']})" if record["escalated"] else ""),
            record["replacementInstanceId"] or "",
            f"[{style}]{outcome}[/]" if style else outcome,
            short_time(datetime.fromisoformat(record["startTime"])),
            seconds_text(record["durationSeconds"]),
            phases,
            record["evidence"] or "",
            record["webUiUrl"],
            *(_wide_cells(record) if wide else ()),
        )
    console.print(table)
    if not records:
        console.print("no repairs found")


def _wide_cells(record: dict[str, Any]) -> tuple[str, ...]:
    closed = record["closeTime"]
    return (
        record["group"] or "",
        record["workflowId"],
        record["runId"] or "",
        "" if record["xid"] is None else str(record["xid"]),
        record["executionStatus"],
        short_time(datetime.fromisoformat(closed)) if closed else "",
        record["error"] or "",
    )
