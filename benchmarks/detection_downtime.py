"""Part B of the detection benchmark: faults written while the probe is stopped, and whether they are delivered.

The real Probe with a kernel-log file (and a file in /dev/kmsg's format), with and without a spool dir, stopped
and restarted, against a reader that only follows new lines; also stopped mid-delivery, killed with SIGKILL (in a
child process: `python -m benchmarks.detection --child-probe`), and with the log rotated while stopped. Run through
benchmarks.detection.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.support import CRITICAL_XIDS, REPO, append, check_critical_xids, running, wait_for
from contract.probe import GpuFinding, Heartbeat
from node_probe import host
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources.base import LineAssembler


class Recorder:
    """The probe's reporter protocol, recording what is delivered."""

    def __init__(self, delay: float = 0.0) -> None:
        self.findings: list[GpuFinding] = []
        self.heartbeats: list[Heartbeat] = []
        self._delay = delay

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None:
        if self._delay:
            await asyncio.sleep(self._delay)  # a slow Temporal: a stop can catch findings still in the spool
        self.findings.append(finding)

    async def send_heartbeat(self, heartbeat: Heartbeat, task_queue: str) -> None:
        self.heartbeats.append(heartbeat)


def fault_lines(start: int, count: int, kmsg: bool) -> list[str]:
    """`count` critical faults, each on its own GPU (a burst on one GPU is one finding by design, and this
    measures delivery, not burst collapse), each line unique so a delivery can be matched to its line."""
    lines = []
    for n in range(start, start + count):
        code = CRITICAL_XIDS[n % len(CRITICAL_XIDS)]
        body = f"NVRM: Xid (PCI:0000:{n + 1:02x}:00): {code}, pid='<unknown>', name=<unknown>, injected fault {n}"
        prefix = f"4,{5000 + 2 * n},{(2000 + n) * 1_000_000},-;" if kmsg else f"[{2000 + n:5d}.000000] "
        lines.append(prefix + body)
    return lines


def noise_lines(start: int, count: int, kmsg: bool) -> list[str]:
    lines = []
    for n in range(start, start + count):
        body = f"usb 1-1: new high-speed USB device number {n} using xhci_hcd"
        lines.append(f"6,{5001 + 2 * n},{(2000 + n) * 1_000_000 + 1},-;{body}" if kmsg else f"[{2000 + n:5d}.5] {body}")
    return lines


def interleave(faults: list[str], noise: list[str]) -> str:
    return "".join(f"{f}\n{n}\n" for f, n in zip(faults, noise, strict=True))


def bench_config(tmp: Path, *, spool: bool = True, **sources: Any) -> ProbeConfig:
    """A probe polling fast, with heartbeats out of the way, and a file spool under `tmp` unless `spool` is off."""
    return ProbeConfig(
        instance_id="i-bench",
        group="bench",
        poll_interval=timedelta(seconds=0.02),
        heartbeat_interval=timedelta(hours=1),
        spool_dir=tmp / "spool" if spool else None,
        **sources,
    )


