"""Ingest throughput: signed heartbeat reports per second per core, from many simulated hosts.

    .venv/bin/python -m benchmarks.ingest_throughput [--hosts 200] [--concurrency 32] [--seconds 40]
        [--token-seconds 20] [--reconnect-seconds 12] [--sequential 400] [--no-pin] [--profile] [--json FILE]

The real ingest (ingest.cli.build_ingest + ingest.server.build_app, served by ingest.cli.serving on 127.0.0.1,
logging as `autorepair ingest` does: INFO, JSON lines) runs in its own process, pinned to one core when the machine
has two or more; everything else (moto_server, the Temporal dev server, the worker and the load generator, this
process) is pinned to the other cores. `--hosts` EC2 instances are launched in moto with the group tag, each with
its own credentials: a role assumed with the instance id as session name (simulator.host_identity), as an
instance profile gives them. Every request is the real node_probe IngestReporter's send_heartbeat: without session
tokens (use_sessions=False) a freshly signed GetCallerIdentity proof, which the ingest sends to moto's STS; with
them (the default) the ingest's HMAC token, after one proof per host.

Phases: (1) the first heartbeat of every host (a membership lookup in moto's EC2 and a signal-with-start of the
health workflow on Temporal: LivenessRelay forwards only the first one of each instance); then without tokens
(2) --sequential heartbeats one at a time (latency without queueing), (3) --concurrency in flight for --seconds
(the steady state: every report verified with STS, none forwarded to Temporal), (3b) the same with a new TCP
connection per report, as a host heartbeating every 60 s makes (aiohttp's client keeps an idle connection 15 s);
then (5, 6, 6b) the same three with session tokens. For each phase the CPU seconds of the ingest, moto, Temporal
and this process are read from /proc/<pid>/stat, so the ingest's requests per CPU-second hold even while other
jobs share the machine. --profile adds phases 7 and 8, like 3 and 6 with cProfile (CPU time) in the ingest, for
where its time goes (not for rates: profiling about doubles the cost).
Results go to stdout as JSON; benchmarks/INGEST.md records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import itertools
import json
import os
import platform
import pstats
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ACCOUNT = "123456789012"  # moto's
AMI = "ami-12c6146b"  # one of moto's built-in AMIs
REGION = "us-east-1"
# The group's timing is production's default (heartbeat every 60 s, loss after 10 min), so the ingest sends its
# liveness batches at production's cadence: once when the hosts are first heard, then every 8 min.
HEARTBEAT_INTERVAL = timedelta(seconds=60)
LOSS_THRESHOLD = timedelta(minutes=10)
# The limiter's checks run on every request, but its limits are raised out of the way: this measures cost, not
# the limits (the defaults, 5/s per instance and 2,000/s in total, would bind a compressed 200-host load).
NO_LIMIT = 1_000_000


# --- Measuring --------------------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (all its threads), from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def shell(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return f"({' '.join(command)}: {err})"


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": shell(["nproc"]),
        "nproc_all": shell(["nproc", "--all"]),
        "uname": shell(["uname", "-a"]),
        "cpu_model": model,
        "python": platform.python_version(),
    }


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (every core, every process), from /proc/stat."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


@dataclass
class Processes:
    """The pids whose CPU is accounted, by role; "other_jobs" is the rest of the machine's busy time."""

    pids: dict[str, int]

    def snapshot(self) -> dict[str, float]:
        mine = {role: cpu_seconds(pid) for role, pid in self.pids.items()}
        return {**mine, "other_jobs": machine_busy_seconds() - sum(mine.values())}


