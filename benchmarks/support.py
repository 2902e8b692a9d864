"""The benchmarks' own helpers: a free port, appending to a log, running a probe, waiting for a condition, and a
local stack (Temporal dev server, moto, an in-process worker, a simulated fleet running the real probe).

The stack's pieces are imported where the stack starts: the other parts need neither Temporal nor moto.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from node_probe.classify.catalog import default_catalog
from node_probe.probe import Probe
from simulator.events import group_events, repaired_instances
from simulator.fleet import COMMON_CRITICAL_XIDS, SimTiming, SimulatedFleet

if TYPE_CHECKING:
    from temporalio.client import Client

    from worker.settings import Settings

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]

# The faults part B writes: the ones real fleets see most (the simulator's common critical Xids), then three more
# of ECS's list; checked against the shipped catalog's ECS column (check_critical_xids), so every fault written
# must impair under the default `ecs` policy.
CRITICAL_XIDS: tuple[int, ...] = (*COMMON_CRITICAL_XIDS, 46, 140, 143)


def check_critical_xids() -> None:
    not_ecs = sorted(set(CRITICAL_XIDS) - set(default_catalog().ecs_codes))
    if not_ecs:
        raise ValueError(f"benchmark fault Xids not in ECS's list of the shipped catalog: {not_ecs}")


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


@contextlib.asynccontextmanager
async def running(probe: Probe) -> AsyncIterator[Probe]:
    """The probe's run loop as a task, cancelled (an in-process stop: its finally blocks run) on the way out."""
    task = asyncio.create_task(probe.run())
    try:
        yield probe
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll a cheap condition every 5 ms; False if it did not hold within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def eventually(
    probe: Callable[[], Awaitable[T]], accept: Callable[[T], bool], *, within: float = 120, every: float = 0.5
) -> T:
    """Poll until `accept(await probe())` and return that value; raise if it does not happen within `within` s."""
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
                raise TimeoutError(f"condition not met within {within}s; last value: {value!r}")
        await asyncio.sleep(every)


# --- The local stack ------------------------------------------------------------------------------------------


@dataclass
class LocalFleet:
    """A simulated capacity group on the local stack, and the events the engine wrote for it."""

    sim: SimulatedFleet
    settings: Settings
    events_path: Path
    client: Client
    timing: SimTiming

    @property
    def group(self) -> str:
        return self.settings.groups[0].name

    def events(self, type: str | None = None, instance_id: str | None = None) -> list[dict[str, Any]]:
        return group_events(self.events_path, self.group, type, instance_id)

    async def repairs_finished(self, count: int, within: float = 300) -> list[str]:
        """Wait until `count` repairs have completed and handed their permit back; returns their instances."""

        return await eventually(
            lambda: asyncio.sleep(0, repaired_instances(self.events_path, self.group)),
            lambda done: len(done) >= count,
            within=within,
        )

    async def all_healthy(self, count: int) -> None:
        await eventually(self.sim.snapshot, lambda s: s.healthy == count and s.running == count, within=90)


def engine_settings(
    temporal_address: str, moto_endpoint: str, events_path: Path, group: str, timing: SimTiming
) -> Settings:
    from contract.config import AwsSettings, EventSettings, TemporalSettings
    from contract.groups import AutoRepair, CapacityGroup
    from worker.settings import Settings

    return Settings(
        temporal=TemporalSettings(address=temporal_address, task_queue=f"tq-{uuid.uuid4().hex[:8]}"),
        aws=AwsSettings(endpoint_url=moto_endpoint, region="us-east-1"),
        events=EventSettings(jsonl_path=events_path),
        groups=[
            CapacityGroup(
                name=group,
                cluster=group,
                launch_template=f"{group}-lt",
                auto_repair=AutoRepair.ENABLED,
                heartbeat_loss_threshold=timing.heartbeat_loss_threshold,
                heartbeat_interval=timing.heartbeat_interval,
                task_poll_interval=timedelta(seconds=1),
                permit_reclaim_interval=timedelta(seconds=2),
                replacement_ready_timeout=timedelta(seconds=60),
            )
        ],
    )


@contextlib.asynccontextmanager
async def local_fleet(
    state: Path,
    *,
    instances: int,
    seed: int,
    aws_latency: bool | None = None,
    group_settings: dict[str, Any] | None = None,
) -> AsyncIterator[LocalFleet]:
    """moto and a Temporal dev server on free ports (their files under `state`), the worker in this process, and
    `instances` simulated instances in a new capacity group; all stopped on the way out. `aws_latency`: the worker
    reaches moto through the fault proxy, answering as slowly as AWS (True) or at once (False); None: straight.
    `group_settings`: the group's settings that differ from engine_settings'."""
    from contract.temporal_client import connect
    from simulator.aws_proxy import FlakyAws
    from simulator.servers import MotoServer, TemporalDevServer, free_port
    from worker.main import run_worker

    # boto3 in the worker and the simulator needs credentials; moto accepts any.
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    timing = SimTiming.compressed()
    group = f"gpu-{uuid.uuid4().hex[:8]}"
    events_path = state / "events.jsonl"
    async with (
        MotoServer(state / "moto", port=free_port()) as moto,
        TemporalDevServer(state / "temporal", port=free_port(), ui_port=free_port()) as temporal,
        contextlib.AsyncExitStack() as stack,
    ):
        engine_endpoint = moto.endpoint_url
        if aws_latency is not None:
            proxy = stack.enter_context(FlakyAws(moto.endpoint_url))
            if aws_latency:
                proxy.like_aws()
            engine_endpoint = proxy.url
        settings = engine_settings(temporal.address, engine_endpoint, events_path, group, timing)
        if group_settings:
            settings.groups = [settings.groups[0].model_copy(update=group_settings)]
        client = await connect(settings.temporal)
        sim = SimulatedFleet(
            group=group,
            cluster=group,
            state_dir=state / "fleet",
            instances=instances,
            seed=seed,
            launch_template=f"{group}-lt",
            endpoint_url=moto.endpoint_url,
            client=client,
            task_queue=settings.temporal.task_queue,
            timing=timing,
        )
        worker = asyncio.create_task(run_worker(settings, client), name="benchmark worker")
        try:
            await sim.setup()
            try:
                yield LocalFleet(sim=sim, settings=settings, events_path=events_path, client=client, timing=timing)
            finally:
                await sim.close()
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
