"""`autorepair doctor`: the preflight. Reads the settings the worker reads and checks, before the first repair finds
out, that what they name is there: Temporal, its namespace and our search attributes; each group's ECS cluster,
launch template or Auto Scaling group, subnets, evidence bucket and daemon services; the event bus; the worker's IAM;
the ingest.

The checks are the rows of CHECKS, in the order they run; each is a small function returning a Verdict (checks in
doctor_temporal.py, doctor_aws.py, doctor_iam.py, doctor_ingest.py). One line per check and group, PASS, FAIL (with
the fix) or SKIP (with why it could not look); exit status FAILED when any failed.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from contract.groups import CapacityGroup
from operator_cli import exit_codes
from operator_cli.arguments import add_common_arguments
from operator_cli.client import one_line, temporal_settings
from operator_cli.doctor_aws import (
    auto_scaling_group_exists,
    aws_identity,
    capacity_provider_exists,
    cluster_exists,
    daemon_services_exist,
    event_bus_exists,
    evidence_bucket_exists,
    launch_template_exists,
    subnets_exist,
)
from operator_cli.doctor_checks import Doctor, Finding, Status, Verdict, failed, passed
from operator_cli.doctor_iam import worker_iam
from operator_cli.doctor_ingest import ingest_healthy
from operator_cli.doctor_temporal import namespace_exists, search_attributes_registered, temporal_reachable
from operator_cli.output import emit
from worker.settings import Settings


async def groups_configured(doc: Doctor) -> Verdict:
    groups = doc.settings.groups
    if not groups:
        return failed(
            "no capacity groups in the settings: the worker would watch nothing",
            "add a [[groups]] table for each capacity group (deploy/config.example.toml)",
        )
    return passed(f"{len(groups)}: {', '.join(group.name for group in groups)}")


@dataclass(frozen=True)
class Check:
    """A check made once."""

    name: str
    run: Callable[[Doctor], Awaitable[Verdict]]

    async def findings(self, doc: Doctor) -> list[Finding]:
        return [await _judged(self.name, self.run(doc))]


@dataclass(frozen=True)
class GroupCheck:
    """A check made for each capacity group."""

    name: str
    run: Callable[[Doctor, CapacityGroup], Awaitable[Verdict]]

    async def findings(self, doc: Doctor) -> list[Finding]:
        return [
            await _judged(f"group {group.name}: {self.name}", self.run(doc, group)) for group in doc.settings.groups
        ]


# In order: a later check skips what an earlier one found unreachable (Temporal, the AWS identity).
CHECKS: tuple[Check | GroupCheck, ...] = (
    Check("temporal", temporal_reachable),
    Check("temporal namespace", namespace_exists),
    Check("search attributes", search_attributes_registered),
    Check("capacity groups", groups_configured),
    Check("aws credentials", aws_identity),
    GroupCheck("ecs cluster", cluster_exists),
    GroupCheck("launch template", launch_template_exists),
    GroupCheck("auto scaling group", auto_scaling_group_exists),
    GroupCheck("capacity provider", capacity_provider_exists),
    GroupCheck("subnets", subnets_exist),
    GroupCheck("evidence bucket", evidence_bucket_exists),
    GroupCheck("daemon services", daemon_services_exist),
    Check("event bus", event_bus_exists),
    Check("worker iam", worker_iam),
    Check("ingest", ingest_healthy),
)


async def _judged(name: str, verdict: Awaitable[Verdict]) -> Finding:
    try:
        found = await verdict
    except Exception as err:  # one check's surprise is its own line: the others still run
        found = failed(
            f"the check could not finish: {type(err).__name__}: {one_line(str(err))}",
            "fix what the error names (AWS's or Temporal's own words) and run doctor again",
        )
    return Finding(check=name, status=found.status, detail=found.detail, fix=found.fix)


async def diagnose(doc: Doctor) -> list[Finding]:
    """Every check of CHECKS, in order."""
    return [finding for row in CHECKS for finding in await row.findings(doc)]


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ingest",
        default=None,
        metavar="URL",
        help="the ingest's URL as the probes use it (their --ingest): its /healthz must answer over verified TLS",
    )
    parser.add_argument(
        "--ingest-ca",
        type=Path,
        default=None,
        metavar="FILE",
        help="the PEM CA the probes trust for it (their SSL_CERT_FILE; default: this machine's trust store)",
    )
    parser.add_argument(
        "--worker-role",
        default=None,
        metavar="ARN",
        help="the worker's IAM role, to simulate its policy from other credentials (default: whoever runs this)",
    )
    add_common_arguments(parser)


def _print_text(findings: list[Finding]) -> None:
    width = max(len(finding.check) for finding in findings)
    for finding in findings:
        fix = f" -- fix: {finding.fix}" if finding.status is Status.FAIL else ""
        print(f"{finding.status.value}  {finding.check:<{width}}  {finding.detail}{fix}")
    counts = {status: sum(1 for f in findings if f.status is status) for status in Status}
    print(f"{counts[Status.PASS]} passed, {counts[Status.FAIL]} failed, {counts[Status.SKIP]} skipped")


async def run_doctor(args: argparse.Namespace) -> int:
    doc = Doctor(
        settings=Settings.load(),
        temporal=temporal_settings(args),
        ingest_url=args.ingest,
        ingest_ca=args.ingest_ca,
        worker_role=args.worker_role,
    )
    findings = await diagnose(doc)
    document = [finding.model_dump(mode="json") for finding in findings]
    emit(args, document, lambda wide: _print_text(findings), rows=document)
    return exit_codes.FAILED if any(f.status is Status.FAIL for f in findings) else exit_codes.OK
