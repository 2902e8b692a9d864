"""`autorepair inject`: game day. A GPU fault or a heartbeat loss reaches an instance's health workflow exactly as a
real one would: a fault line is parsed and classified by the probe's own code and sent by its reporter, a heartbeat
loss is the health workflow's own signal.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta

from rich.table import Table
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from contract import names
from contract import search_attributes as sa
from contract.config import TemporalSettings
from contract.health import HeartbeatLossInjection
from contract.ids import health_workflow_id
from contract.probe import GpuFinding
from node_probe.classify.manual import DEFAULT_PCI, manual_findings, pci_address, records_from_text, xid_line
from node_probe.classify.policy import Policy
from node_probe.classify.record import FaultRecord

# The probe's own policy options and loader: one definition of the flags, for the probe and for injection.
from node_probe.cli import CliError, add_policy_arguments, load_policy_config
from node_probe.delivery.reporter import Reporter
from operator_cli.arguments import add_common_arguments, parse_duration, safe_name
from operator_cli.client import (
    QUERY_TIMEOUT,
    OpsError,
    connect_client,
    requested_by,
    temporal_settings,
)
from operator_cli.exit_codes import OK
from operator_cli.output import emit, iso, seconds_text, short_time, stdout_console

INJECT_SOURCE = "autorepair-inject"
DEFAULT_INJECT_PCI = DEFAULT_PCI
__all__ = ["add_inject_arguments", "inject_fault", "xid_line"]


def add_inject_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instance", type=safe_name("instance id"), required=True)
    parser.add_argument("--group", type=safe_name("group name"), required=True, help="capacity group of the instance")
    fault = parser.add_mutually_exclusive_group(required=True)
    fault.add_argument("--xid", type=int, help="an NVIDIA Xid code, written as the driver logs it")
    fault.add_argument("--kernel-line", metavar="TEXT", help="a kernel log line (NVRM: ...), as the probe reads it")
    fault.add_argument(
        "--heartbeat-loss", type=parse_duration, metavar="DURATION", help="ignore the probe's heartbeats this long"
    )
    parser.add_argument(
        "--pci", type=pci_address, default=DEFAULT_INJECT_PCI, help=f"GPU PCI address for --xid ({DEFAULT_INJECT_PCI})"
    )
    # The probe's own policy options: the finding is classified exactly as the probe on that host would.
    add_policy_arguments(parser)
    add_common_arguments(parser)


async def inject_fault(args: argparse.Namespace) -> int:
    if args.xid is not None and args.xid < 0:
        raise OpsError(f"--xid must be a non-negative Xid code, not {args.xid}")
    if args.heartbeat_loss is not None and args.heartbeat_loss <= timedelta(0):
        raise OpsError("--heartbeat-loss must be longer than 0s")
    # Before connecting: a line the probe would not recognise is the operator's mistake, not the server's.
    records = _records(args) if args.heartbeat_loss is None else []
    temporal = temporal_settings(args)
    client = await connect_client(temporal)
    await _check_instance(client, args.instance, args.group)
    if args.heartbeat_loss is not None:
        return await _inject_heartbeat_loss(client, args)
    return await _inject_findings(client, temporal, args, records)


def _records(args: argparse.Namespace) -> list[FaultRecord]:
    text = xid_line(args.xid, args.pci) if args.xid is not None else args.kernel_line
    try:
        return records_from_text(text)
    except ValueError as err:
        raise OpsError(str(err)) from None


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
        policy = Policy(args.policy, load_policy_config(args.policy_config))
    except CliError as err:
        raise OpsError(str(err)) from None
    reporter = Reporter(client)
    findings = manual_findings(
        records, policy, instance_id=args.instance, group=args.group, source=INJECT_SOURCE, now=datetime.now(UTC)
    )
    for finding in findings:
        await reporter.send_finding(finding, temporal.task_queue)
    workflow_id = health_workflow_id(args.instance)
    sent = [f.model_dump(mode="json") for f in findings]
    emit(args, {"workflowId": workflow_id, "findings": sent}, lambda wide: _print_findings(workflow_id, findings, wide))
    return OK


# `-o wide`: the finding's fields the table leaves out.
WIDE_COLUMNS = ("kind", "code", "verdict", "observed")


def _print_findings(workflow_id: str, findings: list[GpuFinding], wide: bool) -> None:
    table = Table(title=f"Injected into {workflow_id}")
    for column in ("reason", "impairs", "rule", "gpu", "finding id", "line", *(WIDE_COLUMNS if wide else ())):
        table.add_column(column, overflow="fold")
    for finding in findings:
        table.add_row(
            finding.reason,
            "yes: ACCELERATED_COMPUTE goes IMPAIRED" if finding.impairs else "no: counted as a warning",
            finding.rule,
            finding.gpu.pci or "",
            finding.finding_id,
            finding.raw,
            *(
                (
                    finding.kind,
                    "" if finding.code is None else str(finding.code),
                    finding.verdict,
                    short_time(finding.observed_at),
                )
                if wide
                else ()
            ),
            style="bold red" if finding.impairs else None,
        )
    stdout_console().print(table)


async def _inject_heartbeat_loss(client: Client, args: argparse.Namespace) -> int:
    injection = HeartbeatLossInjection(duration=args.heartbeat_loss, requested_by=requested_by())
    workflow_id = health_workflow_id(args.instance)
    handle = client.get_workflow_handle(workflow_id)
    try:
        await handle.signal(names.SIGNAL_INJECT_HEARTBEAT_LOSS, injection, rpc_timeout=QUERY_TIMEOUT)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise OpsError(f"no running health workflow for {args.instance}: its probe has never reported") from None
        raise
    until = datetime.now(UTC) + injection.duration
    document = {
        "workflowId": workflow_id,
        "heartbeatLossSeconds": injection.duration.total_seconds(),
        "approximatelyUntil": iso(until),
        "requestedBy": injection.requested_by,
    }
    said = (
        f"{workflow_id}: heartbeats ignored for {seconds_text(injection.duration.total_seconds())} "
        f"(until about {short_time(until)}); AGENT_CONNECTIVITY goes IMPAIRED once the group's heartbeat "
        "loss threshold passes without one"
    )
    emit(args, document, lambda wide: stdout_console().print(said))
    return OK
