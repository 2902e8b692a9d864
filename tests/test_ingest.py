"""The ingest end to end: real hosts' identities from moto's STS (an assumed role whose session name is an EC2
instance id launched in moto), the real ingest over HTTP on 127.0.0.1, an in-process worker on the Temporal dev
server. A host reports about itself only, in its own group only, at its own rate; nothing refused reaches Temporal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pytest
from botocore.credentials import ReadOnlyCredentials
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from contract.config import IngestSettings
from contract.groups import AutoRepair
from contract.health import HealthState
from contract.ids import health_workflow_id
from contract.ingest import FINDINGS_PATH, HEALTH_PATH, HEARTBEATS_PATH, MAX_REPORT_BYTES, METRICS_PATH, PROOF_HEADER
from contract.names import GROUP_TAG, QUERY_HEALTH
from contract.probe import GpuFinding, Heartbeat
from ingest.cli import build_ingest, serving, serving_metrics
from ingest.server import Ingest, build_app
from node_probe.classify.manual import manual_findings, records_from_text, xid_line
from node_probe.classify.policy import Policy
from node_probe.delivery.ingest_reporter import IngestReporter
from node_probe.delivery.proof import sign_proof
from node_probe.delivery.reporter import Reporter
from node_probe.probe import Probe, ProbeConfig
from simulator.servers import free_port
from tests.harness import eventually, make_settings, running_worker, unique
from tests.prometheus_text import scrape, total
from worker.settings import Settings
from workflows.models import InstanceHealthView

ACCOUNT = "123456789012"  # moto's
AMI = "ami-12c6146b"  # one of moto's built-in AMIs
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Host:
    instance_id: str
    credentials: ReadOnlyCredentials


@dataclass
class Stack:
    client: Client
    moto: str
    settings: Settings
    role_arn: str
    _clients: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    @property
    def group(self) -> str:
        return self.settings.groups[0].name

    def aws(self, service: str) -> Any:
        # One client per service for the test: building one costs tens of milliseconds of CPU.
        if service not in self._clients:
            make: Any = boto3.client  # typed per literal service name; this one is chosen at run time
            self._clients[service] = make(service, endpoint_url=self.moto, region_name="us-east-1")
        return self._clients[service]

    def launch(self, *, group: str | None = None) -> Host:
        """An EC2 instance (tagged with `group` unless None) and its instance-profile credentials: an assumed
        role whose session name is the instance id, as EC2 hands them out."""
        tags = [{"ResourceType": "instance", "Tags": [{"Key": GROUP_TAG, "Value": group}]}] if group else []
        reservation = self.aws("ec2").run_instances(
            ImageId=AMI, InstanceType="p4d.24xlarge", MinCount=1, MaxCount=1, TagSpecifications=tags
        )
        instance_id = reservation["Instances"][0]["InstanceId"]
        creds = self.aws("sts").assume_role(RoleArn=self.role_arn, RoleSessionName=instance_id)["Credentials"]
        return Host(
            instance_id, ReadOnlyCredentials(creds["AccessKeyId"], creds["SecretAccessKey"], creds["SessionToken"])
        )

    def with_ingest(self, **ingest: Any) -> Settings:
        return self.settings.model_copy(
            update={"ingest": IngestSettings(sts_endpoint=self.moto, allowed_accounts=[ACCOUNT], **ingest)}
        )

    def reporter(self, url: str, host: Host) -> IngestReporter:
        return IngestReporter(
            url,
            ingest_id=self.settings.ingest.id,
            sts_endpoint=self.moto,
            region="us-east-1",
            credentials=lambda: host.credentials,
        )

    async def health(self, instance_id: str) -> InstanceHealthView:
        handle = self.client.get_workflow_handle(health_workflow_id(instance_id))
        return await handle.query(QUERY_HEALTH, result_type=InstanceHealthView)

    async def health_exists(self, instance_id: str) -> bool:
        try:
            await self.client.get_workflow_handle(health_workflow_id(instance_id)).describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True


@pytest.fixture(scope="module")
async def stack(
    temporal_env: WorkflowEnvironment, aws_env: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    client = temporal_env.client  # the `client` fixture's, for the whole module: one worker for every test
    settings = make_settings(
        client,
        aws_env,
        tmp_path_factory.mktemp("ingest") / "events.jsonl",
        group=unique("gpu"),
        cluster=unique("cluster"),
        # Monitor only: an impairing finding must show, not start a replacement.
        auto_repair=AutoRepair.DISABLED,
        heartbeat_loss_threshold=timedelta(minutes=10),
    )
    iam = boto3.client("iam", endpoint_url=aws_env, region_name="us-east-1")
    trust = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}],
    }
    role = iam.create_role(RoleName=unique("gpu-node"), AssumeRolePolicyDocument=json.dumps(trust))
    ready = Stack(client, aws_env, settings, role["Role"]["Arn"])
    ready.settings = ready.with_ingest()
    async with running_worker(ready.settings, client):
        yield ready


@contextlib.asynccontextmanager
async def running_ingest(
    stack: Stack, settings: Settings | None = None, port: int | None = None
) -> AsyncIterator[tuple[str, Ingest]]:
    port = port or free_port()
    async with aiohttp.ClientSession() as session:
        ingest = build_ingest(settings or stack.settings, Reporter(stack.client), session)
        async with serving(build_app(ingest), "127.0.0.1", port, None):
            yield f"http://127.0.0.1:{port}", ingest


def fast_probe(host: Host, stack: Stack, log: Path, tmp_path: Path, *, heartbeat_interval: timedelta) -> ProbeConfig:
    """A probe for `host` following `log`, polling and retrying at test speed, with a file spool."""
    return ProbeConfig(
        instance_id=host.instance_id,
        group=stack.group,
        kernel_log=log,
        spool_dir=tmp_path / "spool",
        poll_interval=timedelta(seconds=0.05),
        heartbeat_interval=heartbeat_interval,
        retry_max_backoff=timedelta(seconds=1),
    )


def finding_about(instance_id: str, group: str, xid: int = 79, pci: str = "0000:3b:00") -> GpuFinding:
    records = records_from_text(xid_line(xid, pci, by="test_ingest"))
    (finding,) = manual_findings(
        records, Policy("ecs"), instance_id=instance_id, group=group, source="test", now=datetime.now(UTC)
    )
    return finding


async def post(
    url: str, path: str, body: bytes, *, signer: Host | None, stack: Stack, proof_body: bytes | None = None
) -> tuple[int, dict[str, str], dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if signer is not None:
        headers[PROOF_HEADER] = sign_proof(
            body if proof_body is None else proof_body,
            ingest_id=stack.settings.ingest.id,
            sts_endpoint=stack.moto,
            region="us-east-1",
            credentials=signer.credentials,
        )
    async with aiohttp.ClientSession() as session, session.post(f"{url}{path}", data=body, headers=headers) as resp:
        text = await resp.text()
        return resp.status, dict(resp.headers), json.loads(text) if text.startswith("{") else {"text": text}


@contextlib.asynccontextmanager
async def ingest_metrics(ingest: Ingest) -> AsyncIterator[str]:
    """The ingest's metrics port as `autorepair ingest` serves it (never the hosts' port); yields its /metrics URL."""
    async with serving_metrics(ingest, f"127.0.0.1:{free_port()}") as health_url:
        assert health_url is not None
        yield health_url.replace(HEALTH_PATH, METRICS_PATH)


async def test_a_host_reporting_about_itself_is_relayed_to_its_health_workflow(stack: Stack) -> None:
    host = stack.launch(group=stack.group)
    finding = finding_about(host.instance_id, stack.group)
    async with running_ingest(stack) as (url, ingest), ingest_metrics(ingest) as metrics_url:
        async with stack.reporter(url, host) as reporter:
            await reporter.send_finding(finding, "the ingest's to choose")
            heartbeat = Heartbeat(instance_id=host.instance_id, group=stack.group, sent_at=datetime.now(UTC))
            await reporter.send_heartbeat(heartbeat, "ignored")
        view = await eventually(
            lambda: stack.health(host.instance_id),
            lambda v: finding.finding_id in {f.finding_id for f in v.recent_findings},
            within=60,
        )
        assert view.recent_findings[-1].reason == "XID_79"
        async with aiohttp.ClientSession() as session, session.get(f"{url}{HEALTH_PATH}") as resp:
            assert (resp.status, await resp.text()) == (200, "ok")
        samples = await scrape(metrics_url)
        assert total(samples, "autorepair_ingest_reports_relayed_total", kind="finding") == 1
        assert total(samples, "autorepair_ingest_reports_relayed_total", kind="heartbeat") == 1
        assert ingest.metrics.value("autorepair_ingest_reports_accepted_total", kind="finding") == 1


async def test_a_host_reporting_about_another_instance_is_refused_and_nothing_reaches_temporal(stack: Stack) -> None:
    me, other = stack.launch(group=stack.group), stack.launch(group=stack.group)
    forged = finding_about(other.instance_id, stack.group).model_dump_json().encode()
    async with running_ingest(stack) as (url, ingest):
        status, _, refusal = await post(url, FINDINGS_PATH, forged, signer=me, stack=stack)
        assert status == 403 and refusal["status"] == 403
        assert "a host reports only about itself" in refusal["reason"] and me.instance_id in refusal["reason"]
        # Through the probe's reporter too: it raises, so the probe would keep the finding spooled.
        async with stack.reporter(url, me) as reporter:
            with pytest.raises(Exception, match="only about itself"):
                await reporter.send_finding(GpuFinding.model_validate_json(forged), "q")
        assert ingest.metrics.value("autorepair_ingest_reports_refused_total", status="403", reason="not_self") == 2
        assert ingest.metrics.value("autorepair_ingest_reports_relayed_total", kind="finding") == 0
    assert not await stack.health_exists(other.instance_id)


async def test_unsigned_foreign_group_oversized_and_invalid_reports_are_refused(stack: Stack) -> None:
    member = stack.launch(group=stack.group)
    outsider = stack.launch(group=unique("other-group"))  # tagged for another group, not in this one's cluster
    untagged = stack.launch()  # no tag, but registered in the group's ECS cluster: a member
    ecs = stack.aws("ecs")
    ecs.create_cluster(clusterName=stack.settings.groups[0].cluster)
    ecs.register_container_instance(
        cluster=stack.settings.groups[0].cluster,
        instanceIdentityDocument=json.dumps({"instanceId": untagged.instance_id, "availabilityZone": "us-east-1a"}),
    )

    def body(host: Host, group: str | None = None) -> bytes:
        return finding_about(host.instance_id, group or stack.group).model_dump_json().encode()

    async with running_ingest(stack) as (url, ingest), ingest_metrics(ingest) as metrics_url:
        status, _, refusal = await post(url, FINDINGS_PATH, body(member), signer=None, stack=stack)
        assert (status, refusal["status"]) == (401, 401) and PROOF_HEADER in refusal["reason"]

        status, _, refusal = await post(url, FINDINGS_PATH, body(outsider), signer=outsider, stack=stack)
        assert status == 403 and f"not in group {stack.group}" in refusal["reason"]
        status, _, refusal = await post(url, FINDINGS_PATH, body(member, "no-such-group"), signer=member, stack=stack)
        assert status == 403 and "unknown group" in refusal["reason"]

        status, _, refusal = await post(url, FINDINGS_PATH, body(untagged), signer=untagged, stack=stack)
        assert status == 202, refusal

        oversized = b'{"x": "' + b"a" * MAX_REPORT_BYTES + b'"}'
        status, _, refusal = await post(url, FINDINGS_PATH, oversized, signer=member, stack=stack)
        assert status == 413 and str(MAX_REPORT_BYTES) in refusal["reason"]

        status, _, refusal = await post(url, FINDINGS_PATH, b"{not json", signer=member, stack=stack)
        assert status == 400 and "not a GpuFinding" in refusal["reason"]
        status, _, refusal = await post(url, HEARTBEATS_PATH, body(member), signer=member, stack=stack)
        assert status == 400 and "not a Heartbeat" in refusal["reason"]

        # A proof signed for another body proves nothing about this one.
        status, _, refusal = await post(
            url, FINDINGS_PATH, body(member), signer=member, stack=stack, proof_body=b"something else"
        )
        assert status == 403 and "another body" in refusal["reason"]

        samples = await scrape(metrics_url)
        for status_text, reason in [
            ("401", "unsigned"),
            ("403", "not_member"),
            ("413", "too_large"),
            ("400", "invalid"),
            ("403", "proof"),
        ]:
            assert total(samples, "autorepair_ingest_reports_refused_total", reason=reason, status=status_text) >= 1
        assert ingest.metrics.value("autorepair_ingest_reports_relayed_total", kind="finding") == 1
    for refused in (member, outsider):
        assert not await stack.health_exists(refused.instance_id)


@contextlib.contextmanager
def moto_tasks_stay_put(moto: str) -> Iterator[None]:
    """Tasks keep their lastStatus while described (moto moves one a step towards STOPPED on every DescribeTasks by
    default); the server-wide setting is put back afterwards."""
    base = f"{moto}/moto-api/state-manager"

    def set_transition(transition: dict[str, Any]) -> None:
        body = json.dumps({"model_name": "ecs::task", "transition": transition}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{base}/set-transition", data=body, method="POST")):
            pass

    with urllib.request.urlopen(f"{base}/get-transition?model_name=ecs::task") as resp:
        saved = json.loads(resp.read())
    set_transition({"progression": "manual", "times": 1_000_000_000})
    try:
        yield
    finally:
        set_transition(saved)


async def test_a_probe_in_an_ecs_task_speaks_for_its_container_instance_only(stack: Stack) -> None:
    """A task role's session name is the task id: the ingest resolves the task through ECS to its container
    instance's EC2 instance, which is then the one instance the task may report about."""
    cluster = stack.settings.groups[0].cluster
    host, other = stack.launch(), stack.launch(group=stack.group)  # `host` is a member by its ECS cluster only
    ecs = stack.aws("ecs")
    ecs.create_cluster(clusterName=cluster)
    document = {"instanceId": host.instance_id, "availabilityZone": "us-east-1a", "region": "us-east-1"}
    registered = ecs.register_container_instance(cluster=cluster, instanceIdentityDocument=json.dumps(document))
    family = unique("probe")
    ecs.register_task_definition(
        family=family,
        requiresCompatibilities=["EC2"],
        containerDefinitions=[{"name": "probe", "image": "gpu-autorepair", "cpu": 64, "memory": 128}],
    )

    def task_role(task_id: str) -> Host:
        """The task role's credentials, as ECS hands them to the task: an assumed role named after the task."""
        creds = stack.aws("sts").assume_role(RoleArn=stack.role_arn, RoleSessionName=task_id)["Credentials"]
        return Host(task_id, ReadOnlyCredentials(creds["AccessKeyId"], creds["SecretAccessKey"], creds["SessionToken"]))

    def start_task() -> str:
        started = ecs.start_task(
            cluster=cluster,
            taskDefinition=family,
            containerInstances=[registered["containerInstance"]["containerInstanceArn"]],
        )
        return str(started["tasks"][0]["taskArn"]).rpartition("/")[2]

    with moto_tasks_stay_put(stack.moto):
        task = task_role(start_task())
        stopped_id = start_task()
        ecs.stop_task(cluster=cluster, task=stopped_id, reason="done")
        stopped = task_role(stopped_id)
        nowhere = task_role(uuid.uuid4().hex)  # ECS's own shape of task id, run by no cluster
        mine = finding_about(host.instance_id, stack.group)
        async with running_ingest(stack) as (url, ingest):
            status, _, refusal = await post(
                url, FINDINGS_PATH, mine.model_dump_json().encode(), signer=task, stack=stack
            )
            assert status == 202, refusal

            forged = finding_about(other.instance_id, stack.group).model_dump_json().encode()
            status, _, refusal = await post(url, FINDINGS_PATH, forged, signer=task, stack=stack)
            assert status == 403 and "a host reports only about itself" in refusal["reason"]
            assert f"proven {host.instance_id}" in refusal["reason"]
            assert ingest.tasks.lookups == 1  # the task's instance is remembered, as membership answers are

            for refused in (stopped, nowhere):
                about_host = finding_about(host.instance_id, stack.group).model_dump_json().encode()
                status, _, refusal = await post(url, FINDINGS_PATH, about_host, signer=refused, stack=stack)
                assert status == 403, refusal
                assert f"the ECS task {refused.instance_id} is not running" in refusal["reason"]
                assert cluster in refusal["reason"]
            assert ingest.metrics.value("autorepair_ingest_reports_refused_total", status="403", reason="not_self") == 1
            assert (
                ingest.metrics.value("autorepair_ingest_reports_refused_total", status="403", reason="task_not_running")
                == 2
            )
            assert ingest.metrics.value("autorepair_ingest_reports_relayed_total", kind="finding") == 1
    view = await eventually(
        lambda: stack.health(host.instance_id),
        lambda v: mine.finding_id in {f.finding_id for f in v.recent_findings},
        within=60,
    )
    assert [f.reason for f in view.recent_findings] == ["XID_79"]
    assert not await stack.health_exists(other.instance_id)


