"""A simulated GPU fleet: the world around the repair engine, played against moto over HTTP.

The repair engine (workflows + activities) only ever sees AWS APIs and the probe's signals. This module plays
everything else a real fleet would do, so the engine runs unchanged:
- EC2 instances of one capacity group, launched from a launch template and spread across availability zones;
- the ECS agent on each instance: registering the container instance after boot, deregistering it (and
  stopping its tasks) when the instance is terminated;
- the ECS service scheduler during a drain: cooperative tasks are moved off a DRAINING instance after a short
  grace; "stubborn" tasks ignore the drain and only stop when someone calls StopTask;
- each node's kernel log (a file) with a real `node_probe` Probe following it, plus fault injection that
  writes real-format NVRM lines into that file, stops the probe for good (agent down) or briefly (a blip).

All randomness comes from one `random.Random(seed)` owned by the fleet, so a seed replays the same fleet.
boto3 is blocking, so every AWS call runs in a thread (`asyncio.to_thread`) and never stalls a worker that
shares the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError
from pydantic import BaseModel, Field, model_validator
from temporalio.client import Client

from contract import names
from contract.health import HealthState
from contract.ids import health_workflow_id
from contract.names import DEFAULT_TASK_QUEUE, GROUP_TAG
from contract.repair import RepairPhase
from workflows.models import InstanceHealthView

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ecs import ECSClient

log = logging.getLogger(__name__)

STUBBORN_TAG = "fleet-sim:stubborn"
STARTED_BY = "fleet-sim"

# The 18 Xids ECS acts on (amazon-ecs-agent dcgm_client.go); every other Xid is counted but never repairs.
CRITICAL_XIDS: tuple[int, ...] = (
    46,
    48,
    54,
    62,
    64,
    74,
    79,
    95,
    109,
    110,
    136,
    140,
    142,
    143,
    151,
    155,
    156,
    158,
)
# The ones real fleets see most; the demo draws its faults from these.
COMMON_CRITICAL_XIDS: tuple[int, ...] = (79, 48, 95, 64, 74, 62, 109)
# Application-caused Xids (bad pointer, MMU fault, channel reset): noise that must never trigger a repair.
NOISE_XIDS: tuple[int, ...] = (13, 31, 43)

# Message texts as the NVIDIA driver prints them after "NVRM: Xid (PCI:...): <code>, pid=..., name=..., ".
_XID_MESSAGES: dict[int, str] = {
    13: "Graphics SM Warp Exception on (GPC 1, TPC 0, SM 1): Out Of Range Address",
    31: (
        "Ch 00000018, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_3 faulted @ 0x7f3c_5a000000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ"
    ),
    43: "Ch 00000010",
    46: "GPU stopped processing",
    48: (
        "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, "
        "subpartition 1."
    ),
    54: "Auxiliary power is not connected to the GPU board",
    62: "Internal micro-controller halt",
    64: "ECC page retirement or row remapper recording failure",
    74: "NVLink: fatal error detected on link 2(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    95: "Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No",
    109: "Context Switch Timeout Error",
    110: "Security Fault Error",
    140: "Unrecovered ECC Error",
}
# Hardware faults are usually reported outside any process context.
_NO_PROCESS_XIDS = {48, 54, 62, 64, 74, 95, 110, 140}

# PCI bus addresses of the 8 H100s in a p5.48xlarge.
P5_GPU_PCI: tuple[str, ...] = (
    "0000:53:00",
    "0000:64:00",
    "0000:75:00",
    "0000:86:00",
    "0000:97:00",
    "0000:a8:00",
    "0000:b9:00",
    "0000:ca:00",
)

_RUNNING_STATES = {"pending", "running"}
_GONE_STATES = {"shutting-down", "terminated", "stopping", "stopped"}


class SimTiming(BaseModel):
    """Every time constant of the simulation, scaled so a demo repair completes in well under a minute."""

    boot_delay: timedelta = Field(default=timedelta(seconds=3), description="Launch -> ECS agent registers")
    drain_grace: timedelta = Field(default=timedelta(seconds=2), description="DRAINING -> scheduler moves tasks")
    heartbeat_interval: timedelta = timedelta(seconds=2)
    heartbeat_loss_threshold: timedelta = timedelta(seconds=8)
    blip: timedelta = Field(default=timedelta(seconds=3), description="How long a blip keeps the probe down")
    watch_interval: timedelta = timedelta(milliseconds=500)
    probe_poll_interval: timedelta = timedelta(milliseconds=200)

    @model_validator(mode="after")
    def _blip_below_threshold(self) -> SimTiming:
        # A blip must recover before the engine could call it a heartbeat loss: the worst-case silence is one
        # full interval before the blip plus the blip itself.
        if self.blip + self.heartbeat_interval >= self.heartbeat_loss_threshold:
            raise ValueError("blip + heartbeat_interval must stay below heartbeat_loss_threshold")
        return self


class SimWorkload(BaseModel):
    """What runs on each instance."""

    tasks_per_instance: tuple[int, int] = (2, 4)
    stop_timeouts_s: tuple[int, ...] = (2, 4, 6, 8)
    # Chance that an instance also runs one stubborn task (ignores the drain, stops only on StopTask).
    stubborn_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    task_cpu: int = 256
    task_memory: int = 512

    @model_validator(mode="after")
    def _sane(self) -> SimWorkload:
        low, high = self.tasks_per_instance
        if not 1 <= low <= high:
            raise ValueError("tasks_per_instance must be (low, high) with 1 <= low <= high")
        if not self.stop_timeouts_s or any(not 2 <= t <= 120 for t in self.stop_timeouts_s):
            raise ValueError("stop_timeouts_s must be non-empty, each within ECS's 2..120 s")
        return self


@dataclass
class SimTask:
    arn: str
    family: str
    stop_timeout_s: int
    stubborn: bool


@dataclass
class SimNode:
    """One simulated instance: its AWS identity, its kernel log, and its probe."""

    instance_id: str
    name: str
    availability_zone: str
    kernel_log: Path
    initial: bool
    seen_at: float  # monotonic; the boot delay counts from here
    uptime_base_s: float
    gpu_uuids: dict[str, str]
    container_instance_arn: str | None = None
    task_plan: list[tuple[int, bool]] | None = None  # (stop timeout, stubborn) per task, drawn once
    tasks: dict[str, SimTask] = field(default_factory=dict)
    booted: bool = False  # registered, tasks started, kernel log written, probe started
    probe: asyncio.Task[None] | None = None
    probe_started: bool = False
    probe_error: str | None = None
    agent_down: bool = False
    terminated: bool = False
    draining_since: float | None = None
    drained: bool = False
    kernel_lines: list[str] = field(default_factory=list)

    @property
    def registered(self) -> bool:
        return self.container_instance_arn is not None

    @property
    def probe_running(self) -> bool:
        return self.probe is not None and not self.probe.done()

    def uptime(self) -> float:
        return self.uptime_base_s + (time.monotonic() - self.seen_at)


class FleetSnapshot(BaseModel):
    """What a live summary shows: AWS's view (EC2, ECS) and the engine's view (health workflows)."""

    taken_at: datetime
    ec2_states: dict[str, int]
    container_active: int
    container_draining: int
    running_tasks: int
    # Running, registered instances -> overall health from the health workflow (None: no answer yet).
    health: dict[str, HealthState | None]
    repair_phase: dict[str, RepairPhase]
    retired: list[str]
    initial_instances: list[str]
    replacements_running: list[str]
    terminated: list[str]
    booting: list[str]
    probe_errors: dict[str, str]

    @property
    def running(self) -> int:
        return self.ec2_states.get("running", 0)

    def count(self, state: HealthState) -> int:
        return sum(1 for status in self.health.values() if status == state)

    @property
    def healthy(self) -> int:
        return self.count(HealthState.OK)

    @property
    def impaired(self) -> int:
        return self.count(HealthState.IMPAIRED)


ProbeRunner = Callable[["SimulatedFleet", SimNode], Awaitable[None]]


async def run_real_probe(fleet: SimulatedFleet, node: SimNode) -> None:
    """The real node probe, following the node's kernel log and signalling its health workflow."""
    # Imported here so the AWS side of the simulator (and its tests) works without Temporal or the probe.
    from node_probe.delivery.reporter import Reporter
    from node_probe.probe import Probe, ProbeConfig

    if fleet.client is None:
        raise RuntimeError("a probe needs a Temporal client")
    config = ProbeConfig(
        instance_id=node.instance_id,
        group=fleet.group,
        kernel_log=node.kernel_log,
        heartbeat_interval=fleet.timing.heartbeat_interval,
        poll_interval=fleet.timing.probe_poll_interval,
        task_queue=fleet.task_queue,
        # A file spool, as on a real host: a finding not yet delivered survives a blip's probe restart.
        spool_dir=fleet.state_dir / "spool",
        # Retries at the demo's time scale, not production's.
        retry_max_backoff=fleet.timing.heartbeat_interval,
    )
    reporter = Reporter(fleet.client)
    await Probe(config, reporter).run()


