"""deploy/ parses and agrees with the code: settings, AWS calls, search attributes, commands."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from temporalio.common import SearchAttributeKey

from activities.permissions import every_action
from contract import search_attributes
from contract.healthz import PROBE_METRICS_PORT
from contract.ingest import METRICS_PATH
from contract.names import GROUP_TAG
from simulator.servers import find_binary, free_port
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
POLICY = DEPLOY / "iam" / "worker-policy.json"
COMPOSE = DEPLOY / "compose" / "compose.yaml"

YAML_FILES = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
JSON_FILES = sorted(DEPLOY.rglob("*.json"))
TOML_FILES = sorted(DEPLOY.rglob("*.toml"))
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))

# boto3 client attribute in the activities -> IAM service prefix.
IAM_PREFIX = {"ecs": "ecs", "ec2": "ec2", "events": "events", "autoscaling": "autoscaling", "ssm": "ssm", "s3": "s3"}
AWS_CALL = re.compile(r"(?:self\._aws|\baws)\.(ecs|ec2|events|autoscaling|ssm|s3)\.([a-z0-9_]+)\b")
# Calls whose IAM action is not their operation's name: HeadObject is authorised as GetObject, and a presigned PUT
# (the host's upload of its evidence) as the signer's PutObject.
IAM_ACTION = {"s3:HeadObject": "s3:GetObject", "s3:GeneratePresignedUrl": "s3:PutObject"}
# Not a call of its own: RunInstances with a launch template that names an instance profile needs it.
IMPLIED_ACTIONS = {"iam:PassRole"}
READ_ONLY = re.compile(r":(Describe|List|Get)[A-Za-z]+$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _policy_statements() -> list[dict]:
    return json.loads(POLICY.read_text())["Statement"]


def _policy_actions() -> set[str]:
    return {action for st in _policy_statements() for action in _as_list(st["Action"])}


def _actions_called_by_activities() -> set[str]:
    actions = set()
    for source in (ROOT / "activities").glob("*.py"):
        for service, method in AWS_CALL.findall(source.read_text()):
            operation = "".join(part.capitalize() for part in method.split("_"))
            action = f"{IAM_PREFIX[service]}:{operation}"
            actions.add(IAM_ACTION.get(action, action))
    return actions


def _settings_from(path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    # The file's values must validate on their own: no AUTOREPAIR_* from the test environment in between.
    for name in [n for n in os.environ if n.startswith("AUTOREPAIR_")]:
        monkeypatch.delenv(name)
    return Settings(**tomllib.loads(path.read_text()))


def test_deploy_folder_has_the_expected_pieces():
    for name in [
        "docker/ops.Dockerfile",
        "docker/probe.Dockerfile",
        "README.md",
        "config.example.toml",
        "compose/compose.yaml",
        "compose/autorepair.toml",
        "compose/prometheus.yml",
        "kubernetes/namespace.yaml",
        "kubernetes/worker-configmap.yaml",
        "kubernetes/worker-deployment.yaml",
        "kubernetes/ingest-configmap.yaml",
        "kubernetes/ingest-deployment.yaml",
        "systemd/autorepair-worker.service",
        "systemd/autorepair-ingest.service",
        "systemd/autorepair-probe.service",
        "systemd/install-probe.sh",
        "systemd/autorepair.env.example",
        "ecs/gpu-autorepair.yaml",
        "ecs/README.md",
        "iam/worker-policy.json",
        "iam/ingest-policy.json",
        "iam/README.md",
    ]:
        assert (DEPLOY / name).is_file(), f"deploy/{name} missing"


@pytest.mark.parametrize("path", YAML_FILES, ids=_rel)
def test_yaml_parses(path: Path):
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert documents, f"{_rel(path)} holds no YAML document"
    for doc in documents:
        assert isinstance(doc, dict)


@pytest.mark.parametrize("path", JSON_FILES, ids=_rel)
def test_json_parses(path: Path):
    assert isinstance(json.loads(path.read_text()), dict)


@pytest.mark.parametrize("path", TOML_FILES, ids=_rel)
def test_toml_is_a_valid_settings_file(path: Path, monkeypatch: pytest.MonkeyPatch):
    settings = _settings_from(path, monkeypatch)
    assert settings.groups, f"{_rel(path)} configures no capacity group"
    for group in settings.groups:
        assert group.launch_template or group.auto_scaling_group, f"group {group.name}: nowhere to get replacements"
    # Shipped examples monitor first; operators enable a group after watching it (deploy/README.md).
    assert {g.auto_repair.value for g in settings.groups} == {"DISABLED"}
    assert settings.metrics_bind_address and settings.metrics_bind_address.endswith(":9464")


def test_toml_is_also_loaded_through_autorepair_config(monkeypatch: pytest.MonkeyPatch):
    for name in [n for n in os.environ if n.startswith("AUTOREPAIR_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AUTOREPAIR_CONFIG", str(DEPLOY / "config.example.toml"))
    settings = Settings()
    assert [g.name for g in settings.groups] == ["p5-training", "g6-inference"]
    assert settings.group("p5-training").heartbeat_loss_threshold.total_seconds() == 600
    assert settings.group("g6-inference").auto_scaling_group == "g6-inference-asg"


def test_kubernetes_configmap_holds_a_valid_settings_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    configmap = yaml.safe_load((DEPLOY / "kubernetes" / "worker-configmap.yaml").read_text())
    config = tmp_path / "config.toml"
    config.write_text(configmap["data"]["config.toml"])
    settings = _settings_from(config, monkeypatch)
    assert settings.groups and settings.metrics_bind_address == "0.0.0.0:9464"


def test_worker_policy_is_a_valid_least_privilege_document():
    policy = json.loads(POLICY.read_text())
    assert policy["Version"] == "2012-10-17"
    sids = [st["Sid"] for st in policy["Statement"]]
    assert len(sids) == len(set(sids)), "duplicate Sid"
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow"
        assert set(st) <= {"Sid", "Effect", "Action", "Resource", "Condition"}, "NotAction/NotResource widen"
        for action in _as_list(st["Action"]):
            assert "*" not in action and "?" not in action, f"{st['Sid']}: wildcard action {action}"
            assert re.fullmatch(r"[a-z0-9-]+:[A-Z][A-Za-z0-9]+", action), action
        resources = _as_list(st["Resource"])
        for resource in resources:
            assert resource == "*" or resource.startswith("arn:aws:"), resource
        if "*" in resources:
            # Only the calls IAM cannot scope by resource, and all of them read-only.
            assert resources == ["*"]
            for action in _as_list(st["Action"]):
                assert READ_ONLY.search(action), f"{st['Sid']}: {action} on Resource '*'"


def test_worker_policy_grants_exactly_what_the_activities_call():
    called = _actions_called_by_activities()
    assert called, "found no AWS calls in activities/: has the client attribute naming changed?"
    granted = _policy_actions()
    assert called - granted == set(), f"activities call actions the policy lacks: {sorted(called - granted)}"
    assert granted - called - IMPLIED_ACTIONS == set(), (
        f"policy grants actions no activity calls: {sorted(granted - called - IMPLIED_ACTIONS)}"
    )


def test_the_doctor_simulates_what_the_activities_call():
    # `autorepair doctor` asks IAM about activities/permissions.py's table: it must name every call, and no other.
    expected = _actions_called_by_activities() | IMPLIED_ACTIONS
    assert every_action() == expected, (
        f"missing from activities/permissions.py: {sorted(expected - every_action())}; "
        f"no longer called: {sorted(every_action() - expected)}"
    )


def test_worker_policy_mutations_are_guarded():
    by_action: dict[str, list[dict]] = {}
    for st in _policy_statements():
        for action in _as_list(st["Action"]):
            by_action.setdefault(action, []).append(st)

    def conditions(action: str) -> list[dict]:
        return [st.get("Condition", {}) for st in by_action[action]]

    # Every launch statement requires the template; the instance itself also needs the group tag.
    for st in by_action["ec2:RunInstances"]:
        assert "ec2:LaunchTemplate" in st["Condition"]["ArnEquals"]
        if any(":instance/" in r for r in _as_list(st["Resource"])):
            assert "aws:RequestTag/gpu-autorepair:group" in st["Condition"]["StringLike"]
    # Tags: at launch, or only our own keys afterwards.
    for cond in conditions("ec2:CreateTags"):
        at_launch = cond.get("StringEquals", {}).get("ec2:CreateAction") == "RunInstances"
        own_keys = cond.get("ForAllValues:StringLike", {}).get("aws:TagKeys") == ["gpu-autorepair:*"]
        assert at_launch or own_keys, cond
    for action in ["ec2:TerminateInstances", "ec2:RebootInstances", "ec2:StopInstances", "ec2:DeleteTags"]:
        for cond in conditions(action):
            assert "aws:ResourceTag/gpu-autorepair:group" in cond["StringLike"], action
    for cond in conditions("autoscaling:DetachInstances"):
        assert "aws:ResourceTag/gpu-autorepair:group" in cond["StringLike"]
    # Untagging: the group tag alone (a quarantine takes the instance out of its group), nobody else's tags.
    for cond in conditions("ec2:DeleteTags"):
        assert cond["ForAllValues:StringEquals"]["aws:TagKeys"] == ["gpu-autorepair:group"]
    # Evidence: objects under the evidence prefix of one bucket, never a bucket-wide or account-wide grant.
    for action in ["s3:PutObject", "s3:GetObject"]:
        for st in by_action[action]:
            assert all(r.startswith("arn:aws:s3:::") and r.endswith("/*") and "/" in r[13:-2] for r in st["Resource"])
    for cond in conditions("iam:PassRole"):
        assert cond["StringEquals"]["iam:PassedToService"] == "ec2.amazonaws.com"
    # Run Command: the shell document alone, and only on the groups' instances.
    for st in by_action["ssm:SendCommand"]:
        resources = _as_list(st["Resource"])
        documents = [r for r in resources if ":document/" in r]
        assert documents == [] or documents == ["arn:aws:ssm:us-east-1::document/AWS-RunShellScript"], resources
        if not documents:
            assert "aws:ResourceTag/gpu-autorepair:group" in st["Condition"]["StringLike"]
    for st in by_action["events:PutEvents"]:
        assert all(":event-bus/" in r for r in _as_list(st["Resource"]))
    for action in ["ecs:UpdateContainerInstancesState", "ecs:StopTask", "ecs:DeregisterContainerInstance"]:
        for st in by_action[action]:
            assert all(r.startswith("arn:aws:ecs:") for r in _as_list(st["Resource"])), action


def test_no_policy_ships_for_the_probe():
    assert not (DEPLOY / "iam" / "probe-policy.json").exists()
    assert "no AWS API call" in (DEPLOY / "iam" / "README.md").read_text()


def _unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


def _all_values(path: Path, key: str) -> list[str]:
    return [line.split("=", 1)[1].strip() for line in path.read_text().splitlines() if line.startswith(f"{key}=")]


@pytest.mark.parametrize("path", UNITS, ids=_rel)
def test_systemd_unit_runs_autorepair_hardened(path: Path):
    unit = _unit(path)
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    service = unit["Service"]
    (exec_start,) = _all_values(path, "ExecStart")
    argv = shlex.split(exec_start)
    assert Path(argv[0]).name == "autorepair" and argv[0].startswith("/"), exec_start
    assert argv[1] == path.stem.removeprefix("autorepair-"), exec_start
    assert service["Restart"] == "always"
    assert service["NoNewPrivileges"] == "yes"
    assert service["ProtectSystem"] == "strict"
    assert service.get("DynamicUser") == "yes" or service.get("User") not in (None, "root")


def test_probe_unit_has_exactly_the_access_it_needs():
    path = DEPLOY / "systemd" / "autorepair-probe.service"
    service = _unit(path)["Service"]
    assert service["AmbientCapabilities"] == "CAP_SYSLOG"
    assert service["CapabilityBoundingSet"] == "CAP_SYSLOG"
    assert service["DevicePolicy"] == "closed"
    allowed = _all_values(path, "DeviceAllow")
    assert "/dev/kmsg r" in allowed
    assert any(d.startswith("char-nvidia") and d.endswith("rw") for d in allowed)
    assert service["StateDirectory"] == "autorepair/spool"
    # The kernel log source comes from AUTOREPAIR_PROBE_ARGS: /dev/kmsg unless autorepair.env says --journald.
    assert "$AUTOREPAIR_PROBE_ARGS" in service["ExecStart"] and "/var/lib/autorepair/spool" in service["ExecStart"]
    assert "AUTOREPAIR_PROBE_ARGS=--kmsg" in _all_values(path, "Environment")
    assert service["SupplementaryGroups"] == "systemd-journal"
    # ProtectKernelLogs and PrivateDevices would hide /dev/kmsg and the GPUs from the probe.
    assert service.get("ProtectKernelLogs", "no") == "no"
    assert service.get("PrivateDevices", "no") == "no"


def test_compose_stack_registers_every_search_attribute_with_its_type():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"postgresql", "temporal", "temporal-ui", "worker", "prometheus"} <= set(services)
    script = "\n".join(_as_list(services["temporal-admin-tools"]["command"]))
    type_names = {"KEYWORD": "Keyword", "INT": "Int"}
    for key in search_attributes.ALL:
        assert isinstance(key, SearchAttributeKey)
        kind = type_names[key.indexed_value_type.name.removeprefix("INDEXED_VALUE_TYPE_")]
        assert f"{key.name}:{kind}" in script, f"{key.name} ({kind}) not registered by the compose stack"
    assert services["temporal"]["environment"]["DB"] == "postgres12"
    assert services["temporal-ui"]["ports"] == ["127.0.0.1:8080:8080"]
    worker = services["worker"]
    assert worker["build"]["dockerfile"] == "deploy/docker/ops.Dockerfile"
    assert (COMPOSE.parent / worker["build"]["context"] / worker["build"]["dockerfile"]).resolve().is_file()
    assert "./autorepair.toml:/etc/autorepair/config.toml:ro" in worker["volumes"]
    assert worker["environment"]["AUTOREPAIR_CONFIG"] == "/etc/autorepair/config.toml"
    assert "127.0.0.1:9464:9464" in worker["ports"]
    for service in services.values():
        if "image" in service and "build" not in service:
            image = service["image"]
            assert ":" in image and not image.endswith(":latest"), f"unpinned image {image}"


def test_prometheus_scrapes_the_worker_metrics_and_temporal():
    config = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    targets = {
        target: job.get("metrics_path", "/metrics")
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for target in static["targets"]
    }
    assert targets.get("worker:9464") == "/metrics"
    assert any(target.startswith("temporal:") for target in targets)


def test_prometheus_finds_the_probes_on_the_port_the_unit_and_the_template_serve():
    """The GPU hosts' probes, through EC2 by their group tag, on the port of their --metrics-bind."""
    config = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "gpu-autorepair-probe"]
    (discovery,) = job["ec2_sd_configs"]
    assert discovery["port"] == PROBE_METRICS_PORT and job.get("metrics_path", "/metrics") == METRICS_PATH
    assert {"name": "tag-key", "values": [GROUP_TAG]} in discovery["filters"]
    unit = (DEPLOY / "systemd" / "autorepair-probe.service").read_text()
    assert f"Environment=AUTOREPAIR_PROBE_METRICS_BIND=0.0.0.0:{PROBE_METRICS_PORT}" in unit
    assert "--metrics-bind ${AUTOREPAIR_PROBE_METRICS_BIND}" in unit


