"""`autorepair demo`: a simulated GPU fleet that heals itself, on real local servers.

Everything runs for real except the hardware: a Temporal dev server (with the Web UI), a moto server
standing in for EC2/ECS/EventBridge/IAM/STS over HTTP, the repair worker (all workflows and activities) as
`autorepair worker`, `autorepair ingest`, and the simulated fleet as `autorepair sim` (simulator/sim.py), each in a
process of its own (their logs: <state>/worker.log, ingest.log and sim.log). The sim plays the instances and runs
the real node probe on each (a stand-in above `--probe-standin-above`), reading a kernel-log file and reporting
through the ingest, signed with credentials of its own instance. Faults are NVRM lines written into those files, on
the demo's request to the sim's control endpoint (simulator/sim_control.py).

This module is the command itself: its flags, the validated plan they make, and the run (servers, worker, sim,
fault injection, watching until done). The engine reaches moto through a `FlakyAws` proxy in this process that
injects nothing and logs the engine's changing calls to <state>/engine-calls.jsonl: the sim follows that file (what
the engine launched, drained, terminated, rebooted) and so describes only what changed, plus the whole group at a
cadence that grows with the fleet; the proxy stays here so that the sim can be killed and started again without the
engine's AWS going with it. The live summary and the judge look at the fleet every max(1 s, N/50 s): the world from
the sim, health from Temporal visibility (one list, not a query per instance): a simulator that costs less than the
engine it tests (benchmarks/SIM_COST.md).

What it shows is simulator.demo_summary's, when it is done is simulator.demo_judge's, and the process settings it
changes while it runs are simulator.demo_env's. `demo_stack` is the same demo with the fleet in this process
(benchmarks.sim_cost measures its ways of looking at the world so).

Exit codes: 0 the run reached its goal; 1 it did not (time limit, a spurious repair, a crashed worker or sim, a
drain while auto repair was DISABLED); 2 bad arguments or an unusable state dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import boto3
from rich.console import Console
from rich.live import Live

from contract import names
from contract.config import AwsSettings, EventSettings, IngestSettings, TemporalSettings
from contract.formats import parse_bind
from contract.groups import AutoRepair, CapacityGroup, Remediation
from contract.ids import semaphore_workflow_id
from simulator.aws_proxy import FlakyAws, Listener
from simulator.demo_env import logs_to_file, moto_credentials, quiet_runtime
from simulator.demo_judge import Judge, Outcome
from simulator.demo_metrics import TARGETS_FILE, metrics_url, write_targets
from simulator.demo_summary import EventLog, LiveSummary, describe_event, summary_line, timings_line
from simulator.engine_call_log import EngineCallLog
from simulator.engine_process import EngineProcess
from simulator.fleet import SimTiming, SimulatedFleet
from simulator.fleet_aws import EngineCalls, ecs_instance_lookup, ssm_invocation_lookup
from simulator.fleet_view import FleetSnapshot, snapshot_from_visibility
from simulator.host_identity import HOST_ROLE, HostIdentities
from simulator.probes import via_ingest
from simulator.servers import MotoServer, ServerError, TemporalDevServer, free_port
from simulator.sim import DEFAULT_STANDIN_ABOVE
from simulator.sim_control import SimClient
from worker.settings import Settings
from workflows.models import SemaphoreView

if TYPE_CHECKING:
    from temporalio.client import Client

DEMO_GROUP = "gpu-a"
DEMO_CLUSTER = "gpu-demo"
DEMO_LAUNCH_TEMPLATE = "gpu-demo-p5"
# Every demo repair keeps its evidence here (in moto's S3), the host's bug report included (docs/operations.md §15).
DEMO_EVIDENCE_BUCKET = "gpu-autorepair-demo-evidence"
STATE_MARKER = ".autorepair-demo"  # only a directory holding this file is ever wiped
HEARTBEAT_LOSS_THRESHOLD = timedelta(seconds=8)
HEARTBEAT_INTERVAL = timedelta(seconds=2)  # the simulated probes', and the group's setting: 3 of them fit the threshold
WAIT_FOR_OK_S = 60.0
SIM_START_S = 300.0  # `autorepair sim` listens once its fleet is set up: a minute or more at 1,000 instances
REBOOT_TIMEOUT = timedelta(seconds=60)  # a simulated reboot takes the boot delay, seconds
# How often the worker counts instances by health status for its gauges (30 s in production).
DEMO_GAUGE_INTERVAL = timedelta(seconds=2)
# The live summary and the judge look at the fleet every max(1 s, N x this): 4 s at 200 instances.
SNAPSHOT_PER_INSTANCE_S = 1 / 50


def snapshot_interval(instances: int) -> float:
    """Seconds between the summary's (and the judge's) looks at a fleet of `instances`."""
    return max(1.0, instances * SNAPSHOT_PER_INSTANCE_S)


class DemoError(Exception):
    """A reason to stop before the demo starts (exit code 2)."""


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", type=int, default=12, metavar="N", help="fleet size (default 12)")
    parser.add_argument(
        "--faults",
        type=int,
        default=3,
        metavar="K",
        help="critical Xid faults on K random instances (default 3)",
    )
    parser.add_argument(
        "--heartbeat-loss",
        type=int,
        default=0,
        metavar="K",
        help="K random instances lose their agent for good (default 0)",
    )
    parser.add_argument(
        "--blips",
        type=int,
        default=0,
        metavar="K",
        help="K random instances lose their agent briefly, below the threshold: must not be repaired",
    )
    parser.add_argument(
        "--auto-repair",
        type=str.upper,
        choices=[a.value for a in AutoRepair],
        default=AutoRepair.ENABLED.value,
        help="ENABLED (default) repairs; DISABLED only reports health",
    )
    parser.add_argument(
        "--remediation",
        choices=[r.value for r in Remediation],
        default=Remediation.REPLACE.value,
        help="replace (default, ECS's way) every impaired instance, or reboot-first: reboot where NVIDIA says that "
        "clears the fault, replace the rest",
    )
    parser.add_argument("--seed", type=int, default=7, help="seed of the simulated world (default 7)")
    parser.add_argument("--events", type=Path, default=None, help="event JSON lines (default <state>/events.jsonl)")
    parser.add_argument(
        "--until-repaired",
        action="store_true",
        help="exit 0 once every impaired instance is replaced and N instances are healthy; 1 on --time-limit",
    )
    parser.add_argument(
        "--time-limit", type=float, default=300.0, metavar="SECONDS", help="give up after this (default 300)"
    )
    parser.add_argument(
        "--state-dir", type=Path, default=Path(".state/demo"), help="wiped at start (default .state/demo)"
    )
    parser.add_argument("--exit", action="store_true", help="exit after the run instead of leaving servers up")
    parser.add_argument("--temporal-port", type=int, default=7233)
    parser.add_argument("--ui-port", type=int, default=8233)
    parser.add_argument("--moto-port", type=int, default=5000)
    parser.add_argument("--ingest-port", type=int, default=8480, help="where the hosts report (default 8480)")
    parser.add_argument("--sim-port", type=int, default=8490, help="the simulated fleet's control (default 8490)")
    parser.add_argument(
        "--worker-metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help=f"the worker's Prometheus /metrics (default 0: a free port; <state>/{TARGETS_FILE} names it)",
    )
    parser.add_argument(
        "--ingest-metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="the ingest's Prometheus /metrics (default 0: a free port, named there too)",
    )
    parser.add_argument(
        "--probe-standin-above",
        type=int,
        default=DEFAULT_STANDIN_ABOVE,
        metavar="N",
        help=f"above N instances the fleet runs a probe stand-in instead of the real probe (default "
        f"{DEFAULT_STANDIN_ABOVE})",
    )
    parser.add_argument(
        "--aws-latency",
        action="store_true",
        help="every AWS call of the engine answered as slowly as AWS answers it (50-300 ms by API: FlakyAws.like_aws)",
    )


@dataclass
class DemoPlan:
    """The flags, checked against each other: what one run does."""

    instances: int
    faults: int
    heartbeat_loss: int
    blips: int
    auto_repair: AutoRepair
    remediation: Remediation
    seed: int
    time_limit_s: float
    state_dir: Path
    events_path: Path
    exit_when_done: bool
    temporal_port: int
    ui_port: int
    moto_port: int
    ingest_port: int
    sim_port: int = 8490
    probe_standin_above: int = DEFAULT_STANDIN_ABOVE
    worker_metrics_port: int = 0  # 0: a free one, chosen when the engine starts
    ingest_metrics_port: int = 0
    aws_latency: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoPlan:
        if args.instances < 1:
            raise DemoError("--instances must be at least 1")
        for flag in ("faults", "heartbeat_loss", "blips"):
            if getattr(args, flag) < 0:
                raise DemoError(f"--{flag.replace('_', '-')} must not be negative")
        chosen = args.faults + args.heartbeat_loss + args.blips
        if chosen > args.instances:
            raise DemoError(f"--faults + --heartbeat-loss + --blips ({chosen}) exceeds --instances ({args.instances})")
        if args.time_limit <= 0:
            raise DemoError("--time-limit must be positive")
        ports = [args.temporal_port, args.ui_port, args.moto_port, args.ingest_port, args.sim_port]
        if len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports):
            raise DemoError(
                "--temporal-port, --ui-port, --moto-port, --ingest-port and --sim-port must be distinct valid ports"
            )
        chosen_ports = [p for p in (args.worker_metrics_port, args.ingest_metrics_port) if p]
        if len(set(chosen_ports)) != len(chosen_ports) or not all(
            0 < p < 65536 and p not in ports for p in chosen_ports
        ):
            raise DemoError(
                "--worker-metrics-port and --ingest-metrics-port must be 0 (a free port) or distinct valid ports, "
                "none of the other ports"
            )
        if args.probe_standin_above < 0:
            raise DemoError("--probe-standin-above must not be negative")
        state_dir = Path(args.state_dir)
        return cls(
            instances=args.instances,
            faults=args.faults,
            heartbeat_loss=args.heartbeat_loss,
            blips=args.blips,
            auto_repair=AutoRepair(args.auto_repair),
            remediation=Remediation(args.remediation),
            seed=args.seed,
            time_limit_s=args.time_limit,
            state_dir=state_dir,
            events_path=Path(args.events) if args.events else state_dir / "events.jsonl",
            exit_when_done=args.until_repaired or args.exit,
            temporal_port=args.temporal_port,
            ui_port=args.ui_port,
            moto_port=args.moto_port,
            ingest_port=args.ingest_port,
            sim_port=args.sim_port,
            probe_standin_above=args.probe_standin_above,
            worker_metrics_port=args.worker_metrics_port,
            ingest_metrics_port=args.ingest_metrics_port,
            aws_latency=args.aws_latency,
        )


def _prepare_state_dir(path: Path) -> Path:
    """Wipe the state dir, but only one the demo created: `--state-dir ~` must not delete a home directory."""
    path = path.resolve()
    if path.exists():
        if not path.is_dir():
            raise DemoError(f"--state-dir {path} exists and is not a directory")
        if any(path.iterdir()) and not (path / STATE_MARKER).exists():
            raise DemoError(f"--state-dir {path} is not empty and was not made by the demo; refusing to wipe it")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / STATE_MARKER).write_text("state of `autorepair demo`; wiped at every start\n")
    return path


def build_settings(
    plan: DemoPlan, temporal: TemporalDevServer, moto: MotoServer, account: str, engine_endpoint: str | None = None
) -> Settings:
    """The settings of the worker and the ingest for the demo: the local servers (AWS at `engine_endpoint`, by
    default moto itself), the events file, moto's STS and account for the hosts' proofs, and the one demo group."""
    return Settings(
        temporal=TemporalSettings(address=temporal.address, ui_url=temporal.ui_url),
        aws=AwsSettings(endpoint_url=engine_endpoint or moto.endpoint_url, region="us-east-1"),
        events=EventSettings(eventbridge=True, jsonl_path=plan.events_path),
        ingest=IngestSettings(
            bind=f"127.0.0.1:{plan.ingest_port}",
            sts_endpoint=moto.endpoint_url,
            allowed_accounts=[account],
            allowed_role_arns=[f"arn:aws:iam::{account}:role/{HOST_ROLE}"],
            # Never the fixed default (9480): demos and tests run side by side.
            metrics_bind=f"127.0.0.1:{plan.ingest_metrics_port or free_port()}",
        ),
        groups=[
            CapacityGroup(
                name=DEMO_GROUP,
                cluster=DEMO_CLUSTER,
                launch_template=DEMO_LAUNCH_TEMPLATE,
                auto_repair=plan.auto_repair,
                heartbeat_loss_threshold=HEARTBEAT_LOSS_THRESHOLD,
                heartbeat_interval=HEARTBEAT_INTERVAL,
                # Demo time scale: a repair in well under a minute instead of the production minutes.
                task_poll_interval=timedelta(seconds=1),
                permit_reclaim_interval=timedelta(seconds=5),
                replacement_ready_timeout=timedelta(seconds=60),
                remediation=plan.remediation,
                reboot_timeout=REBOOT_TIMEOUT,
                evidence_bucket=DEMO_EVIDENCE_BUCKET,
                bug_report=True,
                bug_report_timeout=timedelta(seconds=60),
            )
        ],
        # The demo's end stops the worker: in-flight waits need not hold it up.
        graceful_shutdown_timeout=timedelta(seconds=5),
        health_bind_address=None,
        # Temporal's metrics and ours; the gauges counted often enough to follow a demo-scale repair.
        metrics_bind_address=f"127.0.0.1:{plan.worker_metrics_port or free_port()}",
        health_gauge_interval=DEMO_GAUGE_INTERVAL,
    )


async def run_demo(args: argparse.Namespace) -> int:
    # soft_wrap: a long line (a kernel line, a URL) stays one line rather than being cut at 80 columns.
    console = Console(soft_wrap=True)
    try:
        plan = DemoPlan.from_args(args)
        plan.state_dir = _prepare_state_dir(plan.state_dir)
    except DemoError as err:
        console.print(f"[red]autorepair demo: {err}[/red]")
        return 2
    with logs_to_file(plan.state_dir / "demo.log"), moto_credentials():
        try:
            return await _run(plan, console)
        except ServerError as err:
            console.print(f"[red]autorepair demo: {err}[/red]")
            return 1


@dataclass
class Engine:
    """The servers and the engine of one demo: moto, Temporal, the engine's AWS proxy, the worker and the ingest."""

    moto: MotoServer
    temporal: TemporalDevServer
    proxy: FlakyAws  # the engine's AWS: moto, through a proxy that injects nothing, so its calls can be followed
    settings: Settings
    client: Client
    worker: EngineProcess
    ingest_url: str
    identities: HostIdentities


