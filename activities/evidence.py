"""Evidence before a termination: what the fault looked like, in S3 under the incident (contract/evidence.py).

Each activity is one idempotent step of workflows/repair_evidence.py:
- `store_evidence`: the worker writes what it holds (the finding, the probe's recent findings and sources, their
  kernel-log lines) and, where the group has `bug_report`, asks the host for its part through SSM Run Command. The
  host gets one presigned PUT URL per object it may write, which expires: no credential, nothing else writable.
- `evidence_command_status`: one look at that command.
- `finish_evidence`: which objects are there, what is missing and why, in `manifest.json`.
Writing an object twice writes the same bytes: a retried step changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.aws import AwsClients
from activities.ecs import resolve_group
from activities.models import (
    CommandStatus,
    EvidenceCommandCheck,
    EvidenceFinish,
    EvidenceManifest,
    EvidenceRequest,
    EvidenceStored,
)
from activities.ssm import command_status, send_once
from contract import evidence, names
from contract.groups import CapacityGroup
from contract.ids import health_workflow_id

QUERY_TIMEOUT = timedelta(seconds=10)
# The host's kernel log is read from this long before the fault: what led to it.
KERNEL_LOG_BEFORE = timedelta(minutes=10)
KERNEL_LOG_MAX_LINES = 20000
# A presigned URL outlives the command that uses it by this much, no more.
URL_SLACK = timedelta(minutes=5)


def host_script(since_epoch: int, kernel_url: str, report_url: str, report_timeout_s: int) -> list[str]:
    """The shell lines the host runs: its kernel log from before the fault, and nvidia-bug-report.sh where it is
    installed, each uploaded to its own URL. Each line it prints says what happened to one object."""
    for url in (kernel_url, report_url):
        if "'" in url:  # the URLs go into the script single-quoted
            raise ApplicationError("a presigned URL with a quote in it", type="BadPresignedUrl", non_retryable=True)
    return [
        "set -u",
        "dir=$(mktemp -d /tmp/gpu-autorepair-evidence.XXXXXX) || exit 1",
        f"{{ journalctl -k --no-pager -o short-iso-precise --since @{since_epoch} 2>/dev/null || dmesg 2>/dev/null; }}"
        f' | tail -n {KERNEL_LOG_MAX_LINES} > "$dir/kernel-log.txt"',
        f"curl -fsS --retry 3 -X PUT -T \"$dir/kernel-log.txt\" '{kernel_url}' && echo 'kernel-log: uploaded'",
        "if command -v nvidia-bug-report.sh >/dev/null 2>&1; then",
        f'  timeout {report_timeout_s} nvidia-bug-report.sh --output-file "$dir/nvidia-bug-report.log" >/dev/null 2>&1'
        ' || echo "nvidia-bug-report.sh: exit status $?"',
        '  if [ -f "$dir/nvidia-bug-report.log.gz" ]; then',
        f"    curl -fsS --retry 3 -X PUT -T \"$dir/nvidia-bug-report.log.gz\" '{report_url}'"
        " && echo 'nvidia-bug-report: uploaded'",
        "  fi",
        "else echo 'nvidia-bug-report.sh: not installed'; fi",
        'rm -rf "$dir"',
    ]


def kernel_lines(findings: list[dict[str, Any]]) -> str:
    """The findings' kernel-log lines, oldest first, each with when and where the probe saw it; then, for each
    impairing fault whose probe sent them, the lines around it as its source read them."""
    rows = sorted((f for f in findings if f.get("raw")), key=lambda f: str(f.get("observed_at", "")))
    out = [f"{f.get('observed_at', '?')} {f.get('source') or '?'}: {f['raw']}\n" for f in rows]
    for f in rows:
        if f.get("context"):
            where = f"{f.get('observed_at', '?')} ({f.get('source') or '?'})"
            out.append(f"\n--- around {f.get('reason', '?')} at {where}:\n")
            out += [f"{line}\n" for line in f["context"]]
    return "".join(out)


class EvidenceActivities:
    def __init__(self, aws: AwsClients, groups: Callable[[str], CapacityGroup], client: Client) -> None:
        self._aws = aws
        self._groups = groups
        self._client = client

    def activities(self) -> list[Callable[..., Any]]:
        """The bound activity methods, for `Worker(activities=...)`."""
        return [self.store_evidence, self.evidence_command_status, self.finish_evidence]

    @activity.defn(name="store_evidence")
    async def store_evidence(self, request: EvidenceRequest) -> EvidenceStored:
        group = resolve_group(self._groups, request.group)
        bucket = self._bucket(group)
        prefix = evidence.incident_prefix(group.evidence_prefix, group.name, request.instance_id, request.attempt)
        view = await self._health_view(request.instance_id)
        findings = list(view.get("recent_findings") or [])
        if request.finding is not None:
            findings.append(request.finding.model_dump(mode="json"))
        record = {
            "instance_id": request.instance_id,
            "group": request.group,
            "repair_workflow_id": request.repair_workflow_id,
            "reason": request.reason,
            "fault_at": request.fault_at.isoformat(),
            "finding": request.finding.model_dump(mode="json") if request.finding is not None else None,
            "health": view,
        }
        await self._put(bucket, prefix + evidence.FINDINGS, json.dumps(record, indent=2, default=str).encode())
        unique = {str(f.get("finding_id")): f for f in findings}
        await self._put(bucket, prefix + evidence.KERNEL_LINES, kernel_lines(list(unique.values())).encode())
        stored = EvidenceStored(bucket=bucket, prefix=prefix, objects=[evidence.FINDINGS, evidence.KERNEL_LINES])
        if not group.bug_report:
            return stored
        timeout_s = int(group.bug_report_timeout.total_seconds())
        expires = int((group.bug_report_timeout + URL_SLACK).total_seconds())
        kernel_url, report_url = (
            self._aws.s3.generate_presigned_url(
                "put_object", Params={"Bucket": bucket, "Key": prefix + name}, ExpiresIn=expires
            )
            for name in evidence.HOST_OBJECTS
        )
        since = int((request.fault_at - KERNEL_LOG_BEFORE).timestamp())
        comment = f"{evidence.EVIDENCE_COMMENT} {request.instance_id} {request.token}"
        script = host_script(since, kernel_url, report_url, timeout_s)
        try:
            stored.command_id = await send_once(self._aws, request.instance_id, comment, script, timeout_s)
        except ApplicationError as err:
            if not err.non_retryable:
                raise
            # No SSM agent on the host, or no permission: what the worker holds is stored; the manifest says why the
            # host's part is not.
            stored.command_error = str(err)[:500]
        return stored

    @activity.defn(name="evidence_command_status")
    async def evidence_command_status(self, check: EvidenceCommandCheck) -> CommandStatus:
        resolve_group(self._groups, check.group)
        return await command_status(self._aws, check.instance_id, check.command_id)

    @activity.defn(name="finish_evidence")
    async def finish_evidence(self, finish: EvidenceFinish) -> EvidenceManifest:
        resolve_group(self._groups, finish.group)
        objects = list(finish.stored)
        missing: dict[str, str] = {}
        for name in evidence.HOST_OBJECTS:
            if not finish.host_asked:
                missing[name] = finish.host_note or "not asked for (the group's bug_report is off)"
            elif await self._exists(finish.bucket, finish.prefix + name):
                objects.append(name)
            else:
                missing[name] = finish.host_note or "the host's command uploaded nothing"
        manifest = EvidenceManifest(
            location=evidence.s3_url(finish.bucket, finish.prefix), objects=objects, missing=missing
        )
        body = {
            "repair_workflow_id": finish.repair_workflow_id,
            "objects": objects,
            "missing": missing,
            "complete": manifest.complete,
        }
        await self._put(finish.bucket, finish.prefix + evidence.MANIFEST, json.dumps(body, indent=2).encode())
        manifest.objects.append(evidence.MANIFEST)
        return manifest

    # --- S3 and the health workflow ---------------------------------------------------------------------------

    def _bucket(self, group: CapacityGroup) -> str:
        if group.evidence_bucket is None:
            raise ApplicationError(
                f"capacity group {group.name} has no evidence_bucket", type="EvidenceNotConfigured", non_retryable=True
            )
        return group.evidence_bucket

    async def _put(self, bucket: str, key: str, body: bytes) -> None:
        await self._aws.call(f"s3://{bucket}/{key}", self._aws.s3.put_object, Bucket=bucket, Key=key, Body=body)

    async def _exists(self, bucket: str, key: str) -> bool:
        try:
            await self._aws.call(f"s3://{bucket}/{key}", self._aws.s3.head_object, Bucket=bucket, Key=key)
        except ApplicationError as err:
            if err.type in ("404", "NoSuchKey", "NotFound"):
                return False
            raise
        return True

    async def _health_view(self, instance_id: str) -> dict[str, Any]:
        """The health workflow's view as JSON; a note in its place when it does not answer (the evidence is kept
        without it rather than not at all)."""
        handle = self._client.get_workflow_handle(health_workflow_id(instance_id))
        try:
            view = await handle.query(names.QUERY_HEALTH, result_type=dict, rpc_timeout=QUERY_TIMEOUT)
        except RPCError as err:
            if err.status not in (RPCStatusCode.NOT_FOUND, RPCStatusCode.DEADLINE_EXCEEDED):
                raise
            return {"error": f"health workflow did not answer: {err.message}"[:500]}
        return dict(view)
