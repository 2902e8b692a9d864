"""DCGM through its own Python bindings, where they are importable; `dcgmi` (sources/dcgm.py) otherwise.

The bindings (`pydcgm`, `dcgm_structs`, `dcgm_fields`) are not on PyPI: DCGM's package installs them under
/usr/share/datacenter-gpu-manager-4/bindings/python3 (DCGM 4) or /usr/local/dcgm/bindings/python3 (older). With them
the probe connects to nv-hostengine once instead of starting dcgmi every poll, and besides the health watches
(`DcgmGroupHealth.Check`, turned into the same incidents as dcgmi's JSON) it registers for DCGM's policy violations
(`DcgmGroupPolicy.Register`, dcgmPolicyRegister_v2): double-bit ECC errors, PCIe replays, NVLink errors, Xids,
temperature and power over a limit, each delivered by a callback from DCGM's thread as it happens, not at the next
poll. A violation becomes one record (`policy_record`): a DBE is a DCGM failure (reason DCGM_POLICY_DBE, critical, as
ECS acts on Xid 48 and DCGM's memory failure); an Xid is an Xid record, classified like the kernel's; the others are
warnings (DCGM_POLICY_PCIE, _NVLINK, _THERMAL, _POWER). Temperature is watched over DEFAULT_THERMAL_LIMIT_C unless
told otherwise; power over the limit given, else over the GPUs' own enforced power limit as NVML reads it
(`enforced_power_limit_w`), else not at all: GPUs differ too much for one default.

The layouts read here are DCGM's (dcgm_structs.h, and the bindings' ctypes mirror of it: NVIDIA/DCGM
testing/python3/dcgm_structs.py, whose tests/test_policy.py registers its callbacks the same way). If the bindings
import but libdcgm cannot be loaded (DCGM_ST_LIBRARY_NOT_FOUND), the source falls back to dcgmi for good.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import importlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from node_probe.classify.record import FaultRecord
from node_probe.host import boot_id
from node_probe.sources.base import Observation, SourceStatus
from node_probe.sources.dcgm import DcgmHealthReport, DcgmHealthSource, DcgmIncident, GpuLookup, Health

log = logging.getLogger(__name__)

BINDINGS_DIRS = (
    Path("/usr/share/datacenter-gpu-manager-4/bindings/python3"),
    Path("/usr/local/dcgm/bindings/python3"),
)
_MODULES = ("dcgm_structs", "dcgm_fields", "pydcgm")
HOSTENGINE = "127.0.0.1"  # nv-hostengine's default listening address (port 5555)
DEFAULT_THERMAL_LIMIT_C = 90
# What a limit may be. Below about 30 C every working GPU would be in violation, above 120 C none could be (GPUs
# slow down and shut down well before); GPUs' power limits run from about 40 W (small inference cards) to 1 kW and
# more (Blackwell), so outside 25 to 5,000 W a limit is a typo, not a choice.
MIN_THERMAL_LIMIT_C, MAX_THERMAL_LIMIT_C = 30, 120
MIN_POWER_LIMIT_W, MAX_POWER_LIMIT_W = 25, 5000
MAX_QUEUED_VIOLATIONS = 1024

# dcgm_structs.h: dcgmPolicyCondition_t bits, dcgmPolicyConditionIdx_t indexes, and what each is to the probe.
# Values are the header's; the bindings' own constants win where they have them.
_CONDITIONS = (  # (bit name, default bit, index name, default index, reason, the callback's union member)
    ("DCGM_POLICY_COND_XID", 0x40, "DCGM_POLICY_COND_IDX_XID", 6, "XID", "xid"),
    ("DCGM_POLICY_COND_DBE", 0x1, "DCGM_POLICY_COND_IDX_DBE", 0, "DCGM_POLICY_DBE", "dbe"),
    ("DCGM_POLICY_COND_PCI", 0x2, "DCGM_POLICY_COND_IDX_PCI", 1, "DCGM_POLICY_PCIE", "pci"),
    ("DCGM_POLICY_COND_NVLINK", 0x20, "DCGM_POLICY_COND_IDX_NVLINK", 5, "DCGM_POLICY_NVLINK", "nvlink"),
    ("DCGM_POLICY_COND_THERMAL", 0x8, "DCGM_POLICY_COND_IDX_THERMAL", 3, "DCGM_POLICY_THERMAL", "thermal"),
    ("DCGM_POLICY_COND_POWER", 0x10, "DCGM_POLICY_COND_IDX_POWER", 4, "DCGM_POLICY_POWER", "power"),
    ("DCGM_POLICY_COND_MAX_PAGES_RETIRED", 0x4, "", 2, "DCGM_POLICY_RETIRED_PAGES", "mpr"),
)
_BOOL, _LLONG = 0, 1  # dcgmPolicyConditionParams_t's tag
_DBE_LOCATIONS = ("L1", "L2", "device memory", "register file", "texture memory")
# dcgmi's names (dcgmi/Health.cpp HelperSystemToString), so the two paths give the same reasons.
_SYSTEMS = {
    0x1: "PCIe system",
    0x2: "NVLINK system",
    0x4: "PMU system",
    0x8: "MCU system",
    0x10: "Memory system",
    0x20: "SM system",
    0x40: "InfoROM system",
    0x80: "Thermal system",
    0x100: "Power system",
    0x200: "Driver",
    0x400: "NvSwitch NonFatal system",
    0x800: "NvSwitch Fatal system",
    0x1000: "ConnectX system",
}
# DcgmFieldsGetEntityGroupString (dcgmlib/src/dcgm_fields.cpp), by dcgm_field_entity_group_t.
_ENTITY_GROUPS = ("None", "GPU", "vGPU", "Switch", "GPU_I", "GPU_CI", "LINK", "CPU", "CPU_CORE", "ConnectX")
_HEALTH: dict[int, Health] = {10: "warn", 20: "fail"}  # DCGM_HEALTH_RESULT_WARN, _FAIL


class Violation(NamedTuple):
    """A policy violation as the probe reads it: its record, the DCGM GPU id, DCGM's timestamp (microseconds)."""

    record: FaultRecord
    gpu_id: int
    timestamp: int


