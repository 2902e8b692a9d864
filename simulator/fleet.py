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
blocking, so every AWS call runs in a thread of the fleet's own pool (never the event loop's default executor, which
the probes' credentials and the ingest's lookups share) and never stalls a worker that shares the event loop.

What happens on many nodes at once happens side by side, as on real hosts: the nodes a tick boots, drains or buries
are played concurrently (at most AWS_CONCURRENCY calls in flight), and each node's SSM agent plays the engine's
commands (resets, evidence uploads) in a task of its own, so a slow upload never delays a boot.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field, model_validator
from temporalio.client import Client

from contract.health import HealthState
from contract.names import DEFAULT_TASK_QUEUE
from contract.repair import RepairPhase
from node_probe.classify.catalog import default_catalog
from simulator import kernel_lines
from simulator.fleet_aws import AWS_CONCURRENCY, Changes, EngineCalls, FleetAws, SimWorkload
from simulator.fleet_view import FleetSnapshot, FleetWorld, query_health, snapshot_from_visibility
from simulator.nodes import SimNode
from simulator.probes import NodeProbes, ProbeRunner, run_real_probe
from workflows.models import InstanceHealthView

log = logging.getLogger(__name__)

T = TypeVar("T")
__all__ = ["CRITICAL_XIDS", "FleetSnapshot", "SimTiming", "SimulatedFleet"]

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
    # Following the engine's calls (SimulatedFleet's engine_calls), the whole group is described only every
    # max(reconcile_interval, reconcile_per_instance x live instances): 5 s up to 100 instances, 10 s at 200.
    reconcile_interval: timedelta = timedelta(seconds=5)
    reconcile_per_instance: timedelta = timedelta(milliseconds=50)
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
        engine_calls: EngineCalls | None = None,
        probe_kind: str = "real",
    ) -> None:
        """`engine_calls`: the engine's AWS calls as the proxy in front of moto hears them (FlakyAws.listen); with
        them the watch loop describes only what those calls changed, and the whole group at a cadence that grows
        with the fleet (`reconcile_interval`). Without, every tick describes the whole group."""
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
        self.probe_kind = probe_kind  # what probe_runner runs, as the world view names it
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
        # And those (numbered the same way) whose host has a GPU fault, this Xid, before it boots: ACTIVE in ECS,
        # not fit to take work. Set by the fleet, not by a test racing the boot delay.
        self.faulted_replacements: dict[int, int] = {}
        self._replacements_seen = 0
        self._never_registers: set[str] = set()
        self._reboots: set[asyncio.Task[None]] = set()
        self.engine_calls = engine_calls
        self._next_reconcile = 0.0  # monotonic: the first tick looks at everything
        self._container_status: dict[str, str] = {}  # ARN -> status, as last described
        self.reconciles = 0  # full looks at the group
        self.follows = 0  # looks at only what the engine changed
        self.watch_busy_s = 0.0  # wall time the watch loop spent in ticks (its AWS calls, mostly)
        self._pool: ThreadPoolExecutor | None = None  # the fleet's AWS calls, never the loop's default executor
        self._agents: dict[str, asyncio.Task[None]] = {}  # each node's SSM agent, while it plays commands
        self._commands_due: set[str] = set()  # nodes whose agent must look at their commands (again)

    # --- Setup ----------------------------------------------------------------------------------------------

    async def setup(self, *, watch: bool = True) -> list[str]:
        """Cluster, task definitions, launch template, N registered instances with tasks; then watch."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "nodes").mkdir(exist_ok=True)
        launched = await self._aws(self.aws.setup, self.instance_count)
        now = time.monotonic()
        nodes = [self._new_node(instance_id, az, initial=True, seen_at=now) for instance_id, az in launched]
        # The initial fleet is already booted: register at once rather than after the boot delay.
        failed = await self._each(nodes, self._boot)
        if failed:
            raise failed[0]
        if watch:
            self.start_watching()
        return [instance_id for instance_id, _ in launched]

    def _new_node(self, instance_id: str, az: str, *, initial: bool, seen_at: float, adopted: bool = False) -> SimNode:
        """`adopted`: a node this simulator played before it was started again, the same host as its saved identity
        says (where one was saved)."""
        self._name_counter += 1
        kernel_log = self.state_dir / "nodes" / f"{instance_id}.kern.log"
        saved = SimNode.saved_identity(kernel_log, instance_id) if adopted else None
        node = SimNode(
            instance_id=instance_id,
            name=f"{self.group}-{self._name_counter:02d}",
            availability_zone=az,
            kernel_log=kernel_log,
            initial=initial,
            seen_at=seen_at,
            uptime_base_s=self.rng.uniform(600.0, 90_000.0),
            gpu_uuids={
                pci: f"GPU-{uuid.UUID(int=self.rng.getrandbits(128), version=4)}" for pci in kernel_lines.P5_GPU_PCI
            },
        )
        for key, value in (saved or {}).items():
            setattr(node, key, value)
        self.nodes[instance_id] = node
        node.save_identity()
        return node

    async def adopt(self, *, watch: bool = True) -> list[str] | None:
        """A fleet already in moto (this simulator started again after it was killed): its running instances become
        nodes again, the same hosts where their saved identities say so (simulator.nodes), registered ones booted
        with their tasks and probes; nothing is launched or registered anew. None when the group has no instance
        in moto: nothing to adopt, setup() is what is wanted."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "nodes").mkdir(exist_ok=True)
        instances = await self._aws(self.aws.adopt)
        if not instances:
            return None
        registered = await self._aws(self.aws.registered)
        tasks = await self._aws(self.aws.running_tasks)
        now = time.monotonic()
        adopted: list[str] = []
        for instance_id, (state, az) in sorted(instances.items()):
            if state not in _RUNNING_STATES:
                continue
            node = self._new_node(instance_id, az, initial=False, seen_at=now, adopted=True)
            node.reboot_token = self.aws.reboot_tags.get(instance_id)  # a reboot already played, not a new one
            if instance_id in registered:
                arn, status = registered[instance_id]
                node.container_instance_arn = arn
                node.tasks = {task.arn: task for task in tasks.get(arn, [])}
                node.task_plan = [(task.stop_timeout_s, task.stubborn) for task in node.tasks.values()]
                node.booted = True
                self._container_status[arn] = status
                self._probes.start(node)
            adopted.append(instance_id)
        # The reconcile loop boots what is not registered yet, as for any new instance.
        log.info("fleet-sim: adopted %d instances of %s from moto", len(adopted), self.group)
        if watch:
            self.start_watching()
        return adopted

    # --- A node's life: boot (ECS registration, tasks, kernel log, probe), burial ---------------------------

    async def _aws(self, call: Callable[..., T], *args: Any) -> T:
        """One blocking FleetAws call, in the fleet's own pool."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=AWS_CONCURRENCY, thread_name_prefix=f"fleet-sim {self.group}")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(call, *args))

    async def _each(self, nodes: Iterable[SimNode], play: Callable[[SimNode], Awaitable[None]]) -> list[Exception]:
        """`play` on every node side by side; one that fails is logged (the next tick tries again), never stops the
        others. Returns the failures."""
        nodes = list(nodes)
        for node in nodes:
            # Drawn here, in the nodes' order, never inside the concurrent part: a seed replays the same fleet.
            if node.task_plan is None:
                node.task_plan = self.workload.plan_tasks(self.rng)
        results = await asyncio.gather(*(play(node) for node in nodes), return_exceptions=True)
        failed: list[Exception] = []
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, Exception):
                log.warning("fleet-sim: %s on %s failed: %s", getattr(play, "__name__", play), node.instance_id, result)
                failed.append(result)
        return failed

    async def _boot(self, node: SimNode) -> None:
        """Idempotent: a boot that failed half way (a moto error) resumes where it stopped on the next tick."""
        if node.task_plan is None:
            node.task_plan = self.workload.plan_tasks(self.rng)
        await self._aws(self.aws.register_and_start_tasks, node, node.task_plan)
        if not node.booted:
            kernel_lines.append(node, kernel_lines.boot_lines(node.gpu_uuids))
            node.booted = True
        self._probes.start(node)

    async def _bury(self, node: SimNode) -> None:
        node.terminated = True
        await self._probes.stop(node)
        await self._aws(self.aws.deregister_gone, node)
        log.info("fleet-sim: %s terminated, probe stopped", node.instance_id)

    # --- Watch loop -----------------------------------------------------------------------------------------

    def start_watching(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._watch_loop(), name=f"fleet-sim watch {self.group}")

    async def _watch_loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                # moto hiccups or a race with the engine: the next tick sees the world again from scratch.
                log.exception("fleet-sim tick failed")
            finally:
                self.watch_busy_s += time.monotonic() - started
            await asyncio.sleep(self.timing.watch_interval.total_seconds())

    async def tick(self) -> None:
        """One look at the world: boot new instances, move tasks off draining ones, bury terminated ones.

        Without `engine_calls` every tick describes the whole group. With it, a tick describes only what the
        engine's calls changed (nothing at all when it made none), and the whole group at the reconcile interval,
        which grows with the fleet: the safety net for a change made behind the proxy's back."""
        if self.engine_calls is None or time.monotonic() >= self._next_reconcile:
            await self._reconcile()
        else:
            await self._follow()

    def reconcile_interval(self) -> float:
        """Seconds between full looks when following the engine's calls: SimTiming's floor, or more per instance."""
        per_instance = self.timing.reconcile_per_instance.total_seconds() * len(self.live_instances())
        return max(self.timing.reconcile_interval.total_seconds(), per_instance)

    async def _reconcile(self) -> None:
        """The whole group and cluster described, and everything acted on from that."""
        changes = self.engine_calls.take() if self.engine_calls is not None else Changes()
        self.reconciles += 1
        instances, statuses = await self._aws(self.aws.observe)
        self._next_reconcile = time.monotonic() + self.reconcile_interval()
        self._container_status = statuses
        # Out of the group (a quarantine takes its group tag off, then stops it): as good as gone here.
        left = [n for n in self._live_nodes() if n.instance_id not in instances]
        await self._see_instances(instances, left=left)
        self._see_reboots(self.aws.reboot_tags)
        draining = {n.instance_id for n in self._live_nodes() if self._draining(n)}
        # A reset or an evidence command comes only while the repair holds the node DRAINING: look then, and again
        # at a command an agent has not run (its last look failed).
        self._play_commands(draining | changes.commands | self._commands_to_run())
        await self._play_drains()

    async def _follow(self) -> None:
        """Only what the engine changed since the last tick, and the replacements whose boot is due."""
        assert self.engine_calls is not None
        changes = self.engine_calls.take()
        if changes.reconcile:
            self._next_reconcile = 0.0
            await self._reconcile()
            return
        now = time.monotonic()
        boot_due = {
            n.instance_id
            for n in self.nodes.values()
            if not n.booted
            and not n.terminated
            and n.instance_id not in self._never_registers
            and now - n.seen_at >= self.timing.boot_delay.total_seconds()
        }
        asked = changes.instances | boot_due
        if asked:
            self.follows += 1
            instances = await self._aws(self.aws.observe_instances, asked)
            # Asked about and not in the group any more: its group tag is gone.
            left = [n for n in self._live_nodes() if n.instance_id in asked and n.instance_id not in instances]
            await self._see_instances(instances, left=left)
            self._see_reboots({i: t for i, t in self.aws.reboot_tags.items() if i in asked})
        arns = {
            node.container_instance_arn
            for node in self._live_nodes()
            if node.container_instance_arn is not None
            and any(
                named == node.container_instance_arn or node.container_instance_arn.endswith(f"/{named}")
                for named in changes.container_instances
            )
        }
        if arns:
            self.follows += 1
            statuses = await self._aws(self.aws.container_statuses, arns)
            for arn in arns:
                if arn in statuses:
                    self._container_status[arn] = statuses[arn]
                else:
                    self._container_status.pop(arn, None)  # deregistered
        self._play_commands(changes.commands)
        await self._play_drains()

    async def _see_instances(self, instances: dict[str, tuple[str, str]], *, left: list[SimNode]) -> None:
        """New group instances become nodes (booted once the boot delay is over); gone ones, and those that `left`
        the group, are buried: side by side."""
        now = time.monotonic()
        gone: list[SimNode] = list(left)
        boots: list[SimNode] = []
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
                if self._replacements_seen in self.faulted_replacements:
                    self.inject_fault(instance_id, xid=self.faulted_replacements[self._replacements_seen])
            if state in _GONE_STATES and not node.terminated:
                gone.append(node)
            elif (
                state == "running"
                and not node.booted
                and not node.terminated
                and instance_id not in self._never_registers
                and now - node.seen_at >= self.timing.boot_delay.total_seconds()
            ):
                boots.append(node)
        await self._each(gone, self._bury)
        await self._each(boots, self._boot)

    def _see_reboots(self, reboot_tags: dict[str, str]) -> None:
        for instance_id, token in reboot_tags.items():
            node = self.nodes.get(instance_id)
            if node is not None and node.booted and not node.terminated and token != node.reboot_token:
                node.reboot_token = token
                self._play_reboot(node)

    def _live_nodes(self) -> list[SimNode]:
        return [n for n in self.nodes.values() if n.booted and not n.terminated]

    def _draining(self, node: SimNode) -> bool:
        arn = node.container_instance_arn
        return arn is not None and self._container_status.get(arn) == "DRAINING"

    def command_not_run(self, instance_id: str, command_id: str) -> bool:
        """Whether this fleet's instance has yet to run an SSM command the engine sent it (simulator.fleet_aws's
        ssm_invocation_lookup: SSM says InProgress until then). Called from the AWS proxy's threads."""
        node = self.nodes.get(instance_id)
        if node is None or node.terminated or self.engine_calls is None:
            return False
        return self.engine_calls.not_run(instance_id, command_id)

    def _commands_to_run(self) -> set[str]:
        if self.engine_calls is None:
            return set()
        waiting = self.engine_calls.instances_with_commands_to_run()
        for instance_id in waiting:
            node = self.nodes.get(instance_id)
            if node is None or node.terminated:
                self.engine_calls.forget(instance_id)  # not this fleet's, or gone: no agent here will run it
        return waiting

    def _play_commands(self, instance_ids: set[str]) -> None:
        """Each of these nodes' SSM agent looks at the engine's commands (resets, evidence), in a task of its own."""
        for instance_id in sorted(instance_ids):
            node = self.nodes.get(instance_id)
            if node is None or node.terminated or node.container_instance_arn is None:
                continue
            self._commands_due.add(instance_id)
            agent = self._agents.get(instance_id)
            if agent is None or agent.done():
                self._agents[instance_id] = asyncio.create_task(self._ssm_agent(node), name=f"ssm agent {instance_id}")

    async def _ssm_agent(self, node: SimNode) -> None:
        """Until nothing more is due: what the host's SSM agent does with the commands sent to it."""
        try:
            while node.instance_id in self._commands_due and not node.terminated:
                self._commands_due.discard(node.instance_id)
                sent = await self._aws(self.aws.ssm_commands, node.instance_id)
                self._play_resets(node, sent.resets)
                await self._play_evidence(node, sent.evidence)
                if self.engine_calls is not None:
                    self.engine_calls.ran(node.instance_id, sent.ids)
        except Exception as err:  # moto hiccups: the next SendCommand or full look tries again
            log.warning("fleet-sim: %s could not read its SSM commands: %s", node.instance_id, err)
        finally:
            self._agents.pop(node.instance_id, None)

    async def _play_drains(self) -> None:
        """The scheduler's part of a drain, from the last known container statuses: no AWS call to decide."""
        now = time.monotonic()
        moves: list[SimNode] = []
        for node in self._live_nodes():
            if not self._draining(node):
                # Back to ACTIVE (or never drained): a later drain starts its grace afresh.
                node.draining_since, node.drained = None, False
                continue
            if node.draining_since is None:
                node.draining_since = now
            if not node.drained and now - node.draining_since >= self.timing.drain_grace.total_seconds():
                moves.append(node)
        await self._each(moves, self._move_tasks)

    async def _move_tasks(self, node: SimNode) -> None:
        await self._aws(self.aws.move_cooperative_tasks, node)
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

    def _play_resets(self, node: SimNode, commands: list[tuple[str, str]]) -> None:
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

    async def _play_evidence(self, node: SimNode, commands: list[tuple[str, list[str]]]) -> None:
        """What the host's SSM agent would do with an evidence command: its kernel log and a bug report, each PUT
        to its presigned URL (a host without SSM, or an SSM the engine may not use, is the fault proxy's to play)."""
        for command_id, urls in commands:
            if command_id in node.evidence_seen or len(urls) != 2:
                continue
            node.evidence_seen.add(command_id)
            kernel_url, report_url = urls
            kernel_log = node.kernel_log.read_bytes() if node.kernel_log.exists() else b""
            report = gzip.compress(f"simulated nvidia-bug-report.sh of {node.instance_id}\n".encode())
            try:
                await self._aws(self.aws.upload, kernel_url, kernel_log)
                await self._aws(self.aws.upload, report_url, report)
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

    def container_instances_of(self, instance_id: str) -> set[str]:
        """The container instance ARNs the fleet registered for an instance (the ECS agent's, so all there are)."""
        node = self.nodes.get(instance_id)
        return {node.container_instance_arn} if node is not None and node.container_instance_arn else set()

    def live_instances(self) -> list[str]:
        """Booted, not terminated: the instances a fault can be injected into."""
        return [n.instance_id for n in self.nodes.values() if n.booted and not n.terminated]

    def inject_fault(
        self, instance_id: str, xid: int | None = None, pci: str | None = None, recovery_action: int | None = None
    ) -> str:
        """A critical GPU fault (one of ECS's 18 Xids), on `pci` or a GPU drawn at random: the instance must become
        IMPAIRED and be repaired. With `recovery_action` (NVML's code), the driver's Xid 154 follows it."""
        node = self.node(instance_id)
        xid = self.rng.choice(COMMON_CRITICAL_XIDS) if xid is None else xid
        if xid not in CRITICAL_XIDS:
            raise ValueError(f"Xid {xid} is not one of ECS's critical Xids {CRITICAL_XIDS}")
        pci, lines = kernel_lines.fault_lines(node, self.rng, xid, pci)
        if recovery_action is not None:
            lines.append(kernel_lines.recovery_action_line(node, pci, recovery_action))
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
        node.save_identity()  # still down after a restart of the simulator
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

    async def world(self) -> FleetWorld:
        """AWS's counts (one look at the whole group) and the fleet's own lists of its nodes."""
        # Buried nodes (terminated, or out of the group) are none of the group's live instances: not asked.
        counts = await self._aws(self.aws.count, [i for i, node in self.nodes.items() if not node.terminated])
        live = self._live_nodes()
        return FleetWorld(
            ec2_states=counts["ec2"],
            container_active=counts["ecs"].get("ACTIVE", 0),
            container_draining=counts["ecs"].get("DRAINING", 0),
            running_tasks=counts["tasks"].get("RUNNING", 0),
            live=[n.instance_id for n in live],
            initial_instances=[n.instance_id for n in self.nodes.values() if n.initial],
            replacements_running=[n.instance_id for n in live if not n.initial],
            terminated=[n.instance_id for n in self.nodes.values() if n.terminated],
            booting=[n.instance_id for n in self.nodes.values() if not n.booted and not n.terminated],
            probe_errors={n.instance_id: n.probe_error for n in self.nodes.values() if n.probe_error},
            probes=self.probe_kind,
        )

    async def snapshot(self, *, from_visibility: bool = False) -> FleetSnapshot:
        """The world, and each live instance's health: by a query to each health workflow, or, `from_visibility`,
        from Temporal visibility (simulator.fleet_view)."""
        world = await self.world()
        if from_visibility:
            return await snapshot_from_visibility(self.client, self.group, world)
        health: dict[str, HealthState | None] = {}
        phases: dict[str, RepairPhase] = {}
        retired: list[str] = []
        views = await asyncio.gather(*(self.health(i) for i in world.live))
        for instance_id, view in zip(world.live, views, strict=True):
            health[instance_id] = None if view is None else view.healthStatus.overallStatus
            if view is not None and view.repair is not None:
                phases[instance_id] = view.repair.phase
            if view is not None and view.retired:
                retired.append(instance_id)
        return FleetSnapshot.of(world, health, phases, retired)

    async def health(self, instance_id: str) -> InstanceHealthView | None:
        """The health workflow's view of an instance; None when there is none to ask or it does not answer."""
        return await query_health(self.client, instance_id)

    # --- Shutdown -------------------------------------------------------------------------------------------

    async def close(self) -> None:
        """Cancel the watch loop, every probe and pending blip restart. AWS state is left as is (moto's)."""
        tasks: list[asyncio.Task[Any]] = self._probes.close(self.nodes.values())
        tasks += [task for task in self._reboots if not task.done()]
        tasks += [task for task in self._agents.values() if not task.done()]
        if self._watch is not None and not self._watch.done():
            tasks.append(self._watch)
        # Cancel all first, then wait for all: one slow task never delays the others' cancellation.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for node in self.nodes.values():
            node.probe = None
        self._watch = None
        if self._pool is not None:
            # A call in flight finishes in its thread (boto3 cannot be interrupted); none waits in the queue.
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def __aenter__(self) -> SimulatedFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
