"""The operator's terminal: `autorepair describe-instances | history | inject | group describe | group update`.

Everything here reads or changes the fleet through Temporal, never through a worker's memory: health through the
health workflows' `health` query, repairs through visibility (search attributes InstanceId, CapacityGroup,
Outcome) and the repair workflows themselves, live group configuration through the group's drain semaphore.
Rich tables by default, `--json` for scripts. A problem the operator can fix (a bad argument, an unreachable
server, an unknown instance) is one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import re
import socket
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError
from rich.console import Console
from rich.table import Table
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowExecution,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError, TemporalError
from temporalio.service import RPCError, RPCStatusCode

from activities.workflow_ops import live_group_config
from contract import formats, names
from contract import search_attributes as sa
from contract.config import TemporalSettings
from contract.groups import AutoRepair, CapacityGroup, GroupConfigState, GroupConfigUpdate
from contract.health import HealthState, HeartbeatLossInjection
from contract.ids import health_workflow_id, semaphore_workflow_id
from contract.probe import GpuFinding
from contract.repair import PhaseStep, RepairInput, RepairPhase
from contract.semaphore import SemaphoreInput
from node_probe.classify.findings import make_finding
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.policy import Policy
from node_probe.classify.record import FaultRecord

# The probe's own policy options and loader (private there, shared on purpose: one definition of the flags).
from node_probe.cli import CliError, _add_policy_arguments, _load_policy_config
from node_probe.delivery.reporter import Reporter
from worker.settings import Settings
from workflows.models import InstanceHealthView, RepairResult, RepairStatus, SemaphoreView

T = TypeVar("T")


CONNECT_TIMEOUT = timedelta(seconds=10)
# A query of a closed workflow is answered by a worker replaying it; with no worker it would wait for one.
QUERY_TIMEOUT = timedelta(seconds=5)
# Visibility, queries and history reads in flight at once: enough to be quick, few enough to be polite.
CONCURRENCY = 8
INJECT_SOURCE = "autorepair-inject"
DEFAULT_INJECT_PCI = "0000:00:00"
TERMINAL_PHASES = frozenset({RepairPhase.COMPLETED, RepairPhase.FAILED, RepairPhase.CANCELLED})
STATUS_WORDS = {
    WorkflowExecutionStatus.RUNNING: "Running",
    WorkflowExecutionStatus.COMPLETED: "Completed",
    WorkflowExecutionStatus.FAILED: "Failed",
    WorkflowExecutionStatus.CANCELED: "Cancelled",
    WorkflowExecutionStatus.TERMINATED: "Terminated",
    WorkflowExecutionStatus.CONTINUED_AS_NEW: "ContinuedAsNew",
    WorkflowExecutionStatus.TIMED_OUT: "TimedOut",
}
STATUS_STYLES = {"IMPAIRED": "bold red", "INSUFFICIENT_DATA": "yellow", "INITIALIZING": "cyan", "OK": "green"}
# Names go into visibility queries between single quotes; anything else would need escaping rules we avoid.
PCI = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}$")
SAFE_NAME = re.compile(r"^[A-Za-z0-9._:/@+-]{1,255}$")


class OpsError(Exception):
    """One line for the operator. Exit status 2: fix the command; 3: Temporal unreachable or refused."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# --- argument types -------------------------------------------------------------------------------------------

_SHORT_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d)?$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
_ISO_DURATION = TypeAdapter(timedelta)


def parse_duration(text: str) -> timedelta:
    """Seconds (`90`), a number with a unit (`90s`, `10m`, `2h`, `1d`) or ISO-8601 (`PT10M`)."""
    cleaned = text.strip()
    short = _SHORT_DURATION.match(cleaned)
    if short is not None:
        return timedelta(seconds=float(short.group("n")) * _UNIT_SECONDS[short.group("unit")])
    if cleaned.upper().startswith("P"):
        try:
            return _ISO_DURATION.validate_python(cleaned.upper())
        except ValidationError:
            pass
    raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use seconds, 90s, 10m, 2h, or ISO-8601 like PT10M)")