@dataclass
class Phase:
    name: str
    concurrency: int
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    cpu: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ok = self.statuses.get("202", 0)
        per_k = {role: round(1000 * t / ok, 3) if ok else None for role, t in self.cpu.items() if role != "other_jobs"}
        ingest_cpu = self.cpu.get("ingest", 0.0)
        return {
            "concurrency": self.concurrency,
            "requests": sum(self.statuses.values()),
            "statuses": dict(self.statuses),
            "wall_s": round(self.wall_s, 2),
            "accepted_per_s_wall": round(ok / self.wall_s, 1) if self.wall_s else None,
            "ingest_requests_per_cpu_second": round(ok / ingest_cpu, 1) if ingest_cpu else None,
            "ingest_core_utilisation": round(ingest_cpu / self.wall_s, 3) if self.wall_s else None,
            "cpu_seconds": {role: round(seconds, 2) for role, seconds in self.cpu.items()},
            "cpu_seconds_per_1000_accepted": per_k,
            "latency_ms": {
                "p50": round(1000 * percentile(self.latencies, 50), 2),
                "p99": round(1000 * percentile(self.latencies, 99), 2),
                "max": round(1000 * max(self.latencies, default=float("nan")), 2),
            },
        }


# --- The ingest in its own process --------------------------------------------------------------------------------


