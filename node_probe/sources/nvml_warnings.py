"""Warnings worth seeing, never repairs: GPU clocks slowed by hardware or heat, and a PCIe link trained below what
the GPU and its slot can do. NvmlPolling reads them in its poll (nvml_poll.py); this module decides what counts and
words it, and keeps each GPU's last reading for the probe's /healthz.

Neither proves the GPU is failing (a hot rack, a power brake the chassis asserted, a riser seated badly), so no policy
replaces an instance on one (classify/policy.py) and neither states an NVIDIA verdict. The health workflow counts them
in the instance's health details (warning_counts, recent findings), where an operator sees them.

Nothing here calls NVML: what it is given is what NvmlPolling read, on the NVML thread.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from node_probe.classify.policy import (
    NVML_CLOCKS_HW_SLOWDOWN,
    NVML_CLOCKS_SW_THERMAL_SLOWDOWN,
    NVML_PCIE_LINK_DEGRADED,
)

# The checks' names, as NvmlGpu.unsupported records them. The clock reasons have two calls: the one pynvml 12.535+
# and drivers from R535 have, then the older name, which older drivers have and newer ones keep for now.
CLOCK_EVENT_CHECK = "clock_event_reasons"
CLOCK_THROTTLE_CHECK = "clock_throttle_reasons"
CLOCK_CALLS = (
    (CLOCK_EVENT_CHECK, "nvmlDeviceGetCurrentClocksEventReasons"),
    (CLOCK_THROTTLE_CHECK, "nvmlDeviceGetCurrentClocksThrottleReasons"),
)
PCIE_CHECK = "pcie_link"
PCIE_CONDITION = "pcie-link-degraded"

# pynvml names the bits nvmlClocksEventReason<name> (12.535+) or nvmlClocksThrottleReason<name>; these are NVML's
# values, for a module that has neither name.
_BIT_PREFIXES = ("nvmlClocksEventReason", "nvmlClocksThrottleReason")
_DOCUMENTED_BITS = {
    "GpuIdle": 0x1,
    "ApplicationsClocksSetting": 0x2,
    "SwPowerCap": 0x4,
    "HwSlowdown": 0x8,
    "SyncBoost": 0x10,
    "SwThermalSlowdown": 0x20,
    "HwThermalSlowdown": 0x40,
    "HwPowerBrakeSlowdown": 0x80,
    "DisplayClockSetting": 0x100,
}
_IDLE = "GpuIdle"


class ClockWarning(NamedTuple):
    condition: str  # in the finding ids and GpuWarnings.holding
    reason: str
    bits: tuple[str, ...]  # any of these set: the warning holds
    what: str


# Only these bits are warnings. The others are a healthy GPU doing as designed or as told, and are set on most
# GPUs most of the time: GpuIdle (nothing runs), SwPowerCap (the driver holding a busy GPU at its power limit, the
# usual state of a training job), ApplicationsClocksSetting and DisplayClockSetting (clocks someone set), SyncBoost
# (the GPUs of a sync-boost group held at one clock). Warning on those would make every working GPU a warning.
CLOCK_WARNINGS = (
    ClockWarning(
        "clocks-hw-slowdown",
        NVML_CLOCKS_HW_SLOWDOWN,
        ("HwSlowdown", "HwThermalSlowdown", "HwPowerBrakeSlowdown"),
        "GPU clocks cut by hardware slowdown (too hot, an external power brake, or power draw too high)",
    ),
    ClockWarning(
        "clocks-sw-thermal-slowdown",
        NVML_CLOCKS_SW_THERMAL_SLOWDOWN,
        ("SwThermalSlowdown",),
        "GPU clocks lowered by the driver to keep the GPU under its maximum operating temperature",
    ),
)


class GpuWarning(NamedTuple):
    """A warning that holds now: what its finding says."""

    reason: str
    message: str


class ClockBits:
    """The clock event reason bits, by name, as this pynvml gives their values."""

    def __init__(self, nvml: Any) -> None:
        self.values: dict[str, int] = {}
        for name, documented in _DOCUMENTED_BITS.items():
            found = (getattr(nvml, prefix + name, None) for prefix in _BIT_PREFIXES)
            self.values[name] = next((value for value in found if isinstance(value, int)), documented)

    def names(self, mask: int, among: Collection[str] | None = None) -> list[str]:
        return [name for name, bit in self.values.items() if mask & bit and (among is None or name in among)]

    def idle(self, mask: int) -> bool:
        return bool(mask & self.values[_IDLE])

    def warnings(self, mask: int) -> dict[str, GpuWarning | None]:
        """Each clock warning's condition -> the warning, or None where none of its bits is set."""
        judged: dict[str, GpuWarning | None] = {}
        for warning in CLOCK_WARNINGS:
            names = self.names(mask, warning.bits)
            message = f"{warning.what}: {', '.join(names)} (clock event reasons {mask:#x})"
            judged[warning.condition] = GpuWarning(warning.reason, message) if names else None
        return judged


class PcieLink(NamedTuple):
    width: int
    max_width: int
    generation: int
    max_generation: int

    def describe(self) -> str:
        return f"x{self.width} of x{self.max_width}, gen {self.generation} of {self.max_generation}"

    @property
    def narrow(self) -> bool:
        return 0 < self.width < self.max_width

    @property
    def slow(self) -> bool:
        return 0 < self.generation < self.max_generation


def pcie_warning(link: PcieLink, idle: bool | None, held: bool) -> GpuWarning | None:
    """The PCIe link's warning, or None. `idle`: the GPU's GpuIdle clock bit this poll, None where it cannot be read;
    `held`: whether the warning held after the last poll.

    A width below the maximum always counts: a GPU saves power on its link by speed, not by lanes, so a narrow link
    is lanes that did not train (the riser, the slot, the GPU). A generation below the maximum counts only while the
    GPU is not idle: at idle many GPUs train the link down, often to gen 1, and back up as soon as work arrives. At
    idle, or where idleness cannot be read, the generation says nothing either way and what held before holds, so a
    link seen slow under load is neither cleared by the next idle spell nor reported again after it."""
    if link.narrow or (link.slow and (idle is False or held)):
        return GpuWarning(NVML_PCIE_LINK_DEGRADED, f"PCIe link below its maximum: {link.describe()}")
    return None


@dataclass(slots=True)
class GpuWarnings:
    """One GPU's warnings: which hold, the link's maximum (read once a session: the GPU and its slot do not change),
    and `view`, the last poll's readings for /healthz."""

    holding: dict[str, str] = field(default_factory=dict)  # condition -> reason
    link_max: tuple[int, int] | None = None  # (width, generation)
    # Replaced whole after each poll, never changed in place: /healthz reads it from another thread.
    view: Mapping[str, Any] = field(default_factory=lambda: {"clocks": "not read yet", "pcie": "not read yet"})

    def publish(self, mask: int | None, link: PcieLink | None, bits: ClockBits, unsupported: Collection[str]) -> None:
        clock_checks = [check for check, _ in CLOCK_CALLS]
        clocks = {"mask": f"{mask:#x}", "reasons": bits.names(mask)} if mask is not None else None
        self.view = {
            "clocks": clocks or _unread(unsupported, clock_checks),
            "pcie": link._asdict() if link is not None else _unread(unsupported, [PCIE_CHECK]),
            "warnings": sorted(self.holding.values()),
        }


def _unread(unsupported: Collection[str], checks: list[str]) -> str:
    return "not supported" if all(check in unsupported for check in checks) else "not read"
