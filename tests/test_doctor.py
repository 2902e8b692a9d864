"""`autorepair doctor` against the real servers: moto (behind the fault-injecting proxy, which plays IAM's policy
simulator), the Temporal dev server and a real ingest serving TLS. A good setup passes every check; then each seeded
failure is its own FAIL line, with its fix, and a non-zero exit, while the checks it does not touch still pass.

The doctor runs as `python -m operator_cli.main doctor`, as an operator runs it (tests/test_ops_cli.py's way), with
the worker's settings in its environment and the credentials of an assumed role, as the worker has them."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from google.protobuf.duration_pb2 import Duration
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client

from activities.permissions import EVENTS_ACTIONS, actions_needed, every_action
from contract import search_attributes
from contract.config import IngestSettings
from contract.groups import CapacityGroup, Remediation
from ingest.cli import running_ingest
from operator_cli import exit_codes
from operator_cli.doctor_iam import principal_of
from operator_cli.doctor_ingest import healthz_url
from operator_cli.healthcheck import check as healthcheck
from simulator.aws_proxy import FlakyAws
from simulator.policy_simulation import PolicySimulation
from simulator.servers import free_port
from tests.harness import eventually, make_settings, unique
from tests.test_ops_cli import autorepair, cli_env
from worker.settings import Settings

ACCOUNT = "123456789012"
ROLE_PATH = "/gpu-autorepair/"


# --- a CA, and the ingest's certificate it signs ------------------------------------------------------------------


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _certificate(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, signer: ec.EllipticCurvePrivateKey, *, ca: bool
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Pki:
    ca: Path  # signed the ingest's certificate
    other_ca: Path  # did not
    cert: Path
    key: Path


def make_pki(folder: Path) -> Pki:
    folder.mkdir()
    ca_key, other_key, key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    paths = Pki(folder / "ca.pem", folder / "other-ca.pem", folder / "ingest.crt", folder / "ingest.key")
    paths.ca.write_bytes(_pem(_certificate("doctor test CA", ca_key, "doctor test CA", ca_key, ca=True)))
    paths.other_ca.write_bytes(_pem(_certificate("another CA", other_key, "another CA", other_key, ca=True)))
    paths.cert.write_bytes(_pem(_certificate("127.0.0.1", key, "doctor test CA", ca_key, ca=False)))
    paths.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


# --- the world a good setup names ----------------------------------------------------------------------------------


@dataclass
class World:
    settings: Settings
    proxy: FlakyAws
    ingest_url: str
    pki: Pki
    role_arn: str
    credentials: dict[str, str]
    simulation: PolicySimulation
    launch_template: str
    subnet: str

    def env(self, settings: Settings | None = None) -> dict[str, str]:
        settings = settings or self.settings
        env = cli_env(settings) | self.credentials
        env.pop("AUTOREPAIR_CONFIG", None)
        env["AUTOREPAIR_EVENTS__BUS_NAME"] = settings.events.bus_name
        return env

    def with_group(self, index: int, **changes: Any) -> Settings:
        groups = list(self.settings.groups)
        groups[index] = groups[index].model_copy(update=changes)
        return self.settings.model_copy(update={"groups": groups})


def _moto(service: str, endpoint: str) -> Any:
    return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1")  # type: ignore[call-overload]


def _aws_world(endpoint: str, name: str) -> dict[str, str]:
    """What the good setup's settings name, created in moto: two clusters, a launch template, an Auto Scaling group,
    a subnet, an event bus, an evidence bucket, and the worker's role, assumed."""
    ecs, ec2 = _moto("ecs", endpoint), _moto("ec2", endpoint)
    for cluster in (f"{name}-lt", f"{name}-asg"):
        ecs.create_cluster(clusterName=cluster)
    ecs.register_task_definition(
        family=f"{name}-probe", containerDefinitions=[{"name": "p", "image": "p", "memory": 64}]
    )
    ecs.create_service(
        cluster=f"{name}-lt", serviceName="gpu-probe", taskDefinition=f"{name}-probe", schedulingStrategy="DAEMON"
    )
    template = f"{name}-gpu-node"
    ec2.create_launch_template(LaunchTemplateName=template, LaunchTemplateData={"InstanceType": "p5.48xlarge"})
    vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.42.1.0/24", AvailabilityZone="us-east-1a")["Subnet"]
    _moto("autoscaling", endpoint).create_auto_scaling_group(
        AutoScalingGroupName=f"{name}-asg",
        LaunchTemplate={"LaunchTemplateName": template, "Version": "$Latest"},
        MinSize=0,
        MaxSize=2,
        DesiredCapacity=0,
        AvailabilityZones=["us-east-1a"],
    )
    # The Auto Scaling group backs a capacity provider of its group's cluster, as in an ECS fleet run by capacity
    # providers; the launch template group's cluster has none.
    asg_arn = _moto("autoscaling", endpoint).describe_auto_scaling_groups(AutoScalingGroupNames=[f"{name}-asg"])[
        "AutoScalingGroups"
    ][0]["AutoScalingGroupARN"]
    ecs.create_capacity_provider(name=f"{name}-cp", autoScalingGroupProvider={"autoScalingGroupArn": asg_arn})
    ecs.put_cluster_capacity_providers(
        cluster=f"{name}-asg", capacityProviders=[f"{name}-cp"], defaultCapacityProviderStrategy=[]
    )
    _moto("events", endpoint).create_event_bus(Name=f"{name}-bus")
    _moto("s3", endpoint).create_bucket(Bucket=f"{name}-evidence")
    iam = _moto("iam", endpoint)
    task = {"Effect": "Allow", "Principal": {"Service": "ecs-tasks.amazonaws.com"}, "Action": "sts:AssumeRole"}
    trust = {"Version": "2012-10-17", "Statement": [task]}
    role = iam.create_role(RoleName=f"{name}-worker", Path=ROLE_PATH, AssumeRolePolicyDocument=json.dumps(trust))
    assumed = _moto("sts", endpoint).assume_role(RoleArn=role["Role"]["Arn"], RoleSessionName="worker-task")
    return {
        "template": template,
        "subnet": subnet["SubnetId"],
        "role_arn": role["Role"]["Arn"],
        "AWS_ACCESS_KEY_ID": assumed["Credentials"]["AccessKeyId"],
        "AWS_SECRET_ACCESS_KEY": assumed["Credentials"]["SecretAccessKey"],
        "AWS_SESSION_TOKEN": assumed["Credentials"]["SessionToken"],
    }


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("doctor") / "pki")