async def test_the_rate_limit_answers_429_and_the_probe_delivers_everything_once_it_lifts(
    stack: Stack, tmp_path: Path
) -> None:
    host = stack.launch(group=stack.group)
    # A token every 100 s: however slowly this machine answers the three, none comes back in between.
    async with running_ingest(stack, stack.with_ingest(instance_rate=0.01, instance_burst=2)) as (url, _):
        answers = []
        for pci in ("0000:01:00", "0000:02:00", "0000:03:00"):
            report = finding_about(host.instance_id, stack.group, pci=pci).model_dump_json().encode()
            answers.append(await post(url, FINDINGS_PATH, report, signer=host, stack=stack))
        _, headers, refusal = answers[-1]
        assert [a[0] for a in answers] == [202, 202, 429], answers
        assert int(headers["Retry-After"]) >= 1 and refusal["status"] == 429

    # The real probe through the ingest: eight findings at once, four times the burst, a token every 2 s (longer than
    # a delivery takes here). Each 429 keeps the finding spooled; the reporter waits out Retry-After, and everything
    # arrives, in order, nothing dropped.
    async with running_ingest(stack, stack.with_ingest(instance_rate=0.5, instance_burst=2)) as (url, ingest):
        log = tmp_path / "kern.log"
        log.write_text(
            "".join(
                f"[ {100 + n}.000000] NVRM: Xid (PCI:0000:{n + 16:02x}:00): 79, pid=1, name=train, fell off the bus.\n"
                for n in range(8)
            )
        )
        config = fast_probe(host, stack, log, tmp_path, heartbeat_interval=timedelta(minutes=5))
        reporter = stack.reporter(url, host)
        probe = Probe(config, reporter)
        task = asyncio.create_task(probe.run())
        try:
            await eventually(
                lambda: asyncio.sleep(0, probe.stats.delivered), lambda delivered: delivered == 8, within=60, every=0.1
            )
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await reporter.close()
        assert probe.pending == 0 and reporter.dropped == 0 and probe.stats.delivery_failures >= 1
        assert (
            ingest.metrics.value("autorepair_ingest_reports_refused_total", status="429", reason="rate_instance") >= 2
        )
        view = await eventually(
            lambda: stack.health(host.instance_id), lambda v: len(v.recent_findings) == 10, within=60
        )
        pcis = [f.gpu.pci for f in view.recent_findings[2:]]
        assert pcis == [f"0000:{n + 16:02x}:00" for n in range(8)]


