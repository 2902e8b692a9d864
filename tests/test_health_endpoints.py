"""GET /healthz of the worker, the ingest and the probe, and `autorepair healthcheck` against them: 200 while each can
do its work, 503 and why not while it cannot. Against a real Temporal dev server (stopped mid-test where Temporal
going away is the point), the real ingest app and the real probe loop; thresholds are shortened, not slept out."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from contract.config import TemporalSettings
from contract.probe import GpuFinding
from contract.temporal_client import connect
from ingest.cli import build_ingest, running_ingest, serving
from ingest.server import build_app
from node_probe import cli as probe_cli
from node_probe.delivery.reporter import Reporter
from node_probe.health import serving_probe_health
from node_probe.probe import Probe, ProbeConfig
from operator_cli.main import build_parser
from simulator.servers import TemporalDevServer, free_port
from tests.harness import eventually, make_settings, unique
from tests.test_probe import XID_79, FakeReporter
from worker.health_endpoint import TemporalReachability, worker_health
from worker.main import run_worker
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


def fast(client: Client) -> TemporalReachability:
    """Asked every 0.1 s, unhealthy after 1 s without an answer: the defaults' 10 s and 45 s, at test speed."""
    return TemporalReachability(
        client, interval=timedelta(seconds=0.1), stale_after=timedelta(seconds=1), timeout=timedelta(seconds=1)
    )


