"""Check the NVML source on a host with a real NVIDIA GPU, and measure the probe's CPU use at idle.

    .venv/bin/python tests/gpu/check_real_gpu.py [--seconds 30]

Lists the GPUs (index, name, PCI address, UUID, events registered), polls once, classifies what the poll found
under both policies (a healthy GPU gives zero findings), then runs the whole probe (NVML plus /dev/kmsg when
readable, a reporter that only records) for --seconds and measures its CPU time. Prints one JSON summary.

Exit status: 0 = checked and no findings, or no NVIDIA driver here (skipped, with a clear message); 2 = the
poll or the idle run produced findings (look at them: a healthy GPU has none); 1 = the check itself failed.
Not collected by pytest (no test_ prefix): it needs a GPU and takes half a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere, without installing

from contract.probe import GpuFinding, Heartbeat
from node_probe.classify.policy import POLICY_NAMES, Policy
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources.base import RecordSource
from node_probe.sources.kmsg import KMSG_PATH, KmsgSource
from node_probe.sources.nvml import NvmlSource


class RecordingReporter:
    def __init__(self) -> None:
        self.findings: list[GpuFinding] = []
        self.heartbeats: list[Heartbeat] = []

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None:
        self.findings.append(finding)

    async def send_heartbeat(self, heartbeat: Heartbeat, task_queue: str) -> None:
        self.heartbeats.append(heartbeat)


def nvml_or_skip() -> Any:
    """pynvml, initialised; or print why not and exit 0 (a machine without a GPU is not a failure)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        message = f"no NVIDIA driver on this host (nvmlInit: {exc}); nothing to check"
        print(message, file=sys.stderr)
        print(json.dumps({"result": "skipped", "reason": message}))
        sys.exit(0)
    return pynvml


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def idle_run(source: NvmlSource, seconds: float) -> dict[str, Any]:
    sources: list[RecordSource] = [source]
    if os.access(KMSG_PATH, os.R_OK):
        sources.append(KmsgSource())
    config = ProbeConfig(instance_id="check-real-gpu", group="check", heartbeat_interval=timedelta(seconds=60))
    reporter = RecordingReporter()
    probe = Probe(config, reporter, sources=sources)
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    cpu_before, wall_before = time.process_time(), time.monotonic()
    task = asyncio.create_task(probe.run())
    await asyncio.sleep(seconds)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    cpu = time.process_time() - cpu_before
    wall = time.monotonic() - wall_before
    usage_after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "sources": [s.name for s in sources],
        "seconds": round(wall, 2),
        "cpu_seconds": round(cpu, 4),
        "cpu_percent_of_one_core": round(100 * cpu / wall, 3),
        "user_s": round(usage_after.ru_utime - usage_before.ru_utime, 4),
        "system_s": round(usage_after.ru_stime - usage_before.ru_stime, 4),
        "max_rss_mib": round(usage_after.ru_maxrss / 1024, 1),
        "heartbeat_gpu_health": [str(h.gpu_health) for h in reporter.heartbeats],
        # The kmsg history read at start can hold old faults: they are listed, not counted against NVML.
        "findings": [f.model_dump(mode="json", include={"kind", "reason", "impairs", "source", "gpu", "message"})
                     for f in reporter.findings],
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="idle run length (default 30)")
    args = parser.parse_args()

    pynvml = nvml_or_skip()
    summary: dict[str, Any] = {"result": "checked", "at": datetime.now(UTC).isoformat()}
    with contextlib.suppress(Exception):
        summary["driver_version"] = text(pynvml.nvmlSystemGetDriverVersion())
        summary["nvml_version"] = text(pynvml.nvmlSystemGetNVMLVersion())
    pynvml.nvmlShutdown()

    source = NvmlSource(pynvml, poll_interval=60.0)
    status = source.check()
    if not status.is_ok:
        summary.update(result="failed", reason=status.reason)
        print(json.dumps(summary, indent=2))
        return 1
    summary["gpus"] = [
        {"index": g.index, "name": g.name, "pci": g.pci, "uuid": g.uuid, "events_registered": hex(g.events)}
        for g in source.gpus
    ]
    now = datetime.now(UTC)
    observations = source.poll_once()
    summary["poll_findings"] = [
        {
            "kind": o.record.kind,
            "pci": o.record.pci,
            "message": o.record.message,
            **{name: Policy(name).classify(o.record, now)._asdict() for name in POLICY_NAMES},
        }
        for o in observations
    ]
    summary["idle"] = asyncio.run(idle_run(source, args.seconds))
    nvml_findings = [f for f in summary["idle"]["findings"] if f["source"] == "nvml"]
    healthy = not observations and not nvml_findings
    summary["healthy"] = healthy
    print(json.dumps(summary, indent=2))
    return 0 if healthy else 2


if __name__ == "__main__":
    sys.exit(main())