@contextlib.asynccontextmanager
async def engine_stack(plan: DemoPlan, console: Console, *, calls: Listener | None) -> AsyncIterator[Engine]:
    """Moto, Temporal, the engine's proxy (`calls` hears its answers), the worker and the ingest; taken down in
    order on the way out: the worker stops while Temporal, the proxy and moto still answer."""
    from contract.temporal_client import connect

    async with (
        MotoServer(plan.state_dir, plan.moto_port) as moto,
        TemporalDevServer(plan.state_dir, plan.temporal_port, plan.ui_port) as temporal,
        contextlib.AsyncExitStack() as stack,
    ):
        console.print(f"moto {moto.endpoint_url}, Temporal {temporal.address}, Web UI {temporal.ui_url}")
        proxy = stack.enter_context(FlakyAws(moto.endpoint_url))
        if plan.aws_latency:
            proxy.like_aws()
        if calls is not None:
            stack.callback(proxy.listen(calls))
        identities = HostIdentities(moto.endpoint_url)
        await asyncio.to_thread(_create_bucket, moto.endpoint_url, DEMO_EVIDENCE_BUCKET)
        account = await asyncio.to_thread(lambda: identities.account)
        settings = build_settings(plan, temporal, moto, account, engine_endpoint=proxy.url)
        client = await connect(settings.temporal, runtime=quiet_runtime())
        # The engine in processes of its own, as it runs for real: the simulated world must hold up neither the
        # worker's workflow tasks nor the ingest's answers, and what each costs is its own.
        worker = EngineProcess(settings, plan.state_dir / "worker.log")
        await worker.start()
        stack.push_async_callback(worker.stop)
        ingest_process = EngineProcess(settings, plan.state_dir / "ingest.log", role="ingest")
        await ingest_process.start()
        stack.push_async_callback(ingest_process.stop)
        host, port = parse_bind(settings.ingest.bind)
        await ingest_process.listening(host, port)
        ingest = f"http://{host}:{port}"
        console.print(f"ingest {ingest} (hosts report here, each proven by moto's STS as its own instance)")
        _say_metrics(console, plan, settings)
        yield Engine(moto, temporal, proxy, settings, client, worker, ingest, identities)


