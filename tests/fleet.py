"""A simulated fleet and the engine that repairs it, for the end-to-end tests: real Temporal, moto over HTTP, the
simulated fleet running the real probe, and (by default) an in-process worker.

The simulated fleet and the test's own checks always talk to moto directly, so the world the engine acts on is never
faulted. Only the engine goes through a proxy in front of moto (the fleet's own, or a test's fault-injecting one),
and the fleet follows the engine's calls there, as the demo's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import boto3
from temporalio.client import Client

from contract.groups import AutoRepair
from contract.ids import semaphore_workflow_id
from simulator.aws_proxy import FlakyAws
from simulator.events import group_events, repaired_instances
from simulator.fleet import SimTiming, SimulatedFleet
from simulator.fleet_aws import EngineCalls, ssm_invocation_lookup
from simulator.probes import ProbeRunner
from tests.harness import eventually, make_settings, running_worker, unique
from worker.settings import Settings
from workflows.models import SemaphoreView

# What an idle fleet costs, kept low because every end-to-end test runs one: following the engine's calls, a look
# once a second describes only what they changed, and the whole group every 5 s (what a test did behind the engine's
# back); the probes heartbeat every 2 s. Idle, 6 instances took 13% of a core, 6% now. Both stay far below the boot
# delay and the loss threshold the tests wait on.
TIMING = SimTiming.model_validate(
    SimTiming.compressed().model_dump()
    | {"watch_interval": timedelta(seconds=1), "heartbeat_interval": timedelta(seconds=2)}
)

START_BEFORE_STOP = [
    "RepairStarted",
    "DrainPermitGranted",
    "Draining",
    "ReplacementLaunched",
    "ReplacementReady",
    "TasksStopped",
    "Terminated",
    "RepairCompleted",
    "DrainPermitReleased",
]


@dataclass
class Fleet:
    sim: SimulatedFleet
    settings: Settings
    events_path: Path
    client: Client
    moto_endpoint: str

    # The bound on the test's own queries (None: the client's default).
    query_timeout: ClassVar[timedelta | None] = None
    _ec2: Any = field(default=None, init=False, repr=False)

    @property
    def group(self) -> str:
        return self.settings.groups[0].name

    def events(self, type: str | None = None, instance_id: str | None = None) -> list[dict[str, Any]]:
        return group_events(self.events_path, self.group, type, instance_id)

    def steps(self, instance_id: str) -> list[str]:
        return [e["type"] for e in self.events(instance_id=instance_id) if e["type"] != "HealthChanged"]

    async def repairs_finished(self, count: int, within: float = 300) -> list[str]:
        """Wait until `count` repairs have completed and handed their permit back; returns their instances."""

        return await eventually(
            lambda: asyncio.sleep(0, repaired_instances(self.events_path, self.group)),
            lambda done: len(done) >= count,
            within=within,
        )

    async def all_healthy(self, count: int) -> None:
        await eventually(self.sim.snapshot, lambda s: s.healthy == count and s.running == count, within=90)

    async def semaphore(self) -> SemaphoreView:
        handle = self.client.get_workflow_handle(semaphore_workflow_id(self.group))
        return await handle.query("state", result_type=SemaphoreView, rpc_timeout=self.query_timeout)

    def ec2(self) -> Any:
        # moto itself, never the engine's endpoint: the test's own look must not be faulted nor counted. One client
        # for the test: building one costs tens of milliseconds of CPU, and tests look in polls.
        if self._ec2 is None:
            self._ec2 = boto3.client("ec2", endpoint_url=self.moto_endpoint, region_name="us-east-1")
        return self._ec2

    def replacements_of(self, instance_id: str) -> list[str]:
        pages = self.ec2().describe_instances(
            Filters=[{"Name": "tag:gpu-autorepair:replaces", "Values": [instance_id]}]
        )
        return [i["InstanceId"] for r in pages["Reservations"] for i in r["Instances"]]

    def ec2_state(self, instance_id: str) -> str:
        described = self.ec2().describe_instances(InstanceIds=[instance_id])
        return str(described["Reservations"][0]["Instances"][0]["State"]["Name"])


@asynccontextmanager
async def simulated_fleet(
    client: Client,
    moto_endpoint: str,
    tmp_path: Path,
    *,
    instances: int,
    auto_repair: AutoRepair = AutoRepair.ENABLED,
    in_process_worker: bool = True,
    engine_launch_template: str | None = None,
    engine_proxy: FlakyAws | None = None,
    aws_max_attempts: int | None = None,
    group: str | None = None,
    seed: int = 11,
    group_settings: dict[str, Any] | None = None,
    probe_runner: ProbeRunner | None = None,
) -> AsyncIterator[Fleet]:
    """`instances` simulated instances in a new group, and the engine's settings for it.

    `engine_proxy` (default: one of the fleet's own, without faults) is what the engine's AWS calls go through; the
    fleet follows them there. `aws_max_attempts` (default: the settings' own) is the engine's botocore retries;
    `engine_launch_template` is the one the engine launches replacements from (default: the fleet's own)."""
    async with AsyncExitStack() as stack:
        if engine_proxy is None:
            engine_proxy = stack.enter_context(FlakyAws(moto_endpoint))
        engine_calls = EngineCalls()
        stack.callback(engine_proxy.listen(engine_calls))
        group = group or unique("gpu")
        events_path = tmp_path / "events.jsonl"
        settings = make_settings(
            client,
            engine_proxy.url,
            events_path,
            group=group,
            cluster=group,
            launch_template=engine_launch_template or f"{group}-lt",
            auto_repair=auto_repair,
            heartbeat_loss_threshold=TIMING.heartbeat_loss_threshold,
            heartbeat_interval=TIMING.heartbeat_interval,
        )
        if group_settings:
            settings.groups = [settings.groups[0].model_copy(update=group_settings)]
        if aws_max_attempts is not None:
            settings.aws = settings.aws.model_copy(update={"max_attempts": aws_max_attempts})
        sim = SimulatedFleet(
            group=group,
            cluster=group,
            state_dir=tmp_path / "fleet",
            instances=instances,
            seed=seed,
            launch_template=f"{group}-lt",
            endpoint_url=moto_endpoint,
            client=client,
            task_queue=settings.temporal.task_queue,
            timing=TIMING,
            probe_runner=probe_runner,
            engine_calls=engine_calls,
        )
        if in_process_worker:
            await stack.enter_async_context(running_worker(settings, client))
        engine_proxy.answer_with("GetCommandInvocation", ssm_invocation_lookup(sim.command_not_run), service="ssm")
        await sim.setup()
        stack.push_async_callback(sim.close)
        yield Fleet(sim=sim, settings=settings, events_path=events_path, client=client, moto_endpoint=moto_endpoint)


async def assert_start_before_stop(fleet: Fleet, instance_id: str, *, tolerating: Collection[str] = ()) -> None:
    """The repair of `instance_id` took START_BEFORE_STOP's steps (bar those in `tolerating`), in that order, and
    left one running replacement and the instance terminated."""
    steps = [s for s in fleet.steps(instance_id) if s not in tolerating]
    assert steps == START_BEFORE_STOP, f"{instance_id}: {steps}"
    # EC2 is asked from a thread: the simulated probes share this event loop, and a look that blocks it for as long
    # as the heartbeat-loss threshold (a moto slowed by a loaded machine) makes every instance fall silent at once.
    replacements = await asyncio.to_thread(fleet.replacements_of, instance_id)
    assert len(replacements) == 1, f"{instance_id} has replacements {replacements}"
    assert await asyncio.to_thread(fleet.ec2_state, instance_id) == "terminated"
    assert await asyncio.to_thread(fleet.ec2_state, replacements[0]) == "running"
