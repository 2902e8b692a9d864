"""`autorepair ingest`: serve the ingest (ingest/server.py) until SIGTERM/SIGINT. operator_cli/main.py wires it in."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import signal
import ssl
import sys
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from temporalio.client import Client

from contract.formats import parse_bind
from contract.healthz import DEFAULT_INGEST_METRICS_BIND, OFF, Verdict, health_bind, serving_health
from contract.ingest import HEALTH_PATH, METRICS_PATH
from contract.temporal_client import connect
from contract.temporal_options import add_temporal_arguments, load_settings
from ingest.ecs_tasks import AwsTaskLookup, TaskHosts
from ingest.identity import ProofVerifier
from ingest.membership import AwsMembershipLookup, GroupMembership
from ingest.metrics import IngestMetrics
from ingest.rate_limit import RateLimiter
from ingest.server import Ingest, build_app
from ingest.sessions import Sessions
from node_probe.delivery.liveness_relay import LivenessRelay, routes_of
from node_probe.delivery.reporter import Reporter
from worker.health_endpoint import TemporalReachability
from worker.settings import Settings

log = logging.getLogger(__name__)


KEEPALIVE_S = 150.0


class IngestConfigError(Exception):
    """A setting the ingest cannot start with: one line, exit status 2."""


def add_ingest_arguments(parser: argparse.ArgumentParser) -> None:
    add_temporal_arguments(parser)
    parser.add_argument("--bind", default=None, metavar="HOST:PORT", help="listen here (default: ingest.bind)")
    parser.add_argument(
        "--metrics-bind",
        default=None,
        metavar="HOST:PORT",
        help=f"serve GET /metrics (Prometheus) and GET /healthz here, plain HTTP; {OFF!r}: none (default: "
        f"ingest.metrics_bind, {DEFAULT_INGEST_METRICS_BIND})",
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_context(settings: Settings, host: str) -> ssl.SSLContext | None:
    """HTTPS with ingest.tls_cert/tls_key; plain HTTP only on a loopback bind (the demo, the tests) or behind a load
    balancer that terminates TLS, since the proofs and reports would otherwise cross the network readable and
    replayable."""
    ingest = settings.ingest
    if ingest.tls_cert is None or ingest.tls_key is None:
        if not is_loopback(host) and not ingest.tls_terminated_by_load_balancer:
            raise IngestConfigError(
                f"refusing plain HTTP on {host}, which is not a loopback address: set ingest.tls_cert and "
                "ingest.tls_key, or ingest.tls_terminated_by_load_balancer = true behind a load balancer that "
                "terminates TLS"
            )
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(ingest.tls_cert, ingest.tls_key)
    except (OSError, ssl.SSLError) as err:
        raise IngestConfigError(f"ingest.tls_cert/tls_key: {err}") from None
    return context


def build_ingest(
    settings: Settings,
    reporter: Reporter,
    session: aiohttp.ClientSession,
    temporal: TemporalReachability | None = None,
) -> Ingest:
    ingest = settings.ingest
    lookup = AwsMembershipLookup(settings.aws)
    ttl_s = ingest.membership_ttl.total_seconds()
    return Ingest(
        verifier=ProofVerifier(ingest, session),
        membership=GroupMembership(settings.groups, lookup, ttl_s),
        tasks=TaskHosts([group.cluster for group in settings.groups], AwsTaskLookup(lookup.ecs), ttl_s),
        limiter=RateLimiter(ingest.instance_rate, ingest.instance_burst, ingest.total_rate, ingest.total_burst),
        relay=LivenessRelay(reporter, routes_of(settings.groups), settings.temporal.task_queue, relay=True),
        task_queue=settings.temporal.task_queue,
        metrics=IngestMetrics(),
        sessions=Sessions(ingest),
        temporal=temporal,
    )


@contextlib.asynccontextmanager
async def serving(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None
) -> AsyncIterator[None]:
    # Hosts keep their connection open between heartbeats (a minute apart by default): keep it longer than they do.
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
        yield
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving_metrics(ingest: Ingest, bind: str | None) -> AsyncIterator[str | None]:
    """GET /metrics and GET /healthz on `bind`, plain HTTP, while inside; yields the /healthz URL, None when not
    served. A port that cannot be had is logged, not fatal: the hosts' reports matter more than their counts."""
    temporal = ingest.temporal

    def verdict() -> Verdict:
        return Verdict(temporal.problem() if temporal is not None else None)

    async with contextlib.AsyncExitStack() as stack:
        url: str | None = None
        if bind is not None:
            try:
                url = await stack.enter_async_context(serving_health(bind, verdict, ingest.metrics.render))
            except OSError as err:
                log.error("metrics not served on %s: %s; choose a free port with ingest.metrics_bind", bind, err)
            else:
                log.info("metrics on %s", url.replace(HEALTH_PATH, METRICS_PATH))
        yield url


@contextlib.asynccontextmanager
async def running_ingest(
    settings: Settings, client: Client, bind: str | None = None, metrics_bind: str | None = None
) -> AsyncIterator[str]:
    """The ingest serving in this process on `bind` (default settings.ingest.bind), its metrics on `metrics_bind`
    (default settings.ingest.metrics_bind; OFF: none); yields its URL. Raises IngestConfigError for a bind or TLS
    setting it cannot start with."""
    try:
        host, port = parse_bind(bind or settings.ingest.bind)
    except ValueError as err:
        raise IngestConfigError(f"ingest.bind {err}") from None
    try:
        metrics_at = settings.ingest.metrics_bind if metrics_bind is None else health_bind(metrics_bind)
    except ValueError as err:
        raise IngestConfigError(f"--metrics-bind {err}") from None
    ssl_context = tls_context(settings, host)
    async with aiohttp.ClientSession() as session:
        # Its /healthz says 503 while Temporal does not answer (the load balancer's target health check).
        ingest = build_ingest(settings, Reporter(client), session, TemporalReachability(client))
        async with serving(build_app(ingest), host, port, ssl_context), serving_metrics(ingest, metrics_at):
            yield f"{'https' if ssl_context else 'http'}://{host}:{port}"


async def run_ingest(args: argparse.Namespace) -> int:
    settings = load_settings(Settings.load, args)
    # Lazy: the ingest starts and answers while Temporal is down (503, so the hosts keep their reports spooled).
    client = await connect(settings.temporal, lazy=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    try:
        async with running_ingest(settings, client, args.bind, args.metrics_bind) as url:
            log.info("ingest %s listening on %s", settings.ingest.id, url)
            if not settings.ingest.allowed_accounts:
                log.warning("ingest.allowed_accounts is empty: every report will be refused (403)")
            if not settings.groups:
                log.warning("no capacity groups configured: every report will be refused (403)")
            await stop.wait()
    except IngestConfigError as err:
        print(f"autorepair ingest: {err}", file=sys.stderr)
        return 2
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
    return 0
