"""deploy/ecs/: cfn-lint accepts every template, and the ECS template holds together on its own: the probe daemons run
on every GPU instance of their group with the least they need, the ingest is reached over HTTPS through its load
balancer alone, the ops services run read-only on Fargate, every task role trusts only this account's ECS tasks, and
the setup function answers CloudFormation.

What the template says agreeing with the code (parsers, settings, deploy/iam/, the README) is
test_ecs_template_agrees.py; the template's loading and evaluation is tests/cfn_template.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from contract.config import ENV_PREFIX
from contract.formats import parse_bind
from contract.ingest import HEALTH_PATH
from node_probe.cli import ProbeSettings
from tests.cfn_template import (
    ACCOUNT,
    ECS,
    FULL,
    PSEUDO,
    REGION,
    TEMPLATE,
    Stack,
    env_vars,
    field_path_problem,
    minimal,
    stack,
    statement_resources,
    template,
)

__all__ = ["minimal", "stack", "template"]  # fixtures, used by name

TEMPLATES = sorted(p for pattern in ("*.yaml", "*.yml", "*.json", "*.template") for p in ECS.glob(pattern))


# --- cfn-lint ------------------------------------------------------------------------------------------------------


def _cfn_lint() -> str:
    binary = Path(sys.executable).parent / "cfn-lint"
    if not binary.exists():
        pytest.fail(
            "cfn-lint is not installed next to this Python: it comes with the dev extra (pip install -e '.[dev]')"
        )
    return str(binary)


def test_there_is_a_template():
    assert TEMPLATE in TEMPLATES


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_cfn_lint_accepts_the_template(path: Path):
    result = subprocess.run(
        [_cfn_lint(), "--format", "parseable", "--", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_cfn_lint_accepts_the_template_with_every_option_on():
    parameters = [f"{k}={v}" for k, v in FULL.items()]
    result = subprocess.run(
        [_cfn_lint(), "--format", "parseable", "--parameters", *parameters, "--", str(TEMPLATE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- the probe -----------------------------------------------------------------------------------------------------


def test_the_probe_services_run_on_every_instance_of_their_group(stack: Stack):
    services = {n: p for n, p in stack.of_type("AWS::ECS::Service").items() if p.get("SchedulingStrategy") == "DAEMON"}
    assert len(services) == len(stack.params["CapacityGroups"])
    for name, service in services.items():
        assert service["LaunchType"] == "EC2"
        assert "CapacityProviderStrategy" not in service and "DesiredCount" not in service
        assert service["Cluster"] == stack.params["GpuClusterName"]
        assert service["DeploymentConfiguration"]["MaximumPercent"] == 100
        (constraint,) = service["PlacementConstraints"]
        assert constraint["Type"] == "memberOf"
        expression = re.fullmatch(r"attribute:(\S+) == (\S+)", constraint["Expression"])
        assert expression is not None, constraint["Expression"]
        attribute, group = expression.groups()
        # The group's user data sets that attribute, and lets a host-network task use its task role.
        user_data = stack.outputs[f"GpuUserData{re.sub(r'[^0-9A-Za-z]', '', group)}"]
        lines = user_data.splitlines()
        assert f"ECS_CLUSTER={stack.params['GpuClusterName']}" in lines
        assert "ECS_ENABLE_TASK_IAM_ROLE=true" in lines
        assert "ECS_ENABLE_TASK_IAM_ROLE_NETWORK_HOST=true" in lines
        (attributes,) = [line.split("=", 1)[1] for line in lines if line.startswith("ECS_INSTANCE_ATTRIBUTES=")]
        assert json.loads(attributes) == {attribute: group}, name
        # ECS custom attribute names: letters, digits, hyphens, underscores, periods, slashes (no colon).
        assert re.fullmatch(r"[A-Za-z0-9_./-]{1,128}", attribute)


def test_the_probe_task_is_least_privileged_and_reserves_no_gpu(stack: Stack):
    for group, task_definition in stack.probe_groups().items():
        definition = stack.props(task_definition)
        assert definition["NetworkMode"] == "host" and definition["RequiresCompatibilities"] == ["EC2"]
        probe = stack.container(task_definition, "probe")
        assert "ResourceRequirements" not in probe, "a GPU reservation would take a GPU from the workloads"
        assert probe["User"] == "0" and probe["Privileged"] is False
        assert probe["ReadonlyRootFilesystem"] is True
        assert probe["DockerSecurityOptions"] == ["no-new-privileges"]
        linux = probe["LinuxParameters"]
        assert linux["Capabilities"] == {"Drop": ["ALL"], "Add": ["SYSLOG"]}
        assert linux["Devices"] == [{"HostPath": "/dev/kmsg", "ContainerPath": "/dev/kmsg", "Permissions": ["read"]}]
        assert probe["MemoryReservation"] <= 128 < probe["Memory"]
        assert not probe.get("Secrets"), "the probe holds no settings or Temporal credentials"
        env = env_vars(probe)
        assert env.get("NVIDIA_VISIBLE_DEVICES") == "all" and env.get("NVIDIA_DRIVER_CAPABILITIES") == "utility"
        for name in (n for n in env if n.startswith(ENV_PREFIX)):
            assert field_path_problem(name, ProbeSettings) is None, name
        assert probe["Image"] == f"{stack.params['ProbeImageRepository']}:{stack.params['Version']}", group


def test_without_nvml_the_probe_asks_for_no_gpu_access(minimal: Stack):
    for task_definition in minimal.probe_groups().values():
        env = env_vars(minimal.container(task_definition, "probe"))
        assert "NVIDIA_VISIBLE_DEVICES" not in env and "NVIDIA_DRIVER_CAPABILITIES" not in env
    assert all("--set-as-default" not in v for k, v in minimal.outputs.items() if k.startswith("GpuUserData"))


def test_the_probe_task_role_is_the_one_the_ingest_allows(stack: Stack):
    probe_role = stack.get_att("ProbeTaskRole", "Arn")
    ingest_env = env_vars(stack.container("IngestTaskDefinition", "ingest"))
    assert json.loads(ingest_env["AUTOREPAIR_INGEST__ALLOWED_ROLE_ARNS"]) == [probe_role]
    assert json.loads(ingest_env["AUTOREPAIR_INGEST__ALLOWED_ACCOUNTS"]) == [ACCOUNT]
    for task_definition in stack.probe_groups().values():
        assert stack.props(task_definition)["TaskRoleArn"] == probe_role
    others = [n for n, p in stack.of_type("AWS::ECS::TaskDefinition").items() if n not in stack.probe_groups().values()]
    assert all(stack.props(n).get("TaskRoleArn") != probe_role for n in others), "only the probe may hold it"
    role = stack.props("ProbeTaskRole")
    assert not role.get("Policies") and not role.get("ManagedPolicyArns"), "its credentials only prove who it is"
    assert not any(
        {"Ref": "ProbeTaskRole"} in r.get("Properties", {}).get("Roles", []) for r in stack.resources.values()
    )
    assert stack.outputs["ProbeTaskRoleArn"] == probe_role


# --- the ingest ----------------------------------------------------------------------------------------------------


def test_the_ingest_port_is_the_same_everywhere(stack: Stack):
    ingest = stack.container("IngestTaskDefinition", "ingest")
    host, bind_port = parse_bind(env_vars(ingest)["AUTOREPAIR_INGEST__BIND"])
    assert host == "0.0.0.0"
    mappings = {m["Name"]: m["ContainerPort"] for m in ingest["PortMappings"]}
    container_port = mappings.pop("ingest")
    # Its metrics on a port of their own, where ingest.metrics_bind says, for the scraper only.
    metrics_host, metrics_port = parse_bind(env_vars(ingest)["AUTOREPAIR_INGEST__METRICS_BIND"])
    assert mappings == {"metrics": metrics_port} and metrics_host == "0.0.0.0" and metrics_port == 9480
    (target_group,) = stack.of_type("AWS::ElasticLoadBalancingV2::TargetGroup").values()
    (service,) = [p for p in stack.of_type("AWS::ECS::Service").values() if p.get("LoadBalancers")]
    (attachment,) = service["LoadBalancers"]
    assert bind_port == container_port == target_group["Port"] == attachment["ContainerPort"] == 8480
    assert attachment["ContainerName"] == ingest["Name"]
    assert target_group["Protocol"] == "HTTP" and target_group["TargetType"] == "ip"
    assert target_group["HealthCheckPath"] == HEALTH_PATH and target_group["Matcher"] == {"HttpCode": "200"}
    # Only the load balancer reaches 8480, and it reaches nothing else.
    (to_ingest,) = stack.props("LoadBalancerSecurityGroup")["SecurityGroupEgress"]
    assert (to_ingest["FromPort"], to_ingest["ToPort"]) == (8480, 8480)
    assert to_ingest["DestinationSecurityGroupId"] == stack.ref("IngestSecurityGroup")
    assert "SecurityGroupIngress" not in stack.props("IngestSecurityGroup")
    into_ingest = [
        p
        for p in stack.of_type("AWS::EC2::SecurityGroupIngress").values()
        if p["GroupId"] == stack.ref("IngestSecurityGroup")
    ]
    from_balancer, from_scraper = sorted(into_ingest, key=lambda p: p["FromPort"])
    assert from_balancer == {
        **from_balancer,
        "FromPort": 8480,
        "ToPort": 8480,
        "SourceSecurityGroupId": stack.ref("LoadBalancerSecurityGroup"),
    }
    assert from_scraper == {
        **from_scraper,
        "FromPort": metrics_port,
        "ToPort": metrics_port,
        "SourceSecurityGroupId": FULL["MetricsScrapeSecurityGroupId"],
    }
    # The GPU hosts reach the load balancer on 443 only.
    into_balancer = [
        p
        for p in stack.of_type("AWS::EC2::SecurityGroupIngress").values()
        if p["GroupId"] == stack.ref("LoadBalancerSecurityGroup")
    ]
    assert {(p["FromPort"], p["ToPort"]) for p in into_balancer} == {(443, 443)}
    assert {p.get("SourceSecurityGroupId") or p.get("CidrIp") for p in into_balancer} == {
        FULL["GpuInstancesSecurityGroupId"],
        FULL["GpuInstancesCidr"],
    }


def test_the_ingest_is_served_over_https_at_its_name(stack: Stack):
    (listener,) = stack.of_type("AWS::ElasticLoadBalancingV2::Listener").values()
    assert listener["Protocol"] == "HTTPS" and listener["Port"] == 443
    assert listener["Certificates"] == [{"CertificateArn": FULL["CertificateArn"]}]
    assert listener["SslPolicy"].startswith("ELBSecurityPolicy-TLS13-1-2-")  # TLS 1.2 and 1.3 only
    assert listener["DefaultActions"] == [{"Type": "forward", "TargetGroupArn": stack.ref("IngestTargetGroup")}]
    (record,) = stack.of_type("AWS::Route53::RecordSet").values()
    assert record["Name"] == FULL["IngestDomainName"]
    assert record["AliasTarget"]["DNSName"] == stack.get_att("IngestLoadBalancer", "DNSName")


def test_the_ingest_secrets_come_from_where_its_execution_role_may_read(stack: Stack):
    ingest = stack.container("IngestTaskDefinition", "ingest")
    readable = statement_resources(stack, "IngestExecutionRole")
    for secret in ingest["Secrets"]:
        assert secret["ValueFrom"] in readable, secret["Name"]


# --- the ops services ----------------------------------------------------------------------------------------------


def test_ops_services_run_two_read_only_fargate_tasks(stack: Stack):
    services = {n: p for n, p in stack.of_type("AWS::ECS::Service").items() if p.get("LaunchType") == "FARGATE"}
    assert len(services) == 2
    for service in services.values():
        assert service["DesiredCount"] == "2"
        assert service["NetworkConfiguration"]["AwsvpcConfiguration"]["AssignPublicIp"] == "DISABLED"
    for name in ("WorkerTaskDefinition", "IngestTaskDefinition", "SetupTaskDefinition"):
        (container,) = stack.props(name)["ContainerDefinitions"]
        assert container["ReadonlyRootFilesystem"] is True
        assert container["Image"] == f"{stack.params['OpsImageRepository']}:{stack.params['Version']}"
        assert container["LinuxParameters"]["Capabilities"] == {"Drop": ["ALL"]}


# --- roles ---------------------------------------------------------------------------------------------------------


def test_every_task_role_trusts_only_this_accounts_ecs_tasks(stack: Stack):
    for name, role in stack.of_type("AWS::IAM::Role").items():
        (trust,) = role["AssumeRolePolicyDocument"]["Statement"]
        if trust["Principal"] == {"Service": "ecs-tasks.amazonaws.com"}:
            assert trust["Condition"]["StringEquals"] == {"aws:SourceAccount": ACCOUNT}, name


# --- the setup function --------------------------------------------------------------------------------------------


class _FakeEcs:
    def __init__(self, exit_code: int | None) -> None:
        self.exit_code = exit_code
        self.started: list[dict[str, Any]] = []

    def run_task(self, **kwargs: Any) -> dict[str, Any]:
        self.started.append(kwargs)
        return {"tasks": [{"taskArn": "arn:aws:ecs:eu-west-1:123456789012:task/ops/abc"}], "failures": []}

    def describe_tasks(self, **kwargs: Any) -> dict[str, Any]:
        container = {"exitCode": self.exit_code, "reason": None}
        return {
            "tasks": [
                {"lastStatus": "STOPPED", "containers": [container], "stoppedReason": "Essential container exited"}
            ]
        }


@pytest.mark.parametrize(
    ("request_type", "exit_code", "status"),
    [("Create", 0, "SUCCESS"), ("Update", 1, "FAILED"), ("Delete", None, "SUCCESS")],
)
def test_the_setup_function_answers_cloudformation(
    stack: Stack, monkeypatch: pytest.MonkeyPatch, request_type, exit_code, status
):
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    code = stack.props("SetupFunction")["Code"]["ZipFile"]
    namespace: dict[str, Any] = {}
    exec(compile(code, "index.py", "exec"), namespace)
    ecs = _FakeEcs(exit_code)
    namespace["ecs"] = ecs
    namespace["time"] = SimpleNamespace(sleep=lambda seconds: None)
    answers: list[dict[str, Any]] = []

    def urlopen(request: urllib.request.Request, timeout: float) -> Any:
        assert request.get_method() == "PUT" and request.full_url == "https://cloudformation-response.example/abc"
        assert isinstance(request.data, bytes)
        answers.append(json.loads(request.data))
        return SimpleNamespace(close=lambda: None)

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    custom = stack.props("SearchAttributes")
    event = {
        "RequestType": request_type,
        "ResponseURL": "https://cloudformation-response.example/abc",
        "StackId": PSEUDO["AWS::StackId"],
        "RequestId": "r-1",
        "LogicalResourceId": "SearchAttributes",
        "ResourceProperties": {k: v for k, v in custom.items() if k != "ServiceToken"},
    }
    context = SimpleNamespace(log_stream_name="stream", get_remaining_time_in_millis=lambda: 600_000)
    namespace["handler"](event, context)
    (answer,) = answers
    assert answer["Status"] == status, answer["Reason"]
    assert answer["PhysicalResourceId"] == "autorepair-setup"
    if request_type == "Delete":
        assert ecs.started == []
    else:
        (started,) = ecs.started
        assert started["taskDefinition"] == custom["TaskDefinition"] and started["launchType"] == "FARGATE"
        assert started["networkConfiguration"]["awsvpcConfiguration"]["subnets"] == stack.params["OpsSubnetIds"]
