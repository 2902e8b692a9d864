"""Evidence before a termination, and the quarantine, end to end.

On the real dev server, moto over HTTP (S3 included) and the simulated fleet running the real probe. moto's SSM
SendCommand runs nothing, so the fleet plays the host's part of an evidence command: it PUTs its kernel log and a
bug report to the presigned URLs in the script (simulator/fleet.py), holding no credentials of its own. What AWS
must refuse (SendCommand without permission) the fault-injecting proxy in front of moto refuses.
"""

from __future__ import annotations

import gzip
import json
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import boto3
from temporalio.client import Client

from contract import evidence
from contract.groups import Remediation
from contract.ids import health_workflow_id, repair_workflow_id
from contract.names import GROUP_TAG
from simulator.aws_proxy import FlakyAws
from tests.fleet import START_BEFORE_STOP, Fleet, simulated_fleet
from tests.harness import unique
from tests.test_ops_cli import cli_json
from tests.test_remediation_ladder import REBOOTED_IN_PLACE, closed, container_status, steps_of
from tests.test_replacement_attempts import current_details, set_group, tags

PREFIX = "incidents/"
WITH_EVIDENCE = [*START_BEFORE_STOP[:6], "EvidenceStored", *START_BEFORE_STOP[6:]]


def s3(fleet: Fleet) -> Any:
    return boto3.client("s3", endpoint_url=fleet.moto_endpoint, region_name="us-east-1")


def new_bucket(fleet: Fleet) -> str:
    bucket = unique("evidence").lower().replace("_", "-")
    s3(fleet).create_bucket(Bucket=bucket)
    return bucket


def read(fleet: Fleet, bucket: str, key: str) -> bytes:
    return bytes(s3(fleet).get_object(Bucket=bucket, Key=key)["Body"].read())


def incident(fleet: Fleet, instance_id: str, attempt: int = 1) -> str:
    return evidence.incident_prefix(PREFIX, fleet.settings.groups[0].name, instance_id, attempt)


async def test_evidence_is_in_s3_before_the_termination(client: Client, aws_env: str, tmp_path: Path) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        bucket = new_bucket(fleet)
        set_group(fleet, evidence_bucket=bucket, evidence_prefix=PREFIX, bug_report=True)
        await fleet.all_healthy(3)
        faulty = fleet.sim.live_instances()[0]
        fleet.sim.inject_fault(faulty, xid=79)
        node = fleet.sim.node(faulty)
        assert node.last_fault is not None
        pci = node.last_fault[1]
        repair = repair_workflow_id(faulty, 1)

        result = await closed(fleet, repair)

        # The evidence step came after the tasks stopped and before the termination, in the repair's own order.
        assert steps_of(fleet, repair) == WITH_EVIDENCE
        assert result.replacement_instance_id is not None and fleet.ec2_state(faulty) == "terminated"
        prefix = incident(fleet, faulty)
        location = f"s3://{bucket}/{prefix}"
        [stored] = fleet.events("EvidenceStored", faulty)
        assert stored["detail"]["evidence"] == location
        assert stored["detail"]["missing"] == {} and stored["detail"]["complete"] is True
        assert sorted(stored["detail"]["objects"]) == sorted(
            [evidence.FINDINGS, evidence.KERNEL_LINES, *evidence.HOST_OBJECTS, evidence.MANIFEST]
        )
        # Linked from the repair's last events too.
        assert fleet.events("Terminated", faulty)[0]["detail"]["evidence"] == location
        assert fleet.events("RepairCompleted", faulty)[0]["detail"]["evidence"] == location

        # What the worker holds: the finding, and its kernel-log line.
        findings = json.loads(read(fleet, bucket, prefix + evidence.FINDINGS))
        assert findings["finding"]["reason"] == "XID_79" and findings["finding"]["gpu"]["pci"] == pci
        assert findings["repair_workflow_id"] == repair
        assert any(f["reason"] == "XID_79" for f in findings["health"]["recent_findings"])
        lines = read(fleet, bucket, prefix + evidence.KERNEL_LINES).decode()
        assert f"NVRM: GPU {pci}.0: GPU has fallen off the bus." in lines
        # And the lines around it, as the probe's kernel-log source read them (node_probe/classify/context.py).
        around = lines.split("\n--- around XID_79 at ", 1)[1].splitlines()[1:]
        assert len(around) > 2 and any("NVRM" not in line for line in around)
        # What the host uploaded to its presigned URLs: its kernel log (the fault's NVRM lines in it) and the report.
        host_log = read(fleet, bucket, prefix + evidence.HOST_KERNEL_LOG).decode()
        assert f"NVRM: Xid (PCI:{pci}): 79, " in host_log
        report = gzip.decompress(read(fleet, bucket, prefix + evidence.HOST_BUG_REPORT)).decode()
        assert report == f"simulated nvidia-bug-report.sh of {faulty}\n"
        manifest = json.loads(read(fleet, bucket, prefix + evidence.MANIFEST))
        assert manifest["complete"] is True and manifest["repair_workflow_id"] == repair

        # The host was sent a script and two URLs, each for one key and expiring: no credential of the worker's.
        ssm = boto3.client("ssm", endpoint_url=aws_env, region_name="us-east-1")
        [command] = [
            c
            for c in ssm.list_commands(InstanceId=faulty)["Commands"]
            if c["Comment"].startswith(f"{evidence.EVIDENCE_COMMENT} {faulty} ")
        ]
        script = "\n".join(command["Parameters"]["commands"])
        assert "nvidia-bug-report.sh" in script and "journalctl -k" in script
        urls = [part.split("'", 1)[0] for part in script.split("'http")[1:]]
        assert len(urls) == 2
        for url, name in zip(urls, evidence.HOST_OBJECTS, strict=True):
            parts = urlsplit("http" + url)
            assert parts.path == f"/{bucket}/{prefix}{name}"
            query = parse_qs(parts.query)
            assert int(query["X-Amz-Expires"][0]) <= 20 * 60 and "X-Amz-Signature" in query
        assert "aws_secret_access_key" not in script.lower() and "AWS_SECRET" not in script

        details = await current_details(client, repair)
        assert f"[done] Store the evidence in S3 (findings, kernel log, bug report) — {location}" in details
        [record] = await cli_json(fleet.settings, "history", "--instance", faulty)
        assert record["evidence"] == location and result.evidence == location