@dataclass(frozen=True, slots=True)
class DcgmBindings:
    structs: ModuleType
    fields: ModuleType
    pydcgm: ModuleType
    where: str  # the folder they came from, or "sys.path"


def load_bindings(dirs: Sequence[Path] = BINDINGS_DIRS) -> DcgmBindings | None:
    """DCGM's bindings: importable as installed, else from DCGM's own folders (added to sys.path: its modules import
    each other by their top-level names). None where there are none."""
    for where in (None, *dirs):
        added = where is not None and where.is_dir() and str(where) not in sys.path
        if where is not None and not where.is_dir():
            continue
        if added:
            sys.path.append(str(where))
        try:
            structs, fields, pydcgm = (importlib.import_module(name) for name in _MODULES)
        except ImportError:
            if added:
                sys.path.remove(str(where))
            continue
        return DcgmBindings(structs, fields, pydcgm, str(where) if where is not None else "sys.path")
    return None


def dcgm_source(
    *,
    poll_interval: float,
    gpu_lookup: GpuLookup | None,
    dirs: Sequence[Path] = BINDINGS_DIRS,
    thermal_limit_c: int = DEFAULT_THERMAL_LIMIT_C,
    power_limit_w: int | None = None,
    nvml: Any = None,
) -> DcgmHealthSource:
    """The bindings' source where they import, dcgmi's otherwise (which has no policies, so no limits)."""
    bindings = load_bindings(dirs)
    if bindings is None:
        return DcgmHealthSource(poll_interval=poll_interval, gpu_lookup=gpu_lookup)
    log.info("dcgm: using DCGM's Python bindings from %s (policy violations and health watches)", bindings.where)
    return DcgmBindingsSource(
        bindings,
        poll_interval=poll_interval,
        gpu_lookup=gpu_lookup,
        thermal_limit_c=thermal_limit_c,
        power_limit_w=power_limit_w,
        nvml=nvml,
    )


