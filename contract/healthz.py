"""GET /healthz for container orchestrators (ECS container health checks, Kubernetes probes, compose healthchecks):
200 while the process can do its work, 503 with the reason while it cannot. The worker (worker/health_endpoint.py)
and the probe (node_probe/health.py) serve it on a port of their own; the ingest answers it on its own port
(ingest/server.py), where its load balancer's target health check looks. `autorepair healthcheck URL`
(operator_cli/healthcheck.py) is what an image without curl runs.

The answer is computed from state the process keeps anyway, never by calling out while the request waits: a check
that blocked on Temporal would time out as the orchestrator's, and tell it nothing more.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Final

from pydantic import BeforeValidator

from contract.formats import parse_bind
from contract.ingest import HEALTH_PATH, METRICS_PATH

if TYPE_CHECKING:
    from aiohttp import web

# Where the worker and the probe serve it by default: loopback, since the checks run inside the container (or on
# the host, with the probe's host networking); the ingest's is on its own bind (ingest.bind, 8480).
DEFAULT_WORKER_HEALTH_BIND: Final = "127.0.0.1:8481"
DEFAULT_PROBE_HEALTH_BIND: Final = "127.0.0.1:8482"
# The ingest's and the probe's Prometheus ports (each with a /healthz of its own); the worker's is 9464.
DEFAULT_INGEST_METRICS_BIND: Final = "127.0.0.1:9480"
PROBE_METRICS_PORT: Final = 9482
# Prometheus' text format, version 0.0.4: what every Prometheus 2 and 3 reads.
METRICS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
# Said instead of HOST:PORT to serve no endpoint (a TOML file cannot say None).
OFF: Final = "off"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What /healthz answers: `problem` None is 200; otherwise 503 and `problem` is the reason, one line."""

    problem: str | None
    checks: Mapping[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> int:
        return 200 if self.problem is None else 503

    def body(self) -> str:
        answer: dict[str, Any] = {"status": "ok" if self.problem is None else "unhealthy"}
        if self.problem is not None:
            answer["reason"] = self.problem
        answer["checks"] = dict(self.checks)
        return json.dumps(answer)


def health_bind(text: str) -> str | None:
    """A health endpoint's bind as a setting or a flag says it: HOST:PORT, or `off` (or empty) for none."""
    if text.strip().lower() in ("", OFF):
        return None
    try:
        parse_bind(text)
    except ValueError as err:
        raise ValueError(f"{err} (or {OFF!r})") from None
    return text


def _health_bind_setting(value: object) -> object:
    return health_bind(value) if isinstance(value, str) else value


# A settings field: HOST:PORT checked when the settings are read, "off" for none.
HealthBind = Annotated[str | None, BeforeValidator(_health_bind_setting)]


@asynccontextmanager
async def serving_health(
    bind: str, verdict: Callable[[], Verdict], metrics: Callable[[], bytes] | None = None
) -> AsyncIterator[str]:
    """GET /healthz on `bind` while inside; yields the URL it answers on (the real port when `bind` says 0).
    `verdict` is called for each request: it must be cheap and must not wait. With `metrics`, GET /metrics answers
    what it returns (Prometheus' text format), under the same rule."""
    # Here, not at the top: the settings that name a bind read this module, and need no web server.
    from aiohttp import web

    async def healthz(request: web.Request) -> web.Response:
        answer = verdict()
        return web.Response(status=answer.status, text=answer.body(), content_type="application/json")

    host, port = parse_bind(bind)
    app = web.Application()
    app.router.add_get(HEALTH_PATH, healthz)
    if metrics is not None:
        render = metrics

        async def scrape(request: web.Request) -> web.Response:
            return web.Response(body=render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

        app.router.add_get(METRICS_PATH, scrape)
    # No access log: an orchestrator asks every few seconds, forever.
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1] if runner.addresses else port
        shown = f"[{host}]" if ":" in host else host
        yield f"http://{shown}:{bound_port}{HEALTH_PATH}"
    finally:
        await runner.cleanup()