def _kinds(path: Path) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}


def test_kubernetes_worker_deployment():
    docs = _kinds(DEPLOY / "kubernetes" / "worker-deployment.yaml")
    deployment = docs["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["worker"]
    env = {e["name"]: e for e in container["env"]}
    assert env["AUTOREPAIR_CONFIG"]["value"] == "/etc/autorepair/config.toml"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    config_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    mounted_file = Path(mount["mountPath"]) / config_volume["configMap"]["items"][0]["path"]
    assert str(mounted_file) == env["AUTOREPAIR_CONFIG"]["value"]
    configmap = yaml.safe_load((DEPLOY / "kubernetes" / "worker-configmap.yaml").read_text())
    assert config_volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 9464 and ports["health"] == 8481
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    account = docs["ServiceAccount"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")


@pytest.mark.parametrize("image", ["ops", "probe"])
def test_dockerfile_installs_the_project_with_the_autorepair_entrypoint(image: str):
    lines = [line.strip() for line in (DEPLOY / "docker" / f"{image}.Dockerfile").read_text().splitlines()]
    assert "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in lines
    stages = [line for line in lines if line.startswith("FROM ")]
    assert stages == ["FROM ${PYTHON_IMAGE} AS build", "FROM ${PYTHON_IMAGE}"]
    # The project itself is installed, as a wheel (not an editable pointing at the discarded build stage).
    assert any(re.match(r"RUN uv sync .*--no-editable(\s|$)", line) for line in lines)
    assert 'ENTRYPOINT ["autorepair"]' in lines
    copied = {
        source.rstrip("/")
        for line in lines
        if line.startswith("COPY ") and "--from" not in line
        for source in line.split()[1:-1]
    }
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"{image}.Dockerfile does not copy packages {sorted(packages - copied)}"
    # What the build reads besides the code: the metadata, the lock it installs from, the readme and license files
    # the metadata names.
    assert {"pyproject.toml", "uv.lock", "README.md", "LICENSE"} <= copied
    assert "autorepair" in pyproject["project"]["scripts"]


def test_compose_search_attribute_script_registers_them_on_a_real_server_and_is_idempotent(tmp_path: Path):
    """The admin-tools one-shot, as compose runs it (`$$` is compose's escape for `$`), against a bare dev server
    that has none of our attributes: all are created with their types, and a second run changes nothing."""
    compose = yaml.safe_load(COMPOSE.read_text())
    admin = compose["services"]["temporal-admin-tools"]
    script = "\n".join(_as_list(admin["command"])).replace("$$", "$")
    temporal = find_binary("temporal")  # the venv's own, as the rest of the suite uses
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = subprocess.Popen(
        [temporal, "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(port),
         "--http-port", str(free_port()), "--metrics-port", str(free_port()), "--log-level", "error",
         "--db-filename", str(tmp_path / "temporal.db")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    env = os.environ | admin["environment"] | {"TEMPORAL_ADDRESS": address}
    env["PATH"] = f"{Path(temporal).parent}{os.pathsep}{env['PATH']}"
    try:
        first = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0, first.stderr
        listed = subprocess.run(
            [temporal, "operator", "search-attribute", "list", "--address", address, "--output", "json"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        registered = json.loads(listed)["customAttributes"]
        assert registered == {
            key.name: f"INDEXED_VALUE_TYPE_{key.indexed_value_type.name}" for key in search_attributes.ALL
        }
        second = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr
        assert second.stdout.count("already registered") == len(search_attributes.ALL), second.stdout
    finally:
        server.terminate()
        server.wait(timeout=30)