async def downtime(tmp: Path, *, kmsg: bool, spool: bool, before: int, during: int, after: int) -> dict[str, Any]:
    """Run, write `before` faults, stop, write `during` faults, restart, write `after` faults; count deliveries.

    The baseline is a reader started at the end of the log at the moment of the restart (a monitor that only
    follows new lines, like `tail -n0 -F` or an NVML event registration): whatever it sees of the same bytes."""
    log = tmp / ("kmsg" if kmsg else "kern.log")
    # A boot's worth of history the probe must read without reporting anything.
    log.write_text("".join(f"{line}\n" for line in noise_lines(0, 20, kmsg)))
    first, stopped, restarted = (
        fault_lines(100, before, kmsg),
        fault_lines(100 + before, during, kmsg),
        fault_lines(100 + before + during, after, kmsg),
    )
    sources: dict[str, Any] = (
        {"kmsg": True, "kmsg_path": log, "kernel_log": None} if kmsg else {"kernel_log": log, "kmsg": False}
    )
    config = bench_config(tmp, spool=spool, **sources)
    raw = [line for line in first + stopped + restarted]
    run1, run2 = Recorder(), Recorder()
    async with running(Probe(config, run1)):
        append(log, interleave(first, noise_lines(100, before, kmsg)))
        await wait_for(lambda: len(run1.findings) >= before, 10)
        await asyncio.sleep(0.2)  # caught up: the source flushes its cursor when a read comes back empty
    append(log, interleave(stopped, noise_lines(100 + before, during, kmsg)))
    tail_from = log.stat().st_size
    restart = time.perf_counter()
    caught_up: float | None = None
    async with running(Probe(config, run2)):
        if await wait_for(lambda: set(stopped) <= {f.raw for f in run2.findings}, 15):
            caught_up = time.perf_counter() - restart
        append(log, interleave(restarted, noise_lines(100 + before + during, after, kmsg)))
        await wait_for(lambda: set(restarted) <= {f.raw for f in run2.findings}, 10)
        await asyncio.sleep(0.3)  # time to (wrongly) send more
    tail = LineAssembler()
    with log.open("rb") as handle:
        handle.seek(tail_from)
        tail_seen = {r.raw for r in tail.feed(handle.read() + b"\n")}
    delivered_after = Counter(f.raw for f in run2.findings)
    ids = Counter(f.finding_id for f in run1.findings + run2.findings)
    return {
        "before_stop": before,
        "during_stop": during,
        "after_restart": after,
        "delivered_before_stop": sum(line in {f.raw for f in run1.findings} for line in first),
        "downtime_delivered": sum(delivered_after[line] >= 1 for line in stopped),
        "downtime_delivered_twice": sum(delivered_after[line] > 1 for line in stopped),
        "pre_stop_redelivered": sum(delivered_after[line] for line in first),
        "after_restart_delivered": sum(delivered_after[line] >= 1 for line in restarted),
        "unexpected_findings": sum(f.raw not in raw for f in run1.findings + run2.findings),
        "duplicate_ids_all_same_line": all(
            len({f.raw for f in run1.findings + run2.findings if f.finding_id == i}) == 1 for i in ids
        ),
        "restart_to_all_downtime_delivered_ms": None if caught_up is None else round(caught_up * 1000, 1),
        "tail_baseline_downtime_seen": sum(line in tail_seen for line in stopped),
        "tail_baseline_after_restart_seen": sum(line in tail_seen for line in restarted),
    }


async def stopped_mid_delivery(tmp: Path, count: int) -> dict[str, Any]:
    """Temporal slow (50 ms a signal); the probe is stopped when half the faults are delivered. With a spool dir
    the rest wait on disk and go out after the restart (the cursor is already past their lines)."""
    log = tmp / "kern.log"
    log.write_text("".join(f"{line}\n" for line in noise_lines(0, 20, False)))
    faults = fault_lines(100, count, False)
    config = bench_config(tmp, kernel_log=log)
    slow, fast = Recorder(delay=0.05), Recorder()
    async with running(Probe(config, slow)) as probe:
        append(log, interleave(faults, noise_lines(100, count, False)))
        await wait_for(lambda: len(slow.findings) >= count // 2, 10)
        spooled = probe.pending
    async with running(Probe(config, fast)):
        await wait_for(lambda: len(slow.findings) + len(fast.findings) >= count, 10)
        await asyncio.sleep(0.3)
    delivered = Counter(f.raw for f in slow.findings + fast.findings)
    return {
        "faults": count,
        "delivered_before_stop": len(slow.findings),
        "waiting_in_spool_at_stop": spooled,
        "delivered_after_restart": len(fast.findings),
        "delivered": sum(delivered[line] >= 1 for line in faults),
        "delivered_twice": sum(delivered[line] > 1 for line in faults),
    }


async def rotated_while_down(tmp: Path, mode: str, before: int, during: int, after: int) -> dict[str, Any]:
    """The log is rotated while the probe is stopped (`rename`: logrotate's default, a new file at the path;
    `copytruncate`: the file is copied away and emptied), with faults written before and after the rotation."""
    log = tmp / "kern.log"
    log.write_text("".join(f"{line}\n" for line in noise_lines(0, 20, False)))
    first = fault_lines(100, before, False)
    old_file = fault_lines(100 + before, during, False)
    new_file = fault_lines(100 + before + during, after, False)
    config = bench_config(tmp, kernel_log=log)
    run1, run2 = Recorder(), Recorder()
    async with running(Probe(config, run1)):
        append(log, interleave(first, noise_lines(100, before, False)))
        await wait_for(lambda: len(run1.findings) >= before, 10)
        await asyncio.sleep(0.2)
    append(log, interleave(old_file, noise_lines(100 + before, during, False)))
    rotated = tmp / "kern.log.1"
    if mode == "rename":
        log.rename(rotated)
    else:
        rotated.write_bytes(log.read_bytes())
        with log.open("r+b") as handle:
            handle.truncate(0)
    append(log, interleave(new_file, noise_lines(100 + before + during, after, False)))
    async with running(Probe(config, run2)):
        await wait_for(lambda: set(old_file + new_file) <= {f.raw for f in run2.findings}, 3)
        await asyncio.sleep(0.3)
    delivered = {f.raw for f in run2.findings}
    return {
        "rotation": mode,
        "before_stop": before,
        "written_before_rotation": during,
        "delivered_before_rotation": sum(line in delivered for line in old_file),
        "written_after_rotation": after,
        "delivered_after_rotation": sum(line in delivered for line in new_file),
        "pre_stop_redelivered": sum(line in delivered for line in first),
    }


class FileRecorder(Recorder):
    """For the probe run as a child process: each delivery is one O_APPEND write, so a SIGKILL cannot tear it,
    and anything written counts as delivered (as a signal Temporal accepted does)."""

    def __init__(self, path: Path, delay: float) -> None:
        super().__init__(delay)
        self._path = path

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None:
        await super().send_finding(finding, task_queue)
        fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, finding.model_dump_json().encode() + b"\n")
        finally:
            os.close(fd)