def parse_since(text: str) -> datetime:
    """A moment (ISO-8601, e.g. 2025-05-01T12:00:00Z; UTC when no zone is given) or a duration ago (`2h`, `PT30M`)."""
    try:
        return datetime.now(UTC) - parse_duration(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (use ISO-8601 like 2025-05-01T12:00:00Z, or a duration ago like 2h)"
        ) from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _pci(text: str) -> str:
    if not PCI.match(text):
        raise argparse.ArgumentTypeError(f"not a PCI address like {DEFAULT_INJECT_PCI}: {text!r}")
    return text.lower()


def _name(kind: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not SAFE_NAME.match(text):
            raise argparse.ArgumentTypeError(f"not a valid {kind}: {text!r}")
        return text

    return parse


# --- wiring into `autorepair` ---------------------------------------------------------------------------------

Command = Callable[[str, str, Callable[[argparse.Namespace], Any]], argparse.ArgumentParser]


def add_ops_commands(command: Command) -> None:
    """Register the operator's commands through worker/cli.py's `command(name, help, run)`."""
    describe = command(
        "describe-instances", "health status, GPU findings and repair of instances", _guarded(describe_instances)
    )
    describe.add_argument("--group", type=_name("group name"), help="capacity group (lists its running instances)")
    describe.add_argument(
        "--instance", type=_name("instance id"), action="append", default=[], help="instance id (repeatable)"
    )
    describe.add_argument(
        "--status",
        type=str.upper,
        choices=[state.value for state in HealthState],
        help="with --group: only instances whose overall status is this (e.g. IMPAIRED)",
    )
    _add_common(describe)

    history = command("history", "past and running repairs, phase by phase, from Temporal", _guarded(repair_history))
    history.add_argument("--group", type=_name("group name"), help="only this capacity group")
    history.add_argument("--instance", type=_name("instance id"), help="only repairs of this instance")
    history.add_argument("--since", type=parse_since, help="started at or after: ISO-8601 time or a duration ago")
    history.add_argument("--limit", type=int, default=50, help="at most this many repairs, newest first (50)")
    _add_common(history)

    inject = command(
        "inject", "game day: inject a GPU fault or a heartbeat loss, as a real one arrives", _guarded(inject_fault)
    )
    inject.add_argument("--instance", type=_name("instance id"), required=True)
    inject.add_argument("--group", type=_name("group name"), required=True, help="capacity group of the instance")
    fault = inject.add_mutually_exclusive_group(required=True)
    fault.add_argument("--xid", type=int, help="an NVIDIA Xid code, written as the driver logs it")
    fault.add_argument("--kernel-line", metavar="TEXT", help="a kernel log line (NVRM: ...), as the probe reads it")
    fault.add_argument(
        "--heartbeat-loss", type=parse_duration, metavar="DURATION", help="ignore the probe's heartbeats this long"
    )
    inject.add_argument(
        "--pci", type=_pci, default=DEFAULT_INJECT_PCI, help=f"GPU PCI address for --xid ({DEFAULT_INJECT_PCI})"
    )
    # The probe's own policy options: the finding is classified exactly as the probe on that host would.
    _add_policy_arguments(inject)
    _add_common(inject)

    group = command("group", "a capacity group's configuration, changed live", _guarded(_group_usage))
    actions = group.add_subparsers(dest="group_command", metavar="{describe,update}")
    show = actions.add_parser("describe", help="effective configuration and live overrides")
    show.set_defaults(run=_guarded(group_describe))
    show.add_argument("--name", type=_name("group name"), required=True)
    _add_common(show)
    update = actions.add_parser("update", help="change auto repair, the drain cap or the heartbeat threshold now")
    update.set_defaults(run=_guarded(group_update))
    update.add_argument("--name", type=_name("group name"), required=True)
    update.add_argument("--auto-repair", type=str.upper, choices=[a.value for a in AutoRepair])
    update.add_argument("--max-draining-percent", type=int, metavar="P")
    update.add_argument("--heartbeat-loss-threshold", type=parse_duration, metavar="DURATION")
    update.add_argument(
        "--reset", action="store_true", help="drop every live override (back to the settings), then apply the rest"
    )
    update.add_argument("--timeout", type=parse_duration, default=timedelta(seconds=60), help="wait this long (60s)")
    _add_common(update)


def _add_common(parser: argparse.ArgumentParser) -> None:
    # A short-lived Temporal client: worker/cli.py ends the process without finalization (see its _finish).
    parser.set_defaults(hard_exit=True)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    # Unset: the shared settings (AUTOREPAIR_TEMPORAL__* or the TOML file), TLS and API key included.
    parser.add_argument("--temporal-address", default=None)
    parser.add_argument("--namespace", default=None)


def _guarded(handler: Callable[[argparse.Namespace], Awaitable[int]]) -> Callable[[argparse.Namespace], Any]:
    """Turn every failure the operator can act on into one line on stderr and an exit status."""

    async def run(args: argparse.Namespace) -> int:
        name = " ".join(filter(None, [args.command, getattr(args, "group_command", None)]))
        try:
            return await handler(args)
        except OpsError as err:
            print(f"autorepair {name}: {err}", file=sys.stderr)
            return err.code
        except RPCError as err:
            print(f"autorepair {name}: Temporal refused the call: {_one_line(err.message)}", file=sys.stderr)
            return 3
        except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError):
            print(f"autorepair {name}: Temporal did not answer in time", file=sys.stderr)
            return 3

    return run