@dataclass
class DemoStack:
    """One demo's running parts with the simulated fleet in this process (benchmarks.sim_cost compares its ways of
    looking at the world so): the servers, the engine's AWS proxy, the worker and the fleet."""

    moto: MotoServer
    temporal: TemporalDevServer
    proxy: FlakyAws
    settings: Settings
    client: Client
    worker: EngineProcess
    fleet: SimulatedFleet
    engine_calls: EngineCalls | None  # what the fleet follows; None: it describes the whole group every tick


@contextlib.asynccontextmanager
async def demo_stack(
    plan: DemoPlan, console: Console, *, follow_engine: bool = True, ecs_filter: bool = True
) -> AsyncIterator[DemoStack]:
    """The engine (engine_stack) and the (not yet set up) fleet in this process, with a real probe per instance.

    The proxy answers ListContainerInstances' `ec2InstanceId == ...` query as ECS does (moto ignores it, and the
    engine's every lookup of one instance would list the whole cluster). `follow_engine=False, ecs_filter=False`
    is the demo as it was, for comparison (benchmarks.sim_cost): every tick describes the whole group."""
    engine_calls = EngineCalls() if follow_engine else None
    async with engine_stack(plan, console, calls=engine_calls) as engine:
        fleet = SimulatedFleet(
            group=DEMO_GROUP,
            cluster=DEMO_CLUSTER,
            launch_template=DEMO_LAUNCH_TEMPLATE,
            state_dir=plan.state_dir / "fleet",
            instances=plan.instances,
            seed=plan.seed,
            endpoint_url=engine.moto.endpoint_url,
            timing=SimTiming(heartbeat_interval=HEARTBEAT_INTERVAL, heartbeat_loss_threshold=HEARTBEAT_LOSS_THRESHOLD),
            client=engine.client,
            task_queue=engine.settings.temporal.task_queue,
            probe_runner=via_ingest(
                engine.ingest_url, engine.settings.ingest.id, engine.moto.endpoint_url, engine.identities
            ),
            engine_calls=engine_calls,
        )
        if ecs_filter:
            lookup = ecs_instance_lookup(fleet.container_instances_of, engine.moto.endpoint_url)
            engine.proxy.answer_with("ListContainerInstances", lookup, service="ecs")
        if follow_engine:
            engine.proxy.answer_with(
                "GetCommandInvocation", ssm_invocation_lookup(fleet.command_not_run), service="ssm"
            )
        try:
            yield DemoStack(
                engine.moto,
                engine.temporal,
                engine.proxy,
                engine.settings,
                engine.client,
                engine.worker,
                fleet,
                engine_calls,
            )
        finally:
            await fleet.close()
            await engine.worker.stop()


