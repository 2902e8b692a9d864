"""Probe throughput, flood memory and idle CPU.

    .venv/bin/python -m benchmarks.probe_throughput [--quick] [--idle-seconds 30] [--json FILE]   (repository root)

Measures, on this machine:
  1. lines/s through parse + policy + burst collapse (+ building the findings that go out), fed in 1 MiB chunks
     exactly as the file source feeds them, for a realistic mixed kernel log and for a flood of 800,000
     identical Xid 95 lines (only the uptime stamp changes, as in NVIDIA/NVSentinel#1120);
  2. the same flood end to end through the real Probe (kernel-log file source -> ... -> a recording reporter);
  3. peak Python heap during the flood (tracemalloc, a separate pass: tracing slows the code down);
  4. the probe's CPU at idle: the real Probe following an idle kernel-log file for --idle-seconds, by
     time.process_time.
Results go to stdout as JSON; benchmarks/RESULTS.md records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from contract.probe import GpuFinding, Heartbeat
from node_probe.classify.dedupe import BurstCollapser
from node_probe.classify.findings import dedupe_key, make_finding
from node_probe.classify.policy import Policy
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources.base import LineAssembler
from node_probe.sources.log_file import CHUNK_BYTES

FLOOD_LINES = 800_000
MIXED_LINES = 500_000
XID_95 = "NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. RST: Yes, D-RST: No"

# Everyday kernel noise: what a busy GPU host's log is mostly made of.
NOISE = [
    "usb 1-1: new high-speed USB device number {n} using xhci_hcd",
    "IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready",
    'audit: type=1400 audit({t}:{n}): apparmor="DENIED" operation="open" profile="snap.x" name="/proc/{n}"',
    "EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode. Quota mode: none.",
    "nvidia-uvm: Loaded the UVM driver, major device number 511.",
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
    "br-5f2c: port 2(veth{n}) entered forwarding state",
    "TCP: request_sock_TCP: Possible SYN flooding on port 8080. Sending cookies.",
    "systemd[1]: Started Session {n} of User ubuntu.",
    "nvme nvme0: I/O {n} QID 3 timeout, completion polled",
]
# GPU fault records in every shape the parser accepts (a few percent of a real log, more than most hosts see).
FAULTS = [
    "NVRM: Xid (PCI:0000:{b}:00): 13, pid={n}, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0)",
    "NVRM: Xid (PCI:0000:{b}:00): 31, pid={n}, name=train.py, Ch 00000008, intr 00000000. MMU Fault",
    "NVRM: Xid (PCI:0000:{b}:00): 43, pid={n}, name=python, Ch 00000010",
    "NVRM: Xid (PCI:0000:{b}:00): 79, pid={n}, name=python3, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:{b}:00 GPU-I:01 GPU-CI:00): 94, pid={n}, name=x, Contained: SM (0x1). RST: No, D-RST: No",
    "NVRM: Xid (PCI:0000:{b}:00): 45, pid={n}, name=x, Ch 00000008, caused by previous Xid 31",
    "NVRM: Xid (PCI:0000:{b}:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
    "NVRM: Xid (0000:{b}:00): 48, An uncorrectable double bit error (DBE) has been detected on GPU",
    "nvidia-nvswitch3: SXid (PCI:0000:{b}:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
    "NVRM: GPU 0000:{b}:00.0: RmInitAdapter failed! (0x26:0x65:1239)",
]
PREFIXES = [
    lambda t: f"[{t:12.6f}] ",
    lambda t: f"Nov 22 15:39:{int(t) % 60:02d} gpu-host-17 kernel: ",
    lambda t: f"kern  :warn  : 2025-01-21T04:41:{int(t) % 60:02d},283302+00:00 ",
]


def mixed_lines(count: int, fault_share: float = 0.03, seed: int = 7) -> Iterator[str]:
    rng = random.Random(seed)
    buses = ["17", "3b", "5d", "c1", "ca", "e3"]
    for i in range(count):
        t = 1000.0 + i * 0.001
        prefix = PREFIXES[rng.randrange(len(PREFIXES))](t)
        if rng.random() < fault_share:
            body = rng.choice(FAULTS).format(b=rng.choice(buses), n=rng.randrange(1, 99999))
        else:
            body = rng.choice(NOISE).format(n=rng.randrange(1, 99999), t=int(t))
        yield f"{prefix}{body}\n"


def flood_lines(count: int) -> Iterator[str]:
    for i in range(count):
        yield f"[{1900.0 + i * 1e-5:12.6f}] {XID_95}\n"


def chunks(lines: Iterator[str], size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes the file source reads: 1 MiB at a time, lines cut anywhere."""
    buffer: list[str] = []
    length = 0
    for line in lines:
        buffer.append(line)
        length += len(line)
        if length >= size:
            yield "".join(buffer).encode()
            buffer, length = [], 0
    if buffer:
        yield "".join(buffer).encode()