def _rpc_reason(err: RPCError, query: str) -> str:
    if err.status == RPCStatusCode.NOT_FOUND:
        return "no such workflow (for an instance: its probe has never reported)"
    if err.status in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED):
        # Queries are answered by a worker; none polling the task queue means none answers.
        return f"no answer to the {query} query within {QUERY_TIMEOUT.seconds}s: is `autorepair worker` running?"
    return _one_line(err.message)


def _one_line(text: str) -> str:
    return " ".join(text.split())


async def _group_usage(args: argparse.Namespace) -> int:
    raise OpsError("choose describe or update: autorepair group describe --name G")


# --- Temporal -------------------------------------------------------------------------------------------------


def _temporal(args: argparse.Namespace) -> TemporalSettings:
    overrides = {"address": args.temporal_address, "namespace": args.namespace}
    return Settings().temporal.model_copy(update={k: v for k, v in overrides.items() if v})


async def _connect(temporal: TemporalSettings) -> Client:
    from contract.temporal_client import connect

    try:
        return await asyncio.wait_for(connect(temporal), timeout=CONNECT_TIMEOUT.total_seconds())
    except TimeoutError:
        raise OpsError(
            f"cannot reach Temporal at {temporal.address}: no answer within {CONNECT_TIMEOUT.seconds}s", code=3
        ) from None
    except RuntimeError as err:
        raise OpsError(f"cannot reach Temporal at {temporal.address}: {_connect_reason(err)}", code=3) from None


def _connect_reason(err: Exception) -> str:
    text = str(err)
    # The core SDK nests the OS error deep in a transport error; the operator needs only its last words.
    found = re.findall(r'message: "([^"]+)"', text)
    if found:
        return str(found[-1]).lower()
    return _one_line(text.removeprefix("Failed client connect: "))


def workflow_url(temporal: TemporalSettings, workflow_id: str, run_id: str | None) -> str:
    """The Web UI page of a workflow run."""
    return formats.workflow_url(temporal.ui_url, temporal.namespace, workflow_id, run_id)


