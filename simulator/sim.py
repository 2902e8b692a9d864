"""`autorepair sim`: the simulated GPU fleet as a process of its own, beside `autorepair worker` and `ingest`.

It plays the world the engine repairs, against moto (`--endpoint-url`): one capacity group's instances in EC2, their
ECS agents and the service scheduler in ECS, the host side of the engine's SSM commands (GPU resets, evidence
uploads), reboots, and a probe per instance reporting through the ingest (`--ingest`), each signed with credentials
of its own instance as moto's STS grants them. Up to `--probe-standin-above` instances that probe is the real
node probe on a kernel-log file; above, a stand-in that sends the same reports (simulator/probe_standin.py).
Heartbeats go out every `--heartbeat-interval` seconds: production's 60 by default, less only where a scenario
compresses time (the demo's 2).

Faults are injected on request through its control endpoint on `--control` (simulator/sim_control.py: plain JSON,
curl will do); `POST /scenario` plays the scenario of `--faults`, `--heartbeat-loss` and `--blips` once.

With `--engine-calls FILE` (the AWS proxy's log of the engine's calls: simulator/engine_call_log.py) it follows what
the engine changed and looks at the whole group only every max(5 s, N x 50 ms); without, it looks at the whole group
every tick.

Killed (even SIGKILL) and started again with the same flags, it adopts the fleet it finds in moto instead of creating
one: the engine sees only its probes' silence meanwhile. SIGTERM or SIGINT stops it (exit 0); a bad flag exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from datetime import timedelta
from pathlib import Path

from contract.formats import parse_bind
from node_probe.delivery.ingest_reporter import DEFAULT_INGEST_ID
from simulator.engine_call_log import FollowedCallLog
from simulator.fleet import SimTiming, SimulatedFleet
from simulator.host_identity import HostIdentities
from simulator.probe_standin import PROBE_STANDIN, standin_via_ingest
from simulator.probes import via_ingest
from simulator.sim_control import Scenario, control_app

log = logging.getLogger(__name__)

DEFAULT_CONTROL = "127.0.0.1:8490"
DEFAULT_STANDIN_ABOVE = 300


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint-url", required=True, help="moto's endpoint: EC2, ECS, SSM, IAM and STS")
    parser.add_argument("--ingest", required=True, metavar="URL", help="where the probes report")
    parser.add_argument("--ingest-id", default=DEFAULT_INGEST_ID, help="the ingest's id, in the probes' proofs")
    parser.add_argument("--group", required=True, help="the capacity group the instances belong to")
    parser.add_argument("--cluster", required=True, help="its ECS cluster")
    parser.add_argument("--launch-template", required=True, help="its launch template (created if missing)")
    parser.add_argument("--instances", type=int, default=12, metavar="N", help="fleet size at creation (default 12)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the simulated world (default 7)")
    parser.add_argument("--state-dir", type=Path, default=Path(".state/sim"), help="kernel logs, spools, node files")
    parser.add_argument("--control", default=DEFAULT_CONTROL, metavar="HOST:PORT", help="the control endpoint")
    parser.add_argument("--engine-calls", type=Path, default=None, metavar="FILE", help="the proxy's call log")
    parser.add_argument(
        "--heartbeat-interval", type=float, default=60.0, metavar="SECONDS", help="the probes' (default 60)"
    )
    parser.add_argument(
        "--heartbeat-loss-threshold",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="the group's (default 600): a blip stays below it",
    )
    parser.add_argument(
        "--probe-standin-above",
        type=int,
        default=DEFAULT_STANDIN_ABOVE,
        metavar="N",
        help=f"above N instances a probe stand-in per instance, not the real probe (default {DEFAULT_STANDIN_ABOVE})",
    )
    parser.add_argument("--faults", type=int, default=0, metavar="K", help="POST /scenario: critical Xids on K")
    parser.add_argument("--heartbeat-loss", type=int, default=0, metavar="K", help="POST /scenario: K agents down")
    parser.add_argument("--blips", type=int, default=0, metavar="K", help="POST /scenario: K agents down briefly")


class SimError(Exception):
    """A reason not to start (exit code 2)."""


def timing_of(args: argparse.Namespace) -> SimTiming:
    if args.heartbeat_interval <= 0:
        raise SimError("--heartbeat-interval must be positive")
    try:
        return SimTiming(
            heartbeat_interval=timedelta(seconds=args.heartbeat_interval),
            heartbeat_loss_threshold=timedelta(seconds=args.heartbeat_loss_threshold),
        )
    except ValueError as err:
        raise SimError(f"--heartbeat-interval and --heartbeat-loss-threshold: {err}") from None


def make_fleet(args: argparse.Namespace) -> SimulatedFleet:
    if args.instances < 1:
        raise SimError("--instances must be at least 1")
    if min(args.faults, args.heartbeat_loss, args.blips) < 0:
        raise SimError("--faults, --heartbeat-loss and --blips must not be negative")
    timing = timing_of(args)
    identities = HostIdentities(args.endpoint_url)
    standin = args.instances > args.probe_standin_above
    runner = (standin_via_ingest if standin else via_ingest)(args.ingest, args.ingest_id, args.endpoint_url, identities)
    return SimulatedFleet(
        group=args.group,
        cluster=args.cluster,
        launch_template=args.launch_template,
        state_dir=args.state_dir,
        instances=args.instances,
        seed=args.seed,
        endpoint_url=args.endpoint_url,
        timing=timing,
        probe_runner=runner,
        engine_calls=None if args.engine_calls is None else FollowedCallLog(args.engine_calls),
        probe_kind=PROBE_STANDIN if standin else "real",
    )


async def run_sim(args: argparse.Namespace) -> int:
    try:
        host, port = parse_bind(args.control)
        fleet = make_fleet(args)
        scenario = Scenario(faults=args.faults, heartbeat_loss=args.heartbeat_loss, blips=args.blips)
    except (SimError, ValueError) as err:
        print(f"autorepair sim: {err}")
        return 2
    from aiohttp import web

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with fleet:
        adopted = await fleet.adopt()
        if adopted is None:
            created = await fleet.setup()
            log.info("fleet-sim: created %d instances in %s (%s probes)", len(created), args.group, fleet.probe_kind)
        # Listening means ready: the fleet is there, so whoever waits for the port may look at it and inject.
        runner = web.AppRunner(control_app(fleet, scenario), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            log.info("fleet-sim: control endpoint on http://%s:%d", host, port)
            await stop.wait()
        finally:
            await runner.cleanup()
    return 0