async def _probe_report(stack: Stack, url: str, host: Host, *argv: str) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOREPAIR_", "AWS_"))}
    env.update(
        AWS_ACCESS_KEY_ID=host.credentials.access_key or "",
        AWS_SECRET_ACCESS_KEY=host.credentials.secret_key or "",
        AWS_SESSION_TOKEN=host.credentials.token or "",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL_STS=stack.moto,
        AWS_EC2_METADATA_DISABLED="true",
    )
    # In a subprocess, awaited without blocking: the ingest it talks to runs on this event loop.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "operator_cli.main", "probe-report", "--ingest", url, "--sts-endpoint", stack.moto,
        "--group", stack.group, *argv,
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_probe_report_exits_0_when_accepted_and_says_why_in_one_line_when_refused(stack: Stack) -> None:
    me, other = stack.launch(group=stack.group), stack.launch(group=stack.group)
    async with running_ingest(stack) as (url, _):
        code, out, err = await _probe_report(stack, url, me, "--instance-id", me.instance_id, "--xid", "79")
        assert code == 0, err
        assert out.startswith(f"accepted: XID_79 (impairs ACCELERATED_COMPUTE) for {me.instance_id}")
        await eventually(
            lambda: stack.health(me.instance_id), lambda v: [f.reason for f in v.recent_findings] == ["XID_79"]
        )

        line = "NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, An uncorrectable double bit error"
        code, out, err = await _probe_report(stack, url, me, "--instance-id", other.instance_id, "--kernel-line", line)
        assert code == 1 and out == ""
        assert err.count("\n") == 1 and err.startswith("autorepair probe-report: refused (403): a host reports only")

        # For scripts: a line per finding, or one document, the refusal's reason in it (and its one line on stderr).
        code, out, _ = await _probe_report(
            stack, url, me, "--instance-id", me.instance_id, "--xid", "13", "-o", "jsonl"
        )
        [accepted] = [json.loads(line) for line in out.splitlines()]
        assert code == 0 and accepted["accepted"] and accepted["status"] == 202 and accepted["refusal"] is None
        assert (accepted["reason"], accepted["impairs"], accepted["instanceId"]) == ("XID_13", False, me.instance_id)
        args = ("--instance-id", other.instance_id, "--xid", "79", "-o", "json")
        code, out, err = await _probe_report(stack, url, me, *args)
        [refused] = json.loads(out)["findings"]
        assert code == 1 and not refused["accepted"] and refused["status"] == 403
        assert refused["refusal"].startswith("a host reports only") and err.startswith(
            "autorepair probe-report: refused"
        )
    assert not await stack.health_exists(other.instance_id)