async def test_quarantine_stops_and_keeps_the_instance_and_says_what_the_host_could_not_give(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    with FlakyAws(aws_env) as proxy:
        async with simulated_fleet(client, aws_env, tmp_path, instances=3, engine_proxy=proxy) as fleet:
            bucket = new_bucket(fleet)
            set_group(fleet, evidence_bucket=bucket, evidence_prefix=PREFIX, bug_report=True, quarantine=True)
            await fleet.all_healthy(3)
            # The worker may not use Run Command on this host: the evidence it holds is stored all the same.
            proxy.fail("SendCommand", "AccessDeniedException", service="ssm")
            faulty = fleet.sim.live_instances()[0]
            fleet.sim.inject_fault(faulty, xid=79)
            repair = repair_workflow_id(faulty, 1)

            result = await closed(fleet, repair)

            assert steps_of(fleet, repair) == [*WITH_EVIDENCE[:7], "Quarantined", *WITH_EVIDENCE[8:]]
            assert proxy.calls("TerminateInstances") == 0 and proxy.calls("StopInstances") == 1
            # Stopped, kept, out of ECS and out of the group; its replacement serves.
            assert fleet.ec2_state(faulty) in ("stopping", "stopped")
            kept = tags(fleet, faulty)
            assert kept[evidence.QUARANTINE_TAG] == repair and GROUP_TAG not in kept
            assert container_status(fleet, faulty) is None
            assert result.replacement_instance_id is not None
            assert fleet.ec2_state(result.replacement_instance_id) == "running"
            prefix = incident(fleet, faulty)
            [quarantined] = fleet.events("Quarantined", faulty)
            assert (
                quarantined["detail"]["kept"] is True and quarantined["detail"]["evidence"] == f"s3://{bucket}/{prefix}"
            )

            [stored] = fleet.events("EvidenceStored", faulty)
            assert stored["detail"]["complete"] is False
            assert sorted(stored["detail"]["missing"]) == sorted(evidence.HOST_OBJECTS)
            for why in stored["detail"]["missing"].values():
                assert why.startswith("the host could not be asked: ") and "AccessDeniedException" in why
            manifest = json.loads(read(fleet, bucket, prefix + evidence.MANIFEST))
            assert manifest["missing"] == stored["detail"]["missing"]
            assert b"XID_79" in read(fleet, bucket, prefix + evidence.FINDINGS)
            details = await current_details(client, repair)
            assert "[done] Stop and keep the impaired instance (quarantine) — stopped, tagged" in details
            # Its health workflow ended with the repair: the instance is out of the fleet, not dormant in it.
            health = await client.get_workflow_handle(health_workflow_id(faulty)).describe()
            assert health.status is not None and health.status.name == "COMPLETED"


async def test_evidence_that_cannot_be_stored_never_holds_the_repair_and_a_reboot_keeps_it_first(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        missing_bucket = unique("gone").lower().replace("_", "-")
        set_group(fleet, evidence_bucket=missing_bucket, evidence_prefix=PREFIX)
        await fleet.all_healthy(3)
        faulty, rebooted, _ = fleet.sim.live_instances()
        fleet.sim.inject_fault(faulty, xid=79)
        repair = repair_workflow_id(faulty, 1)

        await closed(fleet, repair)

        # Said, and the repair went on: replaced, start-before-stop.
        assert steps_of(fleet, repair) == [*START_BEFORE_STOP[:6], "EvidenceNotStored", *START_BEFORE_STOP[6:]]
        [not_stored] = fleet.events("EvidenceNotStored", faulty)
        assert "NoSuchBucket" in not_stored["detail"]["why"]
        assert "evidence" not in fleet.events("Terminated", faulty)[0]
        assert fleet.ec2_state(faulty) == "terminated"
        details = await current_details(client, repair)
        assert "Store the evidence in S3 (findings, kernel log, bug report) — **not stored**: " in details

        # Under reboot-first, the evidence goes before the reboot clears the host's kernel log.
        bucket = new_bucket(fleet)
        set_group(
            fleet,
            evidence_bucket=bucket,
            remediation=Remediation.REBOOT_FIRST,
            reboot_timeout=timedelta(seconds=12),
        )
        fleet.sim.inject_fault(rebooted, xid=79)  # NVIDIA: RESTART_BM
        repair = repair_workflow_id(rebooted, 1)
        await closed(fleet, repair)
        assert steps_of(fleet, repair) == [*REBOOTED_IN_PLACE[:4], "EvidenceStored", *REBOOTED_IN_PLACE[4:]]
        [stored] = fleet.events("EvidenceStored", rebooted)
        assert stored["detail"]["evidence"] == f"s3://{bucket}/{incident(fleet, rebooted)}"
        assert fleet.sim.node(rebooted).reboots == 1 and container_status(fleet, rebooted) == "ACTIVE"
        details = await current_details(client, repair)
        assert "3. [done] Let tasks stop within their stop timeouts" in details
        assert "4. [done] Store the evidence in S3" in details and "5. [done] Reboot the instance" in details
