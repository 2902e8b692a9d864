"""Shared test set-up: settings pointing at the test servers, an in-process worker, waiting for conditions."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from temporalio.client import Client

from contract.config import AwsSettings, EventSettings, TemporalSettings
from contract.groups import AutoRepair, CapacityGroup
from simulator.engine_process import EngineProcess
from worker.main import build_worker
from worker.settings import Settings

T = TypeVar("T")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# How long a Temporal dev or test server may take to answer after it is spawned: the SDK's 5 s default is too short
# on two cores busy with three test workers.
SERVER_STARTUP_TIMEOUT = timedelta(seconds=60)


def make_settings(
    client: Client,
    moto_endpoint: str,
    events_path: Path,
    *,
    group: str,
    cluster: str,
    launch_template: str | None = None,
    auto_repair: AutoRepair = AutoRepair.ENABLED,
    heartbeat_loss_threshold: timedelta = timedelta(seconds=6),
    heartbeat_interval: timedelta | None = None,
    task_queue: str | None = None,
) -> Settings:
    return Settings(
        temporal=TemporalSettings(
            address=client.service_client.config.target_host,
            namespace=client.namespace,
            task_queue=task_queue or unique("tq"),
        ),
        aws=AwsSettings(endpoint_url=moto_endpoint, region="us-east-1"),
        events=EventSettings(jsonl_path=events_path),
        # Many workers share a test machine: a test that wants the health endpoint gives it a port of its own.
        health_bind_address=None,
        groups=[
            CapacityGroup(
                name=group,
                cluster=cluster,
                launch_template=launch_template,
                auto_repair=auto_repair,
                heartbeat_loss_threshold=heartbeat_loss_threshold,
                # Unless given, the longest interval the threshold allows (the settings require 3 per threshold).
                heartbeat_interval=heartbeat_interval or heartbeat_loss_threshold / 3,
                task_poll_interval=timedelta(seconds=1),
                permit_reclaim_interval=timedelta(seconds=2),
                replacement_ready_timeout=timedelta(seconds=60),
            )
        ],
    )


@asynccontextmanager
async def running_worker(settings: Settings, client: Client) -> AsyncIterator[None]:
    async with build_worker(settings, client):
        yield


@asynccontextmanager
async def worker_process(settings: Settings, log_path: Path) -> AsyncIterator[EngineProcess]:
    """`autorepair worker` as a process of its own, as it runs for real: for a test whose own work (a flood of
    signals, megabytes of payloads to encode) would otherwise take the worker's interpreter lock, and with it the
    2 s the SDK allows a workflow task before it calls it a deadlock."""
    worker = EngineProcess(settings, log_path)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def eventually(
    probe: Callable[[], Awaitable[T]], accept: Callable[[T], bool], *, within: float = 120, every: float = 0.5
) -> T:
    """Poll until `accept(await probe())`; the bound is generous because this asserts behaviour, not speed."""
    deadline = asyncio.get_running_loop().time() + within
    while True:
        try:
            value = await probe()
        except Exception:
            if asyncio.get_running_loop().time() > deadline:
                raise
        else:
            if accept(value):
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"condition not met within {within}s; last value: {value!r}")
        await asyncio.sleep(every)
