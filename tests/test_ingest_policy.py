"""deploy/iam/ingest-policy.json grants exactly the AWS calls ingest/ makes, read-only and scoped to the GPU clusters
where IAM allows it (as tests/test_deploy_files.py holds worker-policy.json to the activities)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
POLICY = ROOT / "deploy" / "iam" / "ingest-policy.json"
README = ROOT / "deploy" / "iam" / "README.md"
INGEST = ROOT / "ingest"

# A boto3 call on a client attribute named after its service: self.ecs.describe_tasks(...), lookup.ec2.describe_...
AWS_CALL = re.compile(r"\.(ecs|ec2|sts|iam|s3|ssm|events|autoscaling|secretsmanager)\.([a-z][a-z0-9_]*)\(")
CLIENT = re.compile(r"\.client\(\s*[\"']([a-z0-9-]+)[\"']")
READ_ONLY = re.compile(r":(Describe|List|Get)[A-Za-z]+$")
# What IAM cannot scope to a resource (the service authorization reference): only these may have Resource "*".
NOT_RESOURCE_SCOPED = {"ec2:DescribeInstances"}
PLACEHOLDER_CLUSTER = "arn:aws:ecs:us-east-1:111122223333:cluster/gpu-training"


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _statements() -> list[dict[str, Any]]:
    return json.loads(POLICY.read_text())["Statement"]


def _granted() -> set[str]:
    return {action for st in _statements() for action in _as_list(st["Action"])}


def _called_by_the_ingest() -> set[str]:
    actions = set()
    for source in INGEST.glob("*.py"):
        for service, method in AWS_CALL.findall(source.read_text()):
            actions.add(f"{service}:{''.join(part.capitalize() for part in method.split('_'))}")
    return actions


def test_the_ingest_makes_the_aws_calls_this_test_can_see():
    called = _called_by_the_ingest()
    assert called, "found no AWS calls in ingest/: has the client attribute naming changed?"
    # Every client the ingest makes is one whose calls the regex above finds: no call hides behind another name.
    clients = {name for source in INGEST.glob("*.py") for name in CLIENT.findall(source.read_text())}
    assert clients == {"ec2", "ecs"}, clients
    # The hosts' proof goes to STS as the host signed it (an HTTP POST), never through an STS client of ours.
    assert "sts" not in clients and not any(action.startswith("sts:") for action in called)


def test_the_policy_grants_exactly_what_the_ingest_calls():
    called, granted = _called_by_the_ingest(), _granted()
    assert called - granted == set(), f"the ingest calls actions the policy lacks: {sorted(called - granted)}"
    assert granted - called == set(), f"the policy grants actions the ingest never calls: {sorted(granted - called)}"
    # What docs/operations.md section 10 says its role needs.
    assert granted == {
        "ec2:DescribeInstances",
        "ecs:ListContainerInstances",
        "ecs:DescribeContainerInstances",
        "ecs:DescribeTasks",
    }


def test_the_policy_is_a_valid_read_only_document():
    policy = json.loads(POLICY.read_text())
    assert set(policy) == {"Version", "Statement"} and policy["Version"] == "2012-10-17"
    sids = [st["Sid"] for st in policy["Statement"]]
    assert len(sids) == len(set(sids)) and all(re.fullmatch(r"[A-Za-z0-9]+", sid) for sid in sids)
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow"
        assert set(st) <= {"Sid", "Effect", "Action", "Resource", "Condition"}, "NotAction/NotResource widen"
        for action in _as_list(st["Action"]):
            assert re.fullmatch(r"[a-z0-9-]+:[A-Z][A-Za-z0-9]+", action), f"{st['Sid']}: {action} (no wildcards)"
            assert READ_ONLY.search(action), f"{st['Sid']}: {action} is not read-only"


def test_the_policy_is_scoped_to_the_gpu_clusters_where_iam_allows():
    for st in _statements():
        resources = _as_list(st["Resource"])
        actions = _as_list(st["Action"])
        if "*" in resources:
            assert resources == ["*"]
            assert set(actions) <= NOT_RESOURCE_SCOPED, f"{st['Sid']}: {actions} could be resource-scoped"
            continue
        for resource in resources:
            assert resource.startswith("arn:aws:ecs:us-east-1:111122223333:"), resource
            assert "/gpu-training" in resource, resource
        if any(a in ("ecs:DescribeContainerInstances", "ecs:DescribeTasks") for a in actions):
            # The container instances and tasks of these clusters only, said twice as worker-policy.json says it.
            assert st["Condition"] == {"ArnEquals": {"ecs:cluster": [PLACEHOLDER_CLUSTER]}}
            assert {r.split(":")[5].split("/")[0] for r in resources} == {"container-instance", "task"}
        if "ecs:ListContainerInstances" in actions:
            assert resources == [PLACEHOLDER_CLUSTER]


def test_the_readme_documents_the_placeholders_and_the_probes_role():
    readme = README.read_text()
    assert "ingest-policy.json" in readme
    for placeholder in ("111122223333", "us-east-1", "gpu-training"):
        assert placeholder in readme
    # The probe talks to the ingest, not to Temporal, and its role grants nothing.
    probe = readme[readme.index("## The node probe") :]
    assert "talks only to Temporal" not in readme
    assert "reports to the **ingest**" in probe and "no AWS API call" in probe