def pipeline(data: Iterator[bytes], policy_name: str = "ecs") -> dict[str, int]:
    """What Probe._consume does per record, minus the event loop: parse, classify, collapse, build findings."""
    assembler = LineAssembler()
    policy = Policy(policy_name)
    bursts: BurstCollapser[Any, Any] = BurstCollapser(timedelta(minutes=5))
    now = datetime.now(UTC)
    records = findings = impairing = 0
    for chunk in data:
        for record in assembler.feed(chunk):
            records += 1
            verdict = policy.classify(record, now)
            if bursts.offer(dedupe_key(record, verdict), record, now):
                make_finding(record, verdict, instance_id="i-1", group="g", source="bench", observed_at=now)
                findings += 1
                impairing += verdict.impairs
    rollups = len(bursts.flush())
    return {
        "lines": assembler.parser.lines_seen,
        "records": records,
        "findings": findings,
        "impairing": impairing,
        "rollups": rollups,
    }


def timed(make_data: Callable[[], Iterator[bytes]], repeat: int) -> dict[str, Any]:
    best: dict[str, Any] = {}
    for _ in range(repeat):
        data = list(make_data())  # generated before timing: only the probe's work is measured
        wall0, cpu0 = time.perf_counter(), time.process_time()
        counts = pipeline(iter(data))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if not best or wall < best["seconds"]:
            best = {**counts, "seconds": round(wall, 3), "cpu_seconds": round(cpu, 3)}
    best["lines_per_second"] = round(best["lines"] / best["seconds"])
    return best


def flood_memory(lines: int) -> dict[str, Any]:
    """Peak heap while the flood streams through (lines generated lazily, as a file is read)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    counts = pipeline(chunks(flood_lines(lines)))
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {**counts, "peak_mib": round((peak - base) / 2**20, 2), "retained_mib": round((current - base) / 2**20, 2)}


class Recorder:
    def __init__(self) -> None:
        self.findings: list[GpuFinding] = []
        self.heartbeats: list[Heartbeat] = []

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None:
        self.findings.append(finding)

    async def send_heartbeat(self, heartbeat: Heartbeat, task_queue: str) -> None:
        self.heartbeats.append(heartbeat)


async def probe_end_to_end(path: Path, lines: int) -> dict[str, Any]:
    config = ProbeConfig(instance_id="i-bench", group="bench", kernel_log=path, heartbeat_interval=timedelta(hours=1))
    reporter = Recorder()
    probe = Probe(config, reporter)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    task = asyncio.create_task(probe.run())
    while probe.stats.records < lines:
        await asyncio.sleep(0.01)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return {
        "records": probe.stats.records,
        "suppressed": probe.stats.suppressed,
        "findings_delivered": len(reporter.findings),
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "lines_per_second": round(lines / wall),
    }


async def idle_cpu(path: Path, seconds: float) -> dict[str, Any]:
    config = ProbeConfig(instance_id="i-idle", group="bench", kernel_log=path)
    probe = Probe(config, Recorder())
    task = asyncio.create_task(probe.run())
    await asyncio.sleep(1.0)  # start-up (reading the file's history) is not idle
    wall0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.sleep(seconds)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return {
        "seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 4),
        "cpu_percent_of_one_core": round(100 * cpu / wall, 3),
        "poll_interval_s": config.poll_interval.total_seconds(),
        "heartbeat_interval_s": config.heartbeat_interval.total_seconds(),
    }


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tenth of the lines, 3 s idle (a smoke test)")
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--repeat", type=int, default=3, help="best of N for the in-process rates")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    flood = FLOOD_LINES // 10 if args.quick else FLOOD_LINES
    mixed = MIXED_LINES // 10 if args.quick else MIXED_LINES
    idle_seconds = 3.0 if args.quick else args.idle_seconds

    results: dict[str, Any] = {"machine": machine(), "at": datetime.now(UTC).isoformat(timespec="seconds")}
    results["mixed_log"] = timed(lambda: chunks(mixed_lines(mixed)), args.repeat)
    results["xid95_flood"] = timed(lambda: chunks(flood_lines(flood)), args.repeat)
    results["xid95_flood_memory"] = flood_memory(flood)
    with tempfile.TemporaryDirectory() as tmp:
        flood_file = Path(tmp) / "flood.log"
        with flood_file.open("w") as out:
            out.writelines(flood_lines(flood))
        results["xid95_flood_through_probe"] = asyncio.run(probe_end_to_end(flood_file, flood))
        idle_file = Path(tmp) / "idle.log"
        idle_file.write_text("".join(mixed_lines(1000)))
        results["idle"] = asyncio.run(idle_cpu(idle_file, idle_seconds))
    text = json.dumps(results, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