class SimulatedFleet:
    """Plays one capacity group's instances, ECS agents, service scheduler and node probes against moto."""

    def __init__(
        self,
        *,
        group: str,
        cluster: str,
        state_dir: Path,
        instances: int,
        seed: int = 7,
        launch_template: str | None = None,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        instance_type: str = "p5.48xlarge",
        image_id: str = "ami-12c6146b",
        availability_zones: int = 3,
        timing: SimTiming | None = None,
        workload: SimWorkload | None = None,
        client: Client | None = None,
        task_queue: str = DEFAULT_TASK_QUEUE,
        probe_runner: ProbeRunner | None = None,
    ) -> None:
        if instances < 1:
            raise ValueError("instances must be >= 1")
        self.group = group
        self.cluster = cluster
        self.state_dir = Path(state_dir)
        self.instance_count = instances
        self.launch_template = launch_template or f"{group}-lt"
        self.region = region
        self.endpoint_url = endpoint_url
        self.instance_type = instance_type
        self.image_id = image_id
        self.availability_zones = availability_zones
        self.timing = timing or SimTiming()
        self.workload = workload or SimWorkload()
        self.client = client
        self.task_queue = task_queue
        # No client, no probe: the AWS side alone (what the simulator's own tests exercise).
        self._probe_runner: ProbeRunner | None = probe_runner or (run_real_probe if client is not None else None)
        self.rng = random.Random(seed)
        self.nodes: dict[str, SimNode] = {}
        self._families: dict[int, str] = {}  # stop timeout -> task definition family
        self._name_counter = 0
        self._watch: asyncio.Task[None] | None = None
        self._restarts: set[asyncio.Task[None]] = set()
        self._closed = False
        # Fewer retries than the engine's: a failed tick is simply retried on the next one.
        boto_config = Config(retries={"max_attempts": 3, "mode": "standard"})
        self._ec2: EC2Client = boto3.client("ec2", region_name=region, endpoint_url=endpoint_url, config=boto_config)
        self._ecs: ECSClient = boto3.client("ecs", region_name=region, endpoint_url=endpoint_url, config=boto_config)

    # --- Setup ----------------------------------------------------------------------------------------------

    async def setup(self, *, watch: bool = True) -> list[str]:
        """Cluster, task definitions, launch template, N registered instances with tasks; then watch."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "nodes").mkdir(exist_ok=True)
        launched = await asyncio.to_thread(self._setup_aws)
        now = time.monotonic()
        for instance_id, az in launched:
            node = self._new_node(instance_id, az, initial=True, seen_at=now)
            # The initial fleet is already booted: register at once rather than after the boot delay.
            await self._boot(node)
        if watch:
            self.start_watching()
        return [instance_id for instance_id, _ in launched]

    def _setup_aws(self) -> list[tuple[str, str]]:
        self._freeze_moto_task_lifecycle()
        self._ecs.create_cluster(clusterName=self.cluster)
        for stop_timeout in sorted(set(self.workload.stop_timeouts_s)):
            family = f"{self.cluster}-job-stop{stop_timeout}s"
            self._ecs.register_task_definition(
                family=family,
                requiresCompatibilities=["EC2"],
                containerDefinitions=[
                    {
                        "name": "job",
                        "image": "public.ecr.aws/docker/library/python:3.12-slim",
                        "cpu": self.workload.task_cpu,
                        "memory": self.workload.task_memory,
                        "essential": True,
                        "stopTimeout": stop_timeout,
                        "resourceRequirements": [{"type": "GPU", "value": "1"}],
                    }
                ],
            )
            self._families[stop_timeout] = family
        self._ensure_launch_template()
        zones = [
            zone["ZoneName"]
            for zone in self._ec2.describe_availability_zones(Filters=[{"Name": "state", "Values": ["available"]}])[
                "AvailabilityZones"
            ]
        ]
        zones = sorted(zones)[: self.availability_zones] or [f"{self.region}a"]
        # Round-robin across zones, like an ASG balancing its AZs.
        per_zone = Counter(zones[i % len(zones)] for i in range(self.instance_count))
        launched: list[tuple[str, str]] = []
        for zone in zones:
            if not per_zone[zone]:
                continue
            reservation = self._ec2.run_instances(
                LaunchTemplate={"LaunchTemplateName": self.launch_template, "Version": "$Latest"},
                MinCount=per_zone[zone],
                MaxCount=per_zone[zone],
                Placement={"AvailabilityZone": zone},
            )
            launched += [(instance["InstanceId"], zone) for instance in reservation["Instances"]]
        return launched

    def _freeze_moto_task_lifecycle(self) -> None:
        """Tasks stop only when someone calls StopTask, as on a real instance.

        By default moto moves a task one step towards STOPPED (lastStatus) on every DescribeTasks, so an
        engine that polls its tasks would see stubborn tasks stop by themselves. The setting is global to the
        moto server, which belongs to the simulated world anyway. No endpoint (real AWS): nothing to do.
        """
        if self.endpoint_url is None:
            return
        body = json.dumps(
            {"model_name": "ecs::task", "transition": {"progression": "manual", "times": 1_000_000_000}}
        ).encode()
        request = urllib.request.Request(
            f"{self.endpoint_url.rstrip('/')}/moto-api/state-manager/set-transition", data=body, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=5):
                pass
        except OSError as err:
            log.warning("fleet-sim: could not pin moto's task lifecycle: %s", err)

    def _ensure_launch_template(self) -> None:
        # The group tag lives in the template, so a replacement the engine launches from it is recognised as a
        # member of the group (and picked up by the watch loop) whatever tags the launch call itself passes.
        try:
            self._ec2.create_launch_template(
                LaunchTemplateName=self.launch_template,
                LaunchTemplateData={
                    "ImageId": self.image_id,
                    "InstanceType": self.instance_type,  # type: ignore[typeddict-item]
                    "TagSpecifications": [
                        {
                            "ResourceType": "instance",
                            "Tags": [
                                {"Key": GROUP_TAG, "Value": self.group},
                                {"Key": "Name", "Value": f"{self.group}-node"},
                            ],
                        }
                    ],
                },
            )
        except ClientError as err:
            if "AlreadyExists" not in err.response.get("Error", {}).get("Code", ""):
                raise

    def _new_node(self, instance_id: str, az: str, *, initial: bool, seen_at: float) -> SimNode:
        self._name_counter += 1
        node = SimNode(
            instance_id=instance_id,
            name=f"{self.group}-{self._name_counter:02d}",
            availability_zone=az,
            kernel_log=self.state_dir / "nodes" / f"{instance_id}.kern.log",
            initial=initial,
            seen_at=seen_at,
            uptime_base_s=self.rng.uniform(600.0, 90_000.0),
            gpu_uuids={pci: f"GPU-{uuid.UUID(int=self.rng.getrandbits(128), version=4)}" for pci in P5_GPU_PCI},
        )
        self.nodes[instance_id] = node
        return node

    # --- Booting a node: ECS registration, tasks, kernel log, probe -----------------------------------------

    async def _boot(self, node: SimNode) -> None:
        """Idempotent: a boot that failed half way (a moto error) resumes where it stopped on the next tick."""
        if node.task_plan is None:
            node.task_plan = self._plan_tasks()
        await asyncio.to_thread(self._register_and_start_tasks, node, node.task_plan)
        if not node.booted:
            self._write_boot_log(node)
            node.booted = True
        self._start_probe(node)

    def _plan_tasks(self) -> list[tuple[int, bool]]:
        """(stop timeout, stubborn) per task, drawn on the loop so the rng's sequence never varies."""
        low, high = self.workload.tasks_per_instance
        plan = [(self.rng.choice(self.workload.stop_timeouts_s), False) for _ in range(self.rng.randint(low, high))]
        if self.rng.random() < self.workload.stubborn_fraction:
            # The last one ignores the drain: only the engine's StopTask after its stop timeout ends it.
            plan[-1] = (plan[-1][0], True)
            if len(plan) == 1:
                plan.insert(0, (self.rng.choice(self.workload.stop_timeouts_s), False))
        return plan

    def _register_and_start_tasks(self, node: SimNode, plan: list[tuple[int, bool]]) -> None:
        region = self.region
        document = {
            "instanceId": node.instance_id,
            "availabilityZone": node.availability_zone,
            "region": region,
        }
        if node.container_instance_arn is None:
            self._ec2.create_tags(Resources=[node.instance_id], Tags=[{"Key": "Name", "Value": node.name}])
            registered = self._ecs.register_container_instance(
                cluster=self.cluster,
                instanceIdentityDocument=json.dumps(document),
            )
            node.container_instance_arn = registered["containerInstance"]["containerInstanceArn"]
        # One task per plan entry: skip those a failed earlier attempt already started.
        for stop_timeout, stubborn in plan[len(node.tasks) :]:
            family = self._families[stop_timeout]
            started = self._ecs.start_task(
                cluster=self.cluster,
                taskDefinition=family,
                containerInstances=[node.container_instance_arn],
                startedBy=STARTED_BY,
                tags=[{"key": STUBBORN_TAG, "value": "true" if stubborn else "false"}],
            )
            for task in started["tasks"]:
                arn = task["taskArn"]
                node.tasks[arn] = SimTask(arn=arn, family=family, stop_timeout_s=stop_timeout, stubborn=stubborn)

    def _write_boot_log(self, node: SimNode) -> None:
        # What dmesg holds after a clean boot: the probe must read it as history and find nothing to report.
        lines = [
            "[    4.812345] nvidia: loading out-of-tree module taints kernel.",
            "[    4.913020] nvidia-nvlink: Nvlink Core is being initialized, major device number 510",
            "[    5.104871] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024",
        ]
        lines += [
            f"[    9.{200000 + i:06d}] NVRM: GPU at PCI:{pci}: {node.gpu_uuids[pci]}"
            for i, pci in enumerate(P5_GPU_PCI)
        ]
        self._append(node, lines)

    # --- Probes ---------------------------------------------------------------------------------------------

    def _start_probe(self, node: SimNode) -> None:
        if self._probe_runner is None or node.agent_down or node.terminated or node.probe_running or self._closed:
            return
        node.probe_error = None
        node.probe = asyncio.create_task(self._probe_main(node), name=f"probe {node.instance_id}")
        node.probe_started = True

    async def _probe_main(self, node: SimNode) -> None:
        assert self._probe_runner is not None
        try:
            await self._probe_runner(self, node)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            # A crashed probe is a silent node: the engine will (rightly) see a heartbeat loss. Keep the
            # reason visible in snapshots instead of losing it in a never-awaited task.
            node.probe_error = f"{type(err).__name__}: {err}"
            log.exception("probe for %s crashed", node.instance_id)

    async def _stop_probe(self, node: SimNode) -> None:
        probe, node.probe = node.probe, None
        if probe is not None and not probe.done():
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe

    # --- Watch loop -----------------------------------------------------------------------------------------

    def start_watching(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._watch_loop(), name=f"fleet-sim watch {self.group}")

    async def _watch_loop(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                # moto hiccups or a race with the engine: the next tick sees the world again from scratch.
                log.exception("fleet-sim tick failed")
            await asyncio.sleep(self.timing.watch_interval.total_seconds())

    async def tick(self) -> None:
        """One look at the world: boot new instances, move tasks off draining ones, bury terminated ones."""
        instances, statuses = await asyncio.to_thread(self._observe)
        draining = {arn for arn, status in statuses.items() if status == "DRAINING"}
        now = time.monotonic()
        for instance_id, (state, az) in instances.items():
            node = self.nodes.get(instance_id)
            if node is None:
                if state not in _RUNNING_STATES:
                    continue
                node = self._new_node(instance_id, az, initial=False, seen_at=now)
                log.info("fleet-sim: new instance %s in %s, booting", instance_id, az)
            if state in _GONE_STATES and not node.terminated:
                await self._bury(node)
            elif (
                state == "running"
                and not node.booted
                and not node.terminated
                and now - node.seen_at >= self.timing.boot_delay.total_seconds()
            ):
                await self._boot(node)
        for node in self.nodes.values():
            if node.terminated or node.container_instance_arn is None:
                continue
            if node.container_instance_arn not in draining:
                # Back to ACTIVE (or never drained): a later drain starts its grace afresh.
                node.draining_since, node.drained = None, False
                continue
            if node.draining_since is None:
                node.draining_since = now
            if not node.drained and now - node.draining_since >= self.timing.drain_grace.total_seconds():
                await asyncio.to_thread(self._move_cooperative_tasks, node)
                node.drained = True

    def _observe(self) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
        """Group instances (id -> (EC2 state, AZ)) and the cluster's container instances (ARN -> status)."""
        instances: dict[str, tuple[str, str]] = {}
        paginator = self._ec2.get_paginator("describe_instances")
        for page in paginator.paginate(Filters=[{"Name": f"tag:{GROUP_TAG}", "Values": [self.group]}]):
            for reservation in page["Reservations"]:
                for instance in reservation["Instances"]:
                    instances[instance["InstanceId"]] = (
                        instance["State"]["Name"],
                        instance.get("Placement", {}).get("AvailabilityZone", ""),
                    )
        return instances, self._container_statuses()

    def _container_statuses(self) -> dict[str, str]:
        """Container instance ARN -> status, read from DescribeContainerInstances.

        Not ListContainerInstances' `status` filter: older moto releases ignore it and list every instance.
        """
        arns: list[str] = []
        paginator = self._ecs.get_paginator("list_container_instances")
        for page in paginator.paginate(cluster=self.cluster):
            arns += page["containerInstanceArns"]
        statuses: dict[str, str] = {}
        for start in range(0, len(arns), 100):  # DescribeContainerInstances takes at most 100
            described = self._ecs.describe_container_instances(
                cluster=self.cluster, containerInstances=arns[start : start + 100]
            )
            for ci in described["containerInstances"]:
                statuses[ci["containerInstanceArn"]] = ci["status"]
        return statuses

    def _running_task_arns(self, node: SimNode) -> list[str]:
        assert node.container_instance_arn is not None
        arns: list[str] = []
        paginator = self._ecs.get_paginator("list_tasks")
        for page in paginator.paginate(
            cluster=self.cluster, containerInstance=node.container_instance_arn, desiredStatus="RUNNING"
        ):
            arns += page["taskArns"]
        return arns

    def _move_cooperative_tasks(self, node: SimNode) -> None:
        """The service scheduler's part of a drain: stop every task that honours it; stubborn ones stay."""
        for arn in self._running_task_arns(node):
            task = node.tasks.get(arn)
            if task is not None and task.stubborn:
                continue
            self._ecs.stop_task(cluster=self.cluster, task=arn, reason="fleet-sim: moved off a DRAINING instance")
        log.info("fleet-sim: moved cooperative tasks off draining %s", node.instance_id)

    async def _bury(self, node: SimNode) -> None:
        node.terminated = True
        await self._stop_probe(node)
        await asyncio.to_thread(self._deregister_gone, node)
        log.info("fleet-sim: %s terminated, probe stopped", node.instance_id)

    def _deregister_gone(self, node: SimNode) -> None:
        # ECS does this itself when an instance is terminated: its tasks stop and the container instance
        # leaves the cluster. Skipped when the engine already deregistered it (moto answers that with a 500).
        arn = node.container_instance_arn
        if arn is None:
            return
        described = self._ecs.describe_container_instances(cluster=self.cluster, containerInstances=[arn])
        if not described["containerInstances"]:
            return
        for task_arn in self._running_task_arns(node):
            self._ecs.stop_task(cluster=self.cluster, task=task_arn, reason="fleet-sim: instance terminated")
        with contextlib.suppress(ClientError):
            self._ecs.deregister_container_instance(cluster=self.cluster, containerInstance=arn, force=True)

    # --- Fault injection ------------------------------------------------------------------------------------

    def node(self, instance_id: str) -> SimNode:
        try:
            return self.nodes[instance_id]
        except KeyError:
            raise KeyError(f"{instance_id} is not an instance of the simulated group {self.group}") from None

    def live_instances(self) -> list[str]:
        """Booted, not terminated: the instances a fault can be injected into."""
        return [n.instance_id for n in self.nodes.values() if n.booted and not n.terminated]

    def write_kernel_lines(self, instance_id: str, lines: list[str]) -> None:
        self._append(self.node(instance_id), lines)

    def _append(self, node: SimNode, lines: list[str]) -> None:
        node.kernel_log.parent.mkdir(parents=True, exist_ok=True)
        # One write of whole lines: the probe never sees half a line.
        with node.kernel_log.open("a", encoding="utf-8") as handle:
            handle.write("".join(f"{line}\n" for line in lines))
        node.kernel_lines += lines

    def _stamp(self, node: SimNode) -> str:
        uptime = node.uptime()
        seconds = int(uptime)
        micros = int((uptime - seconds) * 1_000_000)
        return f"[{seconds:5d}.{micros:06d}]"

    def xid_line(self, node: SimNode, xid: int, pci: str | None = None) -> str:
        """One NVRM Xid line exactly as the driver writes it to the kernel log."""
        pci = pci or self.rng.choice(P5_GPU_PCI)
        if xid in _NO_PROCESS_XIDS:
            process = "pid='<unknown>', name=<unknown>"
        else:
            process = f"pid={self.rng.randint(1000, 65000)}, name={self.rng.choice(['python3', 'pt_main_thread'])}"
        message = _XID_MESSAGES.get(xid, "Xid event, see the NVIDIA Xid catalog")
        return f"{self._stamp(node)} NVRM: Xid (PCI:{pci}): {xid}, {process}, {message}"

    def inject_fault(self, instance_id: str, xid: int | None = None) -> str:
        """A critical GPU fault (one of ECS's 18 Xids): the instance must become IMPAIRED and be repaired."""
        node = self.node(instance_id)
        xid = self.rng.choice(COMMON_CRITICAL_XIDS) if xid is None else xid
        if xid not in CRITICAL_XIDS:
            raise ValueError(f"Xid {xid} is not one of ECS's critical Xids {CRITICAL_XIDS}")
        pci = self.rng.choice(P5_GPU_PCI)
        lines = [self.xid_line(node, xid, pci)]
        if xid == 79:
            # The driver repeats the news in its own words right after the Xid: a probe must not count the
            # one fault twice.
            lines.append(f"{self._stamp(node)} NVRM: GPU {pci}.0: GPU has fallen off the bus.")
        self._append(node, lines)
        log.info("fleet-sim: injected Xid %d on %s (%s)", xid, instance_id, pci)
        return lines[0]

    def inject_noise(self, instance_id: str, xid: int | None = None) -> str:
        """An application-caused Xid (13/31/43): counted, never a repair."""
        node = self.node(instance_id)
        xid = self.rng.choice(NOISE_XIDS) if xid is None else xid
        if xid in CRITICAL_XIDS:
            raise ValueError(f"Xid {xid} is critical, not noise")
        line = self.xid_line(node, xid)
        self._append(node, [line])
        return line

    async def heartbeat_loss(self, instance_id: str) -> None:
        """The node's agent goes down for good: no more heartbeats; the engine must impair it by threshold."""
        node = self.node(instance_id)
        node.agent_down = True
        await self._stop_probe(node)
        log.info("fleet-sim: agent down on %s", instance_id)

    async def blip(self, instance_id: str, duration: timedelta | None = None) -> None:
        """A short agent disconnect that heals on its own (must never trigger anything). Returns at once."""
        node = self.node(instance_id)
        duration = duration or self.timing.blip
        await self._stop_probe(node)
        restart = asyncio.create_task(self._restart_after(node, duration), name=f"blip {instance_id}")
        self._restarts.add(restart)
        restart.add_done_callback(self._restarts.discard)
        log.info("fleet-sim: blip on %s for %.1fs", instance_id, duration.total_seconds())

    async def _restart_after(self, node: SimNode, duration: timedelta) -> None:
        await asyncio.sleep(duration.total_seconds())
        self._start_probe(node)

    # --- Observation ----------------------------------------------------------------------------------------

    async def snapshot(self) -> FleetSnapshot:
        counts = await asyncio.to_thread(self._count_aws)
        live = [n for n in self.nodes.values() if n.booted and not n.terminated]
        views = await asyncio.gather(*(self._query_health(n.instance_id) for n in live))
        health: dict[str, HealthState | None] = {}
        phases: dict[str, RepairPhase] = {}
        retired: list[str] = []
        for node, view in zip(live, views, strict=True):
            health[node.instance_id] = None if view is None else view.healthStatus.overallStatus
            if view is not None and view.repair is not None:
                phases[node.instance_id] = view.repair.phase
            if view is not None and view.retired:
                retired.append(node.instance_id)
        return FleetSnapshot(
            taken_at=datetime.now(UTC),
            ec2_states=counts["ec2"],
            container_active=counts["ecs"].get("ACTIVE", 0),
            container_draining=counts["ecs"].get("DRAINING", 0),
            running_tasks=counts["tasks"].get("RUNNING", 0),
            health=health,
            repair_phase=phases,
            retired=retired,
            initial_instances=[n.instance_id for n in self.nodes.values() if n.initial],
            replacements_running=[n.instance_id for n in live if not n.initial],
            terminated=[n.instance_id for n in self.nodes.values() if n.terminated],
            booting=[n.instance_id for n in self.nodes.values() if not n.booted and not n.terminated],
            probe_errors={n.instance_id: n.probe_error for n in self.nodes.values() if n.probe_error},
        )

    def _count_aws(self) -> dict[str, dict[str, int]]:
        instances, statuses = self._observe()
        ec2 = Counter(state for state, _ in instances.values())
        ecs = Counter(statuses.values())
        running = 0
        paginator = self._ecs.get_paginator("list_tasks")
        for page in paginator.paginate(cluster=self.cluster, desiredStatus="RUNNING"):
            running += len(page["taskArns"])
        return {"ec2": dict(ec2), "ecs": dict(ecs), "tasks": {"RUNNING": running}}

    async def _query_health(self, instance_id: str) -> InstanceHealthView | None:
        if self.client is None:
            return None
        handle = self.client.get_workflow_handle(health_workflow_id(instance_id))
        try:
            return await handle.query(
                names.QUERY_HEALTH, result_type=InstanceHealthView, rpc_timeout=timedelta(seconds=3)
            )
        except Exception:
            # Not started yet (no heartbeat so far), or no worker to answer: unknown, not unhealthy.
            return None

    async def health(self, instance_id: str) -> InstanceHealthView | None:
        return await self._query_health(instance_id)

    # --- Shutdown -------------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Cancel the watch loop, every probe and pending blip restart. AWS state is left as is (moto's)."""
        self._closed = True
        tasks: list[asyncio.Task[Any]] = [t for t in self._restarts if not t.done()]
        if self._watch is not None and not self._watch.done():
            tasks.append(self._watch)
        tasks += [n.probe for n in self.nodes.values() if n.probe is not None and not n.probe.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for node in self.nodes.values():
            node.probe = None
        self._watch = None

    async def __aenter__(self) -> SimulatedFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
