"""`autorepair demo`: a simulated GPU fleet that heals itself, on real local servers.

Everything runs for real except the hardware: a Temporal dev server (with the Web UI), a moto server
standing in for EC2/ECS/EventBridge over HTTP, the repair worker (all workflows and activities) in this
process, and the real node probe on each simulated node reading a kernel-log file. Faults are NVRM lines
written into those files.

Exit codes: 0 the run reached its goal; 1 it did not (time limit, a spurious repair, a crashed worker, a drain
while auto repair was DISABLED); 2 bad arguments or an unusable state dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text
from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)

from contract.config import AwsSettings, EventSettings, TemporalSettings
from contract.groups import AutoRepair, CapacityGroup
from contract.health import HealthState
from simulator.fleet import FleetSnapshot, SimTiming, SimulatedFleet
from simulator.servers import MotoServer, ServerError, TemporalDevServer
from worker.settings import Settings

DEMO_GROUP = "gpu-a"
DEMO_CLUSTER = "gpu-demo"
DEMO_LAUNCH_TEMPLATE = "gpu-demo-p5"
STATE_MARKER = ".autorepair-demo"  # only a directory holding this file is ever wiped
HEARTBEAT_LOSS_THRESHOLD = timedelta(seconds=8)
# With auto repair DISABLED, "nothing happened" must hold this long after every fault shows as IMPAIRED.
DISABLED_GRACE_S = 10.0
WAIT_FOR_OK_S = 60.0
NOISE_INSTANCES = 2

log = logging.getLogger(__name__)


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


@dataclass
class _Plan:
    instances: int
    faults: int
    heartbeat_loss: int
    blips: int
    auto_repair: AutoRepair
    seed: int
    time_limit_s: float
    state_dir: Path
    events_path: Path
    exit_when_done: bool
    temporal_port: int
    ui_port: int
    moto_port: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> _Plan:
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
        ports = [args.temporal_port, args.ui_port, args.moto_port]
        if len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports):
            raise DemoError("--temporal-port, --ui-port and --moto-port must be distinct valid ports")
        state_dir = Path(args.state_dir)
        return cls(
            instances=args.instances,
            faults=args.faults,
            heartbeat_loss=args.heartbeat_loss,
            blips=args.blips,
            auto_repair=AutoRepair(args.auto_repair),
            seed=args.seed,
            time_limit_s=args.time_limit,
            state_dir=state_dir,
            events_path=Path(args.events) if args.events else state_dir / "events.jsonl",
            exit_when_done=args.until_repaired or args.exit,
            temporal_port=args.temporal_port,
            ui_port=args.ui_port,
            moto_port=args.moto_port,
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


@contextlib.contextmanager
def _logs_to_file(path: Path) -> Iterator[None]:
    """The live summary owns the terminal: worker, probe and SDK logs go to a file instead.

    A plain stdlib formatter on purpose: workflow code logs from inside Temporal's sandbox, where a formatter
    that imports lazily (structlog's JSON fallback, rich tracebacks) fails and hides the original message.
    """
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)
        handler.close()


@contextlib.contextmanager
def _moto_credentials() -> Iterator[None]:
    """Throwaway credentials for boto3: whatever real ones the shell has never travel to the moto server."""
    keys = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    dropped = ("AWS_SESSION_TOKEN", "AWS_PROFILE")
    saved = {k: os.environ.get(k) for k in (*keys, *dropped)}
    os.environ.update(keys)
    for key in dropped:
        os.environ.pop(key, None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def build_settings(plan: _Plan, temporal: TemporalDevServer, moto: MotoServer) -> Settings:
    return Settings(
        temporal=TemporalSettings(address=temporal.address, ui_url=temporal.ui_url),
        aws=AwsSettings(endpoint_url=moto.endpoint_url, region="us-east-1"),
        events=EventSettings(eventbridge=True, jsonl_path=plan.events_path),
        groups=[
            CapacityGroup(
                name=DEMO_GROUP,
                cluster=DEMO_CLUSTER,
                launch_template=DEMO_LAUNCH_TEMPLATE,
                auto_repair=plan.auto_repair,
                heartbeat_loss_threshold=HEARTBEAT_LOSS_THRESHOLD,
                # Demo time scale: a repair in well under a minute instead of the production minutes.
                task_poll_interval=timedelta(seconds=1),
                permit_reclaim_interval=timedelta(seconds=5),
                replacement_ready_timeout=timedelta(seconds=60),
            )
        ],
    )


@dataclass
class _EventLog:
    """Follows the events file the worker appends to, counting event types."""

    path: Path
    offset: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    partial: str = ""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("r", encoding="utf-8") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
                self.offset = handle.tell()
        except FileNotFoundError:
            return []
        text = self.partial + chunk
        lines = text.split("\n")
        self.partial = lines.pop()  # an unfinished last line waits for the next read
        events: list[dict[str, Any]] = []
        for line in lines:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                self.counts[str(event.get("type", "?"))] += 1
                events.append(event)
        return events


def _describe_event(event: dict[str, Any]) -> str:
    kind = event.get("type", "?")
    extra = ""
    if kind == "RepairStarted":
        extra = f"reason {event.get('reason')}"
    elif kind == "ReplacementLaunched":
        extra = f"replacement {event.get('replacement_instance_id')}"
    elif kind == "TasksStopped":
        extra = f"forced {event.get('forced')}"
    elif kind == "RepairFailed":
        extra = f"error {event.get('error')}"
    elif kind == "HealthChanged":
        extra = str(event.get("overall_status", ""))
    stamp = str(event.get("time", ""))[11:19]
    return f"{stamp} {kind:<20} {event.get('instance_id', '')} {extra}".rstrip()


@dataclass
class _Outcome:
    done: bool = False
    failed: bool = False
    message: str = ""


class _Judge:
    """Decides when the run reached its goal (or failed), from the fleet's snapshot and the event counts."""

    def __init__(self, plan: _Plan, fleet: SimulatedFleet, targets: set[str], blipped: set[str]) -> None:
        self.plan = plan
        self.fleet = fleet
        self.targets = targets  # must be impaired (and, when ENABLED, replaced)
        self.blipped = blipped
        self.quiet_since: float | None = None

    def judge(self, snap: FleetSnapshot, events: Counter[str]) -> _Outcome:
        terminated = set(snap.terminated)
        spurious = sorted(terminated - self.targets)
        if spurious:
            which = ", ".join(f"{i} (blip)" if i in self.blipped else i for i in spurious)
            return _Outcome(failed=True, message=f"repaired instances that had no fault: {which}")
        false_alarms = sorted(
            iid for iid, status in snap.health.items() if status == HealthState.IMPAIRED and iid not in self.targets
        )
        if false_alarms:
            which = ", ".join(f"{i} (blip)" if i in self.blipped else i for i in false_alarms)
            return _Outcome(failed=True, message=f"IMPAIRED without a fault: {which}")
        if self.plan.auto_repair is AutoRepair.DISABLED:
            return self._judge_disabled(snap)
        replaced = self.targets <= terminated
        back_to_n = (
            snap.running == self.plan.instances
            and snap.healthy == self.plan.instances
            and snap.container_draining == 0
            and not snap.booting
        )
        repairs_done = events["RepairCompleted"] >= len(self.targets)
        if replaced and back_to_n and repairs_done:
            return _Outcome(
                done=True,
                message=(
                    f"all {len(self.targets)} impaired instances replaced; "
                    f"{self.plan.instances}/{self.plan.instances} instances healthy"
                ),
            )
        return _Outcome()

    def _judge_disabled(self, snap: FleetSnapshot) -> _Outcome:
        if snap.container_draining or snap.terminated or snap.replacements_running or snap.booting:
            return _Outcome(failed=True, message="auto repair is DISABLED, yet an instance was drained or replaced")
        impaired = all(snap.health.get(t) == HealthState.IMPAIRED for t in self.targets)
        if not impaired:
            self.quiet_since = None
            return _Outcome()
        now = time.monotonic()
        if self.quiet_since is None:
            self.quiet_since = now
        if now - self.quiet_since >= DISABLED_GRACE_S:
            return _Outcome(
                done=True,
                message=(
                    f"auto repair DISABLED: {len(self.targets)} instance(s) IMPAIRED and reported, "
                    f"nothing drained or replaced for {DISABLED_GRACE_S:.0f}s"
                ),
            )
        return _Outcome()


def _render(
    plan: _Plan,
    snap: FleetSnapshot | None,
    events: Counter[str],
    elapsed: float,
    status: str,
    workflows_url: str,
) -> RenderableType:
    table = Table(
        title=f"gpu-autorepair demo: group {DEMO_GROUP}, auto repair {plan.auto_repair.value}",
        caption=f"Web UI: {workflows_url}",
        expand=False,
    )
    for column in ("time", "running", "healthy", "impaired", "other", "draining", "replaced", "repairs"):
        table.add_column(column, justify="right")
    if snap is None:
        table.add_row(f"{elapsed:4.0f}s", *["-"] * 7)
    else:
        unknown = len(snap.health) - snap.healthy - snap.impaired
        booting = f" (+{len(snap.booting)} booting)" if snap.booting else ""
        failed = f" ({events['RepairFailed']} failed)" if events["RepairFailed"] else ""
        table.add_row(
            f"{elapsed:4.0f}s",
            f"{snap.running}/{plan.instances}",
            str(snap.healthy),
            str(snap.impaired),
            str(unknown),
            str(snap.container_draining),
            f"{len(snap.replacements_running)}{booting}",
            f"{events['RepairCompleted']} done{failed}",
        )
    lines: list[RenderableType] = [table]
    if snap is not None and snap.repair_phase:
        phases = ", ".join(f"{iid} {phase.value}" for iid, phase in sorted(snap.repair_phase.items()))
        lines.append(Text(f"repairing: {phases}", style="yellow"))
    if snap is not None and snap.probe_errors:
        lines.append(Text(f"probe errors: {snap.probe_errors}", style="red"))
    lines.append(Text(status, style="bold"))
    return Group(*lines)


def _summary_line(snap: FleetSnapshot | None, events: Counter[str], elapsed: float) -> str:
    if snap is None:
        return f"[{elapsed:5.0f}s] starting"
    return (
        f"[{elapsed:5.0f}s] running={snap.running} healthy={snap.healthy} impaired={snap.impaired} "
        f"draining={snap.container_draining} replacements={len(snap.replacements_running)} "
        f"booting={len(snap.booting)} repairs_completed={events['RepairCompleted']}"
    )


async def run_demo(args: argparse.Namespace) -> int:
    # soft_wrap: a long line (a kernel line, a URL) stays one line rather than being cut at 80 columns.
    console = Console(soft_wrap=True)
    try:
        plan = _Plan.from_args(args)
        plan.state_dir = _prepare_state_dir(plan.state_dir)
    except DemoError as err:
        console.print(f"[red]autorepair demo: {err}[/red]")
        return 2
    with _logs_to_file(plan.state_dir / "demo.log"), _moto_credentials():
        try:
            return await _run(plan, console)
        except ServerError as err:
            console.print(f"[red]autorepair demo: {err}[/red]")
            return 1


async def _run(plan: _Plan, console: Console) -> int:
    # Imported here: the worker pulls in every workflow and activity, which `--help` does not need.
    from contract.temporal_client import connect
    from worker.main import run_worker

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
        async with (
            MotoServer(plan.state_dir, plan.moto_port) as moto,
            TemporalDevServer(plan.state_dir, plan.temporal_port, plan.ui_port) as temporal,
        ):
            console.print(f"moto {moto.endpoint_url}, Temporal {temporal.address}, Web UI {temporal.ui_url}")
            settings = build_settings(plan, temporal, moto)
            client = await connect(settings.temporal, runtime=_quiet_runtime())
            worker = asyncio.create_task(run_worker(settings, client), name="repair worker")
            fleet = SimulatedFleet(
                group=DEMO_GROUP,
                cluster=DEMO_CLUSTER,
                launch_template=DEMO_LAUNCH_TEMPLATE,
                state_dir=plan.state_dir / "fleet",
                instances=plan.instances,
                seed=plan.seed,
                endpoint_url=moto.endpoint_url,
                timing=SimTiming(heartbeat_loss_threshold=HEARTBEAT_LOSS_THRESHOLD),
                client=client,
                task_queue=settings.temporal.task_queue,
            )
            try:
                return await _drive(plan, console, fleet, worker, stop, started, temporal.workflows_url())
            finally:
                # Inside the servers' block: probes and worker stop while Temporal and moto still answer.
                await fleet.close()
                worker.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await worker
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


def _quiet_runtime() -> Runtime:
    """The SDK core's own warnings (retries while a server stops) go to the log file, not over the summary."""
    return Runtime(
        telemetry=TelemetryConfig(
            logging=LoggingConfig(
                filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
                forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")),
            )
        )
    )


async def _drive(
    plan: _Plan,
    console: Console,
    fleet: SimulatedFleet,
    worker: asyncio.Task[None],
    stop: asyncio.Event,
    started: float,
    workflows_url: str,
) -> int:
    # An --events file outside the (wiped) state dir may hold an earlier run: count only what this run adds.
    events = _EventLog(plan.events_path, offset=_size(plan.events_path))
    instances = await fleet.setup()
    console.print(f"fleet: {len(instances)} x {fleet.instance_type} in cluster {DEMO_CLUSTER}, probes starting")

    def elapsed() -> float:
        return time.monotonic() - started

    interactive = console.is_terminal
    snap: FleetSnapshot | None = None
    status = "waiting for every instance to report OK"
    outcome = _Outcome()
    judge: _Judge | None = None
    last_line = 0.0
    live_display: contextlib.AbstractContextManager[Live | None] = (
        Live(
            _render(plan, None, events.counts, elapsed(), status, workflows_url),
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
                live.update(_render(plan, snap, events.counts, elapsed(), status, workflows_url), refresh=True)
            elif time.monotonic() - last_line >= 5:
                # Not a terminal (CI, a pipe): a plain line every few seconds instead of a redrawn table.
                console.print(_summary_line(snap, events.counts, elapsed()))
                last_line = time.monotonic()

        # 1. Wait for the probes' first heartbeats.
        wait_until = time.monotonic() + min(WAIT_FOR_OK_S, plan.time_limit_s)
        while not stop.is_set():
            snap = await fleet.snapshot()
            show()
            if snap.healthy == plan.instances or time.monotonic() > wait_until or worker.done():
                break
            await _sleep_or_stop(stop, 1.0)
        if snap is not None and snap.healthy < plan.instances:
            console.print(f"[yellow]only {snap.healthy}/{plan.instances} instances report OK; going on[/yellow]")

        # 2. Inject: faults, agent losses, blips on distinct random instances; noise on a few healthy ones.
        chosen = fleet.rng.sample(instances, plan.faults + plan.heartbeat_loss + plan.blips)
        faulted = chosen[: plan.faults]
        lost = chosen[plan.faults : plan.faults + plan.heartbeat_loss]
        blipped = chosen[plan.faults + plan.heartbeat_loss :]
        rest = [i for i in instances if i not in chosen]
        for instance_id in fleet.rng.sample(rest, min(NOISE_INSTANCES, len(rest))):
            line = fleet.inject_noise(instance_id)
            console.print(f"noise      {instance_id}: {line}")
        for instance_id in faulted:
            line = fleet.inject_fault(instance_id)
            console.print(f"[red]fault[/red]      {instance_id}: {line}")
        for instance_id in lost:
            await fleet.heartbeat_loss(instance_id)
            console.print(f"[red]agent down[/red] {instance_id}: no more heartbeats")
        for instance_id in blipped:
            await fleet.blip(instance_id)
            console.print(f"blip       {instance_id}: agent down for {fleet.timing.blip.total_seconds():.0f}s")
        judge = _Judge(plan, fleet, set(faulted) | set(lost), set(blipped))
        status = "repairing" if plan.auto_repair is AutoRepair.ENABLED else "watching (auto repair DISABLED)"

        # 3. Watch until the goal, a failure, the time limit, or Ctrl-C.
        while not stop.is_set():
            for event in events.read_new():
                console.print(_describe_event(event))
            snap = await fleet.snapshot()
            if not outcome.done and not outcome.failed:
                if worker.done():
                    error = None if worker.cancelled() else worker.exception()
                    outcome = _Outcome(failed=True, message=f"the repair worker stopped: {error!r}")
                else:
                    outcome = judge.judge(snap, events.counts)
                if not outcome.done and not outcome.failed and elapsed() > plan.time_limit_s:
                    outcome = _Outcome(failed=True, message=f"time limit of {plan.time_limit_s:.0f}s reached")
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
        console.print(_summary_line(snap, events.counts, elapsed()))
        console.print(f"[{'green' if outcome.done else 'red'}]{status}[/]")
    console.print(f"events: {plan.events_path}  Web UI: {workflows_url}")
    return 0 if outcome.done else 1


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