def enforced_power_limit_w(nvml: Any) -> int | None:
    """The lowest enforced power limit among this host's GPUs, in watts, as NVML reads it; None where NVML cannot
    say for every GPU (no driver, no GPUs, a GPU that does not report it).

    The enforced limit is the one the driver holds a GPU to (its board's default, or lower where an operator or a
    management tool capped it), so drawing more is a GPU not doing what it is told. DCGM's power policy has one
    limit for the whole group, so on a host of mixed GPUs the lowest one's: a GPU with a higher limit may then be
    reported over the lower one, a warning that never impairs, where the highest would hide every other GPU's
    violations. Rounded up to whole watts, so a GPU held exactly at its limit is no violation."""
    try:
        nvml.nvmlInit()
    except Exception as exc:  # pynvml's NVMLError, or no libnvidia-ml at all
        log.info("dcgm: NVML cannot read the GPUs' power limits (%s); power not watched", exc)
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(int(nvml.nvmlDeviceGetCount()))]
        milliwatts = [int(nvml.nvmlDeviceGetEnforcedPowerLimit(handle)) for handle in handles]
    except Exception as exc:
        log.info("dcgm: NVML did not give every GPU's enforced power limit (%s); power not watched", exc)
        return None
    finally:
        with contextlib.suppress(Exception):  # the answer is in; a failing shutdown changes nothing of it
            nvml.nvmlShutdown()
    if not milliwatts or min(milliwatts) <= 0:
        return None
    return -(-min(milliwatts) // 1000)


def _const(module: ModuleType, name: str, default: int) -> int:
    value = getattr(module, name, default) if name else default
    return int(value)


def conditions(structs: ModuleType) -> Iterator[tuple[int, int, str, str]]:
    """(bit, parms index, reason, union member) of each policy condition, in the order a callback is read."""
    for bit_name, bit, index_name, index, reason, member in _CONDITIONS:
        yield _const(structs, bit_name, bit), _const(structs, index_name, index), reason, member


def policy_record(response: Any, structs: ModuleType) -> Violation | None:
    """A policy violation (a c_dcgmPolicyCallbackResponse_v2) as a record; None for a condition this probe does not
    know. A callback names one condition (its union holds one member); were several bits set, the first here wins."""
    condition = int(response.condition)
    for bit, _, reason, member in conditions(structs):
        if condition & bit:
            value = getattr(response.val, member)
            gpu_id = int(response.gpuId)
            return Violation(_violation(reason, member, value, gpu_id), gpu_id, int(value.timestamp))
    return None


def _violation(reason: str, member: str, value: Any, gpu_id: int) -> FaultRecord:
    stamp = int(value.timestamp)
    wall_s = stamp / 1e6 if stamp > 0 else None  # microseconds since the epoch
    if member == "xid":
        code = int(value.errnum)
        raw = f"dcgm policy violation: GPU {gpu_id}: Xid {code}, timestamp {stamp}"
        return FaultRecord(0, raw, "xid", code, None, f"Xid {code} (DCGM policy violation)", wall_s=wall_s)
    if member == "dbe":
        where = _DBE_LOCATIONS[value.location] if 0 <= value.location < len(_DBE_LOCATIONS) else str(value.location)
        what = f"{int(value.numerrors)} double-bit ECC error(s) in {where}"
    elif member == "pci":
        what = f"PCIe replay counter at {int(value.counter)}"
    elif member == "nvlink":
        what = f"NVLink error counter (DCGM field {int(value.fieldId)}) at {int(value.counter)}"
    elif member == "thermal":
        what = f"temperature {int(value.thermalViolation)} C, over the policy's limit"
    elif member == "power":
        what = f"power {int(value.powerViolation)} W, over the policy's limit"
    else:
        what = f"retired pages pending: {int(value.sbepages)} single-bit, {int(value.dbepages)} double-bit"
    return FaultRecord(
        line=0,
        raw=f"dcgm policy violation: GPU {gpu_id}: {reason}: {what}, timestamp {stamp}",
        kind="dcgm",
        code=None,
        pci=None,
        message=f"GPU {gpu_id}: {what} (DCGM policy violation)",
        wall_s=wall_s,
        reason=reason,
        critical=member == "dbe",
    )


def health_report(response: Any) -> DcgmHealthReport:
    """A c_dcgmHealthResponse_v5 as the incidents dcgmi's JSON would have given."""
    incidents = []
    for index in range(min(int(response.incidentCount), len(response.incidents))):
        incident = response.incidents[index]
        health = _HEALTH.get(int(incident.health))
        if health is None:
            continue
        group = int(incident.entityInfo.entityGroupId)
        incidents.append(
            DcgmIncident(
                _ENTITY_GROUPS[group] if 0 <= group < len(_ENTITY_GROUPS) else str(group),
                str(int(incident.entityInfo.entityId)),
                _SYSTEMS.get(int(incident.system), "Internal error"),
                health,
                bytes(incident.error.msg).split(b"\0", 1)[0].decode("utf-8", "replace").strip(),
            )
        )
    overall: Health | None = _HEALTH.get(int(response.overallHealth))
    return DcgmHealthReport(overall or "pass", tuple(incidents))


class DcgmBindingsSource(DcgmHealthSource):
    """DCGM's health watches polled through the bindings, its policy violations as they come."""

    def __init__(
        self,
        bindings: DcgmBindings,
        *,
        poll_interval: float = 60.0,
        timeout: float = 30.0,
        gpu_lookup: GpuLookup | None = None,
        hostengine: str = HOSTENGINE,
        thermal_limit_c: int = DEFAULT_THERMAL_LIMIT_C,
        power_limit_w: int | None = None,
        nvml: Any = None,
        **dcgmi: Any,
    ) -> None:
        """`power_limit_w` None: the GPUs' own limit from `nvml` (pynvml), read at each connect since an operator may
        change it; without `nvml` either, power is not watched."""
        super().__init__(poll_interval=poll_interval, timeout=timeout, gpu_lookup=gpu_lookup, **dcgmi)
        self.bindings = bindings
        self._hostengine = hostengine
        self._limits = {"DCGM_POLICY_THERMAL": thermal_limit_c, "DCGM_POLICY_POWER": power_limit_w}
        self._nvml = nvml if power_limit_w is None else None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcgm")
        self._handle: Any = None
        self._group: Any = None
        self._callback: Any = None  # the C callback DCGM holds: referenced here, or it is collected under DCGM
        self._hung: concurrent.futures.Future[Any] | None = None
        self.use_dcgmi = False  # the bindings imported but libdcgm did not load
        self._loop: asyncio.AbstractEventLoop | None = None
        self._violations: asyncio.Queue[Any] = asyncio.Queue(MAX_QUEUED_VIOLATIONS)
        self.violations_dropped = 0

    def check(self) -> SourceStatus:
        return super().check() if self.use_dcgmi else self._status

    async def observations(self) -> AsyncIterator[Observation]:
        self._loop = asyncio.get_running_loop()
        while True:
            for observation in await self.poll():
                yield observation
            deadline = self._loop.time() + self._poll
            while (left := deadline - self._loop.time()) > 0:
                try:
                    async with asyncio.timeout(left):
                        response = await self._violations.get()
                except TimeoutError:
                    break
                violation = self._violation_observation(response)
                if violation is not None:
                    yield violation

    async def poll(self) -> list[Observation]:
        if self.use_dcgmi:
            return await super().poll()
        try:
            response = await self._call(self._health_check)
        except _Unusable:
            return await super().poll()
        except _Failed:
            return []
        self._set_ok()
        return self._diff(health_report(response))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """`fn` on the DCGM thread, within the timeout; a call that does not return marks the source down."""
        if self._hung is not None:
            if not self._hung.done():
                self._set_down(f"dcgm: nv-hostengine still has not answered a call after {self._timeout:.0f}s")
                raise _Failed
            self._hung = None
        future = self._executor.submit(fn)
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the probe's own cancellation.
            async with asyncio.timeout(self._timeout):
                return await asyncio.wrap_future(future)
        except TimeoutError:
            self._hung = future
            self._set_down(f"dcgm: nv-hostengine did not answer within {self._timeout:.0f}s (hung?)")
        except self.bindings.structs.DCGMError as exc:
            if getattr(exc, "value", None) == _const(self.bindings.structs, "DCGM_ST_LIBRARY_NOT_FOUND", -25):
                log.warning("dcgm: the bindings are installed but libdcgm is not (%s); using dcgmi", exc)
                self.use_dcgmi = True
                raise _Unusable from exc
            self._set_down(f"dcgm: nv-hostengine at {self._hostengine}: {exc}")
            self._disconnect()
        raise _Failed

    def _health_check(self) -> Any:
        if self._group is None:
            self._connect()
        return self._group.health.Check()

    def _connect(self) -> None:
        """On the DCGM thread: a handle, a group of every GPU, its health watches, our policy and its callback."""
        structs, pydcgm = self.bindings.structs, self.bindings.pydcgm
        self._handle = pydcgm.DcgmHandle(ipAddress=self._hostengine, opMode=structs.DCGM_OPERATION_MODE_AUTO)
        system = self._handle.GetSystem()
        # A group of our own (DCGM drops it when we disconnect), so the default group's settings are left alone.
        group = system.GetGroupWithGpuIds(f"gpu-autorepair-{os.getpid()}", system.GetAllSupportedGpuIds())
        group.health.Set(_const(structs, "DCGM_HEALTH_WATCH_ALL", 0xFFFFFFFF))
        limits = dict(self._limits)
        if self._nvml is not None:
            limits["DCGM_POLICY_POWER"] = enforced_power_limit_w(self._nvml)
        policy, watched = self._policy(limits)
        group.policy.Set(policy)
        callback_type = ctypes.CFUNCTYPE(None, ctypes.POINTER(structs.c_dcgmPolicyCallbackResponse_v2), ctypes.c_uint64)
        self._callback = callback_type(self._on_violation)
        group.policy.Register(watched, self._callback, None)
        self._group = group
        power = limits["DCGM_POLICY_POWER"]
        log.info(
            "dcgm: connected to nv-hostengine at %s; watching health and policy violations (over %d C, %s)",
            self._hostengine,
            limits["DCGM_POLICY_THERMAL"],
            "power not watched" if power is None else f"over {power} W",
        )

    def _policy(self, limits: dict[str, int | None]) -> tuple[Any, int]:
        """The policy to set: every condition we watch, booleans on, `limits` (by reason) where they need one."""
        structs = self.bindings.structs
        policy = structs.c_dcgmPolicy_v1()
        policy.version = structs.dcgmPolicy_version1
        watched = 0
        for bit, index, reason, member in conditions(structs):
            if member == "mpr" or (member in ("thermal", "power") and limits[reason] is None):
                continue
            watched |= bit
            limit = limits.get(reason)
            policy.parms[index].tag = _BOOL if limit is None else _LLONG
            if limit is None:
                policy.parms[index].val.boolean = True
            else:
                policy.parms[index].val.llval = limit
        policy.condition = watched
        return policy, watched

    def _on_violation(self, response: Any, user_data: int) -> None:
        """On DCGM's thread: copy what it points at (it is DCGM's memory, gone after we return) to the loop."""
        copy = self.bindings.structs.c_dcgmPolicyCallbackResponse_v2()
        ctypes.memmove(ctypes.addressof(copy), response, ctypes.sizeof(copy))
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._queue_violation, copy)

    def _queue_violation(self, response: Any) -> None:
        try:
            self._violations.put_nowait(response)
        except asyncio.QueueFull:
            self.violations_dropped += 1  # a storm of callbacks: the health watches still see the condition

    def _violation_observation(self, response: Any) -> Observation | None:
        violation = policy_record(response, self.bindings.structs)
        if violation is None:
            log.info("dcgm: policy violation with unknown condition %#x ignored", int(response.condition))
            return None
        record, gpu_id, stamp = violation
        # DCGM numbers GPUs in NVML's order, so its GPU id is the NVML index.
        identity = self._gpu_lookup(gpu_id) if self._gpu_lookup is not None else None
        if identity is not None:
            record = record._replace(pci=identity[0], uuid=identity[1])
        what = record.reason or f"XID_{record.code}"
        return Observation(record, self.name, f"policy:{boot_id()}:{gpu_id}:{what}:{stamp}")

    def _disconnect(self) -> None:
        self._group = None
        handle, self._handle = self._handle, None
        if handle is not None:
            self._executor.submit(handle.Shutdown)


class _Unusable(Exception):
    """The bindings cannot be used on this host: dcgmi it is."""


class _Failed(Exception):
    """This poll learnt nothing; the source's status says why."""