async def _bounded(calls: Iterable[Awaitable[T]]) -> list[T]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(call: Awaitable[T]) -> T:
        async with gate:
            return await call

    return list(await asyncio.gather(*(one(c) for c in calls)))


async def _list(client: Client, query: str, limit: int | None = None) -> list[WorkflowExecution]:
    found: list[WorkflowExecution] = []
    async for execution in client.list_workflows(query, limit=limit):
        found.append(execution)
    return found


def _console() -> Console:
    # Made per call, not at import, so it writes to whatever sys.stdout is now.
    return Console(file=sys.stdout)


def _print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else formats.iso(moment)


def _short_time(moment: datetime | None) -> str:
    return "" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _seconds_text(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    whole = round(seconds)
    if whole < 120:
        return f"{whole}s"
    if whole < 7200:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def _operator() -> str:
    """Who asked, for the history and the event: user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


# --- describe-instances ---------------------------------------------------------------------------------------


async def describe_instances(args: argparse.Namespace) -> int:
    if not args.group and not args.instance:
        raise OpsError("give --group G (all its running instances) or --instance I (repeatable)")
    temporal = _temporal(args)
    client = await _connect(temporal)
    if args.instance:
        instances: list[tuple[str, str | None]] = [(i, None) for i in dict.fromkeys(args.instance)]
    else:
        query = (
            f"WorkflowType = '{names.HEALTH_WORKFLOW}' AND CapacityGroup = {sa.quoted(args.group)} "
            "AND ExecutionStatus = 'Running'"
        )
        if args.status:
            query += f" AND {sa.HEALTH_STATUS.name} = {sa.quoted(args.status)}"
        executions = await _list(client, query)
        instances = sorted(
            (
                execution.typed_search_attributes.get(sa.INSTANCE_ID) or execution.id.removeprefix("health/"),
                execution.run_id,
            )
            for execution in executions
        )
    entries = await _bounded(_describe_one(client, temporal, instance, run_id) for instance, run_id in instances)
    if args.json:
        _print_json(entries)
    else:
        _print_instances(entries, args.group)
    return 1 if any("error" in e for e in entries) else 0


async def _describe_one(
    client: Client, temporal: TemporalSettings, instance_id: str, run_id: str | None
) -> dict[str, Any]:
    workflow_id = health_workflow_id(instance_id)
    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    try:
        if run_id is None:
            run_id = (await handle.describe(rpc_timeout=QUERY_TIMEOUT)).run_id
        view = await handle.query(names.QUERY_HEALTH, result_type=InstanceHealthView, rpc_timeout=QUERY_TIMEOUT)
    except RPCError as err:
        return {"ec2InstanceId": instance_id, "error": _rpc_reason(err, names.QUERY_HEALTH)}
    except (WorkflowQueryFailedError, WorkflowQueryRejectedError) as err:
        return {"ec2InstanceId": instance_id, "error": _one_line(str(err))}
    return health_entry(view, workflow_url(temporal, workflow_id, run_id))


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
        "lastHeartbeat": _iso(view.last_heartbeat),
        "heartbeatsIgnoredUntil": _iso(view.heartbeats_ignored_until),
        "rejectedSignals": view.rejected_signals,
        "retired": view.retired,
        "probeSources": [s.model_dump(mode="json") for s in view.probe_sources],
        "workflowUrl": url,
    }


def _print_instances(entries: list[dict[str, Any]], group: str | None) -> None:
    console = _console()
    checks = Table(title=f"Instance health{f' in {group}' if group else ''}")
    for column in ("instance", "overall", "check", "status", "reason", "last updated", "last change"):
        checks.add_column(column, overflow="fold")
    findings = Table(title="GPU findings behind it")
    for column in ("instance", "observed", "reason", "impairs", "gpu", "count", "rule", "message"):
        findings.add_column(column, overflow="fold")
    repairs = Table(title="Repairs")
    for column in ("instance", "repair", "phase", "reason", "replacement", "error"):
        repairs.add_column(column, overflow="fold")
    sources = Table(title="Probe sources that are down")
    for column in ("instance", "source", "state", "reason"):
        sources.add_column(column, overflow="fold")
    problems: list[str] = []
    for entry in entries:
        instance = entry["ec2InstanceId"]
        if "error" in entry:
            problems.append(f"{instance}: {entry['error']}")
            continue
        health = entry["healthStatus"]
        overall = health["overallStatus"]
        for index, detail in enumerate(health["details"]):
            checks.add_row(
                instance if index == 0 else "",
                f"[{STATUS_STYLES.get(overall, '')}]{overall}[/]" if index == 0 else "",
                detail["type"],
                f"[{STATUS_STYLES.get(detail['status'], '')}]{detail['status']}[/]",
                detail.get("statusReason") or "",
                _short_time(datetime.fromisoformat(detail["lastUpdated"])),
                _short_time(datetime.fromisoformat(detail["lastStatusChange"])),
            )
        for finding in entry["findings"]:
            findings.add_row(
                instance,
                _short_time(datetime.fromisoformat(finding["observed_at"])),
                finding["reason"],
                "yes" if finding["impairs"] else "no",
                (finding.get("gpu") or {}).get("pci") or "",
                str(finding["count"]),
                finding["rule"],
                finding["message"],
                style="bold red" if finding["impairs"] else None,
            )
        repair = entry["repair"]
        if repair is not None:
            repairs.add_row(
                instance,
                repair["workflow_id"],
                repair["phase"],
                repair["reason"],
                repair.get("replacement_instance_id") or "",
                repair.get("error") or "",
            )
        elif entry["repairWithheld"]:
            repairs.add_row(instance, "", "not repaired", entry["repairWithheld"], "", "")
        for source in entry["probeSources"]:
            if source["state"] != "OK":
                sources.add_row(instance, source["name"], source["state"], source.get("reason") or "")
    if checks.row_count:
        console.print(checks)
    if findings.row_count:
        console.print(findings)
    if repairs.row_count:
        console.print(repairs)
    if sources.row_count:
        console.print(sources)
    if not entries:
        console.print("no running health workflows found")
    for problem in problems:
        console.print(f"[yellow]{problem}[/]")


# --- history --------------------------------------------------------------------------------------------------


async def repair_history(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise OpsError("--limit must be at least 1")
    temporal = _temporal(args)
    client = await _connect(temporal)
    clauses = [f"WorkflowType = '{names.REPAIR_WORKFLOW}'"]
    if args.group:
        clauses.append(f"CapacityGroup = {sa.quoted(args.group)}")
    if args.instance:
        clauses.append(f"InstanceId = {sa.quoted(args.instance)}")
    if args.since:
        clauses.append(f"StartTime >= '{_iso(args.since)}'")
    executions = await _list(client, " AND ".join(clauses), limit=args.limit)
    executions.sort(key=lambda e: e.start_time, reverse=True)
    records = await _bounded(_repair_record(client, temporal, e) for e in executions)
    if args.json:
        _print_json(records)
    else:
        _print_history(records)
    return 0


async def _repair_record(client: Client, temporal: TemporalSettings, execution: WorkflowExecution) -> dict[str, Any]:
    attrs = execution.typed_search_attributes
    handle = client.get_workflow_handle(execution.id, run_id=execution.run_id, result_type=RepairResult)
    status, timeline, note = await _repair_progress(handle, execution)
    started = await _repair_input(client, handle) if status is None else None
    reason = status.reason if status else (started.reason if started else None)
    replacement = status.replacement_instance_id if status else None
    if status is None and isinstance(timeline, RepairResult):
        replacement = timeline.replacement_instance_id
    steps = timeline.timeline if isinstance(timeline, RepairResult) else timeline
    execution_status = STATUS_WORDS.get(execution.status or WorkflowExecutionStatus.RUNNING, "Unknown")
    # The repair writes its own outcome (Completed, Failed, Cancelled); one terminated by an operator or timed out
    # never could, and then Temporal's execution status says what happened.
    outcome = attrs.get(sa.OUTCOME) or execution_status
    end = execution.close_time
    return {
        "workflowId": execution.id,
        "runId": execution.run_id,
        "instanceId": attrs.get(sa.INSTANCE_ID)
        or (status.instance_id if status else execution.id.removeprefix("repair/")),
        "group": attrs.get(sa.CAPACITY_GROUP) or (status.group if status else None),
        "reason": reason,
        "xid": attrs.get(sa.XID),
        "replacementInstanceId": replacement,
        "phase": status.phase.value if status else attrs.get(sa.REPAIR_PHASE),
        "outcome": outcome,
        "executionStatus": execution_status,
        "error": status.error if status else None,
        "startTime": _iso(execution.start_time),
        "closeTime": _iso(end),
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
        text = _rpc_reason(err, names.QUERY_STATUS) if isinstance(err, RPCError) else _one_line(str(err)) or "timeout"
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
                "startedAt": _iso(step.started_at),
                "durationSeconds": seconds,
                "ongoing": ongoing,
            }
        )
    return phases


def _print_history(records: list[dict[str, Any]]) -> None:
    console = _console()
    table = Table(title="Repairs")
    for column in ("instance", "reason", "replacement", "outcome", "started", "took", "phases", "Web UI"):
        table.add_column(column, overflow="fold")
    for record in records:
        if record["phases"] is None:
            phases = record["note"] or "durations unavailable"
        else:
            phases = ", ".join(
                f"{p['phase']} {_seconds_text(p['durationSeconds'])}" + ("…" if p["ongoing"] else "")
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
            record["reason"] or "",
            record["replacementInstanceId"] or "",
            f"[{style}]{outcome}[/]" if style else outcome,
            _short_time(datetime.fromisoformat(record["startTime"])),
            _seconds_text(record["durationSeconds"]),
            phases,
            record["webUiUrl"],
        )
    console.print(table)
    if not records:
        console.print("no repairs found")


# --- inject ---------------------------------------------------------------------------------------------------


def xid_line(xid: int, pci: str = DEFAULT_INJECT_PCI) -> str:
    """An Xid exactly in the driver's format, so the probe's own parser reads it."""
    return f"NVRM: Xid (PCI:{pci}): {xid}, pid=<unknown>, name=<unknown>, injected by autorepair inject"


async def inject_fault(args: argparse.Namespace) -> int:
    if args.xid is not None and args.xid < 0:
        raise OpsError(f"--xid must be a non-negative Xid code, not {args.xid}")
    if args.heartbeat_loss is not None and args.heartbeat_loss <= timedelta(0):
        raise OpsError("--heartbeat-loss must be longer than 0s")
    # Before connecting: a line the probe would not recognise is the operator's mistake, not the server's.
    records = _records(args) if args.heartbeat_loss is None else []
    temporal = _temporal(args)
    client = await _connect(temporal)
    await _check_instance(client, args.instance, args.group)
    if args.heartbeat_loss is not None:
        return await _inject_heartbeat_loss(client, args)
    return await _inject_findings(client, temporal, args, records)


def _records(args: argparse.Namespace) -> list[FaultRecord]:
    text = xid_line(args.xid, args.pci) if args.xid is not None else args.kernel_line
    records = list(parse_lines(text.splitlines()))
    if not records:
        raise OpsError(f"not a GPU fault line the probe recognises: {_one_line(text)!r}")
    return records


async def _check_instance(client: Client, instance_id: str, group: str) -> None:
    """Refuse to inject into an instance that was replaced, or into the wrong group's bookkeeping."""
    try:
        description = await client.get_workflow_handle(health_workflow_id(instance_id)).describe(
            rpc_timeout=QUERY_TIMEOUT
        )
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return  # never reported yet: signal-with-start creates its health workflow, as the probe's first signal
        raise
    if description.status == WorkflowExecutionStatus.COMPLETED:
        raise OpsError(
            f"{instance_id} was replaced by a repair (its health workflow completed): nothing to inject into"
        )
    actual = description.typed_search_attributes.get(sa.CAPACITY_GROUP)
    if description.status == WorkflowExecutionStatus.RUNNING and actual is not None and actual != group:
        raise OpsError(f"{instance_id} belongs to capacity group {actual}, not {group}")


async def _inject_findings(
    client: Client, temporal: TemporalSettings, args: argparse.Namespace, records: list[FaultRecord]
) -> int:
    try:
        policy = Policy(args.policy, _load_policy_config(args.policy_config))
    except CliError as err:
        raise OpsError(str(err)) from None
    reporter = Reporter(client)
    now = datetime.now(UTC)
    findings: list[GpuFinding] = []
    for record in records:
        finding = make_finding(
            record,
            policy.classify(record, now),
            instance_id=args.instance,
            group=args.group,
            source=INJECT_SOURCE,
            observed_at=now,
            # A fresh position per injection: the same line injected twice is two faults, not a redelivery.
            position=f"inject:{uuid.uuid4().hex}",
        )
        await reporter.send_finding(finding, temporal.task_queue)
        findings.append(finding)
    workflow_id = health_workflow_id(args.instance)
    if args.json:
        _print_json({"workflowId": workflow_id, "findings": [f.model_dump(mode="json") for f in findings]})
        return 0
    table = Table(title=f"Injected into {workflow_id}")
    for column in ("reason", "impairs", "rule", "gpu", "finding id", "line"):
        table.add_column(column, overflow="fold")
    for finding in findings:
        table.add_row(
            finding.reason,
            "yes: ACCELERATED_COMPUTE goes IMPAIRED" if finding.impairs else "no: counted as a warning",
            finding.rule,
            finding.gpu.pci or "",
            finding.finding_id,
            finding.raw,
            style="bold red" if finding.impairs else None,
        )
    _console().print(table)
    return 0


async def _inject_heartbeat_loss(client: Client, args: argparse.Namespace) -> int:
    injection = HeartbeatLossInjection(duration=args.heartbeat_loss, requested_by=_operator())
    workflow_id = health_workflow_id(args.instance)
    handle = client.get_workflow_handle(workflow_id)
    try:
        await handle.signal(names.SIGNAL_INJECT_HEARTBEAT_LOSS, injection, rpc_timeout=QUERY_TIMEOUT)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise OpsError(f"no running health workflow for {args.instance}: its probe has never reported") from None
        raise
    until = datetime.now(UTC) + injection.duration
    if args.json:
        _print_json(
            {
                "workflowId": workflow_id,
                "heartbeatLossSeconds": injection.duration.total_seconds(),
                "approximatelyUntil": _iso(until),
                "requestedBy": injection.requested_by,
            }
        )
    else:
        _console().print(
            f"{workflow_id}: heartbeats ignored for {_seconds_text(injection.duration.total_seconds())} "
            f"(until about {_short_time(until)}); AGENT_CONNECTIVITY goes IMPAIRED once the group's heartbeat "
            "loss threshold passes without one"
        )
    return 0


# --- group describe / update ----------------------------------------------------------------------------------


async def group_describe(args: argparse.Namespace) -> int:
    temporal = _temporal(args)
    client = await _connect(temporal)
    handle = client.get_workflow_handle(semaphore_workflow_id(args.name))
    # A semaphore that is not running still has the overrides its last run left: the next one takes them over.
    state, running = await live_group_config(client, args.name, QUERY_TIMEOUT)
    view = (
        await handle.query(names.QUERY_STATE, result_type=SemaphoreView, rpc_timeout=QUERY_TIMEOUT) if running else None
    )
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
        "updatedAt": _iso(state.updated_at) if state else None,
        "updatedBy": state.updated_by if state else "",
        "draining": None
        if view is None
        else {
            "capacity": view.capacity,
            "groupSize": view.group_size,
            "holders": [p.instance_id for p in view.holders],
            "waiting": [w.instance_id for w in view.waiters],
        },
        "workflowUrl": workflow_url(temporal, semaphore_workflow_id(args.name), None) if state else None,
    }
    if args.json:
        _print_json(document)
    else:
        _print_group(document)
    return 0