@dataclass
class SimStack:
    """The demo as it runs: the engine, and the simulated fleet as `autorepair sim` in a process of its own."""

    engine: Engine
    sim: EngineProcess
    world: SimClient  # the sim's control endpoint


def sim_arguments(plan: DemoPlan, engine: Engine, calls_log: Path) -> list[str]:
    """`autorepair sim`'s flags for this demo: its group, the servers, the compressed heartbeats, the scenario."""
    return [
        *("--endpoint-url", engine.moto.endpoint_url, "--ingest", engine.ingest_url),
        *("--ingest-id", engine.settings.ingest.id, "--group", DEMO_GROUP, "--cluster", DEMO_CLUSTER),
        *("--launch-template", DEMO_LAUNCH_TEMPLATE, "--instances", str(plan.instances), "--seed", str(plan.seed)),
        *("--state-dir", str(plan.state_dir / "fleet"), "--control", f"127.0.0.1:{plan.sim_port}"),
        *("--engine-calls", str(calls_log), "--probe-standin-above", str(plan.probe_standin_above)),
        *("--heartbeat-interval", f"{HEARTBEAT_INTERVAL.total_seconds():g}"),
        *("--heartbeat-loss-threshold", f"{HEARTBEAT_LOSS_THRESHOLD.total_seconds():g}"),
        *("--faults", str(plan.faults), "--heartbeat-loss", str(plan.heartbeat_loss), "--blips", str(plan.blips)),
    ]