def serve_ingest(settings_path: Path, port: int, cpu: int | None, profile_path: Path | None) -> int:
    """The child: pin, log as `autorepair ingest` does, serve until SIGTERM; print the relay's counters as JSON.
    With a profile path, SIGUSR1 starts cProfile (CPU time) and SIGUSR2 stops it and dumps the stats to
    <path>.<n>, n counting the windows from 1."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # before any thread exists: the loop's threads inherit it
    from worker.logging_setup import configure_logging
    from worker.settings import Settings

    configure_logging("json")
    settings = Settings.model_validate_json(settings_path.read_text())
    counters = asyncio.run(_serve(settings, port, profile_path))
    print(json.dumps(counters), flush=True)
    return 0


async def _serve(settings: Any, port: int, profile_path: Path | None) -> dict[str, int]:
    import aiohttp

    from contract.temporal_client import connect
    from ingest.cli import build_ingest, serving, serving_metrics
    from ingest.server import build_app
    from node_probe.delivery.reporter import Reporter

    client = await connect(settings.temporal)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    profiles: list[cProfile.Profile] = []

    def start_profile() -> None:
        profiles.append(cProfile.Profile(time.process_time))
        profiles[-1].enable()

    def stop_profile() -> None:
        profiles[-1].disable()
        profiles[-1].dump_stats(f"{profile_path}.{len(profiles)}")

    if profile_path is not None:
        loop.add_signal_handler(signal.SIGUSR1, start_profile)
        loop.add_signal_handler(signal.SIGUSR2, stop_profile)
    async with aiohttp.ClientSession() as session:
        ingest = build_ingest(settings, Reporter(client), session)
        # Its metrics port too, where the settings name one (heartbeat_scale.py scrapes it).
        async with (
            serving(build_app(ingest), "127.0.0.1", port, None),
            serving_metrics(ingest, settings.ingest.metrics_bind),
        ):
            await stop.wait()
    return {
        "heartbeats_forwarded_to_temporal": ingest.relay.heartbeats_forwarded,
        "liveness_batches_sent": ingest.relay.batches_sent,
        "membership_lookups": ingest.membership.lookups,
    }


@dataclass
class IngestProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    counters: dict[str, int] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def ingest_process(
    settings: Any, state: Path, cpu: int | None, profile_path: Path | None
) -> AsyncIterator[IngestProcess]:
    from contract.ingest import HEALTH_PATH
    from simulator.servers import free_port

    port = free_port()
    settings_path = state / "ingest-settings.json"
    settings_path.write_text(settings.model_dump_json())
    log_path = state / "ingest.log"
    command = [sys.executable, "-m", "benchmarks.ingest_throughput", "--serve-ingest", str(settings_path)]
    command += ["--port", str(port)]
    command += ["--cpu", str(cpu)] if cpu is not None else []
    command += ["--profile-out", str(profile_path)] if profile_path is not None else []
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
    running = IngestProcess(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(_answers, f"{running.url}{HEALTH_PATH}"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
                raise RuntimeError(f"the ingest did not start (exit {proc.poll()}); {log_path}:\n{tail}")
            await asyncio.sleep(0.2)
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = await asyncio.to_thread(proc.communicate, timeout=30)
            lines = out.decode(errors="replace").strip().splitlines()
            running.counters = json.loads(lines[-1]) if lines else {}
        except (subprocess.TimeoutExpired, ValueError):
            proc.kill()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status) == 200
    except OSError:
        return False


# --- Hosts and load -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Host:
    instance_id: str
    credentials: Any  # botocore ReadOnlyCredentials


def launch_hosts(endpoint: str, group: str, count: int) -> list[Host]:
    """`count` instances tagged with `group` in moto's EC2, and each one's instance-profile credentials."""
    import boto3

    from contract.names import GROUP_TAG
    from simulator.host_identity import HostIdentities

    ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name=REGION)
    tags: list[Any] = [{"ResourceType": "instance", "Tags": [{"Key": GROUP_TAG, "Value": group}]}]
    ids: list[str] = []
    while len(ids) < count:
        batch = min(100, count - len(ids))
        reservation = ec2.run_instances(
            ImageId=AMI, InstanceType="p4d.24xlarge", MinCount=batch, MaxCount=batch, TagSpecifications=tags
        )
        ids += [instance["InstanceId"] for instance in reservation["Instances"]]
    identities = HostIdentities(endpoint, REGION)
    return [Host(instance_id, identities.credentials(instance_id)) for instance_id in ids]


def signing_cost_us(host: Host, endpoint: str, count: int = 500) -> float:
    """What a host spends signing one proof (not the ingest's cost): microseconds, median of `count`."""
    from node_probe.delivery.proof import sign_proof

    body = b'{"instance_id":"%s"}' % host.instance_id.encode()
    times = []
    for _ in range(count):
        start = time.perf_counter()
        sign_proof(body, ingest_id="bench", sts_endpoint=endpoint, region=REGION, credentials=host.credentials)
        times.append(time.perf_counter() - start)
    return round(1e6 * percentile(times, 50), 1)


async def drive(
    name: str,
    reporters: Sequence[tuple[str, Any]],
    group: str,
    processes: Processes,
    *,
    concurrency: int,
    count: int | None = None,
    seconds: float | None = None,
    reconnect: bool = False,
) -> Phase:
    """`concurrency` senders, each taking the next host round robin and awaiting its IngestReporter's
    send_heartbeat (sign a fresh proof, POST, raise unless 202), until `count` requests or `seconds` have passed.
    With `reconnect`, each host's connection is closed after each report, so the next one opens a new one."""
    from contract.probe import Heartbeat
    from node_probe.delivery.ingest_reporter import IngestRefused

    concurrency = min(concurrency, len(reporters))  # a host sends one report at a time, as a probe does
    phase = Phase(name, concurrency)
    requests, hosts, busy = itertools.count(), itertools.cycle(range(len(reporters))), set[int]()
    deadline = time.monotonic() + (seconds or 0)

    async def sender() -> None:
        while True:
            if (count is not None and next(requests) >= count) or (seconds and time.monotonic() >= deadline):
                return
            host = next(index for index in hosts if index not in busy)
            busy.add(host)
            instance_id, reporter = reporters[host]
            heartbeat = Heartbeat(instance_id=instance_id, group=group, sent_at=datetime.now(UTC))
            start = time.perf_counter()
            try:
                await reporter.send_heartbeat(heartbeat, "the ingest's to choose")
                status = "202"
            except IngestRefused as refused:
                status = str(refused.status)
            except Exception as err:  # a connection error: counted, not fatal
                status = type(err).__name__
            phase.latencies.append(time.perf_counter() - start)
            phase.statuses[status] += 1
            if reconnect:
                await reporter.close()
            busy.discard(host)

    before, start = processes.snapshot(), time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(concurrency)))
    phase.wall_s = time.perf_counter() - start
    after = processes.snapshot()
    phase.cpu = {role: after[role] - before[role] for role in before}
    return phase