async def get(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text.startswith("{") else {"text": text}


async def healthcheck(url: str, *flags: str) -> tuple[int, str]:
    """`autorepair healthcheck URL` as a container's health check runs it: its exit status and its stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "operator_cli.main",
        "healthcheck",
        url,
        *flags,
        cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, err.decode()


def status(code: int) -> Any:
    return lambda answer: answer[0] == code


def bare_settings(address: str, **fields: Any) -> Settings:
    return Settings(temporal=TemporalSettings(address=address), **fields)


# --- the worker and the ingest: Temporal answering, then not -----------------------------------------------------


async def test_worker_and_ingest_say_503_once_temporal_stops_answering(tmp_path: Path) -> None:
    server = TemporalDevServer(tmp_path / "temporal", port=free_port(), ui_port=free_port())
    await server.start()
    try:
        client = await Client.connect(server.address, data_converter=pydantic_data_converter)
        settings = bare_settings(server.address, health_bind_address=f"127.0.0.1:{free_port()}")
        worker_url = f"http://{settings.health_bind_address}/healthz"
        ingest_port = free_port()
        ingest_url = f"http://127.0.0.1:{ingest_port}/healthz"
        async with (
            worker_health(settings, client, temporal=fast(client)) as health,
            aiohttp.ClientSession() as session,
        ):
            ingest = build_ingest(settings, Reporter(client), session, fast(client))
            async with serving(build_app(ingest), "127.0.0.1", ingest_port, None):
                code, body = await eventually(lambda: get(worker_url), status(200), within=30, every=0.1)
                assert body["status"] == "ok" and body["checks"]["shutting_down"] is False
                assert await eventually(lambda: get(ingest_url), status(200), within=30, every=0.1) == (
                    200,
                    {"text": "ok"},
                )
                assert await healthcheck(worker_url) == (0, "")
                assert await healthcheck(ingest_url) == (0, "")

                await server.stop()
                _, body = await eventually(lambda: get(worker_url), status(503), within=30, every=0.1)
                assert body["status"] == "unhealthy"
                assert body["reason"].startswith(f"Temporal at {server.address} unreachable since ")
                _, refusal = await eventually(lambda: get(ingest_url), status(503), within=30, every=0.1)
                assert refusal["kind"] == "temporal" and "unreachable since" in refusal["reason"]
                assert not health.shutting_down

                code, said = await healthcheck(worker_url)
                assert code == 1 and f"{worker_url} answered 503: Temporal at {server.address} unreachable" in said
                code, said = await healthcheck(ingest_url)
                assert code == 1 and "answered 503: Temporal at" in said
    finally:
        await server.stop()


async def test_the_worker_says_503_once_its_shutdown_began(client: Client) -> None:
    settings = bare_settings(client.service_client.config.target_host, health_bind_address=f"127.0.0.1:{free_port()}")
    url = f"http://{settings.health_bind_address}/healthz"
    async with worker_health(settings, client, temporal=fast(client)) as health:
        await eventually(lambda: get(url), status(200), within=30, every=0.1)
        health.begin_shutdown()
        code, body = await get(url)
        assert code == 503 and body["reason"].startswith("shutting down since ")
        assert body["checks"]["shutting_down"] is True
        code, said = await healthcheck(url)
        assert code == 1 and "answered 503: shutting down since" in said


async def test_run_worker_serves_health_on_its_setting(client: Client, aws_env: str, tmp_path: Path) -> None:
    """The wiring: `autorepair worker`'s run_worker serves /healthz at health_bind_address, default thresholds."""
    settings = make_settings(client, aws_env, tmp_path / "events.jsonl", group=unique("gpu"), cluster=unique("c"))
    settings = settings.model_copy(update={"health_bind_address": f"127.0.0.1:{free_port()}"})
    url = f"http://{settings.health_bind_address}/healthz"
    task = asyncio.create_task(run_worker(settings, client))
    try:
        _, body = await eventually(lambda: get(url), status(200), within=60, every=0.2)
        assert body["checks"]["temporal"].startswith("answered ")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_health_and_metrics_bind_addresses_are_checked_and_off_turns_them_off() -> None:
    assert Settings().health_bind_address == "127.0.0.1:8481"
    assert Settings(health_bind_address="off").health_bind_address is None
    assert Settings(health_bind_address="[::1]:9000").health_bind_address == "[::1]:9000"
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        Settings(health_bind_address="8481")
    # The metrics endpoint's bind reads the same way (a bad one was a Rust panic's text at start).
    assert Settings(metrics_bind_address="off").metrics_bind_address is None
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        Settings(metrics_bind_address="9464")


async def test_the_ingest_says_503_while_temporal_cannot_be_reached_and_200_when_it_can(client: Client) -> None:
    """`autorepair ingest`'s own set-up (ingest/cli.py running_ingest), with its default thresholds: its lazy client
    to an address nothing answers on never blocks the answer."""
    nowhere = f"127.0.0.1:{free_port()}"
    lazy = await connect(TemporalSettings(address=nowhere), lazy=True)
    async with running_ingest(bare_settings(nowhere), lazy, f"127.0.0.1:{free_port()}") as url:
        code, refusal = await get(f"{url}/healthz")
        assert code == 503 and refusal["kind"] == "temporal"
        assert refusal["reason"].startswith(f"Temporal at {nowhere} ")
        code, said = await healthcheck(f"{url}/healthz")
        assert code == 1 and f"answered 503: Temporal at {nowhere}" in said

    address = client.service_client.config.target_host
    async with running_ingest(bare_settings(address), client, f"127.0.0.1:{free_port()}") as url:
        assert await eventually(lambda: get(f"{url}/healthz"), status(200), within=30, every=0.1) == (
            200,
            {"text": "ok"},
        )


# --- the probe ---------------------------------------------------------------------------------------------------


def fast_probe(tmp_path: Path, reporter: Any, kernel_log: Path) -> Probe:
    config = ProbeConfig(
        instance_id=unique("i"),
        group="g",
        kernel_log=kernel_log,
        poll_interval=timedelta(seconds=0.05),
        heartbeat_interval=timedelta(seconds=0.1),  # unhealthy after 3 of them: 0.3 s
        retry_max_backoff=timedelta(seconds=0.1),
    )
    return Probe(config, reporter)


@contextlib.asynccontextmanager
async def probe_with_health(probe: Probe) -> AsyncIterator[str]:
    async with serving_probe_health(probe, f"127.0.0.1:{free_port()}") as url:
        assert url is not None
        task = asyncio.create_task(probe.run())
        try:
            yield url
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_the_probe_is_healthy_while_it_delivers_and_503_once_delivery_fails_for_three_intervals(
    tmp_path: Path,
) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    reporter = FakeReporter()
    probe = fast_probe(tmp_path, reporter, log)
    async with probe_with_health(probe) as url:
        _, body = await eventually(lambda: get(url), lambda a: a[0] == 200 and bool(reporter.heartbeats), every=0.05)
        assert body["checks"]["sources"] == {probe.source_health()[0].name: "ok"}
        assert await healthcheck(url) == (0, "")

        reporter.failing = True
        _, body = await eventually(lambda: get(url), status(503), within=10, every=0.05)
        assert body["reason"].startswith("no heartbeat delivered since ")
        assert body["reason"].endswith("(temporal unreachable)")
        code, said = await healthcheck(url)
        assert code == 1 and "answered 503: no heartbeat delivered since" in said

        reporter.failing = False
        await eventually(lambda: get(url), status(200), within=10, every=0.05)
    code, said = await healthcheck(url)
    assert code == 1 and "unreachable" in said  # the endpoint goes with the probe


class FindingsRefused(FakeReporter):
    """Heartbeats go through; every finding fails (say the ingest refuses it)."""

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None:
        raise ConnectionError("finding refused")


async def test_a_finding_failing_for_three_intervals_is_503_though_heartbeats_go_through(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    reporter = FindingsRefused()
    probe = fast_probe(tmp_path, reporter, log)
    async with probe_with_health(probe) as url:
        await eventually(lambda: get(url), lambda a: a[0] == 200 and bool(reporter.heartbeats), every=0.05)
        with log.open("a") as handle:
            handle.write(XID_79)
        _, body = await eventually(lambda: get(url), status(503), within=10, every=0.05)
        assert body["reason"].startswith("1 finding undelivered, failing since ")
        assert "finding refused" in body["reason"] and body["checks"]["pending_findings"] == 1
        assert body["checks"]["heartbeat"].startswith("delivered ")


async def test_the_probe_says_503_while_every_source_is_down(tmp_path: Path) -> None:
    log = tmp_path / "not-yet.log"
    probe = fast_probe(tmp_path, FakeReporter(), log)
    async with probe_with_health(probe) as url:
        code, body = await get(url)
        assert code == 503
        assert body["reason"].startswith(f"every source is down: kernel log {log}: No such file or directory")
        log.write_text("")
        await eventually(lambda: get(url), status(200), within=10, every=0.05)


async def test_autorepair_probe_serves_health_on_health_bind(client: Client, tmp_path: Path) -> None:
    """The command itself, reporting straight to the dev server: --health-bind is where its /healthz answers."""
    log = tmp_path / "kern.log"
    log.write_text("")
    bind = f"127.0.0.1:{free_port()}"
    argv = ["probe", "--group", "g", "--direct-temporal", "--instance-id", unique("i"), "--kernel-log", str(log)]
    argv += ["--temporal-address", client.service_client.config.target_host, "--task-queue", unique("tq")]
    argv += ["--no-nvml", "--no-dcgm", "--no-daemons", "--no-container-runtime", "--spool-dir", str(tmp_path / "s")]
    await assert_probe_delivers([*argv, "--heartbeat-interval", "1", "--health-bind", bind], bind)
    assert build_parser().parse_args([*argv, "--health-bind", "off"]).health_bind is None


async def assert_probe_delivers(argv: list[str], bind: str) -> None:
    """`autorepair probe` with these arguments says healthy on `bind` once it delivered a heartbeat."""
    task = asyncio.create_task(probe_cli.run_probe_command(build_parser().parse_args(argv)))
    try:
        _, body = await eventually(
            lambda: get(f"http://{bind}/healthz"),
            lambda a: a[0] == 200 and a[1]["checks"]["heartbeat"].startswith("delivered"),
            within=30,
            every=0.1,
        )
        assert body["status"] == "ok"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_healthcheck_says_why_when_nothing_answers() -> None:
    url = f"http://127.0.0.1:{free_port()}/healthz"
    code, said = await healthcheck(url, "--timeout", "2")
    assert code == 1 and said.startswith(f"autorepair healthcheck: {url} unreachable: ")
    assert len(said.strip().splitlines()) == 1


def test_a_source_that_is_ok_and_says_how_it_looked_is_not_down() -> None:
    """The container runtime, OK, says how it checked (its API, or its unit only) in `reason`: /healthz still counts
    it up, so one source down beside it is not "every source is down"."""
    from types import SimpleNamespace

    from contract.health import HealthState
    from contract.probe import ProbeSourceHealth
    from node_probe.health import ProbeHealth

    sources = [
        ProbeSourceHealth(name="kernel log", state=HealthState.INSUFFICIENT_DATA, reason="no such file"),
        ProbeSourceHealth(
            name="container runtime",
            state=HealthState.OK,
            reason="docker: unit and API on /var/run/docker.sock",
            gpu_source=False,
        ),
    ]
    delivery = SimpleNamespace(
        running_since=0.0, heartbeat_at=0.0, heartbeat_error=None, findings_failing_since=None, finding_error=None
    )
    probe = SimpleNamespace(
        config=SimpleNamespace(heartbeat_interval=timedelta(seconds=60)),
        delivery=delivery,
        source_health=lambda: list(sources),
        pending=0,
        gpu_readings=lambda: {},
    )
    verdict = ProbeHealth(probe, clock=lambda: 1.0).verdict()  # type: ignore[arg-type]
    assert verdict.problem is None
    assert verdict.checks["sources"] == {
        "kernel log": "no such file",
        "container runtime": "ok: docker: unit and API on /var/run/docker.sock",
    }
    sources.pop()
    assert ProbeHealth(probe, clock=lambda: 1.0).verdict().problem == "every source is down: no such file"  # type: ignore[arg-type]