def _local_group(name: str) -> CapacityGroup | None:
    try:
        return Settings().group(name)
    except KeyError:
        return None


def _print_group(document: dict[str, Any]) -> None:
    console = _console()
    table = Table(title=f"Capacity group {document['name']}")
    for column in ("setting", "value", "live override"):
        table.add_column(column, overflow="fold")
    overrides = document["overrides"]
    effective = document["effective"] or {}
    for key in ("auto_repair", "max_draining_percent", "heartbeat_loss_threshold"):
        value = effective.get(key, "?")
        table.add_row(key, str(value), "yes" if key in overrides else "", style="bold" if key in overrides else None)
    for key in ("cluster", "launch_template", "auto_scaling_group", "replacement_ready_timeout"):
        if effective.get(key) is not None:
            table.add_row(key, str(effective[key]), "")
    if document["effectiveSource"]:
        table.caption = f"from {document['effectiveSource']}"
    console.print(table)
    if document["revision"]:
        console.print(
            f"revision {document['revision']}, changed {document['updatedAt']} by {document['updatedBy'] or '?'}"
        )
    draining = document["draining"]
    if draining is not None:
        console.print(
            f"draining {len(draining['holders'])} / {draining['capacity']} ({draining['groupSize']} instances)"
            + (f", waiting: {', '.join(draining['waiting'])}" if draining["waiting"] else "")
        )
    elif not document["semaphoreRunning"]:
        kept = " (its last run's overrides apply, and the next run takes them over)" if document["revision"] else ""
        console.print(f"no drain semaphore running for this group now{kept}")