async def settle(processes: Processes, roles: Sequence[str], *, below: float = 0.15, within: float = 15.0) -> float:
    """Wait until `roles` together use under `below` of a core over a second (the worker has started the health
    workflows); returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < within:
        before = processes.snapshot()
        await asyncio.sleep(1.0)
        after = processes.snapshot()
        if sum(after[role] - before[role] for role in roles) < below:
            break
    return round(time.monotonic() - start, 1)


# --- Profile summary ----------------------------------------------------------------------------------------------

# (what, file, function): CPU time inside the function and everything it calls, as a share of the ingest's profiled
# CPU time. Nested rows overlap (the STS call is part of the verification, which is part of the handler).
INCLUSIVE: list[tuple[str, str, str]] = [
    ("aiohttp serving a request (routing, handler, response)", "aiohttp/web_protocol.py", "_handle_request"),
    ("  the report handler (_Reports._report)", "ingest/server.py", "_report"),
    ("    its checks (_check)", "ingest/server.py", "_check"),
    ("      proof verification (ProofVerifier.verify)", "ingest/identity.py", "verify"),
    ("        the STS call (_ask_sts: connect, POST, read, parse XML)", "ingest/identity.py", "_ask_sts"),
    ("          a new TCP connection to STS (aiohttp connector)", "aiohttp/connector.py", "connect"),
    ("        decoding the proof (base64, SignedStsRequest JSON)", "ingest/identity.py", "_decode"),
    ("      rate limiter (per instance)", "ingest/rate_limit.py", "take_instance"),
    ("      group membership (cached)", "ingest/membership.py", "check"),
    ("    the 'relayed' INFO log line (structlog JSON)", "logging/__init__.py", "info"),
    ("    liveness relay (coalesced: no Temporal call)", "delivery/liveness_relay.py", "send_heartbeat"),
    ("reading report bytes (aiohttp server data_received)", "aiohttp/web_protocol.py", "data_received"),
    ("reading STS's answer bytes (aiohttp client data_received)", "aiohttp/client_proto.py", "data_received"),
]


def profile_summary(path: Path, top: int = 12) -> dict[str, Any]:
    raw: dict[Any, Any] = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in raw.values()) or 1.0
    inclusive: dict[str, float] = {}
    for label, file, function in INCLUSIVE:
        times = [entry[3] for (filename, _, name), entry in raw.items() if filename.endswith(file) and name == function]
        inclusive[label] = round(100 * max(times, default=0.0) / total, 1)
    outside = round(100 - inclusive[INCLUSIVE[0][0]], 1)
    inclusive["outside the request handler (event loop, transport callbacks, sockets)"] = outside
    rows = sorted(
        (
            (entry[2], entry[1], f"{'/'.join(Path(filename).parts[-2:])}:{line}({name})")
            for (filename, line, name), entry in raw.items()
        ),
        reverse=True,
    )
    return {
        "profiled_cpu_s": round(total, 2),
        "inclusive_share_percent": inclusive,
        "top_functions_by_self_cpu": [
            {"function": where, "calls": calls, "share_percent": round(100 * t / total, 1)}
            for t, calls, where in rows[:top]
        ],
    }


# --- The run ------------------------------------------------------------------------------------------------------


def plan_cpus(pin: bool) -> tuple[int | None, set[int]]:
    """The ingest's core and everyone else's, or (None, empty) when not pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, set()
    return cpus[0], set(cpus[1:])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp  # noqa: F401  (imported before the stack: a missing dependency fails fast)

    from benchmarks.support import engine_settings
    from contract.config import IngestSettings
    from contract.temporal_client import connect
    from node_probe.delivery.ingest_reporter import IngestReporter
    from simulator.fleet import SimTiming
    from simulator.servers import MotoServer, TemporalDevServer, free_port
    from worker.main import run_worker

    results: dict[str, Any] = {
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python -m benchmarks.ingest_throughput", *sys.argv[1:]]),
        "machine": machine(),  # before pinning: nproc counts the cores this process may use
        "uptime_before": shell(["uptime"]),
    }
    ingest_cpu, other_cpus = plan_cpus(not args.no_pin)
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)  # inherited by moto, Temporal and the worker's threads
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION=REGION)
    results |= {
        "pinning": {"ingest_cpu": ingest_cpu, "others_cpus": sorted(other_cpus)} if other_cpus else "none",
        "settings": {
            "hosts": args.hosts,
            "concurrency": args.concurrency,
            "seconds": args.seconds,
            "token_seconds": args.token_seconds,
            "session_ttl_s": IngestSettings().session_ttl.total_seconds(),
            "heartbeat_interval_s": HEARTBEAT_INTERVAL.total_seconds(),
            "rate_limits": "raised out of the way (checked on every request, never binding)",
        },
    }
    timing = SimTiming(heartbeat_interval=HEARTBEAT_INTERVAL, heartbeat_loss_threshold=LOSS_THRESHOLD)
    group = f"gpu-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="ingest-bench-") as tmp:
        state = Path(tmp)
        profile_path = (args.profile_stats or state / "ingest.prof") if args.profile else None
        async with (
            MotoServer(state / "moto", port=free_port()) as moto,
            TemporalDevServer(state / "temporal", port=free_port(), ui_port=free_port()) as temporal,
        ):
            settings = engine_settings(temporal.address, moto.endpoint_url, state / "events.jsonl", group, timing)
            ingest_settings = IngestSettings(
                sts_endpoint=moto.endpoint_url,
                allowed_accounts=[ACCOUNT],
                instance_rate=NO_LIMIT,
                instance_burst=NO_LIMIT,
                total_rate=NO_LIMIT,
                total_burst=NO_LIMIT,
            )
            settings = settings.model_copy(update={"ingest": ingest_settings})
            started = time.perf_counter()
            hosts = await asyncio.to_thread(launch_hosts, moto.endpoint_url, group, args.hosts)
            results["setup_s"] = {"launch_and_assume_roles": round(time.perf_counter() - started, 1)}
            results["host_signing_us_per_proof_p50"] = signing_cost_us(hosts[0], moto.endpoint_url)
            client = await connect(settings.temporal)
            worker = asyncio.create_task(run_worker(settings, client), name="benchmark worker")
            try:
                async with ingest_process(settings, state, ingest_cpu, profile_path) as ingest:
                    assert moto.pid is not None and temporal.pid is not None and ingest.proc.pid
                    pids = {"ingest": ingest.proc.pid, "moto": moto.pid, "temporal": temporal.pid}
                    processes = Processes({**pids, "loadgen_and_worker": os.getpid()})
                    results["phases"] = await phases(args, hosts, group, settings, ingest, processes, IngestReporter)
                results["ingest_counters"] = ingest.counters
                results["ingest_log_lines"] = sum(1 for _ in ingest.log_path.open("rb"))
                for n, name in enumerate(("7_no_tokens", "8_tokens"), 1):
                    if profile_path is not None and Path(f"{profile_path}.{n}").exists():
                        results.setdefault("ingest_profiles", {})[name] = profile_summary(Path(f"{profile_path}.{n}"))
            finally:
                worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await worker
    results["uptime_after"] = shell(["uptime"])
    return results


