"""Each deployment flavour under deploy/ is whole: it starts the worker and the ingest, the probes it configures point
at an ingest it makes, health checks ask /healthz, shutdown gets its grace, nothing keeps an outbox on disk, and the
compose stack publishes nothing beyond loopback and keeps state only in its database. tests/test_deploy_files.py
checks each file on its own; this checks the flavours hold together."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from contract.formats import parse_bind
from ingest.cli import is_loopback
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
COMPOSE = COMPOSE_DIR / "compose.yaml"
KUBERNETES = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
INSTALL_PROBE = SYSTEMD / "install-probe.sh"
PROBE_UNIT = SYSTEMD / "autorepair-probe.service"
INGEST_UNIT = SYSTEMD / "autorepair-ingest.service"
WORKER_UNIT = SYSTEMD / "autorepair-worker.service"
ECS_TEMPLATE = DEPLOY / "ecs" / "gpu-autorepair.yaml"

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
OPS_IMAGE = f"ghcr.io/gpu-autorepair/gpu-autorepair:{VERSION}"
# The name every flavour gives its ingest and every probe-side configuration uses (and the certificate carries).
INGEST_HOST = "ingest.autorepair.internal"
INGEST_PORT = 8480
# `docker compose stop`, the kubelet and systemd must wait longer than the worker's graceful_shutdown_timeout.
STOP_GRACE = timedelta(seconds=90)


# --- reading the files ------------------------------------------------------------------------------------------


def _settings(text: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """A settings file's values on their own: no AUTOREPAIR_* from the test environment in between."""
    for name in [n for n in os.environ if n.startswith("AUTOREPAIR_")]:
        monkeypatch.delenv(name)
    return Settings(**tomllib.loads(text))


def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]


def _compose_settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    return _settings((COMPOSE_DIR / "autorepair.toml").read_text(), monkeypatch)


def _one_shots(services: dict[str, dict[str, Any]]) -> set[str]:
    """Services others wait for to complete: they run once and exit."""
    return {
        name
        for service in services.values()
        for name, condition in (service.get("depends_on") or {}).items()
        if isinstance(condition, dict) and condition.get("condition") == "service_completed_successfully"
    }


