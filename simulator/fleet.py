"""A simulated GPU fleet: the world around the repair engine, played against moto over HTTP.

The repair engine (workflows + activities) only ever sees AWS APIs and the probe's signals. The simulated fleet
plays everything else a real fleet would do, so the engine runs unchanged. `SimulatedFleet` is the one object a
demo, a test or a benchmark holds; it runs the watch loop that moves each node through its life and offers fault
injection. The parts it drives:
- simulator.fleet_aws: EC2 and ECS as the instances, ECS agents and service scheduler would use them;
- simulator.kernel_lines: each node's kernel log (a file), in the NVIDIA driver's own words;
- simulator.probes: a real `node_probe` Probe per node following that file.

Faults are real-format NVRM lines written into a node's kernel log, or its probe stopped for good (agent down)
or briefly (a blip). The remediation ladder's reboots and GPU resets are played here too, since moto's
RebootInstances changes nothing and its SSM SendCommand runs nothing: a reboot (seen by the tag the engine's reboot
step leaves) stops the node's probe, and after the boot delay starts it again on a new boot id with a fresh uptime;
a reset (seen among the node's SSM commands) lets the GPU be. Either clears the fault unless the node's scenario says
it persists (its fault's lines again) or the reboot hangs (the probe never comes back). moto's ECS agent is always
connected, so the agent's drop during a reboot is the probe's silence alone.

All randomness comes from one `random.Random(seed)` owned by the fleet, so a seed replays the same fleet. boto3 is
blocking, so every AWS call runs in a thread (`asyncio.to_thread`) and never stalls a worker that shares the event
loop.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import logging
import random
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator
from temporalio.client import Client

from contract import names
from contract.health import HealthState
from contract.ids import health_workflow_id
from contract.names import DEFAULT_TASK_QUEUE
from contract.repair import RepairPhase
from node_probe.classify.catalog import default_catalog
from simulator import kernel_lines
from simulator.fleet_aws import FleetAws, SimWorkload
from simulator.nodes import SimNode
from simulator.probes import NodeProbes, ProbeRunner, run_real_probe
from workflows.models import InstanceHealthView

log = logging.getLogger(__name__)

# The Xids ECS acts on (the catalog's ecs_replaces column); every other Xid is counted but never repairs.
CRITICAL_XIDS: tuple[int, ...] = tuple(sorted(default_catalog().ecs_codes))


def _critical(codes: tuple[int, ...]) -> tuple[int, ...]:
    outside = [code for code in codes if code not in CRITICAL_XIDS]
    if outside:
        raise RuntimeError(f"Xids {outside} are not among ECS's critical Xids {CRITICAL_XIDS}")
    return codes


def _noise(codes: tuple[int, ...]) -> tuple[int, ...]:
    catalog = default_catalog()
    wrong = [code for code in codes if code not in catalog or code in catalog.ecs_codes]
    if wrong:
        raise RuntimeError(f"Xids {wrong} are not catalogued non-critical Xids")
    return codes


# A choice, not a catalog fact: the critical Xids real fleets see most, which injected faults are drawn from
# when no Xid is named. Order matters: the rng picks by position, so reordering changes a seed's faults.
COMMON_CRITICAL_XIDS: tuple[int, ...] = _critical((79, 48, 95, 64, 74, 62, 109))
# Also a choice: application-caused Xids (bad pointer, MMU fault, channel reset), frequent on busy fleets, that
# must never trigger a repair.
NOISE_XIDS: tuple[int, ...] = _noise((13, 31, 43))

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

    @classmethod
    def compressed(cls) -> SimTiming:
        """The end-to-end tests' and benchmarks' timings: a repair completes in seconds."""
        return cls(
            boot_delay=timedelta(seconds=2),
            drain_grace=timedelta(seconds=1),
            heartbeat_interval=timedelta(seconds=1),
            heartbeat_loss_threshold=timedelta(seconds=6),
            blip=timedelta(seconds=3),
        )

    @model_validator(mode="after")
    def _blip_below_threshold(self) -> SimTiming:
        # A blip must recover before the engine could call it a heartbeat loss: the worst-case silence is one
        # full interval before the blip plus the blip itself.
        if self.blip + self.heartbeat_interval >= self.heartbeat_loss_threshold:
            raise ValueError("blip + heartbeat_interval must stay below heartbeat_loss_threshold")
        return self


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
        self.instance_type = instance_type
        self.timing = timing or SimTiming()
        self.workload = workload or SimWorkload()
        self.client = client
        self.task_queue = task_queue
        self.rng = random.Random(seed)
        self.nodes: dict[str, SimNode] = {}
        self.aws = FleetAws(
            group=group,
            cluster=cluster,
            launch_template=self.launch_template,
            region=region,
            endpoint_url=endpoint_url,
            instance_type=instance_type,
            image_id=image_id,
            availability_zones=availability_zones,
            workload=self.workload,
        )
        # No client, no probe: the AWS side alone (what the simulator's own tests exercise).
        runner = probe_runner or (run_real_probe if client is not None else None)
        self._probes = NodeProbes(None if runner is None else functools.partial(runner, self))
        self._name_counter = 0
        self._watch: asyncio.Task[None] | None = None
        # Fault injection: replacements, numbered in the order the fleet sees them launched (1 is the first), whose
        # ECS agent never registers (a bad AMI, an agent that cannot reach ECS). They run in EC2, never in the cluster.
        self.unregistered_replacements: set[int] = set()
        self._replacements_seen = 0
        self._never_registers: set[str] = set()
        self._reboots: set[asyncio.Task[None]] = set()

    # --- Setup ----------------------------------------------------------------------------------------------

    async def setup(self, *, watch: bool = True) -> list[str]:
        """Cluster, task definitions, launch template, N registered instances with tasks; then watch."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "nodes").mkdir(exist_ok=True)
        launched = await asyncio.to_thread(self.aws.setup, self.instance_count)
        now = time.monotonic()
        for instance_id, az in launched:
            node = self._new_node(instance_id, az, initial=True, seen_at=now)
            # The initial fleet is already booted: register at once rather than after the boot delay.
            await self._boot(node)
        if watch:
            self.start_watching()
        return [instance_id for instance_id, _ in launched]

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
            gpu_uuids={
                pci: f"GPU-{uuid.UUID(int=self.rng.getrandbits(128), version=4)}" for pci in kernel_lines.P5_GPU_PCI
            },
        )
        self.nodes[instance_id] = node
        return node

    # --- A node's life: boot (ECS registration, tasks, kernel log, probe), burial ---------------------------

    async def _boot(self, node: SimNode) -> None:
        """Idempotent: a boot that failed half way (a moto error) resumes where it stopped on the next tick."""
        if node.task_plan is None:
            node.task_plan = self.workload.plan_tasks(self.rng)
        await asyncio.to_thread(self.aws.register_and_start_tasks, node, node.task_plan)
        if not node.booted:
            kernel_lines.append(node, kernel_lines.boot_lines(node.gpu_uuids))
            node.booted = True
        self._probes.start(node)

    async def _bury(self, node: SimNode) -> None:
        node.terminated = True
        await self._probes.stop(node)
        await asyncio.to_thread(self.aws.deregister_gone, node)
        log.info("fleet-sim: %s terminated, probe stopped", node.instance_id)

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
        instances, statuses = await asyncio.to_thread(self.aws.observe)
        draining = {arn for arn, status in statuses.items() if status == "DRAINING"}
        now = time.monotonic()
        for instance_id, (state, az) in instances.items():
            node = self.nodes.get(instance_id)
            if node is None:
                if state not in _RUNNING_STATES:
                    continue
                node = self._new_node(instance_id, az, initial=False, seen_at=now)
                self._replacements_seen += 1
                if self._replacements_seen in self.unregistered_replacements:
                    self._never_registers.add(instance_id)
                    log.info("fleet-sim: new instance %s in %s will never register in ECS", instance_id, az)
                else:
                    log.info("fleet-sim: new instance %s in %s, booting", instance_id, az)
            if state in _GONE_STATES and not node.terminated:
                await self._bury(node)
            elif (
                state == "running"
                and not node.booted
                and not node.terminated
                and instance_id not in self._never_registers
                and now - node.seen_at >= self.timing.boot_delay.total_seconds()
            ):
                await self._boot(node)
        for node in list(self.nodes.values()):
            if node.booted and not node.terminated and node.instance_id not in instances:
                # Out of the group (a quarantine takes its group tag off, then stops it): as good as gone here.
                await self._bury(node)
        for instance_id, token in self.aws.reboot_tags.items():
            node = self.nodes.get(instance_id)
            if node is not None and node.booted and not node.terminated and token != node.reboot_token:
                node.reboot_token = token
                self._play_reboot(node)
        for node in self.nodes.values():
            if node.terminated or node.container_instance_arn is None:
                continue
            if node.container_instance_arn in draining:
                # A reset or an evidence command comes only while the repair holds the node DRAINING: look then.
                await self._play_resets(node)
                await self._play_evidence(node)
            if node.container_instance_arn not in draining:
                # Back to ACTIVE (or never drained): a later drain starts its grace afresh.
                node.draining_since, node.drained = None, False
                continue
            if node.draining_since is None:
                node.draining_since = now
            if not node.drained and now - node.draining_since >= self.timing.drain_grace.total_seconds():
                await asyncio.to_thread(self.aws.move_cooperative_tasks, node)
                node.drained = True

    # --- The remediation ladder, played -------------------------------------------------------------------

    def _play_reboot(self, node: SimNode) -> None:
        task = asyncio.create_task(self._reboot(node), name=f"reboot {node.instance_id}")
        self._reboots.add(task)  # held until done: the event loop keeps only a weak reference
        task.add_done_callback(self._reboots.discard)

    async def _reboot(self, node: SimNode) -> None:
        """The host goes down (its probe and agent with it) and boots again: a new boot id, uptime from zero, a clean
        boot's kernel lines, then the fault's lines again when it persists, then the probe."""
        node.rebooting = True
        node.reboots += 1
        await self._probes.stop(node)
        log.info("fleet-sim: %s rebooting", node.instance_id)
        await asyncio.sleep(self.timing.boot_delay.total_seconds())
        if node.reboot_hangs:
            log.info("fleet-sim: %s never comes back from its reboot", node.instance_id)
            return
        node.boot_id = str(uuid.uuid4())
        node.seen_at, node.uptime_base_s = time.monotonic(), 0.0
        kernel_lines.append(node, kernel_lines.boot_lines(node.gpu_uuids))
        self._fault_again(node)
        node.rebooting = False
        self._probes.start(node)
        log.info("fleet-sim: %s back on boot %s", node.instance_id, node.boot_id)

    async def _play_resets(self, node: SimNode) -> None:
        commands = await asyncio.to_thread(self.aws.gpu_reset_commands, node.instance_id)
        for command_id, gpu in commands:
            if command_id in node.resets_seen:
                continue
            node.resets_seen.add(command_id)
            if node.reset_refused:
                log.info("fleet-sim: reset of GPU %s on %s refused (processes hold it)", gpu, node.instance_id)
                continue
            node.resets += 1
            log.info("fleet-sim: GPU %s of %s reset", gpu, node.instance_id)
            self._fault_again(node)

    async def _play_evidence(self, node: SimNode) -> None:
        """What the host's SSM agent would do with an evidence command: its kernel log and a bug report, each PUT
        to its presigned URL (a host without SSM, or an SSM the engine may not use, is the fault proxy's to play)."""
        for command_id, urls in await asyncio.to_thread(self.aws.evidence_commands, node.instance_id):
            if command_id in node.evidence_seen or len(urls) != 2:
                continue
            node.evidence_seen.add(command_id)
            kernel_url, report_url = urls
            kernel_log = node.kernel_log.read_bytes() if node.kernel_log.exists() else b""
            report = gzip.compress(f"simulated nvidia-bug-report.sh of {node.instance_id}\n".encode())
            try:
                await asyncio.to_thread(self.aws.upload, kernel_url, kernel_log)
                await asyncio.to_thread(self.aws.upload, report_url, report)
            except OSError as err:
                log.warning("fleet-sim: %s could not upload its evidence: %s", node.instance_id, err)
                continue
            log.info("fleet-sim: %s uploaded its kernel log and bug report", node.instance_id)

    def _fault_again(self, node: SimNode) -> None:
        if node.fault_persists and node.last_fault is not None:
            xid, pci = node.last_fault
            kernel_lines.append(node, [kernel_lines.xid_line(node, self.rng, xid, pci)])
            log.info("fleet-sim: Xid %d on %s (%s) again: the fault persists", xid, node.instance_id, pci)

    # --- Fault injection ------------------------------------------------------------------------------------

    def node(self, instance_id: str) -> SimNode:
        try:
            return self.nodes[instance_id]
        except KeyError:
            raise KeyError(f"{instance_id} is not an instance of the simulated group {self.group}") from None

    def live_instances(self) -> list[str]:
        """Booted, not terminated: the instances a fault can be injected into."""
        return [n.instance_id for n in self.nodes.values() if n.booted and not n.terminated]

    def inject_fault(self, instance_id: str, xid: int | None = None, pci: str | None = None) -> str:
        """A critical GPU fault (one of ECS's 18 Xids), on `pci` or a GPU drawn at random: the instance must become
        IMPAIRED and be repaired."""
        node = self.node(instance_id)
        xid = self.rng.choice(COMMON_CRITICAL_XIDS) if xid is None else xid
        if xid not in CRITICAL_XIDS:
            raise ValueError(f"Xid {xid} is not one of ECS's critical Xids {CRITICAL_XIDS}")
        pci, lines = kernel_lines.fault_lines(node, self.rng, xid, pci)
        node.last_fault = (xid, pci)
        kernel_lines.append(node, lines)
        log.info("fleet-sim: injected Xid %d on %s (%s)", xid, instance_id, pci)
        return lines[0]

    def inject_noise(self, instance_id: str, xid: int | None = None) -> str:
        """An application-caused Xid (13/31/43): counted, never a repair."""
        node = self.node(instance_id)
        xid = self.rng.choice(NOISE_XIDS) if xid is None else xid
        if xid in CRITICAL_XIDS:
            raise ValueError(f"Xid {xid} is critical, not noise")
        line = kernel_lines.xid_line(node, self.rng, xid)
        kernel_lines.append(node, [line])
        return line

    async def heartbeat_loss(self, instance_id: str) -> None:
        """The node's agent goes down for good: no more heartbeats; the engine must impair it by threshold."""
        node = self.node(instance_id)
        node.agent_down = True
        await self._probes.stop(node)
        log.info("fleet-sim: agent down on %s", instance_id)

    async def blip(self, instance_id: str, duration: timedelta | None = None) -> None:
        """A short agent disconnect that heals on its own (must never trigger anything). Returns at once."""
        node = self.node(instance_id)
        duration = duration or self.timing.blip
        await self._probes.stop(node)
        self._probes.restart_after(node, duration)
        log.info("fleet-sim: blip on %s for %.1fs", instance_id, duration.total_seconds())

    # --- Observation ----------------------------------------------------------------------------------------

    async def snapshot(self) -> FleetSnapshot:
        counts = await asyncio.to_thread(self.aws.count)
        live = [n for n in self.nodes.values() if n.booted and not n.terminated]
        views = await asyncio.gather(*(self.health(n.instance_id) for n in live))
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

    async def health(self, instance_id: str) -> InstanceHealthView | None:
        """The health workflow's view of an instance; None when there is none to ask or it does not answer."""
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

    # --- Shutdown -------------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Cancel the watch loop, every probe and pending blip restart. AWS state is left as is (moto's)."""
        tasks: list[asyncio.Task[Any]] = self._probes.close(self.nodes.values())
        tasks += [task for task in self._reboots if not task.done()]
        if self._watch is not None and not self._watch.done():
            tasks.append(self._watch)
        # Cancel all first, then wait for all: one slow task never delays the others' cancellation.
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