@contextlib.asynccontextmanager
async def sim_stack(plan: DemoPlan, console: Console) -> AsyncIterator[SimStack]:
    """The engine, then `autorepair sim` once it listens (its fleet set up). The proxy logs the engine's changing
    calls to a file the sim follows, and answers the engine's one-instance ECS lookups from what the sim says its
    agents registered (moto's own listing when the sim does not answer). The sim stops first on the way out."""
    calls_log = plan.state_dir / "engine-calls.jsonl"
    async with engine_stack(plan, console, calls=EngineCallLog(calls_log)) as engine:
        sim = EngineProcess(
            engine.settings, plan.state_dir / "sim.log", role="sim", args=sim_arguments(plan, engine, calls_log)
        )
        world = SimClient(f"http://127.0.0.1:{plan.sim_port}")
        await sim.start()
        try:
            await sim.listening("127.0.0.1", plan.sim_port, within=SIM_START_S)
            lookup = ecs_instance_lookup(world.container_instances_of, engine.moto.endpoint_url)
            engine.proxy.answer_with("ListContainerInstances", lookup, service="ecs")
            engine.proxy.answer_with(
                "GetCommandInvocation", ssm_invocation_lookup(world.command_not_run), service="ssm"
            )
            yield SimStack(engine, sim, world)
        finally:
            await sim.stop()