def _manifests(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kind(path: Path, kind: str) -> dict[str, Any]:
    (doc,) = [doc for doc in _manifests(path) if doc["kind"] == kind]
    return doc


def _unit_values(path: Path, key: str) -> list[str]:
    return [line.split("=", 1)[1].strip() for line in path.read_text().splitlines() if line.startswith(f"{key}=")]


def _unit_value(path: Path, key: str) -> str:
    (value,) = _unit_values(path, key)
    return value


def _unit_environment(path: Path) -> dict[str, str]:
    return dict(assignment.split("=", 1) for assignment in _unit_values(path, "Environment"))


def _seconds(text: str) -> float:
    """`90s`, `1m30s` (compose) or `90` (systemd)."""
    units = {"h": 3600, "m": 60, "s": 1, "": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|m|s|)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(float(number) * units[unit] for number, unit in parts)


def _script_setting(name: str) -> str:
    """A `NAME="value"` setting at the top of install-probe.sh."""
    (value,) = re.findall(rf'^{name}="([^"]*)"$', INSTALL_PROBE.read_text(), flags=re.MULTILINE)
    return value


def _env_example() -> dict[str, str]:
    lines = (SYSTEMD / "autorepair.env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


# --- every flavour starts the ingest ----------------------------------------------------------------------------


def _assert_ingest_serves_safely(settings: Settings, where: str) -> None:
    """What `autorepair ingest` checks at start (ingest/cli.py tls_context): off loopback, TLS at the ingest or at a
    load balancer that terminates it; and some account allowed, or every report is refused."""
    ingest = settings.ingest
    host, _, port = ingest.bind.rpartition(":")
    assert int(port) == INGEST_PORT, f"{where}: the ingest binds {ingest.bind}"
    if not is_loopback(host):
        assert (ingest.tls_cert and ingest.tls_key) or ingest.tls_terminated_by_load_balancer, where
    assert ingest.allowed_accounts, f"{where}: no ingest.allowed_accounts, every report would be refused"
    assert settings.groups, f"{where}: no groups, every report would be refused as unknown_group"


def test_compose_runs_the_ingest_beside_the_worker(monkeypatch: pytest.MonkeyPatch):
    services = _services()
    worker, ingest = services["worker"], services["ingest"]
    assert worker["command"] == ["worker"] and ingest["command"] == ["ingest"]
    for service in (worker, ingest):
        assert service["image"] == OPS_IMAGE
        assert service["build"]["dockerfile"] == "deploy/docker/ops.Dockerfile"
        assert service["environment"]["AUTOREPAIR_CONFIG"] == "/etc/autorepair/config.toml"
        assert "./autorepair.toml:/etc/autorepair/config.toml:ro" in service["volumes"]
        assert service["depends_on"]["temporal-admin-tools"]["condition"] == "service_completed_successfully"
    settings = _compose_settings(monkeypatch)
    _assert_ingest_serves_safely(settings, "compose/autorepair.toml")
    # The certificate and key the settings name are in the folder compose mounts read-only, which git ignores.
    assert "./tls:/etc/autorepair/tls:ro" in ingest["volumes"]
    assert {settings.ingest.tls_cert, settings.ingest.tls_key} == {
        Path("/etc/autorepair/tls/tls.crt"),
        Path("/etc/autorepair/tls/tls.key"),
    }
    ignored = (COMPOSE_DIR / "tls" / ".gitignore").read_text().splitlines()
    assert "*" in ignored and "!.gitignore" in ignored
    # Its port, published for the GPU hosts, is the one it binds.
    (published,) = ingest["ports"]
    assert published.rsplit(":", 2)[1:] == [str(INGEST_PORT), str(INGEST_PORT)]


def test_prometheus_scrapes_the_ingest_on_its_metrics_port_not_the_hosts(monkeypatch: pytest.MonkeyPatch):
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    jobs = {
        target: job
        for job in config["scrape_configs"]
        for s in job.get("static_configs", [])
        for target in s["targets"]
    }
    assert f"ingest:{INGEST_PORT}" not in jobs  # the hosts' port serves no metrics
    settings = _settings((COMPOSE_DIR / "autorepair.toml").read_text(), monkeypatch)
    assert settings.ingest.metrics_bind is not None
    host, port = parse_bind(settings.ingest.metrics_bind)
    job = jobs[f"ingest:{port}"]
    assert host == "0.0.0.0" and job.get("scheme", "http") == "http" and job.get("metrics_path") == "/metrics"
    assert str(port) in _compose()["services"]["ingest"]["expose"]  # on the compose network, not published


def test_kubernetes_runs_the_ingest_with_a_service_and_a_disruption_budget(monkeypatch: pytest.MonkeyPatch):
    path = KUBERNETES / "ingest-deployment.yaml"
    deployment = _kind(path, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == OPS_IMAGE and container["args"] == ["ingest"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    # The hosts' port, and the metrics port the pod's annotations send Prometheus to.
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert ports == {"https": INGEST_PORT, "metrics": int(annotations["prometheus.io/port"])}
    assert annotations.get("prometheus.io/scheme", "http") == "http"

    service = _kind(path, "Service")
    assert service["spec"]["selector"].items() <= labels.items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == INGEST_PORT and service_port["targetPort"] == "https"
    assert service["spec"]["type"] == "LoadBalancer", "the GPU hosts are outside the cluster"

    budget = _kind(path, "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["minAvailable"] == 1

    account = _kind(path, "ServiceAccount")
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    role = account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"]
    assert re.fullmatch(r"arn:aws:iam::\d{12}:role/gpu-autorepair-ingest", role)

    # Settings: the file the ConfigMap holds, mounted where AUTOREPAIR_CONFIG says, with the TLS Secret beside it.
    env = {e["name"]: e for e in container["env"]}
    config_path = Path(env["AUTOREPAIR_CONFIG"]["value"])
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    projected: dict[Path, tuple[str, str]] = {}
    for source in volume["projected"]["sources"]:
        (kind,) = set(source) & {"configMap", "secret"}
        for item in source[kind]["items"]:
            projected[Path(mount["mountPath"]) / item["path"]] = (source[kind]["name"], item["key"])
    configmap = _kind(KUBERNETES / "ingest-configmap.yaml", "ConfigMap")
    assert projected[config_path] == (configmap["metadata"]["name"], "config.toml")
    settings = _settings(configmap["data"]["config.toml"], monkeypatch)
    _assert_ingest_serves_safely(settings, "kubernetes/ingest-configmap.yaml")
    assert settings.ingest.tls_cert is not None and settings.ingest.tls_key is not None
    assert settings.ingest.metrics_bind == f"0.0.0.0:{ports['metrics']}"
    assert projected[settings.ingest.tls_cert] == ("gpu-autorepair-ingest-tls", "tls.crt")
    assert projected[settings.ingest.tls_key] == ("gpu-autorepair-ingest-tls", "tls.key")
    # The Secrets it names are the ones its header tells how to create.
    secret = env["AUTOREPAIR_INGEST__SESSION_SECRET"]["valueFrom"]["secretKeyRef"]
    header = path.read_text()
    assert f"create secret generic {secret['name']}" in header and f"--from-literal={secret['key']}=" in header
    assert "create secret tls gpu-autorepair-ingest-tls" in header

    # The ingest must know the worker's groups and Temporal, or it refuses their hosts (403 unknown_group).
    worker_configmap = _kind(KUBERNETES / "worker-configmap.yaml", "ConfigMap")
    worker_settings = _settings(worker_configmap["data"]["config.toml"], monkeypatch)
    assert [(g.name, g.cluster) for g in settings.groups] == [(g.name, g.cluster) for g in worker_settings.groups]
    assert settings.temporal.address == worker_settings.temporal.address
    assert settings.temporal.namespace == worker_settings.temporal.namespace
    assert settings.temporal.task_queue == worker_settings.temporal.task_queue


def test_kubernetes_has_no_probe_daemonset_and_fits_the_restricted_policy():
    """A Kubernetes GPU node is never an ECS container instance, so never one this project repairs."""
    assert not (KUBERNETES / "probe-daemonset.yaml").exists()
    kinds = {doc["kind"] for path in KUBERNETES.glob("*.yaml") for doc in _manifests(path)}
    assert "DaemonSet" not in kinds
    namespace = _kind(KUBERNETES / "namespace.yaml", "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for name in ("worker-deployment.yaml", "ingest-deployment.yaml"):
        pod = _kind(KUBERNETES / name, "Deployment")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert not any("hostPath" in volume for volume in pod.get("volumes", []))
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"]["drop"] == ["ALL"]
            assert context["readOnlyRootFilesystem"] is True
            assert container["image"] == OPS_IMAGE


def test_systemd_runs_the_ingest_hardened_like_the_worker(monkeypatch: pytest.MonkeyPatch):
    argv = shlex.split(_unit_value(INGEST_UNIT, "ExecStart"))
    assert argv == ["/opt/gpu-autorepair/bin/autorepair", "ingest"]
    hardening = {
        line
        for line in WORKER_UNIT.read_text().splitlines()
        if re.match(r"(Protect|Private|Restrict|NoNewPrivileges|Capability|Ambient|SystemCall|LockPersonality)", line)
    }
    ingest_lines = set(INGEST_UNIT.read_text().splitlines())
    assert len(hardening) > 20 and hardening <= ingest_lines, hardening - ingest_lines
    assert _unit_value(INGEST_UNIT, "DynamicUser") == "yes"
    # TLS: the files config.example.toml names, handed to the dynamic user as credentials.
    example = _settings((DEPLOY / "config.example.toml").read_text(), monkeypatch)
    _assert_ingest_serves_safely(example, "config.example.toml")
    credentials = dict(value.split(":", 1) for value in _unit_values(INGEST_UNIT, "LoadCredential"))
    assert credentials == {"tls.crt": str(example.ingest.tls_cert), "tls.key": str(example.ingest.tls_key)}
    env = _unit_environment(INGEST_UNIT)
    assert env["AUTOREPAIR_INGEST__TLS_CERT"] == "%d/tls.crt" and env["AUTOREPAIR_INGEST__TLS_KEY"] == "%d/tls.key"
    assert env["AUTOREPAIR_CONFIG"] == "/etc/autorepair/config.toml"


# --- every probe points at an ingest its flavour makes ----------------------------------------------------------


def _probe_ingest_urls() -> dict[str, str]:
    """Every place outside the ECS template that configures a probe, and the ingest URL it gives it."""
    return {
        "systemd/autorepair.env.example": _env_example()["AUTOREPAIR_PROBE_INGEST"],
        "systemd/install-probe.sh": _script_setting("INGEST_URL"),
    }


def test_every_probe_points_at_the_ingest_a_flavour_makes():
    urls = _probe_ingest_urls()
    for where, url in urls.items():
        parts = urlsplit(url)
        assert parts.scheme == "https", f"{where}: {url}"
        assert (parts.hostname, parts.port) == (INGEST_HOST, INGEST_PORT), f"{where}: {url}"
    # Each flavour that runs an ingest gives it that name, or documents it as its load balancer's name.
    service = _kind(KUBERNETES / "ingest-deployment.yaml", "Service")
    assert service["metadata"]["annotations"]["external-dns.alpha.kubernetes.io/hostname"] == INGEST_HOST
    assert f"https://{INGEST_HOST}:{INGEST_PORT}" in INGEST_UNIT.read_text()
    assert "load balancer" in INGEST_UNIT.read_text()
    compose_text = COMPOSE.read_text()
    # compose.yaml's recipe for the certificate names the same host.
    assert f'-subj "/CN={INGEST_HOST}" -addext "subjectAltName=DNS:{INGEST_HOST}"' in compose_text


def test_the_probe_unit_reads_what_the_install_script_writes():
    """Every variable the unit's command line uses is set by the unit or written by install-probe.sh."""
    exec_start = _unit_value(PROBE_UNIT, "ExecStart")
    used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)\}?", exec_start))
    script = INSTALL_PROBE.read_text()
    written = set(re.findall(r'echo "([A-Z_][A-Z0-9_]*)=', script))
    assert used <= written | set(_unit_environment(PROBE_UNIT)), used - written
    assert used <= set(_env_example()) | set(_unit_environment(PROBE_UNIT))
    assert {"AUTOREPAIR_PROBE_GROUP", "AUTOREPAIR_PROBE_INGEST", "AWS_REGION"} <= written
    assert _unit_value(PROBE_UNIT, "EnvironmentFile") == "-/etc/autorepair/autorepair.env"
    assert 'ENV_FILE="$CONF_DIR/autorepair.env"' in script and "CONF_DIR=/etc/autorepair" in script
    argv = shlex.split(exec_start)
    assert argv[:2] == ["/opt/gpu-autorepair/bin/autorepair", "probe"] and "PREFIX=/opt/gpu-autorepair" in script
    assert "--health-bind" not in argv, "the probe's default, 127.0.0.1:8482"


# --- the ECS template (deploy/ecs, written separately) ------------------------------------------------------------


class _CfnLoader(yaml.SafeLoader):
    """CloudFormation YAML: short-form intrinsics (!Ref, !Sub, !GetAtt ...) become their long form."""


def _intrinsic(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    value: Any
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    if suffix == "Ref":
        return {"Ref": value}
    if suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {f"Fn::{suffix}": value}


_CfnLoader.add_multi_constructor("!", _intrinsic)


def _walk(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, dict):
        for item in value.values():
            yield from _walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from _walk(item)


def _references(value: Any) -> set[str]:
    """Logical ids and parameters an expression refers to: Ref, GetAtt and ${...} of Sub."""
    names: set[str] = set()
    for node in _walk(value):
        if isinstance(node, dict):
            if isinstance(node.get("Ref"), str):
                names.add(node["Ref"])
            if isinstance(node.get("Fn::GetAtt"), list):
                names.add(node["Fn::GetAtt"][0])
            sub = node.get("Fn::Sub")
            text = sub[0] if isinstance(sub, list) else sub
            if isinstance(text, str):
                names |= {name.split(".")[0] for name in re.findall(r"\$\{([^}!]+)\}", text)}
    return names


def _resources(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The template's resources, those of each Fn::ForEach (AWS::LanguageExtensions) by their logical id pattern."""
    found: dict[str, dict[str, Any]] = {}
    for logical_id, resource in template.get("Resources", {}).items():
        if logical_id.startswith("Fn::ForEach::"):
            found |= resource[2]
        else:
            found[logical_id] = resource
    return found


def _command_words(command: list[Any]) -> list[Any]:
    return [word for word in command if not (isinstance(word, dict) and "Fn::If" in word)]


def test_ecs_template_runs_the_ingest_and_points_its_probes_at_it():
    """deploy/ecs/gpu-autorepair.yaml (written separately; skipped until it exists): a service runs `autorepair
    ingest`, and every probe task's --ingest is the name the template gives its load balancer (a Route 53 alias
    record of it), on a port the load balancer listens on."""
    if not ECS_TEMPLATE.exists():
        pytest.skip("deploy/ecs/gpu-autorepair.yaml is not written yet")
    template = yaml.load(ECS_TEMPLATE.read_text(), Loader=_CfnLoader)  # a SafeLoader: no arbitrary objects
    resources, parameters = _resources(template), template.get("Parameters", {})
    commands = {
        logical_id: _command_words(container.get("Command", []))
        for logical_id, resource in resources.items()
        if resource.get("Type") == "AWS::ECS::TaskDefinition"
        for container in resource["Properties"]["ContainerDefinitions"]
    }
    ingest_tasks = {logical_id for logical_id, command in commands.items() if command[:1] == ["ingest"]}
    assert ingest_tasks, "no task definition runs `autorepair ingest`"
    services = [r["Properties"] for r in resources.values() if r.get("Type") == "AWS::ECS::Service"]
    assert any(_references(s.get("TaskDefinition")) & ingest_tasks for s in services), "no service runs the ingest"

    balancers = {i for i, r in resources.items() if r.get("Type") == "AWS::ElasticLoadBalancingV2::LoadBalancer"}
    assert balancers, "no load balancer in front of the ingest"
    listener_ports = {
        r["Properties"]["Port"]
        for r in resources.values()
        if r.get("Type") == "AWS::ElasticLoadBalancingV2::Listener"
        and _references(r["Properties"]["LoadBalancerArn"]) & balancers
    }
    # The names made for a load balancer: its alias records, and the parameters those records are named by.
    alias_names: set[str] = set()
    for logical_id, r in resources.items():
        if r.get("Type") == "AWS::Route53::RecordSet" and _references(r["Properties"].get("AliasTarget")) & balancers:
            alias_names |= {logical_id} | _references(r["Properties"]["Name"])
    probes = {logical_id: command for logical_id, command in commands.items() if command[:1] == ["probe"]}
    assert probes, "no task definition runs `autorepair probe`"
    for logical_id, command in probes.items():
        assert "--ingest" in command, f"{logical_id}: the probe has no --ingest"
        url = command[command.index("--ingest") + 1]
        names = _references(url)
        assert names & (alias_names | balancers), f"{logical_id}: --ingest {url} is no name of the load balancer"
        for name in names & set(parameters):
            assert "probes call" in parameters[name].get("Description", ""), f"{name}: not documented as the name"
        text = url["Fn::Sub"] if isinstance(url, dict) and isinstance(url.get("Fn::Sub"), str) else ""
        port = urlsplit(re.sub(r"\$\{[^}]+\}", "host", text)).port or 443
        assert text.startswith("https://") and port in listener_ports, f"{logical_id}: --ingest {url}"


# --- compose: loopback, health checks, one volume, current Temporal ------------------------------------------------


def _port_bindings(services: dict[str, dict[str, Any]]) -> Iterator[tuple[str, str]]:
    for name, service in services.items():
        for port in service.get("ports", []):
            if isinstance(port, dict):  # the long syntax
                yield name, str(port.get("host_ip", ""))
            else:
                parts = str(port).rsplit(":", 2)
                yield name, parts[0] if len(parts) == 3 else ""


def test_compose_publishes_every_port_on_loopback_only():
    """Temporal's frontend has no authentication here: on every interface, anyone could signal or terminate any
    workflow around the ingest. The ingest alone is meant to be reached, once INGEST_PUBLISH_ADDRESS says where."""
    bindings = list(_port_bindings(_services()))
    assert ("temporal", "127.0.0.1") in bindings
    for service, host_ip in bindings:
        default = re.fullmatch(r"\$\{[A-Z_]+:-([^}]*)\}", host_ip)
        assert (default.group(1) if default else host_ip) == "127.0.0.1", f"{service} publishes on {host_ip!r}"


def test_compose_gives_every_long_running_service_a_health_check():
    services = _services()
    one_shots = _one_shots(services)
    assert {"temporal-schema", "temporal-admin-tools"} <= one_shots
    long_running = set(services) - one_shots
    assert {"postgresql", "temporal", "temporal-ui", "worker", "ingest", "prometheus"} <= long_running
    for name in long_running:
        check = services[name].get("healthcheck")
        assert check and not check.get("disable") and check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert services[name].get("restart") == "unless-stopped", name
    for name in one_shots:
        assert services[name].get("restart", "no") == "no", f"{name}: a one-shot others wait for must not restart"
    # Each waits for what it needs to be healthy, not merely started.
    assert services["temporal"]["depends_on"]["temporal-schema"]["condition"] == "service_completed_successfully"
    assert services["temporal-schema"]["depends_on"]["postgresql"]["condition"] == "service_healthy"
    for name in ("temporal-admin-tools", "temporal-ui"):
        assert services[name]["depends_on"]["temporal"]["condition"] == "service_healthy", name


def test_compose_health_checks_ask_healthz_where_the_worker_and_the_ingest_serve_it(monkeypatch: pytest.MonkeyPatch):
    services = _services()
    settings = _compose_settings(monkeypatch)
    assert settings.health_bind_address is not None
    worker_check = services["worker"]["healthcheck"]["test"]
    assert worker_check == ["CMD", "autorepair", "healthcheck", f"http://{settings.health_bind_address}/healthz"]
    ingest_check = services["ingest"]["healthcheck"]["test"]
    assert ingest_check[:3] == ["CMD", "autorepair", "healthcheck"]
    url = urlsplit(ingest_check[-1])
    # HTTPS with the certificate, asked on loopback where its name does not match: hence --insecure.
    assert (url.scheme, url.hostname, url.port, url.path) == ("https", "127.0.0.1", INGEST_PORT, "/healthz")
    assert "--insecure" in ingest_check
    assert services["prometheus"]["healthcheck"]["test"][-1].endswith("/-/healthy")
    assert "pg_isready" in " ".join(services["postgresql"]["healthcheck"]["test"])


def test_compose_keeps_state_only_in_the_database():
    compose = _compose()
    assert set(compose["volumes"]) == {"postgresql-data"}
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0] if isinstance(volume, str) else volume.get("source", "")
            if name == "postgresql":
                assert source == "postgresql-data"
            else:
                # Only files that ship, read-only: this folder's configuration, the dynamic config, the ingest's
                # certificate, the alert rules (deploy/prometheus/, shared with Kubernetes) and Grafana's dashboard
                # and provisioning (deploy/grafana/).
                assert source.startswith(("./", "../prometheus/", "../grafana/")) and volume.endswith(":ro"), (
                    f"{name}: {volume}"
                )
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source} missing"


def test_compose_sets_up_a_current_temporal_server_without_auto_setup():
    services = _services()
    images = {name: service.get("image", "") for name, service in services.items()}
    assert not any("auto-setup" in image for image in images.values())
    server = re.fullmatch(r"temporalio/server:(1\.(2\d|3\d)\.\d+)", images["temporal"])
    assert server, images["temporal"]
    # The schema tools of the server's own version.
    for name in ("temporal-schema", "temporal-admin-tools"):
        assert images[name] == f"temporalio/admin-tools:{server.group(1)}", name
    environment = services["temporal"]["environment"]
    assert environment["DB"] == "postgres12" and environment["POSTGRES_SEEDS"] == "postgresql"
    assert environment["BIND_ON_IP"] == "0.0.0.0"
    # The dynamic config file the server refuses to start without is mounted where it is told to look.
    (mount,) = services["temporal"]["volumes"]
    source, target, _ = mount.split(":")
    assert target == environment["DYNAMIC_CONFIG_FILE_PATH"] and (COMPOSE_DIR / source).is_file()
    # Both stores, created if missing, set up and migrated to the image's schema.
    schema = "\n".join(services["temporal-schema"]["command"])
    assert services["temporal-schema"]["environment"]["SQL_PLUGIN"] == "postgres12"
    for step in ("create-database", "setup-schema -v 0.0", "update-schema -d"):
        assert f'temporal-sql-tool --db "$$db" {step}' in schema, step
    assert "temporal:temporal visibility:temporal_visibility" in schema
    assert (environment["DBNAME"], environment["VISIBILITY_DBNAME"]) == ("temporal", "temporal_visibility")
    # The namespace, then the search attributes.
    admin = "\n".join(services["temporal-admin-tools"]["command"])
    assert "temporal operator cluster health" in admin
    assert admin.index("temporal operator namespace create") < admin.index("search-attribute create")


def test_compose_file_is_valid_for_docker_compose(tmp_path: Path):
    """`docker compose config` where the compose plugin is installed (it needs no engine to parse)."""
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no docker compose here")
    env = os.environ | {"POSTGRES_PASSWORD": "test"}
    checked = subprocess.run(
        [docker, "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, env=env, timeout=60
    )
    assert checked.returncode == 0, checked.stderr


# --- the worker: /healthz, graceful shutdown, no state --------------------------------------------------------------


def test_every_flavour_gives_the_worker_longer_to_stop_than_its_graceful_shutdown(monkeypatch: pytest.MonkeyPatch):
    compose_worker = _services()["worker"]
    compose_timeout = _compose_settings(monkeypatch).graceful_shutdown_timeout
    assert timedelta(seconds=_seconds(compose_worker["stop_grace_period"])) == STOP_GRACE > compose_timeout

    pod = _kind(KUBERNETES / "worker-deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    configmap = _kind(KUBERNETES / "worker-configmap.yaml", "ConfigMap")
    kubernetes_timeout = _settings(configmap["data"]["config.toml"], monkeypatch).graceful_shutdown_timeout
    assert timedelta(seconds=pod["terminationGracePeriodSeconds"]) == STOP_GRACE > kubernetes_timeout

    default_timeout = Settings.model_fields["graceful_shutdown_timeout"].default
    assert timedelta(seconds=_seconds(_unit_value(WORKER_UNIT, "TimeoutStopSec"))) == STOP_GRACE > default_timeout
    assert _unit_value(WORKER_UNIT, "KillSignal") == "SIGTERM"


def test_kubernetes_worker_probes_ask_healthz_on_the_port_it_serves(monkeypatch: pytest.MonkeyPatch):
    pod = _kind(KUBERNETES / "worker-deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    configmap = _kind(KUBERNETES / "worker-configmap.yaml", "ConfigMap")
    settings = _settings(configmap["data"]["config.toml"], monkeypatch)
    # The kubelet asks from the node: the worker must listen on every interface of the pod.
    assert settings.health_bind_address == "0.0.0.0:8481"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz" and ports[get["port"]] == 8481, probe
    # Patient: a restart cannot end a Temporal outage.
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 300

    ingest = _kind(KUBERNETES / "ingest-deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    (ingest_container,) = ingest["containers"]
    for probe in ("livenessProbe", "readinessProbe"):
        get = ingest_container[probe]["httpGet"]
        assert get == {"scheme": "HTTPS", "path": "/healthz", "port": "https"}, probe
    liveness = ingest_container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 300


def test_the_worker_keeps_nothing_on_disk():
    assert not _unit_values(WORKER_UNIT, "StateDirectory") and not _unit_values(WORKER_UNIT, "ReadWritePaths")
    pod = _kind(KUBERNETES / "worker-deployment.yaml", "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(volumes) == {"config", "tmp"} and "emptyDir" in volumes["tmp"]
    (container,) = pod["containers"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/etc/autorepair", "/tmp"}


def _deploy_text_files() -> Iterator[Path]:
    """Every file of deploy/ that configures something: not the READMEs, which may tell what was removed."""
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and path.suffix != ".md":
            try:
                path.read_text()
            except UnicodeDecodeError:
                continue
            yield path


def test_no_outbox_on_disk_anywhere_under_deploy():
    """Events a sink refused wait in Temporal: no outbox directory, volume, state directory or setting for one."""
    on_disk = re.compile(
        r"webhook_outbox|outbox_dir"  # the setting
        r"|(?<![\w.])/(?:[\w.-]+/)*[\w.-]*outbox(?![\w.]*\.py)"  # an absolute path (not workflows/event_outbox.py)
        r"|(?:StateDirectory|ReadWritePaths|CacheDirectory)=.*outbox"  # systemd's state for one
        r"|name:\s*[\w-]*outbox|^\s*[\w-]*outbox[\w-]*:\s*$",  # a volume for one (compose, Kubernetes)
        re.IGNORECASE,
    )
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _deploy_text_files()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if on_disk.search(line)
    ]
    assert found == []


# --- the probe's install script -------------------------------------------------------------------------------


def test_install_probe_script_pins_this_version_and_parses():
    assert _script_setting("AUTOREPAIR_VERSION") == VERSION
    text = INSTALL_PROBE.read_text()
    assert text.startswith("#!/bin/bash\n") and "\nset -euo pipefail\n" in text
    assert '"gpu-autorepair[probe]==$AUTOREPAIR_VERSION"' in text
    assert INSTALL_PROBE.stat().st_mode & stat.S_IXUSR
    parsed = subprocess.run(["bash", "-n", str(INSTALL_PROBE)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr


def test_install_probe_script_is_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck is not None, "shellcheck is not installed: `make test` installs Debian's shellcheck"
    checked = subprocess.run([shellcheck, str(INSTALL_PROBE)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout


def test_install_probe_script_installs_the_shipped_unit():
    """User data cannot read the repository: the script carries the unit, which must stay the one shipped."""
    embedded = re.search(r"<<'UNIT'\n(.*?)^UNIT$", INSTALL_PROBE.read_text(), flags=re.DOTALL | re.MULTILINE)
    assert embedded and embedded.group(1) == PROBE_UNIT.read_text()


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _sandboxed_script(tmp_path: Path, **settings: str) -> tuple[Path, dict[str, str]]:
    """install-probe.sh with its paths under tmp_path, its settings changed, and stubs for what a test machine must
    not run: systemctl, the instance metadata (curl), root (id), and the venv (a python whose `-m venv` makes a
    stand-in: the real interpreter, a pip that records what it installs, an autorepair that says that version)."""
    root, bin_dir, stand_in, log = tmp_path / "root", tmp_path / "bin", tmp_path / "venv", tmp_path / "calls.log"
    for folder in (bin_dir, stand_in, root / "etc/systemd/system"):
        folder.mkdir(parents=True)
    text = INSTALL_PROBE.read_text()
    for name, value in {
        "PREFIX": str(root / "opt/gpu-autorepair"),
        "CONF_DIR": str(root / "etc/autorepair"),
        "UNIT_FILE": str(root / "etc/systemd/system/autorepair-probe.service"),
    }.items():
        text, count = re.subn(rf"^{name}=.*$", f"{name}={value}", text, flags=re.MULTILINE)
        assert count == 1, name
    for name, value in settings.items():
        text, count = re.subn(rf'^{name}=".*"$', f'{name}="{value}"', text, flags=re.MULTILINE)
        assert count == 1, name
    script = tmp_path / "install-probe.sh"
    script.write_text(text)

    _stub(bin_dir / "id", "echo 0\n")
    _stub(bin_dir / "systemctl", f'echo "systemctl $*" >>{log}\n')
    _stub(
        bin_dir / "curl",
        'case "$*" in\n'
        "  *api/token*) echo token ;;\n"
        '  *tags/instance/gpu-autorepair:group*) [ -n "${IMDS_GROUP:-}" ] || exit 22; echo "$IMDS_GROUP" ;;\n'
        "  *) exit 22 ;;\n"
        "esac\n",
    )
    _stub(stand_in / "pip", f'echo "pip $*" >>{log}\necho "${{@: -1}}" | sed "s/.*==//" >"$(dirname "$0")/version"\n')
    _stub(stand_in / "autorepair", 'echo "autorepair $(cat "$(dirname "$0")/version")"\n')
    _stub(
        bin_dir / "python3.13",
        'if [ "$1" = -m ] && [ "$2" = venv ]; then\n'
        f'  echo "venv $3" >>{log}\n'
        f'  mkdir -p "$3/bin" && ln -s {sys.executable} "$3/bin/python"\n'
        f'  cp {stand_in}/pip {stand_in}/autorepair "$3/bin/"\n'
        "  exit\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n',
    )
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path), "LC_ALL": "C"}
    return script, env


def _run(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)


def test_install_probe_script_installs_enables_and_starts_the_probe_idempotently(tmp_path: Path):
    script, env = _sandboxed_script(tmp_path, PROBE_ARGS="--journald --policy nvidia-catalog")
    env["IMDS_GROUP"] = "p5-training"  # GROUP is empty: the instance's own tag
    root, log = tmp_path / "root", tmp_path / "calls.log"
    first = _run(script, env)
    assert first.returncode == 0, first.stderr + first.stdout
    assert f"autorepair {VERSION} in " in first.stdout
    env_file = (root / "etc/autorepair/autorepair.env").read_text().splitlines()
    assert env_file[1:] == [
        "AUTOREPAIR_PROBE_GROUP=p5-training",
        f"AUTOREPAIR_PROBE_INGEST=https://{INGEST_HOST}:{INGEST_PORT}",
        "AUTOREPAIR_PROBE_ARGS=--journald --policy nvidia-catalog",
        "AWS_REGION=us-east-1",
    ]
    assert stat.S_IMODE((root / "etc/autorepair/autorepair.env").stat().st_mode) == 0o640
    assert (root / "etc/systemd/system/autorepair-probe.service").read_text() == PROBE_UNIT.read_text()
    calls = log.read_text().splitlines()
    assert calls == [
        f"venv {root}/opt/gpu-autorepair",
        f"pip install --disable-pip-version-check --no-input --quiet --prefer-binary gpu-autorepair[probe]=={VERSION}",
        "systemctl daemon-reload",
        "systemctl enable autorepair-probe.service",
        "systemctl restart --no-block autorepair-probe.service",
    ]
    # Again: the same files, the venv kept, the service restarted on what is installed.
    log.write_text("")
    second = _run(script, env)
    assert second.returncode == 0, second.stderr
    assert (root / "etc/autorepair/autorepair.env").read_text().splitlines() == env_file
    assert [c for c in log.read_text().splitlines() if c.startswith(("venv", "systemctl restart"))] == [
        "systemctl restart --no-block autorepair-probe.service"
    ]


def test_install_probe_script_trusts_a_private_ca_and_refuses_what_cannot_work(tmp_path: Path):
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
    script, env = _sandboxed_script(tmp_path, GROUP="g6-inference", INGEST_CA_PEM=pem)
    done = _run(script, env)
    assert done.returncode == 0, done.stderr
    conf = tmp_path / "root/etc/autorepair"
    assert (conf / "ingest-ca.pem").read_text() == pem + "\n"
    assert f"SSL_CERT_FILE={conf}/ingest-ca.pem" in (conf / "autorepair.env").read_text().splitlines()

    # No group given and no tag in the instance metadata.
    script, env = _sandboxed_script(tmp_path / "no-group")
    refused = _run(script, env)
    assert refused.returncode == 1 and "no gpu-autorepair:group tag" in refused.stderr
    # Plain HTTP: the probe refuses it off loopback, so the install does too, before touching anything.
    script, env = _sandboxed_script(tmp_path / "http", GROUP="g", INGEST_URL=f"http://{INGEST_HOST}:{INGEST_PORT}")
    refused = _run(script, env)
    assert refused.returncode == 1 and "is not an https:// URL" in refused.stderr
    assert not (tmp_path / "http/root/opt").exists()


def test_install_probe_script_lets_the_probe_ask_docker_where_the_host_has_its_group(tmp_path: Path):
    """The CONTAINER_RUNTIME check as deployed: a drop-in adds the docker group to the shipped unit only where the
    group exists (a unit naming a missing group does not start), and RUNTIME_SOCKET_GROUP="" takes it away again."""
    script, env = _sandboxed_script(tmp_path, GROUP="g")
    _stub(tmp_path / "bin" / "getent", '[ "$1 $2" = "group docker" ] && echo "docker:x:992:" || exit 2\n')
    drop_in = tmp_path / "root/etc/systemd/system/autorepair-probe.service.d/runtime-socket.conf"
    done = _run(script, env)
    assert done.returncode == 0, done.stderr
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.read_string(drop_in.read_text())
    assert dict(parser["Service"]) == {"supplementarygroups": "docker"}
    assert "the probe joins group docker" in done.stdout
    # The shipped unit itself is unchanged: it still names only the journal's group.
    assert (tmp_path / "root/etc/systemd/system/autorepair-probe.service").read_text() == PROBE_UNIT.read_text()

    # A host without that group: no drop-in (and none left from before).
    script, env = _sandboxed_script(tmp_path / "none", GROUP="g", RUNTIME_SOCKET_GROUP="runtime-users")
    _stub(tmp_path / "none" / "bin" / "getent", '[ "$1 $2" = "group docker" ] && echo "docker:x:992:" || exit 2\n')
    assert _run(script, env).returncode == 0
    assert not (tmp_path / "none/root/etc/systemd/system/autorepair-probe.service.d/runtime-socket.conf").exists()
    # Left out on purpose: the drop-in goes.
    script, env = _sandboxed_script(tmp_path / "again", GROUP="g", RUNTIME_SOCKET_GROUP="")
    again = tmp_path / "again/root/etc/systemd/system/autorepair-probe.service.d"
    again.mkdir(parents=True)
    (again / "runtime-socket.conf").write_text("[Service]\nSupplementaryGroups=docker\n")
    assert _run(script, env).returncode == 0
    assert not (again / "runtime-socket.conf").exists()