@pytest.fixture
def proxy(aws_env: str) -> Iterator[FlakyAws]:
    with FlakyAws(aws_env) as flaky:
        yield flaky


@pytest.fixture
async def world(client: Client, aws_env: str, proxy: FlakyAws, pki: Pki, tmp_path: Path) -> AsyncIterator[World]:
    name = unique("doc")
    made = _aws_world(aws_env, name)
    settings = make_settings(client, proxy.url, tmp_path / "events.jsonl", group=f"{name}-lt", cluster=f"{name}-lt")
    by_template = settings.groups[0].model_copy(
        update={
            "launch_template": made["template"],
            "subnets": [made["subnet"]],
            "allow_other_azs": True,
            "evidence_bucket": f"{name}-evidence",
            "remediation": Remediation.REBOOT_FIRST,
            "daemon_services": ["gpu-probe"],
        }
    )
    by_asg = CapacityGroup(name=f"{name}-asg", cluster=f"{name}-asg", auto_scaling_group=f"{name}-asg")
    settings = settings.model_copy(
        update={
            "groups": [by_template, by_asg],
            "events": settings.events.model_copy(update={"bus_name": f"{name}-bus", "eventbridge": True}),
            "ingest": IngestSettings(tls_cert=pki.cert, tls_key=pki.key),
        }
    )
    simulation = proxy.simulate_policy()
    async with running_ingest(settings, client, bind=f"127.0.0.1:{free_port()}", metrics_bind="off") as url:
        # Its /healthz answers 200 once it has heard Temporal answer.
        await eventually(lambda: _healthy(healthz_url(url)), lambda answer: answer[0], within=60, every=0.2)
        credentials = {k: v for k, v in made.items() if k.startswith("AWS_")}
        yield World(
            settings, proxy, url, pki, made["role_arn"], credentials, simulation, made["template"], made["subnet"]
        )


async def _healthy(url: str) -> tuple[bool, str]:
    # On a thread: the ingest answering it runs on this event loop.
    return await asyncio.to_thread(healthcheck, url, 5.0, insecure=True)


async def doctor(world: World, *args: str, settings: Settings | None = None) -> tuple[int, list[dict[str, str]]]:
    env = world.env(settings)
    ingest = ["--ingest", world.ingest_url, "--ingest-ca", str(world.pki.ca)]
    code, out, err = await autorepair(env, "doctor", *ingest, *args, "-o", "json")
    assert "Traceback" not in err, err
    return code, json.loads(out)


