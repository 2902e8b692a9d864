"""One simulated instance's state, shared by the parts of the simulated fleet that act on it.

The AWS side fills in its ECS identity and tasks, the kernel-log writer appends to its log file, the probe
supervisor starts and stops its probe, and the fleet's watch loop moves it through boot, drain and burial.
Plain data on purpose: every decision about a node lives with the part that makes it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# What moto cannot tell a simulator started again about a node (simulator.fleet's adopt): the rest (its instance,
# AZ, container instance, tasks) is read back from moto.
_KEPT = ("name", "initial", "uptime_base_s", "gpu_uuids", "boot_id", "agent_down")


@dataclass
class SimTask:
    """One ECS task the simulated scheduler started on a node."""

    arn: str
    family: str
    stop_timeout_s: int
    stubborn: bool  # ignores a drain; only StopTask ends it


@dataclass
class SimNode:
    """One simulated instance: its AWS identity, its kernel log, and its probe."""

    instance_id: str
    name: str
    availability_zone: str
    kernel_log: Path
    initial: bool
    seen_at: float  # monotonic; the boot delay counts from here
    uptime_base_s: float
    gpu_uuids: dict[str, str]
    container_instance_arn: str | None = None
    task_plan: list[tuple[int, bool]] | None = None  # (stop timeout, stubborn) per task, drawn once
    tasks: dict[str, SimTask] = field(default_factory=dict)
    booted: bool = False  # registered, tasks started, kernel log written, probe started
    probe: asyncio.Task[None] | None = None
    probe_error: str | None = None
    agent_down: bool = False
    terminated: bool = False
    draining_since: float | None = None
    drained: bool = False
    # Its boot (/proc/sys/kernel/random/boot_id on a real host): a new one on every reboot the fleet plays.
    boot_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    # The remediation ladder as the fleet plays it (simulator.fleet): the reboot token last acted on, the reset
    # commands already run, and the scenario: its GPU fault comes back after a reset or reboot, its GPU reset is
    # refused (processes hold the GPU: the fleet leaves the fault alone), a reboot never comes back.
    reboot_token: str | None = None
    resets_seen: set[str] = field(default_factory=set)
    reboots: int = 0
    resets: int = 0
    rebooting: bool = False
    last_fault: tuple[int, str] | None = None  # (Xid, PCI address) of the last fault injected
    fault_persists: bool = False
    reset_refused: bool = False
    reboot_hangs: bool = False
    evidence_seen: set[str] = field(default_factory=set)  # evidence commands already played
    # The lines written to its kernel log from now on, while a probe stand-in (simulator.probe_standin) listens:
    # it classifies what is written instead of reading the file back.
    kernel_news: asyncio.Queue[list[str]] | None = None

    @property
    def registered(self) -> bool:
        return self.container_instance_arn is not None

    @property
    def probe_running(self) -> bool:
        return self.probe is not None and not self.probe.done()

    def uptime(self) -> float:
        # The kernel's clock: a node that has been up a while before the simulation saw it, plus what passed since.
        return self.uptime_base_s + (time.monotonic() - self.seen_at)

    def identity_path(self) -> Path:
        return self.kernel_log.with_name(f"{self.instance_id}.node.json")

    def save_identity(self) -> None:
        """Beside its kernel log: what a simulator started again needs to play this node as the same host."""
        kept = {key: getattr(self, key) for key in _KEPT}
        self.identity_path().write_text(json.dumps(kept, sort_keys=True))

    @staticmethod
    def saved_identity(kernel_log: Path, instance_id: str) -> dict[str, Any] | None:
        """What save_identity() wrote for `instance_id` (whose log is `kernel_log`), or None: never saved."""
        try:
            kept = json.loads(kernel_log.with_name(f"{instance_id}.node.json").read_text())
        except (OSError, ValueError):
            return None
        return {key: kept[key] for key in _KEPT if key in kept}