async def _run(plan: DemoPlan, console: Console) -> int:
    started = time.monotonic()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        # Ctrl-C ends the demo in order (probes, worker, servers) instead of tearing it down mid-step.
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)

    try:
        console.print(f"state dir {plan.state_dir} (server logs, events, kernel logs)")
        async with sim_stack(plan, console) as demo:
            return await _drive(plan, console, demo, stop, started)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


def _say_metrics(console: Console, plan: DemoPlan, settings: Settings) -> None:
    """Where the worker and the ingest serve /metrics, on the console and in a file a Prometheus can read."""
    worker, ingest = settings.metrics_bind_address, settings.ingest.metrics_bind
    assert worker is not None and ingest is not None  # build_settings sets both
    targets = write_targets(plan.state_dir, worker=worker, ingest=ingest)
    console.print(
        f"metrics: worker {metrics_url(worker)}, ingest {metrics_url(ingest)} (Prometheus file_sd: {targets})"
    )


def _create_bucket(endpoint_url: str, bucket: str) -> None:
    boto3.client("s3", endpoint_url=endpoint_url, region_name="us-east-1").create_bucket(Bucket=bucket)


async def _drive(plan: DemoPlan, console: Console, demo: SimStack, stop: asyncio.Event, started: float) -> int:
    worker, sim, client = demo.engine.worker, demo.sim, demo.engine.client
    workflows_url = demo.engine.temporal.workflows_url()
    # An --events file outside the (wiped) state dir may hold an earlier run: count only what this run adds.
    events = EventLog(plan.events_path, offset=_size(plan.events_path))
    first = await asyncio.to_thread(demo.world.world)
    console.print(
        f"fleet: {len(first.live)} instances in cluster {DEMO_CLUSTER}, {first.probes} probes starting "
        f"(autorepair sim, pid {sim.pid}, control {demo.world.url}, log {plan.state_dir / 'sim.log'})"
    )

    async def look() -> FleetSnapshot | None:
        """The sim's world and Temporal's health of it; None while the sim does not answer."""
        try:
            world = await asyncio.to_thread(demo.world.world)
        except (OSError, ValueError):
            return None
        return await snapshot_from_visibility(client, DEMO_GROUP, world)

    def elapsed() -> float:
        return time.monotonic() - started

    interactive = console.is_terminal
    summary = LiveSummary(
        group=DEMO_GROUP, auto_repair=plan.auto_repair, instances=plan.instances, workflows_url=workflows_url
    )
    snap: FleetSnapshot | None = None
    status = "waiting for every instance to report OK"
    outcome = Outcome()
    last_line = 0.0
    live_display: contextlib.AbstractContextManager[Live | None] = (
        Live(
            summary.render(None, events.counts, elapsed(), status),
            console=console,
            auto_refresh=False,
        )
        if interactive
        else contextlib.nullcontext()
    )
    with live_display as live:

        def show() -> None:
            nonlocal last_line
            if live is not None:
                live.update(summary.render(snap, events.counts, elapsed(), status), refresh=True)
            elif time.monotonic() - last_line >= 5:
                # Not a terminal (CI, a pipe): a plain line every few seconds instead of a redrawn table.
                console.print(summary_line(snap, events.counts, elapsed()))
                last_line = time.monotonic()

        # 1. Wait for the probes' first heartbeats. A look at the fleet costs AWS and Temporal calls: every
        # snapshot_interval, never more often, whatever the fleet's size.
        every = snapshot_interval(plan.instances)
        wait_until = time.monotonic() + min(WAIT_FOR_OK_S, plan.time_limit_s)
        while not stop.is_set():
            snap = await look() or snap
            show()
            if (snap and snap.healthy == plan.instances) or time.monotonic() > wait_until or not worker.alive:
                break
            await _sleep_or_stop(stop, every)
        if snap is not None and snap.healthy < plan.instances:
            console.print(f"[yellow]only {snap.healthy}/{plan.instances} instances report OK; going on[/yellow]")

        # 2. Inject, in the sim (POST /scenario): faults, agent losses, blips on distinct random instances; noise on a
        # few healthy ones.
        played = await asyncio.to_thread(demo.world.play_scenario)
        injected_at = datetime.now(UTC)
        for instance_id, line in played.noise.items():
            console.print(f"noise      {instance_id}: {line}")
        faults_at: dict[str, datetime] = {}
        for instance_id, line in played.faulted.items():
            faults_at[instance_id] = injected_at
            console.print(f"[red]fault[/red]      {instance_id}: {line}")
        for instance_id in played.lost:
            console.print(f"[red]agent down[/red] {instance_id}: no more heartbeats")
        for instance_id in played.blipped:
            console.print(f"blip       {instance_id}: agent down for {played.blip_seconds:.0f}s")
        judge = Judge(
            instances=plan.instances,
            auto_repair=plan.auto_repair,
            targets=set(played.faulted) | set(played.lost),
            blipped=set(played.blipped),
            group=DEMO_GROUP,
            remediation=plan.remediation,
        )
        status = "repairing" if plan.auto_repair is AutoRepair.ENABLED else "watching (auto repair DISABLED)"

        # 3. Watch until the goal, a failure, the time limit, or Ctrl-C: events every second, the fleet (and the
        # judge, who needs a fresh look) every snapshot_interval.
        next_look = 0.0
        while not stop.is_set():
            for event in events.read_new():
                console.print(describe_event(event))
            fresh: FleetSnapshot | None = None
            if time.monotonic() >= next_look or snap is None:
                next_look = time.monotonic() + every
                fresh = await look()
                snap = fresh or snap
            if not outcome.done and not outcome.failed:
                if not sim.alive:
                    outcome = Outcome(
                        failed=True,
                        message=f"the simulated fleet exited ({sim.exit_status}); its log:\n{sim.log_tail(10)}",
                    )
                elif not worker.alive:
                    outcome = Outcome(
                        failed=True,
                        message=f"the repair worker exited ({worker.exit_status}); its log:\n{worker.log_tail(10)}",
                    )
                elif fresh is not None:  # the judge needs a fresh look; the sim may not have answered this time
                    outcome = judge.judge(fresh, events.counts, events.fixed_in_place, events.abandoned_replacements)
                if not outcome.done and not outcome.failed and elapsed() > plan.time_limit_s:
                    outcome = Outcome(failed=True, message=f"time limit of {plan.time_limit_s:.0f}s reached")
                if outcome.done or outcome.failed:
                    status = ("DONE: " if outcome.done else "FAILED: ") + outcome.message
                    if not plan.exit_when_done:
                        status += " | servers stay up, Ctrl-C to stop"
            show()
            if (outcome.done or outcome.failed) and plan.exit_when_done:
                break
            await _sleep_or_stop(stop, 1.0)

    if not outcome.done and not outcome.failed:
        console.print("stopped by the user")
        return 0 if not plan.exit_when_done else 1
    if not interactive:  # on a terminal the live table's last frame already says all this
        console.print(summary_line(snap, events.counts, elapsed()))
        console.print(f"[{'green' if outcome.done else 'red'}]{status}[/]")
    within_cap = True
    if faults_at:
        console.print(timings_line(events, faults_at))
        within_cap = await _show_drain_cap(client, console)
    console.print(f"events: {plan.events_path}  Web UI: {workflows_url}")
    return 0 if outcome.done and within_cap else 1


async def _show_drain_cap(client: Client, console: Console) -> bool:
    """The most repairs that held a drain permit at once, against the group's cap: never over it."""
    handle = client.get_workflow_handle(semaphore_workflow_id(DEMO_GROUP))
    try:
        view = await handle.query(names.QUERY_STATE, result_type=SemaphoreView)
    except Exception as err:  # a demo without repairs has no semaphore: nothing was drained
        console.print(f"drain cap: not read ({err})")
        return True
    over = view.max_holders_seen > view.capacity
    style = "red" if over else "green"
    console.print(f"[{style}]drain cap: at most {view.max_holders_seen} draining at once, cap {view.capacity}[/]")
    return not over


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
