"""The fix's gate (workflows/fix_gate.py) run on this host as a repair would run it after a reset or a reboot: the
checks on what the probe reports (GPUs visible, NVIDIA's standing verdicts, memory pending), from one poll of the NVML
source, then the host's part (activities/remediation.py gate_script: `dcgmi diag` where DCGM is installed) in a shell.
A healthy GPU passes; check_real_gpu.py records the checks."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from activities.models import HealthViewExcerpt
from activities.remediation import gate_script
from contract.groups import CapacityGroup
from contract.probe import ACTION_NONE, GpuFinding, GpuRef
from contract.repair import GpuVerdict
from node_probe.classify.record import FaultRecord
from workflows.fix_gate import failures, run_gate

HOST_TIMEOUT_S = 120.0


def excerpt(records: Sequence[FaultRecord], gpu_count: int, now: datetime) -> HealthViewExcerpt:
    """What the health workflow would hold after one poll's records: the verdicts still asking, the rest as findings."""
    verdicts = [
        GpuVerdict(
            verdict=r.nvidia_verdict,
            action=r.nvidia_action or "",
            gpu=r.pci,
            reason=r.reason or r.kind,
            finding_id=f"poll-{n}",
            observed_at=now,
        )
        for n, r in enumerate(records)
        if r.nvidia_verdict and r.nvidia_action != ACTION_NONE
    ]
    findings = [
        GpuFinding(
            finding_id=f"poll-{n}",
            instance_id="this-host",
            group="gate",
            kind=r.kind,
            reason=r.reason or r.kind,
            impairs=False,  # the gate's memory check reads reasons; a poll's conditions never impair under `ecs`
            gpu=GpuRef(pci=r.pci),
            observed_at=now,
        )
        for n, r in enumerate(records)
    ]
    return HealthViewExcerpt(gpu_count=gpu_count, nvidia_verdicts=verdicts, recent_findings=findings)


def run_host_part(group: CapacityGroup, timeout: float = HOST_TIMEOUT_S) -> dict[str, Any]:
    lines = gate_script(group)
    if not lines:
        return {"ran": False}
    try:
        done = subprocess.run(["bash", "-c", "\n".join(lines)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ran": True, "passed": False, "detail": f"not done within {timeout:g} s"}
    output = (done.stdout + done.stderr).strip()[-2000:]
    return {"ran": True, "passed": done.returncode == 0, "exit_status": done.returncode, "output": output}


def gate_here(records: Sequence[FaultRecord], gpu_count: int, host: bool = True) -> dict[str, Any]:
    """The gate's checks on this host's poll, and its host part; `passed` as a repair would judge it."""
    now = datetime.now(UTC)
    checks = run_gate(excerpt(records, gpu_count, now), since=now - timedelta(seconds=1))
    result: dict[str, Any] = {"checks": [c.model_dump() for c in checks], "failed": failures(checks)}
    if host:
        result["host"] = run_host_part(CapacityGroup(name="gate", cluster="gate"))
    host_ok = not host or result["host"].get("passed", True)
    result["passed"] = result["failed"] is None and bool(host_ok)
    return result
