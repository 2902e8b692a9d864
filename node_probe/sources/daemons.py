"""Critical daemons (ECS's DAEMON health check): systemd units that must run for the GPUs to be usable.

`systemctl is-active` on all units in one call per poll. A unit that stays down past a threshold is one finding
(kind `daemon`, reason `DAEMON_<unit>`), impairing when the unit is marked critical. When a reported unit comes
back up, that is a finding too (kind `daemon_recovered`, same reason, never impairing), so the health workflow can
clear its DAEMON check; a later outage is a new episode and a new finding. This source says nothing about the GPUs
themselves, so it never counts for the heartbeat's GPU health (`gpu_source = False`).

Defaults (`default_daemons`): the fabric manager on hosts with NVSwitches (critical: without it CUDA cannot use
the GPUs), nvidia-persistenced, and the DCGM host engine; the last two only when installed, and not critical.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, Field

from contract.probe import KIND_DAEMON, KIND_DAEMON_RECOVERED
from node_probe.classify.record import FaultRecord, RecordKind
from node_probe.host import CommandResult, CommandRunner, boot_id, run_command
from node_probe.sources.base import Observation, SourceStatus, TrackedStatus, polled

log = logging.getLogger(__name__)

SOURCE_NAME = "daemons"
# `systemctl is-active` states that mean "running": reloading is a running unit re-reading its config.
UP_STATES = frozenset({"active", "reloading"})
NVSWITCH_DIRS = (Path("/proc/driver/nvidia-nvswitch/devices"),)
NVSWITCH_DEVICE_GLOB = "nvidia-nvswitch[0-9]*"


class DaemonSpec(BaseModel):
    unit: str = Field(min_length=1)
    critical: bool = False
    # Watched only if systemd knows the unit: defaults name units a host may not have installed.
    only_if_installed: bool = False

    @classmethod
    def parse(cls, text: str) -> DaemonSpec:
        """`UNIT` or `UNIT:critical` (the command line's --daemon)."""
        unit, _, flag = text.partition(":")
        if flag not in ("", "critical"):
            raise ValueError(f"{text!r}: expected UNIT or UNIT:critical")
        return cls(unit=unit.strip(), critical=flag == "critical")


def has_nvswitches(dev: Path = Path("/dev"), proc_dirs: Sequence[Path] = NVSWITCH_DIRS) -> bool:
    if any(dev.glob(NVSWITCH_DEVICE_GLOB)):
        return True
    return any(path.is_dir() and any(path.iterdir()) for path in proc_dirs)


def default_daemons(nvswitches: bool | None = None) -> list[DaemonSpec]:
    if nvswitches is None:
        nvswitches = has_nvswitches()
    specs = []
    if nvswitches:
        specs.append(DaemonSpec(unit="nvidia-fabricmanager", critical=True))
    specs += [
        DaemonSpec(unit="nvidia-persistenced", only_if_installed=True),
        DaemonSpec(unit="nvidia-dcgm", only_if_installed=True),
        DaemonSpec(unit="dcgm", only_if_installed=True),
    ]
    return specs


class DaemonSource(TrackedStatus):
    name = SOURCE_NAME
    gpu_source = False  # a daemon being down is a finding, not a reason to doubt what the GPU sources see
    # What a subclass watching other units (sources/container_runtime.py) reports instead.
    down_kind: RecordKind = KIND_DAEMON
    up_kind: RecordKind = KIND_DAEMON_RECOVERED
    reason_prefix = "DAEMON_"

    def __init__(
        self,
        units: Sequence[DaemonSpec],
        *,
        down_threshold: float = 60.0,
        poll_interval: float = 15.0,
        timeout: float = 10.0,
        systemctl: str = "systemctl",
        runner: CommandRunner = run_command,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.units = list(units)
        self._threshold = down_threshold
        self._poll = poll_interval
        self._timeout = timeout
        self._systemctl = systemctl
        self._run = runner
        self._clock = clock
        super().__init__("daemons: not checked yet")
        self._installed: dict[str, bool] = {}  # only for only_if_installed units, once known
        self._down_since: dict[str, float] = {}
        self._reported: set[str] = set()
        self._episodes: dict[str, int] = {}

    def check(self) -> SourceStatus:
        return self._status

    def observations(self) -> AsyncIterator[Observation]:
        return polled(self.poll, self._poll)

    async def poll(self) -> list[Observation]:
        await self._learn_installed()
        watched = [spec for spec in self.units if not spec.only_if_installed or self._installed.get(spec.unit)]
        if not watched:
            self._mark_ok()
            return []
        states = await self._states(watched)
        if states is None:
            return []
        self._mark_ok()
        now = self._clock()
        found = []
        for spec, state in zip(watched, states, strict=True):
            observation = self._update(spec, state, now)
            if observation is not None:
                found.append(observation)
        return found

    async def _states(self, watched: list[DaemonSpec]) -> list[str] | None:
        """Each watched unit's state, `systemctl is-active`'s word for it; None when systemctl could not say."""
        result = await self._systemctl_call(["is-active", *(spec.unit for spec in watched)])
        if result is None:
            return None
        states = result.stdout.split()
        if len(states) != len(watched):
            self._set_down(f"{self.name}: systemctl is-active answered {len(states)} lines for {len(watched)} units")
            return None
        return states

    def _describe(self, spec: DaemonSpec, state: str) -> str:
        """What is wrong with a unit in `state`, for the finding's message."""
        return f"{spec.unit} is {state}"

    def _raw(self, spec: DaemonSpec, state: str) -> str:
        """The finding's raw text: what was read. Part of the finding id, so stable for one outage."""
        return f"systemctl is-active {spec.unit}: {state}"

    async def _learn_installed(self) -> None:
        unknown = [s.unit for s in self.units if s.only_if_installed and s.unit not in self._installed]
        if not unknown:
            return
        result = await self._systemctl_call(["show", "--property=LoadState", "--value", *unknown])
        if result is None:
            return
        states = result.stdout.split()
        if len(states) != len(unknown):
            return  # an unexpected answer: ask again next poll rather than guess
        for unit, load_state in zip(unknown, states, strict=True):
            # A unit not installed now may be installed later (the package arrives after the probe).
            installed = load_state not in ("not-found", "masked")
            if installed:
                self._installed[unit] = True
                log.info("%s: watching %s", self.name, unit)

    async def _systemctl_call(self, args: list[str]) -> CommandResult | None:
        argv = [self._systemctl, *args]
        try:
            return await self._run(argv, self._timeout)
        except FileNotFoundError:
            self._set_down(f"{self.name}: {self._systemctl} not found (no systemd?)")
        except TimeoutError:
            self._set_down(f"{self.name}: {' '.join(argv)} did not finish within {self._timeout:.0f}s")
        except OSError as exc:
            self._set_down(f"{self.name}: cannot run {self._systemctl}: {exc.strerror or exc}")
        return None

    def _update(self, spec: DaemonSpec, state: str, now: float) -> Observation | None:
        unit = spec.unit
        if state in UP_STATES:
            if unit not in self._down_since:
                return None
            log.info("%s: %s is %s again", self.name, unit, state)
            down_for = now - self._down_since.pop(unit)
            if unit not in self._reported:
                return None  # back within the threshold: never reported, so nothing to take back
            self._reported.discard(unit)
            episode = self._episodes.get(unit, 0)
            self._episodes[unit] = episode + 1
            # Reported so that the DAEMON check does not latch: the health workflow clears it unless a repair began.
            return self._observation(
                spec, self.up_kind, state, f"{unit} is {state} again after {down_for:.0f}s", f"up:{episode}"
            )
        since = self._down_since.setdefault(unit, now)
        down_for = now - since
        if unit in self._reported or down_for < self._threshold:
            return None
        self._reported.add(unit)
        message = f"{self._describe(spec, state)} for {down_for:.0f}s (threshold {self._threshold:.0f}s)"
        return self._observation(
            spec,
            self.down_kind,
            state,
            message + (" (critical)" if spec.critical else ""),
            f"down:{self._episodes.get(unit, 0)}",
        )

    def _observation(self, spec: DaemonSpec, kind: RecordKind, state: str, message: str, episode: str) -> Observation:
        record = FaultRecord(
            line=0,
            raw=self._raw(spec, state),
            kind=kind,
            code=None,
            pci=None,
            message=message,
            reason=f"{self.reason_prefix}{spec.unit}",
            critical=spec.critical,
        )
        return Observation(record, self.name, f"state:{boot_id()}:{spec.unit}:{episode}")