def by_check(findings: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    return {finding["check"]: finding for finding in findings}


def failing(findings: list[dict[str, str]]) -> list[str]:
    return [finding["check"] for finding in findings if finding["status"] == "FAIL"]


# --- a good setup --------------------------------------------------------------------------------------------------


async def test_a_good_setup_passes_every_check_it_can_make(world: World) -> None:
    code, findings = await doctor(world)
    lt, asg = (group.name for group in world.settings.groups)
    statuses = {finding["check"]: finding["status"] for finding in findings}
    assert statuses == {
        "temporal": "PASS",
        "temporal namespace": "PASS",
        "search attributes": "PASS",
        "capacity groups": "PASS",
        "aws credentials": "PASS",
        f"group {lt}: ecs cluster": "PASS",
        f"group {asg}: ecs cluster": "PASS",
        f"group {lt}: launch template": "PASS",
        f"group {asg}: launch template": "SKIP",
        f"group {lt}: auto scaling group": "SKIP",
        f"group {asg}: auto scaling group": "PASS",
        f"group {lt}: capacity provider": "SKIP",
        f"group {asg}: capacity provider": "PASS",
        f"group {lt}: subnets": "PASS",
        f"group {asg}: subnets": "SKIP",
        f"group {lt}: evidence bucket": "PASS",
        f"group {asg}: evidence bucket": "SKIP",
        f"group {lt}: daemon services": "PASS",
        f"group {asg}: daemon services": "SKIP",
        "event bus": "PASS",
        "worker iam": "PASS",
        "ingest": "PASS",
    }, findings
    assert code == exit_codes.OK
    assert all(set(finding) == {"check", "status", "detail", "fix"} for finding in findings)
    assert all(finding["fix"] == "" for finding in findings)
    found = by_check(findings)
    assert f"assumed-role/{world.role_arn.rsplit('/', 1)[-1]}/worker-task" in found["aws credentials"]["detail"]
    assert f"{world.subnet} in us-east-1a" in found[f"group {lt}: subnets"]["detail"]

    # The simulation asked IAM about the worker's role itself (its path found through iam:GetRole), for exactly what
    # its groups need: a reboot-first launch template group with an evidence bucket, an Auto Scaling group group.
    (asked,) = world.simulation.asked
    assert asked[0] == world.role_arn and ROLE_PATH in asked[0]
    needed = actions_needed(world.settings.groups, world.settings.events)
    assert asked[1] == list(needed)
    for action in (
        "ec2:RunInstances",
        "ec2:RebootInstances",
        "s3:PutObject",
        "autoscaling:DetachInstances",
        "ecs:DescribeServices",
    ):
        assert action in needed
    assert not {"ec2:StopInstances", "ec2:DeleteTags"} & set(needed)  # no group quarantines

    # The same report as text: one line per check, its status first, then the count.
    code, out, err = await autorepair(
        world.env(), "doctor", "--ingest", world.ingest_url, "--ingest-ca", str(world.pki.ca)
    )
    assert code == exit_codes.OK, err
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == [finding["status"] for finding in findings]
    assert lines[-1] == "16 passed, 0 failed, 6 skipped"


# --- each seeded failure: its own line, its fix, a non-zero exit ---------------------------------------------------


def only_failure(code: int, findings: list[dict[str, str]], check: str) -> dict[str, str]:
    """The one FAIL of the report, which must be `check`; the exit status says it failed."""
    assert failing(findings) == [check], findings
    assert code == exit_codes.FAILED
    found = by_check(findings)[check]
    assert found["fix"], found
    return found


async def test_a_missing_cluster(world: World) -> None:
    group = world.settings.groups[0]
    code, findings = await doctor(world, settings=world.with_group(0, cluster="no-such-cluster"))
    found = only_failure(code, findings, f"group {group.name}: ecs cluster")
    assert found["detail"] == "no ECS cluster 'no-such-cluster' in us-east-1"
    assert (
        "create the ECS cluster 'no-such-cluster' in us-east-1, or name an existing one in groups[0].cluster"
        in (found["fix"])
    )


async def test_an_auto_scaling_group_that_backs_no_capacity_provider_of_its_cluster(world: World) -> None:
    lt, asg = world.settings.groups
    # Both exist, but they do not belong together: the launch template group's cluster has no capacity provider.
    code, findings = await doctor(world, settings=world.with_group(1, cluster=lt.cluster))
    found = only_failure(code, findings, f"group {asg.name}: capacity provider")
    assert found["detail"] == (
        f"no capacity provider of ECS cluster {lt.cluster!r} is backed by Auto Scaling group "
        f"{asg.auto_scaling_group!r} (the cluster's: none)"
    )
    assert "groups[1].cluster or groups[1].auto_scaling_group" in found["fix"]
    code, findings = await doctor(world)
    assert (
        f"capacity provider '{asg.name.removesuffix('-asg')}-cp'"
        in by_check(findings)[f"group {asg.name}: capacity provider"]["detail"]
    )


async def test_a_launch_template_name_typo(world: World) -> None:
    group = world.settings.groups[0]
    typo = world.launch_template[:-1]
    code, findings = await doctor(world, settings=world.with_group(0, launch_template=typo))
    found = only_failure(code, findings, f"group {group.name}: launch template")
    assert found["detail"] == f"no launch template {typo!r} in us-east-1"
    assert found["fix"].startswith(f"did you mean {world.launch_template!r}? set groups[0].launch_template")


async def test_a_missing_subnet(world: World) -> None:
    group = world.settings.groups[0]
    gone = "subnet-0000000000000dead"
    code, findings = await doctor(world, settings=world.with_group(0, subnets=[world.subnet, gone]))
    found = only_failure(code, findings, f"group {group.name}: subnets")
    assert found["detail"] == f"no subnet {gone} in us-east-1"
    assert "groups[0].subnets" in found["fix"]


async def test_a_daemon_service_typo(world: World) -> None:
    group = world.settings.groups[0]
    code, findings = await doctor(world, settings=world.with_group(0, daemon_services=["gpu-probe", "gpu-prbe"]))
    found = only_failure(code, findings, f"group {group.name}: daemon services")
    assert found["detail"] == f"in ECS cluster {group.cluster!r}: gpu-prbe not found (MISSING)"
    assert "groups[0].daemon_services" in found["fix"]


async def test_a_missing_event_bus(world: World) -> None:
    events = world.settings.events.model_copy(update={"bus_name": "no-such-bus"})
    code, findings = await doctor(world, settings=world.settings.model_copy(update={"events": events}))
    found = only_failure(code, findings, "event bus")
    assert found["detail"] == "no EventBridge bus 'no-such-bus' in us-east-1"
    assert "aws events create-event-bus --name no-such-bus" in found["fix"]


async def test_a_denied_iam_action(world: World) -> None:
    world.proxy.simulate_policy(denied={"ec2:RunInstances", "s3:PutObject"})
    code, findings = await doctor(world)
    found = only_failure(code, findings, "worker iam")
    assert found["detail"] == (
        f"{world.role_arn} may not call ec2:RunInstances (launch replacements from the launch template); "
        "s3:PutObject (keep the evidence (evidence_bucket))"
    )
    assert "deploy/iam/worker-policy.json" in found["fix"]


async def test_what_the_credentials_may_not_look_at_is_skipped_not_failed(world: World) -> None:
    # The worker's own policy has no iam:SimulatePrincipalPolicy, ecs:DescribeClusters or events:DescribeEventBus.
    world.proxy.fail("SimulatePrincipalPolicy", "AccessDenied", message="not authorized")
    world.proxy.fail("DescribeClusters", "AccessDeniedException", message="not authorized")
    world.proxy.fail("DescribeEventBus", "AccessDeniedException", message="not authorized")
    code, findings = await doctor(world)
    assert code == exit_codes.OK and failing(findings) == []
    found = by_check(findings)
    refused = found["worker iam"]
    assert refused["status"] == "SKIP" and "may not call iam:SimulatePrincipalPolicy" in refused["detail"]
    assert found["event bus"]["status"] == "SKIP" and "events:DescribeEventBus" in found["event bus"]["detail"]
    # The cluster is still looked at, through a call the worker does make.
    group = world.settings.groups[0]
    assert found[f"group {group.name}: ecs cluster"] == {
        "check": f"group {group.name}: ecs cluster",
        "status": "PASS",
        "detail": f"ECS cluster {group.cluster!r} answers",
        "fix": "",
    }
    assert world.proxy.calls("ListContainerInstances") >= 2

    # moto itself has no policy simulator: what an endpoint without one answers.
    world.proxy.heal()
    code, findings = await doctor(world)
    assert code == exit_codes.OK and failing(findings) == []
    unsupported = by_check(findings)["worker iam"]
    assert unsupported["status"] == "SKIP" and "does not simulate policies" in unsupported["detail"]


async def test_temporal_unreachable(world: World) -> None:
    address = f"127.0.0.1:{free_port()}"
    code, findings = await doctor(world, "--address", address)
    found = only_failure(code, findings, "temporal")
    assert found["detail"].startswith(f"cannot reach Temporal at {address}")
    assert "--address" in found["fix"]
    statuses = {f["check"]: f["status"] for f in findings}
    assert statuses["temporal namespace"] == statuses["search attributes"] == "SKIP"
    assert statuses["aws credentials"] == statuses["event bus"] == "PASS"


async def test_a_missing_namespace(world: World) -> None:
    namespace = unique("no-such-namespace")
    code, findings = await doctor(world, "-n", namespace)
    found = only_failure(code, findings, "temporal namespace")
    assert found["detail"].startswith(f"no namespace {namespace!r}")
    assert f"temporal operator namespace create --namespace {namespace}" in found["fix"]
    assert by_check(findings)["search attributes"]["status"] == "SKIP"


async def test_missing_search_attributes_and_setup_fixes_them(world: World, client: Client) -> None:
    namespace = unique("fresh")
    await client.workflow_service.register_namespace(
        RegisterNamespaceRequest(namespace=namespace, workflow_execution_retention_period=Duration(seconds=86400))
    )
    await eventually(
        lambda: client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace)),
        lambda answer: answer is not None,
        within=60,
    )
    code, findings = await doctor(world, "-n", namespace)
    found = only_failure(code, findings, "search attributes")
    for key in search_attributes.ALL:
        assert key.name in found["detail"]
    assert "autorepair setup" in found["fix"]

    # The fix it names works: `autorepair setup` for that namespace (its -n, as every Temporal command takes), and the
    # check passes; said as JSON, it added every one of ours, and a second run adds none.
    names = sorted(key.name for key in search_attributes.ALL)
    for added in (names, []):
        code, out, err = await autorepair(world.env(), "setup", "-n", namespace, "-o", "json")
        assert code == exit_codes.OK, err
        assert json.loads(out) == {"namespace": namespace, "added": added, "registered": names}
    code, findings = await doctor(world, "-n", namespace)
    assert code == exit_codes.OK and by_check(findings)["search attributes"]["status"] == "PASS", findings