async def group_update(args: argparse.Namespace) -> int:
    update = GroupConfigUpdate(
        auto_repair=AutoRepair(args.auto_repair) if args.auto_repair else None,
        max_draining_percent=args.max_draining_percent,
        heartbeat_loss_threshold=args.heartbeat_loss_threshold,
        reset=args.reset,
        requested_by=_operator(),
    )
    settings_groups = [g.name for g in Settings().groups]
    if settings_groups and args.name not in settings_groups:
        # Only when this host has the groups configured; otherwise the worker (which always has) decides.
        raise OpsError(f"unknown capacity group {args.name!r} (configured: {', '.join(settings_groups)})")
    temporal = _temporal(args)
    client = await _connect(temporal)
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
        raise OpsError(_one_line(message)) from None
    except TimeoutError:
        raise OpsError(
            f"no worker completed the update within {_seconds_text(args.timeout.total_seconds())}: is "
            f"`autorepair worker` running on task queue {temporal.task_queue}?",
            code=3,
        ) from None
    if not isinstance(state, GroupConfigState):
        raise OpsError(f"unexpected answer from the drain semaphore: {state!r}", code=3)
    if args.json:
        _print_json(
            {
                "name": args.name,
                "effective": state.effective.model_dump(mode="json") if state.effective else None,
                "overrides": state.overrides.model_dump(mode="json", exclude_none=True),
                "revision": state.revision,
                "updatedAt": _iso(state.updated_at),
                "updatedBy": state.updated_by,
            }
        )
    else:
        changed = ", ".join(f"{k}={v}" for k, v in state.overrides.model_dump(mode="json", exclude_none=True).items())
        overrides = f"live overrides now {changed}" if changed else "no live overrides (the settings apply)"
        _console().print(f"capacity group {args.name}: revision {state.revision}, {overrides}")
    return 0