def test_plain_http_on_a_non_loopback_bind_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from operator_cli.main import main

    for name in [n for n in os.environ if n.startswith("AUTOREPAIR_")]:
        monkeypatch.delenv(name)
    assert main(["ingest", "--bind", "0.0.0.0:8480"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("autorepair ingest: refusing plain HTTP on 0.0.0.0")
    assert "ingest.tls_cert" in err


def test_plain_http_behind_a_tls_terminating_load_balancer_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    from ingest.cli import tls_context
    from worker.settings import Settings

    for name in [n for n in os.environ if n.startswith("AUTOREPAIR_")]:
        monkeypatch.delenv(name)
    settings = Settings(ingest={"tls_terminated_by_load_balancer": True})
    assert tls_context(settings, "0.0.0.0") is None  # an ALB with an ACM certificate ends TLS in front of it


def test_retry_after_is_whole_seconds_and_at_least_one() -> None:
    from ingest.rate_limit import RateLimiter, retry_after

    now = [0.0]
    limiter = RateLimiter(0.5, 1, 1000.0, 1000, clock=lambda: now[0], max_instances=2)
    assert limiter.take_instance("i-a") == 0
    assert limiter.take_instance("i-a") == pytest.approx(2.0)
    assert retry_after(0.01) == 1 and retry_after(2.0) == 2 and retry_after(2.1) == 3
    now[0] = 2.0
    assert limiter.take_instance("i-a") == 0  # refilled: a host that waited Retry-After gets through
    limiter.take_instance("i-b")
    limiter.take_instance("i-c")
    assert len(limiter) == 2  # bounded: the least recently seen instance is forgotten


async def test_ecs_task_answers_are_cached_bounded_and_an_aws_error_is_no_answer() -> None:
    from botocore.exceptions import ClientError

    from ingest.ecs_tasks import MAX_TASK_CLUSTERS, TaskHosts, TaskLookupUnavailable

    asked: list[tuple[str, str]] = []
    failing = [False]

    class Lookup:
        def instance_of(self, cluster: str, task_id: str) -> str | None:
            asked.append((cluster, task_id))
            if failing[0]:
                raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "slow down"}}, "DescribeTasks")
            return "i-0123456789abcdef0" if (cluster, task_id) == ("c2", "a" * 32) else None

    now = [0.0]
    clusters = ["c1", "c2", "c1", *(f"x{n}" for n in range(MAX_TASK_CLUSTERS))]
    hosts = TaskHosts(clusters, Lookup(), 60.0, clock=lambda: now[0], max_entries=2)  # type: ignore[arg-type]
    assert hosts.clusters[:2] == ("c1", "c2") and len(hosts.clusters) == MAX_TASK_CLUSTERS
    assert await hosts.instance_of("a" * 32) == "i-0123456789abcdef0"
    assert asked == [("c1", "a" * 32), ("c2", "a" * 32)]  # stops at the first cluster that runs it
    assert await hosts.instance_of("b" * 32) is None and len(asked) == 2 + MAX_TASK_CLUSTERS
    asked.clear()
    assert await hosts.instance_of("a" * 32) == "i-0123456789abcdef0" and not asked  # remembered, yes and no
    assert await hosts.instance_of("b" * 32) is None and not asked
    failing[0] = True
    now[0] = 61.0
    with pytest.raises(TaskLookupUnavailable):
        await hosts.instance_of("a" * 32)
    with pytest.raises(TaskLookupUnavailable):  # an error is not remembered: asked again
        await hosts.instance_of("a" * 32)
    assert len(asked) == 2 and hosts.lookups == 4
    failing[0] = False
    for task in ("c" * 32, "d" * 32, "e" * 32):
        await hosts.instance_of(task)
    assert len(hosts._cache) == 2  # bounded