async def child_probe(config_path: Path, delivered: Path) -> None:
    """--child-probe: the real Probe in its own process, so that it can be killed with SIGKILL (no finally runs,
    no cursor or spool flush), which an in-process cancel cannot show."""
    config = ProbeConfig.model_validate_json(config_path.read_text())
    await Probe(config, FileRecorder(delivered, delay=0.02)).run()


async def killed_mid_delivery(tmp: Path, before: int, during: int) -> dict[str, Any]:
    """SIGKILL while `before` faults are being delivered (20 ms a signal), `during` more written while it is dead,
    then a restart from the same spool dir."""
    log, delivered = tmp / "kern.log", tmp / "delivered.jsonl"
    log.write_text("".join(f"{line}\n" for line in noise_lines(0, 20, False)))
    config = bench_config(tmp, kernel_log=log)
    config_path = tmp / "probe.json"
    config_path.write_text(config.model_dump_json())
    first, stopped = fault_lines(100, before, False), fault_lines(100 + before, during, False)

    def seen() -> list[GpuFinding]:
        if not delivered.exists():
            return []
        return [GpuFinding.model_validate_json(line) for line in delivered.read_text().splitlines() if line]

    async def start() -> asyncio.subprocess.Process:
        # The benchmark's own entry point, from the repository root (benchmarks/ is not an installed package).
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.detection", "--child-probe", str(config_path), str(delivered), cwd=REPO
        )

    child = await start()
    try:
        append(log, interleave(first, noise_lines(100, before, False)))
        await wait_for(lambda: len(seen()) >= before // 2, 30)
        child.kill()
        await child.wait()
        at_kill = len(seen())
        append(log, interleave(stopped, noise_lines(100 + before, during, False)))
        child = await start()
        await wait_for(lambda: set(first + stopped) <= {f.raw for f in seen()}, 30)
        await asyncio.sleep(0.5)  # time to (wrongly) send more
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    findings = seen()
    counts = Counter(f.raw for f in findings)
    return {
        "before_kill": before,
        "delivered_at_kill": at_kill,
        "during_stop": during,
        "delivered": sum(counts[line] >= 1 for line in first + stopped),
        "faults": before + during,
        "delivered_twice": sum(counts[line] > 1 for line in first + stopped),
        "duplicates_have_same_id": all(len({f.finding_id for f in findings if f.raw == line}) == 1 for line in counts),
    }


async def part_b(quick: bool) -> dict[str, Any]:
    check_critical_xids()  # every fault written must impair under the default policy
    before, during, after = (3, 10, 2) if quick else (5, 50, 5)
    out: dict[str, Any] = {}
    cases: list[tuple[str, bool, bool]] = [
        ("kernel-log file, spool dir (cursor)", False, True),
        ("kernel-log file, no spool dir (re-reads history)", False, False),
    ]
    if host.boot_id():
        cases += [
            ("kmsg-format file, spool dir (cursor)", True, True),
            ("kmsg-format file, no spool dir (re-reads history)", True, False),
        ]
    else:
        out["kmsg_skipped"] = "this host has no boot id, which the kmsg cursor needs"
    for name, kmsg, spool in cases:
        with tempfile.TemporaryDirectory() as tmp:
            out[name] = await downtime(Path(tmp), kmsg=kmsg, spool=spool, before=before, during=during, after=after)
    for mode in ("rename", "copytruncate"):
        with tempfile.TemporaryDirectory() as tmp:
            out[f"log rotated ({mode}) while stopped"] = await rotated_while_down(
                Path(tmp), mode, before, during // 2, during // 2
            )
    with tempfile.TemporaryDirectory() as tmp:
        out["stopped mid-delivery, spool dir"] = await stopped_mid_delivery(Path(tmp), 10 if quick else 40)
    with tempfile.TemporaryDirectory() as tmp:
        out["SIGKILL mid-delivery, spool dir"] = await killed_mid_delivery(Path(tmp), *((10, 5) if quick else (40, 20)))
    return out
