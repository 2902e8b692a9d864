"""The probe's and the ingest's Prometheus endpoints, scraped over HTTP while they run and parsed by prometheus_client:
the series move when things happen (a finding, a delivery failing, a spool backlog, a refusal, a relay), each on a
port of its own that also answers /healthz, and never on the port the GPU hosts reach. The probe against a fake
reporter and against the real ingest (tests/test_ingest.py's stack: moto's STS, the Temporal dev server)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.client import Client

from contract.ingest import FINDINGS_PATH, HEALTH_PATH, METRICS_PATH, REFUSED_UNKNOWN_GROUP
from ingest.cli import running_ingest as serving_ingest
from node_probe import cli as probe_cli
from node_probe.health import serving_probe_health
from node_probe.probe import Probe, ProbeConfig
from operator_cli.main import build_parser
from simulator.servers import free_port
from tests import test_ingest
from tests.harness import eventually, unique
from tests.prometheus_text import fetch, has_series, scrape, total
from tests.test_health_endpoints import bare_settings
from tests.test_ingest import Stack, ingest_metrics, post, running_ingest
from tests.test_probe import XID_13, XID_79, FakeReporter

stack = test_ingest.stack  # the module-scoped fixture: a worker, moto's IAM role for the hosts, the group


def probe_config(instance_id: str, group: str, log: Path, spool: Path | None = None) -> ProbeConfig:
    return ProbeConfig(
        instance_id=instance_id,
        group=group,
        kernel_log=log,
        spool_dir=spool,
        poll_interval=timedelta(seconds=0.05),
        heartbeat_interval=timedelta(seconds=0.2),
        retry_max_backoff=timedelta(seconds=0.2),
    )


@contextlib.asynccontextmanager
async def probe_serving_metrics(probe: Probe, health_bind: str | None = None) -> AsyncIterator[str]:
    """The probe running, its metrics on a port of their own; yields their /metrics URL."""
    metrics_bind = f"127.0.0.1:{free_port()}"
    async with serving_probe_health(probe, health_bind, metrics_bind=metrics_bind):
        task = asyncio.create_task(probe.run())
        try:
            yield f"http://{metrics_bind}{METRICS_PATH}"
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def append(path: Path, text: str) -> None:
    with path.open("a") as handle:
        handle.write(text)


# --- the probe ------------------------------------------------------------------------------------------------------


async def test_the_probes_series_move_with_findings_failures_and_the_spool(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    reporter = FakeReporter()
    probe = Probe(probe_config(unique("i"), "g", log), reporter)
    health_bind = f"127.0.0.1:{free_port()}"
    async with probe_serving_metrics(probe, health_bind) as url:
        samples = await eventually(
            lambda: scrape(url), lambda s: total(s, "autorepair_probe_heartbeats_total", result="delivered") >= 1
        )
        instance = probe.config.instance_id
        assert total(samples, "autorepair_probe_info", group="g", instance_id=instance) == 1
        [source] = probe.source_states()
        assert total(samples, "autorepair_probe_source_state", group="g", source=source, state="ok") == 1
        assert total(samples, "autorepair_probe_source_state", source=source, state="failed") == 0
        assert has_series(samples, "autorepair_probe_spool_findings", group="g")
        assert total(samples, "autorepair_probe_spool_findings") == 0
        assert total(samples, "autorepair_probe_findings_total") == 0
        assert total(samples, "process_resident_memory_bytes") > 0

        append(log, XID_79)
        samples = await eventually(
            lambda: scrape(url), lambda s: total(s, "autorepair_probe_findings_delivered_total") == 1
        )
        assert total(samples, "autorepair_probe_findings_total", group="g", reason="XID_79", kind="xid") == 1
        assert total(samples, "autorepair_probe_records_total") == 1

        # Delivery fails: the finding waits in the spool, and the failures say why.
        reporter.failing = True
        append(log, XID_13)
        samples = await eventually(
            lambda: scrape(url), lambda s: total(s, "autorepair_probe_delivery_failures_total") >= 2
        )
        assert total(samples, "autorepair_probe_spool_findings") == 1
        assert total(samples, "autorepair_probe_delivery_failures_total", why="ConnectionError") >= 2
        assert total(samples, "autorepair_probe_findings_total", reason="XID_13") == 1
        samples = await eventually(
            lambda: scrape(url), lambda s: total(s, "autorepair_probe_heartbeats_total", result="failed") >= 1
        )

        reporter.failing = False
        samples = await eventually(
            lambda: scrape(url), lambda s: total(s, "autorepair_probe_findings_delivered_total") == 2
        )
        assert total(samples, "autorepair_probe_spool_findings") == 0

        # The metrics port answers /healthz too; the loopback health port serves no metrics.
        status, _, body = await asyncio.to_thread(fetch, url.replace(METRICS_PATH, HEALTH_PATH))
        assert status == 200 and json.loads(body)["status"] == "ok"
        assert (await asyncio.to_thread(fetch, f"http://{health_bind}{METRICS_PATH}"))[0] == 404
        assert (await asyncio.to_thread(fetch, f"http://{health_bind}{HEALTH_PATH}"))[0] == 200


async def test_a_source_that_cannot_read_is_degraded_then_ok(tmp_path: Path) -> None:
    log = tmp_path / "not-yet.log"
    probe = Probe(probe_config(unique("i"), "g", log), FakeReporter())
    async with probe_serving_metrics(probe) as url:
        [source] = probe.source_states()
        samples = await scrape(url)
        states = ("ok", "degraded", "failed")
        now = {state: total(samples, "autorepair_probe_source_state", source=source, state=state) for state in states}
        assert now == {"ok": 0, "degraded": 1, "failed": 0}
        log.write_text("")
        await eventually(
            lambda: scrape(url), lambda s: total(s, "autorepair_probe_source_state", source=source, state="ok") == 1
        )


async def test_autorepair_probe_serves_metrics_and_health_on_one_port(client: Client, tmp_path: Path) -> None:
    """The command itself: --metrics-bind the same as --health-bind is one server answering both."""
    log = tmp_path / "kern.log"
    log.write_text(XID_79)
    bind = f"127.0.0.1:{free_port()}"
    argv = ["probe", "--group", "g", "--direct-temporal", "--instance-id", unique("i"), "--kernel-log", str(log)]
    argv += ["--temporal-address", client.service_client.config.target_host, "--task-queue", unique("tq")]
    argv += ["--no-nvml", "--no-dcgm", "--no-daemons", "--no-container-runtime", "--spool-dir", str(tmp_path / "s")]
    argv += ["--heartbeat-interval", "1", "--health-bind", bind, "--metrics-bind", bind]
    task = asyncio.create_task(probe_cli.run_probe_command(build_parser().parse_args(argv)))
    try:
        samples = await eventually(
            lambda: scrape(f"http://{bind}{METRICS_PATH}"),
            lambda s: total(s, "autorepair_probe_findings_delivered_total") == 1,
            within=30,
            every=0.1,
        )
        assert total(samples, "autorepair_probe_findings_total", group="g", reason="XID_79") == 1
        assert (await asyncio.to_thread(fetch, f"http://{bind}{HEALTH_PATH}"))[0] == 200
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    parsed = build_parser().parse_args(["probe", "--group", "g", "--direct-temporal"])
    assert parsed.metrics_bind is None  # off unless asked: a port on every GPU host is the operator's choice


# --- the ingest, and a probe reporting to it ---------------------------------------------------------------------


async def test_a_refused_probe_and_the_ingest_both_show_the_refusal_then_the_relay(
    stack: Stack, tmp_path: Path
) -> None:
    host = stack.launch(group=stack.group)
    log, spool = tmp_path / "kern.log", tmp_path / "spool"
    log.write_text(XID_79)
    async with running_ingest(stack) as (url, ingest), ingest_metrics(ingest) as ingest_url:
        before = await scrape(ingest_url)
        assert total(before, "autorepair_ingest_requests_total") == 0

        # A wrong --group: the ingest refuses every try; the probe keeps the finding spooled and counts why.
        async with stack.reporter(url, host) as reporter:
            wrong = Probe(probe_config(host.instance_id, "gpu-trainnig", log, spool), reporter)
            async with probe_serving_metrics(wrong) as probe_url:
                probe_samples = await eventually(
                    lambda: scrape(probe_url),
                    lambda s: total(s, "autorepair_probe_delivery_failures_total", why=REFUSED_UNKNOWN_GROUP) >= 1,
                    within=30,
                )
                assert total(probe_samples, "autorepair_probe_spool_findings") == 1
                assert total(probe_samples, "autorepair_probe_findings_delivered_total") == 0
        samples = await scrape(ingest_url)
        refused = total(samples, "autorepair_ingest_reports_refused_total", status="403", reason=REFUSED_UNKNOWN_GROUP)
        assert refused >= 1
        assert total(samples, "autorepair_ingest_requests_total", kind="finding", code="403") >= 1
        assert total(samples, "autorepair_ingest_report_duration_seconds_count", kind="finding", outcome="refused") >= 1
        assert total(samples, "autorepair_ingest_reports_relayed_total", kind="finding") == 0
        # Proven through STS (a miss), though refused afterwards.
        assert total(samples, "autorepair_ingest_identity_cache_total", result="miss") >= 1

        # The right group on the same spool: delivered, relayed, and the next reports ride the session token.
        async with stack.reporter(url, host) as reporter:
            right = Probe(probe_config(host.instance_id, stack.group, log, spool), reporter)
            async with probe_serving_metrics(right) as probe_url:
                await eventually(
                    lambda: scrape(probe_url),
                    lambda s: (
                        total(s, "autorepair_probe_findings_delivered_total") == 1
                        and total(s, "autorepair_probe_heartbeats_total", result="delivered") >= 2
                    ),
                    within=30,
                )
        samples = await scrape(ingest_url)
        assert total(samples, "autorepair_ingest_reports_relayed_total", kind="finding") == 1
        assert total(samples, "autorepair_ingest_requests_total", kind="finding", code="202") == 1
        assert total(samples, "autorepair_ingest_relay_duration_seconds_count", kind="finding") == 1
        assert (
            total(samples, "autorepair_ingest_report_duration_seconds_count", kind="heartbeat", outcome="relayed") >= 2
        )
        assert total(samples, "autorepair_ingest_identity_cache_total", result="hit") >= 1
        # What a scrape reads is what the ingest counted (the scrape just taken: the wrong probe's last tries may
        # have been counted after the first one).
        assert total(
            samples, "autorepair_ingest_reports_refused_total", status="403", reason=REFUSED_UNKNOWN_GROUP
        ) == ingest.metrics.value("autorepair_ingest_reports_refused_total", status="403", reason=REFUSED_UNKNOWN_GROUP)

        # The hosts' port serves their reports and the load balancer's /healthz, not the metrics.
        assert (await asyncio.to_thread(fetch, f"{url}{METRICS_PATH}"))[0] == 404
        status, _, _ = await post(url, FINDINGS_PATH, b"{not json", signer=None, stack=stack)
        assert status == 400
        samples = await scrape(ingest_url)
        assert total(samples, "autorepair_ingest_reports_refused_total", status="400", reason="invalid") == 1


async def test_autorepair_ingest_serves_metrics_on_its_own_port(client: Client) -> None:
    """ingest/cli.py's set-up: ingest.metrics_bind (or --metrics-bind) serves /metrics and /healthz in plain HTTP."""
    address = client.service_client.config.target_host
    metrics_bind = f"127.0.0.1:{free_port()}"
    settings = bare_settings(address)
    async with serving_ingest(settings, client, f"127.0.0.1:{free_port()}", metrics_bind) as url:
        status, _, body = await eventually(
            lambda: asyncio.to_thread(fetch, f"http://{metrics_bind}{HEALTH_PATH}"), lambda a: a[0] == 200, within=30
        )
        assert json.loads(body)["status"] == "ok"
        status, content_type, text = await asyncio.to_thread(fetch, f"http://{metrics_bind}{METRICS_PATH}")
        assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
        assert "# TYPE autorepair_ingest_reports_refused_total counter" in text
        assert (await asyncio.to_thread(fetch, f"{url}{METRICS_PATH}"))[0] == 404
    async with serving_ingest(settings, client, f"127.0.0.1:{free_port()}", "off"):
        with pytest.raises(urllib.error.URLError):  # nothing listens there
            await asyncio.to_thread(fetch, f"http://{metrics_bind}{METRICS_PATH}")
    assert settings.ingest.metrics_bind == "127.0.0.1:9480"