async def phases(
    args: argparse.Namespace,
    hosts: list[Host],
    group: str,
    settings: Any,
    ingest: IngestProcess,
    processes: Processes,
    reporter_class: Any,
) -> dict[str, Any]:
    def pool(use_sessions: bool) -> list[tuple[str, Any]]:
        return [
            (
                host.instance_id,
                reporter_class(
                    ingest.url,
                    ingest_id=settings.ingest.id,
                    sts_endpoint=settings.ingest.sts_endpoint,
                    region=REGION,
                    credentials=lambda credentials=host.credentials: credentials,
                    use_sessions=use_sessions,
                ),
            )
            for host in hosts
        ]

    proofs, tokens = pool(False), pool(True)
    out: dict[str, Any] = {}

    async def phase(name: str | None, reporters: list[tuple[str, Any]], *, profile: bool = False, **how: Any) -> None:
        if profile:
            os.kill(ingest.proc.pid, signal.SIGUSR1)
        how.setdefault("concurrency", args.concurrency)
        result = await drive(name or "warm-up", reporters, group, processes, **how)
        if profile:
            os.kill(ingest.proc.pid, signal.SIGUSR2)
        if name is not None:  # None: a warm-up, not recorded
            out[name] = result.summary()

    try:
        await phase("1_first_heartbeat_per_host", proofs, concurrency=16, count=len(hosts))
        out["1_first_heartbeat_per_host"]["settle_s_after"] = await settle(
            processes, ["loadgen_and_worker", "temporal", "ingest"]
        )
        await phase(None, proofs, seconds=3)  # every host's connection open, caches warm
        await phase("2_no_tokens_sequential", proofs, concurrency=1, count=args.sequential)
        await phase("3_no_tokens_loaded", proofs, seconds=args.seconds)
        await phase("3b_no_tokens_new_connection_per_report", proofs, seconds=args.reconnect_seconds, reconnect=True)
        await phase(None, tokens, count=len(hosts))  # one proof per host, answered with its session token
        await phase(None, tokens, seconds=2)
        await phase("5_tokens_sequential", tokens, concurrency=1, count=args.sequential)
        await phase("6_tokens_loaded", tokens, seconds=args.token_seconds)
        await phase("6b_tokens_new_connection_per_report", tokens, seconds=args.reconnect_seconds, reconnect=True)
        if args.profile:  # apart from the rates: cProfile roughly doubles the ingest's CPU per request
            await phase("7_profiled_no_tokens_not_for_rates", proofs, seconds=args.profile_seconds, profile=True)
            await phase("8_profiled_tokens_not_for_rates", tokens, seconds=args.profile_seconds, profile=True)
    finally:
        await asyncio.gather(*(reporter.close() for _, reporter in proofs + tokens))
    out["proofs_signed"] = {
        "no_tokens_pool": sum(r.proofs_signed for _, r in proofs),
        "tokens_pool": sum(r.proofs_signed for _, r in tokens),
    }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=200, help="simulated hosts, each with its own credentials")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight in phase 3")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of phase 3 (no tokens)")
    parser.add_argument("--token-seconds", type=float, default=20.0, help="length of phase 6 (session tokens)")
    parser.add_argument(
        "--reconnect-seconds", type=float, default=12.0, help="phases 3b, 6b: a new connection per report"
    )
    parser.add_argument("--sequential", type=int, default=400, help="requests of phase 2, one at a time")
    parser.add_argument("--no-pin", action="store_true", help="do not pin the ingest to a core of its own")
    parser.add_argument("--profile", action="store_true", help="then cProfile the ingest (CPU time): phases 7, 8")
    parser.add_argument("--profile-seconds", type=float, default=8.0, help="length of phases 7 and 8")
    parser.add_argument("--profile-stats", type=Path, default=None, help="keep the raw pstats as FILE.1, FILE.2")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    # The ingest child's own arguments (this module runs itself as the ingest process).
    parser.add_argument("--serve-ingest", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_ingest is not None:
        return serve_ingest(args.serve_ingest, args.port, args.cpu, args.profile_out)
    results = asyncio.run(run(args))
    text = json.dumps(results, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
