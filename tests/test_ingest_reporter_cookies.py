"""The probe's HTTP session sends back a load balancer's cookie: what an ALB's duration-based stickiness needs to keep
a host on one ingest replica (deploy/ecs/gpu-autorepair.yaml)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from aiohttp import web
from botocore.credentials import ReadOnlyCredentials

from contract.probe import Heartbeat
from node_probe.delivery.ingest_reporter import IngestReporter


@pytest.fixture
async def balancer() -> AsyncIterator[tuple[str, list[str | None]]]:
    """An HTTP endpoint that, like an ALB with stickiness on, sets AWSALB on its answers; yields its URL (by name, as
    a balancer is reached) and the Cookie header of each request it got."""
    seen: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        response = web.json_response({})
        response.set_cookie("AWSALB", "replica-1", max_age=86400, path="/")
        return response

    app = web.Application()
    app.router.add_post("/{path:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://localhost:{port}", seen
    finally:
        await runner.cleanup()


async def test_the_second_heartbeat_carries_the_cookie_the_first_answer_set(
    balancer: tuple[str, list[str | None]],
) -> None:
    url, seen = balancer
    reporter = IngestReporter(
        url,
        sts_endpoint="http://localhost:1",  # signed into the proof, never called by the reporter
        credentials=lambda: ReadOnlyCredentials("AKIDEXAMPLE", "secret", None),
        use_sessions=False,
    )
    heartbeat = Heartbeat(instance_id="i-0123456789abcdef0", group="gpu-a", sent_at=datetime.now(UTC))
    try:
        await reporter.send_heartbeat(heartbeat, "gpu-autorepair")
        await reporter.send_heartbeat(heartbeat, "gpu-autorepair")
    finally:
        await reporter.close()
    assert seen == [None, "AWSALB=replica-1"]