async def test_an_ingest_restart_loses_nothing_and_declares_nothing_lost(stack: Stack, tmp_path: Path) -> None:
    """The ingest is stateless: while it is down the probe keeps its findings spooled (the connection is refused),
    and once it is back on the same address they arrive, in order. A down time inside the threshold impairs
    nothing."""
    host = stack.launch(group=stack.group)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "kern.log"
    log.write_text("")
    config = fast_probe(host, stack, log, tmp_path, heartbeat_interval=timedelta(seconds=1))

    def xid_13(pci: int) -> str:  # a warning under the ECS policy: it shows, it does not impair
        return f"[ {100 + pci}.000000] NVRM: Xid (PCI:0000:{pci:02x}:00): 13, pid=1, name=train, Graphics Exception\n"

    reporter = stack.reporter(url, host)
    probe = Probe(config, reporter)
    task = asyncio.create_task(probe.run())
    try:
        async with running_ingest(stack, port=port):
            with log.open("a") as handle:
                handle.write(xid_13(1))
            await eventually(lambda: asyncio.sleep(0, probe.stats.delivered), lambda n: n == 1, within=30, every=0.1)
        # Down: three findings and some heartbeats find nobody; the probe keeps the findings.
        with log.open("a") as handle:
            handle.write(xid_13(2) + xid_13(3) + xid_13(4))
        await eventually(lambda: asyncio.sleep(0, probe.stats.delivery_failures), lambda n: n >= 2, within=30)
        assert probe.pending == 3
        async with running_ingest(stack, port=port):
            await eventually(lambda: asyncio.sleep(0, probe.stats.delivered), lambda n: n == 4, within=30, every=0.1)
            view = await eventually(
                lambda: stack.health(host.instance_id), lambda v: len(v.recent_findings) == 4, within=30
            )
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await reporter.close()
    assert [f.gpu.pci for f in view.recent_findings] == [f"0000:{n:02x}:00" for n in (1, 2, 3, 4)]
    assert view.healthStatus.overallStatus is HealthState.OK
    assert probe.pending == 0 and reporter.dropped == 0