async def test_an_ingest_certificate_that_does_not_verify(world: World) -> None:
    code, findings = await doctor(world, "--ingest-ca", str(world.pki.other_ca))
    found = only_failure(code, findings, "ingest")
    assert found["detail"].startswith(f"{healthz_url(world.ingest_url)}: its certificate does not verify against")
    assert "--ingest-ca" in found["fix"]


# --- the parts, directly -------------------------------------------------------------------------------------------


def test_the_principal_of_each_kind_of_caller() -> None:
    assert principal_of(f"arn:aws:sts::{ACCOUNT}:assumed-role/gpu-autorepair-worker/1f2e3d") == (
        f"arn:aws:iam::{ACCOUNT}:role/gpu-autorepair-worker"
    )
    assert (
        principal_of(f"arn:aws-cn:sts::{ACCOUNT}:assumed-role/worker/i-0abc")
        == f"arn:aws-cn:iam::{ACCOUNT}:role/worker"
    )
    assert principal_of(f"arn:aws:iam::{ACCOUNT}:user/ops/alice") == f"arn:aws:iam::{ACCOUNT}:user/ops/alice"
    assert principal_of(f"arn:aws:iam::{ACCOUNT}:root") is None
    assert principal_of(f"arn:aws:sts::{ACCOUNT}:federated-user/bob") is None


def test_a_group_needs_only_what_its_settings_use() -> None:
    plain = CapacityGroup(name="g", cluster="c", launch_template="lt", gate_diag_level=0)
    replace_only = actions_needed([plain], Settings().events.model_copy(update={"eventbridge": False}))
    assert "ec2:RunInstances" in replace_only and "iam:PassRole" in replace_only
    assert not {"ec2:RebootInstances", "ssm:SendCommand", "s3:PutObject", "autoscaling:DetachInstances"} & set(
        replace_only
    )
    assert not set(EVENTS_ACTIONS) & set(replace_only)
    everything = plain.model_copy(
        update={"remediation": Remediation.REBOOT_FIRST, "gpu_reset": True, "quarantine": True, "evidence_bucket": "b"}
    )
    assert set(actions_needed([everything], Settings().events)) >= {
        "ec2:RebootInstances",
        "ssm:SendCommand",
        "ec2:StopInstances",
        "s3:GetObject",
        *EVENTS_ACTIONS,
    }
    assert set(actions_needed([everything], Settings().events)) <= every_action()
