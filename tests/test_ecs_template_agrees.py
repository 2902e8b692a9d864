"""deploy/ecs/gpu-autorepair.yaml agrees with the code: the probe's command parses with the probe's own argument
parser, each container's environment loads the real settings, the health checks are commands the image has, the
roles grant what deploy/iam/ says, the alert rule matches the events the worker publishes, the README's walkthrough
deploys the template as it is, and the images' defaults follow the release.

The template's own structure and cfn-lint are test_ecs_template.py; its loading and evaluation is
tests/cfn_template.py.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from activities.events import event_body
from activities.models import HEALTH_DETAIL_TYPE, EventType, FleetEvent
from contract import event_types as ev
from contract.config import ENV_PREFIX, IngestSettings
from contract.formats import parse_bind
from contract.groups import DEFAULT_HEARTBEAT_INTERVAL
from contract.health import HealthState
from contract.healthz import DEFAULT_PROBE_HEALTH_BIND, DEFAULT_WORKER_HEALTH_BIND, PROBE_METRICS_PORT
from contract.ingest import HEALTH_PATH
from ingest.cli import tls_context
from operator_cli.main import build_parser
from tests.cfn_template import (
    ACCOUNT,
    ECS,
    FULL,
    MINIMAL,
    REGION,
    ROOT,
    TEMPLATE,
    Stack,
    actions,
    as_list,
    env_vars,
    field_path_problem,
    load_template,
    minimal,
    role_statements,
    secret_names,
    stack,
    statement_resources,
    template,
)
from worker.settings import Settings

__all__ = ["minimal", "stack", "template"]  # fixtures, used by name

SETTINGS_EXAMPLE = ECS / "settings.example.toml"
WORKER_POLICY = ROOT / "deploy" / "iam" / "worker-policy.json"
INGEST_POLICY = ROOT / "deploy" / "iam" / "ingest-policy.json"

# What ECS injects from `secrets`, by the name the container sees.
SECRET_VALUES = {
    "AUTOREPAIR_CONFIG_TOML": SETTINGS_EXAMPLE.read_text(),
    "AUTOREPAIR_TEMPORAL__API_KEY": "temporal-api-key-for-the-test",
    "AUTOREPAIR_INGEST__SESSION_SECRET": "s" * 48,
}
FARGATE_MAX_STOP_TIMEOUT = 120


def _environment_of(container: dict[str, Any]) -> dict[str, str]:
    """What the process sees: the plain variables and the secrets ECS resolved."""
    environment = env_vars(container)
    for name in secret_names(container):
        assert name in SECRET_VALUES, f"the test has no value for secret {name}"
        environment[name] = SECRET_VALUES[name]
    return environment


@pytest.fixture
def environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[dict[str, str]], None]]:
    """Sets exactly the given AUTOREPAIR_* variables (nothing from the test run's own environment in between)."""
    for name in [n for n in os.environ if n.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(name)

    def apply(values: dict[str, str]) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    yield apply


# --- the probe -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("given", [FULL, MINIMAL], ids=["full", "minimal"])
def test_one_probe_daemon_per_capacity_group_parses_with_the_probes_parser(template: dict[str, Any], given: dict):
    stack = Stack(template, given)
    groups = stack.probe_groups()
    assert sorted(groups) == sorted(stack.params["CapacityGroups"])
    ingest = stack.container("IngestTaskDefinition", "ingest")
    ingest_env = env_vars(ingest)
    for group, task_definition in groups.items():
        probe = stack.container(task_definition, "probe")
        command = probe["Command"]
        args = build_parser().parse_args(command)
        assert args.command == "probe"
        assert args.group == group
        # The ingest's HTTPS name, which the certificate covers and the DNS record points at the load balancer.
        assert args.ingest == f"https://{stack.params['IngestDomainName']}" == stack.outputs["IngestUrl"]
        # Signed for the ingest's own STS endpoint and id, or every proof is refused (401/403).
        assert args.sts_endpoint == ingest_env["AUTOREPAIR_INGEST__STS_ENDPOINT"]
        assert args.region == REGION
        assert args.ingest_id == IngestSettings().id and "AUTOREPAIR_INGEST__ID" not in ingest_env
        assert args.kmsg and not args.journald and args.kernel_log is None
        assert args.no_daemons and args.container_runtime is False
        assert args.nvml is (stack.params["ProbeGpuAccess"] == "nvidia-default-runtime")
        assert args.heartbeat_interval == float(stack.params["HeartbeatIntervalSeconds"])
        assert not args.direct_temporal
        # The spool is on the host's disk, where the probe writes it.
        volumes = {v["Name"]: v for v in stack.props(task_definition)["Volumes"]}
        mounts = {m["ContainerPath"]: m["SourceVolume"] for m in probe["MountPoints"]}
        assert str(args.spool_dir) in mounts
        assert volumes[mounts[str(args.spool_dir)]]["Host"]["SourcePath"] == str(args.spool_dir)


def test_the_probe_heartbeats_as_often_as_the_settings_expect(stack: Stack):
    default = stack.template["Parameters"]["HeartbeatIntervalSeconds"]["Default"]
    assert timedelta(seconds=default) == DEFAULT_HEARTBEAT_INTERVAL
    settings = tomllib.loads(SETTINGS_EXAMPLE.read_text())
    for group in settings["groups"]:
        assert group.get("heartbeat_interval", "PT1M") == "PT1M"


# --- the ingest, the worker and setup -------------------------------------------------------------------------------


def test_the_balancer_keeps_each_host_on_one_ingest_replica(stack: Stack):
    """Duration-based stickiness (the balancer's cookie, which the probe's HTTP session sends back:
    tests/test_ingest_reporter_cookies.py), as ACTIONS.md's finding 1 asks."""
    group = stack.template["Resources"]["IngestTargetGroup"]["Properties"]
    attributes = {a["Key"]: a["Value"] for a in group["TargetGroupAttributes"]}
    assert attributes["stickiness.enabled"] == "true"
    assert attributes["stickiness.type"] == "lb_cookie"
    # Longer than any pause in a host's heartbeats (a minute apart), within the ALB's 7-day maximum.
    assert 3600 <= int(attributes["stickiness.lb_cookie.duration_seconds"]) <= 7 * 86400


def test_the_ingest_environment_loads_the_real_settings(stack: Stack, environment):
    ingest = stack.container("IngestTaskDefinition", "ingest")
    assert ingest["Command"] == ["ingest"] and build_parser().parse_args(ingest["Command"]).command == "ingest"
    values = _environment_of(ingest)
    for name in values:
        assert field_path_problem(name, Settings) is None
    environment(values)
    settings = Settings.load()
    assert settings.ingest.bind == "0.0.0.0:8480"
    assert settings.ingest.tls_terminated_by_load_balancer is True
    assert settings.ingest.tls_cert is None
    assert tls_context(settings, "0.0.0.0") is None  # plain HTTP behind the balancer: the ingest starts
    assert settings.ingest.allowed_accounts == [ACCOUNT]
    assert settings.ingest.allowed_role_arns == [stack.get_att("ProbeTaskRole", "Arn")]
    assert settings.ingest.sts_endpoint == f"https://sts.{REGION}.amazonaws.com"
    assert settings.ingest.session_secret is not None
    assert settings.temporal.address == FULL["TemporalAddress"]
    assert settings.temporal.namespace == FULL["TemporalNamespace"]
    assert settings.temporal.api_key is not None
    assert settings.aws.region == REGION
    # The settings' groups are the stack's: the probes' groups, in the GPU cluster the roles are scoped to.
    assert [g.name for g in settings.groups] == stack.params["CapacityGroups"]
    assert {g.cluster for g in settings.groups} == {stack.params["GpuClusterName"]}
    assert {g.launch_template for g in settings.groups} <= set(stack.params["LaunchTemplateIds"])


def test_the_engine_environment_loads_the_real_settings(stack: Stack, environment):
    worker = stack.container("WorkerTaskDefinition", "worker")
    assert worker["Command"] == ["worker"] and build_parser().parse_args(worker["Command"]).command == "worker"
    values = _environment_of(worker)
    for name in values:
        assert field_path_problem(name, Settings) is None
    environment(values)
    settings = Settings.load()
    assert settings.temporal.address == FULL["TemporalAddress"]
    assert settings.temporal.api_key is not None and settings.temporal.api_key.get_secret_value()
    assert settings.aws.region == REGION
    assert settings.events.bus_name == stack.props("EventBus")["Name"] == stack.params["EventBusName"]
    assert settings.events.source == stack.params["EventSource"]
    assert settings.log_format == "json"
    # Metrics where the port mapping is, the health check where the endpoint is.
    assert settings.metrics_bind_address is not None
    assert [m["ContainerPort"] for m in worker["PortMappings"]] == [parse_bind(settings.metrics_bind_address)[1]]
    assert settings.health_bind_address == DEFAULT_WORKER_HEALTH_BIND
    assert worker["HealthCheck"]["Command"] == [
        "CMD",
        "autorepair",
        "healthcheck",
        f"http://{DEFAULT_WORKER_HEALTH_BIND}{HEALTH_PATH}",
    ]
    # SIGTERM: the activities' grace, and time to close, before ECS's SIGKILL (Fargate allows 120 s at most).
    assert worker["StopTimeout"] == FARGATE_MAX_STOP_TIMEOUT
    assert settings.graceful_shutdown_timeout < timedelta(seconds=worker["StopTimeout"])
    assert worker["ReadonlyRootFilesystem"] is True
    readable = statement_resources(stack, "WorkerExecutionRole")
    for secret in worker["Secrets"]:
        assert secret["ValueFrom"] in readable, secret["Name"]


def test_the_setup_task_loads_the_settings_and_runs_setup(stack: Stack, environment):
    setup = stack.container("SetupTaskDefinition", "setup")
    assert build_parser().parse_args(setup["Command"]).command == "setup"
    values = _environment_of(setup)
    for name in values:
        assert field_path_problem(name, Settings) is None
    environment(values)
    assert Settings.load().temporal.address == FULL["TemporalAddress"]
    custom = stack.props("SearchAttributes")
    assert custom["TaskDefinition"] == stack.ref("SetupTaskDefinition")
    assert custom["ServiceToken"] == stack.get_att("SetupFunction", "Arn")


# --- the images ----------------------------------------------------------------------------------------------------


def test_the_health_checks_are_commands_the_images_have(stack: Stack):
    checks = {
        "WorkerTaskDefinition": f"http://{DEFAULT_WORKER_HEALTH_BIND}{HEALTH_PATH}",
        **{td: f"http://{DEFAULT_PROBE_HEALTH_BIND}{HEALTH_PATH}" for td in stack.probe_groups().values()},
    }
    for task_definition, url in checks.items():
        (container,) = stack.props(task_definition)["ContainerDefinitions"]
        kind, *command = container["HealthCheck"]["Command"]
        assert kind == "CMD" and command == ["autorepair", "healthcheck", url]
        assert build_parser().parse_args(command[1:]).command == "healthcheck"
    for task_definition in stack.probe_groups().values():
        args = build_parser().parse_args(stack.container(task_definition)["Command"])
        # Where the probe serves it (the default, unless the command names another).
        assert getattr(args, "health_bind", None) in (None, DEFAULT_PROBE_HEALTH_BIND)
        # Its metrics, on the host's network for a Prometheus elsewhere, on a port of their own.
        assert args.metrics_bind == f"0.0.0.0:{PROBE_METRICS_PORT}"


def test_image_defaults_follow_the_release():
    template = load_template(TEMPLATE)
    parameters = template["Parameters"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert parameters["Version"]["Default"] == pyproject["project"]["version"]
    assert parameters["OpsImageRepository"]["Default"] == "ghcr.io/gpu-autorepair/gpu-autorepair"
    assert parameters["ProbeImageRepository"]["Default"] == "ghcr.io/gpu-autorepair/gpu-autorepair-probe"


# --- roles ---------------------------------------------------------------------------------------------------------


def _policy_file(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["Statement"]


def test_the_worker_role_grants_what_worker_policy_json_grants(stack: Stack, minimal: Stack):
    statements = role_statements(stack, "WorkerTaskRole")
    shipped = _policy_file(WORKER_POLICY)
    assert actions(statements) == actions(shipped)
    assert {st["Sid"] for st in statements} == {st["Sid"] for st in shipped}
    # One RunInstances pair per launch template, each naming its template exactly.
    launches = [st for st in statements if "ec2:RunInstances" in st["Action"]]
    assert len(launches) == 2 * len(FULL["LaunchTemplateIds"].split(","))
    for st in launches:
        template_arn = st["Condition"]["ArnEquals"]["ec2:LaunchTemplate"]
        assert template_arn.rsplit("/", 1)[1] in FULL["LaunchTemplateIds"].split(",")
        if any(":instance/" in r for r in st["Resource"]):
            assert st["Condition"]["StringLike"] == {"aws:RequestTag/gpu-autorepair:group": "?*"}
    # The guards worker-policy.json has, here too.
    for st in statements:
        for action in st["Action"]:
            if action in ("ec2:TerminateInstances", "ec2:RebootInstances", "ec2:StopInstances", "ec2:DeleteTags"):
                assert st["Condition"]["StringLike"] == {"aws:ResourceTag/gpu-autorepair:group": "?*"}, action
            if st["Resource"] == "*":
                assert re.search(r":(Describe|List|Get)[A-Za-z]+$", action), action
        for resource in as_list(st["Resource"]):
            assert (
                resource == "*"
                or f":{ACCOUNT}:" in resource
                or resource.startswith(("arn:aws:s3:::", f"arn:aws:ssm:{REGION}::document/", f"arn:aws:ec2:{REGION}::"))
            ), resource
    (evidence,) = [st for st in statements if "s3:PutObject" in st["Action"]]
    assert evidence["Resource"] == [f"arn:aws:s3:::{FULL['EvidenceBucket']}/gpu-autorepair/*"]
    (passing,) = [st for st in statements if "iam:PassRole" in st["Action"]]
    assert passing["Resource"] == [f"arn:aws:iam::{ACCOUNT}:role/{FULL['GpuNodeRoleName']}"]
    # Without launch templates, Auto Scaling groups or an evidence bucket, only those grants go.
    left_out = actions(shipped) - actions(role_statements(minimal, "WorkerTaskRole"))
    assert left_out == {"ec2:RunInstances", "s3:PutObject", "s3:GetObject"}


def test_the_ingest_role_grants_what_ingest_policy_json_grants(stack: Stack):
    statements = role_statements(stack, "IngestTaskRole")
    shipped = _policy_file(INGEST_POLICY)
    assert actions(statements) == actions(shipped)
    assert {st["Sid"] for st in statements} == {st["Sid"] for st in shipped}
    cluster = f"arn:aws:ecs:{REGION}:{ACCOUNT}:cluster/{FULL['GpuClusterName']}"
    for st in statements:
        if st["Resource"] != "*":
            assert all(f":{ACCOUNT}:" in r and f"/{FULL['GpuClusterName']}" in r for r in st["Resource"])
        if "ecs:DescribeTasks" in st["Action"]:
            assert st["Condition"]["ArnEquals"]["ecs:cluster"] == [cluster]


# --- events ----------------------------------------------------------------------------------------------------------


def matches(pattern: dict[str, Any], body: dict[str, Any]) -> bool:
    """EventBridge's matching of exact values: each key of the pattern in the body, its value one of those listed."""
    return all(
        matches(want, body.get(key) or {}) if isinstance(want, dict) else body.get(key) in want
        for key, want in pattern.items()
    )


def test_the_alert_rule_matches_events_the_worker_publishes(stack: Stack):
    (rule,) = stack.of_type("AWS::Events::Rule").values()
    pattern = rule["EventPattern"]
    assert pattern["source"] == [stack.params["EventSource"]]
    health, problems = pattern["$or"]
    assert health["detail-type"] == [HEALTH_DETAIL_TYPE]
    assert FleetEvent.model_fields["type"].annotation is EventType
    health_changed = FleetEvent.of(
        ev.HealthChanged(overall_status=HealthState.IMPAIRED, details=[]),
        event_id="e",
        time=datetime(2026, 1, 1, tzinfo=UTC),
        group="g",
        instance_id="i",
        workflow_id="health/i",
    )
    assert health_changed.detail_type == HEALTH_DETAIL_TYPE
    # EventBridge's Detail is the whole published event: the pattern's keys are where the event has them.
    assert matches(health["detail"], event_body(health_changed))
    assert not matches(health["detail"], event_body(health_changed.model_copy(update={"detail": {}})))
    for name in health["detail"]["type"] + problems["detail"]["type"]:
        assert name in {t.value for t in EventType}, name
    assert rule["EventBusName"] == stack.ref("EventBus")
    assert stack.outputs["EventBusArn"] == stack.get_att("EventBus", "Arn")


# --- the walkthrough -----------------------------------------------------------------------------------------------

README = ECS / "README.md"
TEMPLATE_BODY_LIMIT = 51_200  # bytes CloudFormation takes inline; above it, from S3


def test_the_readme_deploys_the_template_as_it_is(template: dict[str, Any]):
    readme = README.read_text()
    (deploy,) = re.findall(r"aws cloudformation deploy .*?(?=\n\S|\n\n)", readme, flags=re.S)
    assert "--template-file deploy/ecs/gpu-autorepair.yaml" in deploy
    if TEMPLATE.stat().st_size > TEMPLATE_BODY_LIMIT:
        assert "--s3-bucket" in deploy
    assert "CAPABILITY_IAM" in deploy
    if template.get("Transform"):
        assert "CAPABILITY_AUTO_EXPAND" in deploy
    given = dict(re.findall(r"\b([A-Z][A-Za-z]+)=(\S+)", deploy))
    assert set(given) <= set(template["Parameters"]), sorted(set(given) - set(template["Parameters"]))
    required = {name for name, spec in template["Parameters"].items() if "Default" not in spec}
    assert required <= set(given), f"the walkthrough leaves out required parameters {sorted(required - set(given))}"


def test_the_readme_shows_the_user_data_the_stack_prints(stack: Stack):
    readme = README.read_text()
    for output, user_data in stack.outputs.items():
        if output.startswith("GpuUserData"):
            for line in user_data.splitlines():
                if line.startswith("ECS_ENABLE_"):
                    assert line in readme.splitlines()
