"""A stand-in for pynvml, for the NVML source's tests (tests/test_nvml_source_*.py).

The stand-in keeps everything of the real module except the C calls: its constants, its exception classes (raised
the way pynvml raises them, `NVMLError(code)`, which picks the `NVMLError_*` subclass), and its ctypes return types
(`c_nvmlEventData_t`, `nvmlPciInfo_t`, `c_nvmlFieldValue_t` arrays, `c_nvmlDevice_t` pointers). A test checks
that every faked function exists in pynvml with the same parameters (tests/test_nvml_source_lifecycle.py), so the real
module drops in unchanged.

The R575+ verdict calls answer as pynvml 13.x does on a real H200 (tests/gpu/recorded/h200-2026-12-04-check.json):
`nvmlDeviceGetSramEccErrorStatus` returns NVML_SUCCESS and fills the versioned struct it is given a pointer to,
`nvmlDeviceGetRepairStatus` returns `[bChannelRepairPending, bTpcRepairPending]`, and
`nvmlDeviceGetUnrepairableMemoryFlag_v1` an int. An older GPU or driver answers NOT_SUPPORTED or FUNCTION_NOT_FOUND
(`FakeGpu.errors`); an older pynvml lacks the function or struct altogether (`older_pynvml`).

The clock event reasons are a bitmask of pynvml's `nvmlClocksEventReason*` values (the older name,
`nvmlDeviceGetCurrentClocksThrottleReasons`, answers the same), and the PCIe link is four ints, as pynvml 13.x
returns them; the recorded H200 answers GpuIdle (0x1) and x16 of x16, gen 5 of 5 at idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import time
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pynvml

from node_probe.classify.policy import Policy
from node_probe.sources.base import Observation
from node_probe.sources.nvml import NvmlSource
from tests.test_probe import eventually

NOW = datetime(2025, 1, 1, tzinfo=UTC)
XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
RECOVERY = pynvml.nvmlEventTypeGpuRecoveryAction
UNAVAILABLE = pynvml.nvmlEventTypeGpuUnavailableError
NO_INSTANCE = 0xFFFFFFFF


def nvml_error(code: int) -> pynvml.NVMLError:
    """What pynvml's _nvmlCheckReturn raises for a return code: the NVMLError_* subclass for it."""
    return pynvml.NVMLError(code)


@dataclass
class FakeGpu:
    bus_id: str | bytes
    uuid: str | bytes
    name: str = "NVIDIA H100 80GB HBM3"
    supported_events: int = XID | DBE | RECOVERY | UNAVAILABLE | pynvml.nvmlEventTypeSingleBitEccError
    ecc_uncorrected: int = 0
    retired_pending: int = 0
    remapped_rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    recovery_action: int = 0
    sram_threshold_exceeded: int = 0  # c_nvmlEccSramErrorStatus_v1_t.bThresholdExceeded
    unrepairable_memory: int = 0
    repair_status: tuple[int, int] = (0, 0)  # (bChannelRepairPending, bTpcRepairPending)
    clock_reasons: int = pynvml.nvmlClocksEventReasonGpuIdle
    pcie_link: tuple[int, int, int, int] = (16, 16, 5, 5)  # (width, max width, generation, max generation)
    lost: bool = False
    # function name -> NVML error code it returns (NOT_SUPPORTED, FUNCTION_NOT_FOUND, ...)
    errors: dict[str, int] = field(default_factory=dict)
    field_return: int = pynvml.NVML_SUCCESS
    registered: int = 0
    struct: Any = field(default_factory=pynvml.struct_c_nvmlDevice_t)

    @property
    def handle(self) -> Any:
        return ctypes.pointer(self.struct)  # a c_nvmlDevice_t, as nvmlDeviceGetHandleByIndex returns


class FakeNvml(types.SimpleNamespace):
    """pynvml's constants, types and exception classes, with the C calls replaced by this object's state."""

    FAKED = (
        "nvmlInit",
        "nvmlShutdown",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetHandleByIndex",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetName",
        "nvmlEventSetCreate",
        "nvmlEventSetFree",
        "nvmlDeviceGetSupportedEventTypes",
        "nvmlDeviceRegisterEvents",
        "nvmlEventSetWait",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetSramEccErrorStatus",
        "nvmlDeviceGetUnrepairableMemoryFlag_v1",
        "nvmlDeviceGetRepairStatus",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetCurrPcieLinkWidth",
        "nvmlDeviceGetMaxPcieLinkWidth",
        "nvmlDeviceGetCurrPcieLinkGeneration",
        "nvmlDeviceGetMaxPcieLinkGeneration",
    )

    def __init__(self, gpus: list[FakeGpu]) -> None:
        real = {
            name: getattr(pynvml, name)
            for name in dir(pynvml)
            if name.startswith(
                (
                    "NVML_",
                    "NVMLError",
                    "nvmlEventType",
                    "c_nvml",
                    "nvmlPciInfo",
                    "struct_c_nvml",
                    "nvmlClocksEventReason",
                    "nvmlClocksThrottleReason",
                )
            )
        }
        super().__init__(**real)
        self.gpus = gpus
        self.init_error: int | None = None
        self.inits = 0
        self.shutdowns = 0
        self.initialised = False
        # Each wait takes the next item: (gpu index, event type, event data, gi, ci), an NVML error code, or a
        # callable run in the NVML thread (to block it, or raise something unexpected).
        self.events: list[Any] = []
        self.waits = 0
        self.calls: list[str] = []
        self.absent: set[str] = set()  # names this pynvml lacks (older_pynvml)

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_") and name in object.__getattribute__(self, "__dict__").get("absent", ()):
            raise AttributeError(f"module 'pynvml' has no attribute {name!r}")
        return super().__getattribute__(name)

    # --- init ---
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        self.inits += 1
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self.initialised = False

    def _check(self, gpu: FakeGpu | None = None, function: str = "") -> None:
        self.calls.append(function)
        if not self.initialised:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
        if gpu is not None:
            if gpu.lost:
                raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
            if function in gpu.errors:
                raise nvml_error(gpu.errors[function])

    def _gpu(self, handle: Any) -> FakeGpu:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        return next(g for g in self.gpus if ctypes.addressof(g.struct) == address)

    # --- devices ---
    def nvmlDeviceGetCount(self) -> int:
        self._check(function="nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._check(function="nvmlDeviceGetHandleByIndex")
        return self.gpus[index].handle

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = gpu.bus_id  # a str is encoded by _PrintableStructure; reading it back gives a str
        return info

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetUUID")
        return gpu.uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetName")
        return gpu.name

    # --- events ---
    def nvmlEventSetCreate(self) -> Any:
        self._check(function="nvmlEventSetCreate")
        return pynvml.c_nvmlEventSet_t()

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self.calls.append("nvmlEventSetFree")

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetSupportedEventTypes")
        return gpu.supported_events

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceRegisterEvents")
        if eventTypes & ~gpu.supported_events:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # what the driver does for an unsupported bit
        gpu.registered = eventTypes

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        self._check(function="nvmlEventSetWait")
        self.waits += 1
        if not self.events:
            time.sleep(timeoutms / 1000)
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        item = self.events.pop(0)
        if callable(item):
            return item()
        if isinstance(item, int):
            raise nvml_error(item)
        index, event_type, event_data, gi, ci = item
        data = pynvml.c_nvmlEventData_t()
        data.device = self.gpus[index].handle  # a new pointer object to the same device, as NVML's
        data.eventType = event_type
        data.eventData = event_data
        data.gpuInstanceId = gi
        data.computeInstanceId = ci
        return data

    # --- polled state ---
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetTotalEccErrors")
        assert (errorType, counterType) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        return gpu.ecc_uncorrected

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: Any) -> int:
        gpu = self._gpu(device)
        self._check(gpu, "nvmlDeviceGetRetiredPagesPendingStatus")
        return gpu.retired_pending

    def nvmlDeviceGetRemappedRows(self, device: Any) -> tuple[int, int, int, int]:
        gpu = self._gpu(device)
        self._check(gpu, "nvmlDeviceGetRemappedRows")
        return gpu.remapped_rows

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetFieldValues")
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for i, field_id in enumerate(fieldIds):
            values[i].fieldId = field_id
            assert field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
            values[i].nvmlReturn = gpu.field_return
            values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            values[i].value.uiVal = gpu.recovery_action
        return values

    def nvmlDeviceGetSramEccErrorStatus(self, device: Any, status: Any) -> int:
        gpu = self._gpu(device)
        self._check(gpu, "nvmlDeviceGetSramEccErrorStatus")
        # pynvml hands `status` to the C function as it is: NVML writes through a pointer to a versioned struct. A
        # struct passed as it is would go by value and NVML would write elsewhere (byref works too with the real
        # library; the stand-in reads through `.contents`, so it takes a pointer).
        assert isinstance(status, ctypes.POINTER(pynvml.c_nvmlEccSramErrorStatus_v1_t)), type(status)
        if status.contents.version != pynvml.nvmlEccSramErrorStatus_v1:
            raise nvml_error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        status.contents.bThresholdExceeded = gpu.sram_threshold_exceeded
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetUnrepairableMemoryFlag_v1(self, device: Any) -> int:
        gpu = self._gpu(device)
        self._check(gpu, "nvmlDeviceGetUnrepairableMemoryFlag_v1")
        return gpu.unrepairable_memory

    def nvmlDeviceGetRepairStatus(self, device: Any) -> list[int]:
        gpu = self._gpu(device)
        self._check(gpu, "nvmlDeviceGetRepairStatus")
        channel, tpc = gpu.repair_status
        return [channel, tpc]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetCurrentClocksEventReasons")
        return gpu.clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return gpu.clock_reasons

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetCurrPcieLinkWidth")
        return gpu.pcie_link[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetMaxPcieLinkWidth")
        return gpu.pcie_link[1]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetCurrPcieLinkGeneration")
        return gpu.pcie_link[2]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetMaxPcieLinkGeneration")
        return gpu.pcie_link[3]


def older_pynvml(fake: FakeNvml, *names: str) -> None:
    """A pynvml from before these functions or structs (before 12.575): the module has no such attribute."""
    fake.absent.update(names)


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(bus_id="00000000:3B:00.0", uuid="GPU-11111111-2222-3333-4444-555555555555"),
        FakeGpu(bus_id=b"00000000:C1:00.0", uuid=b"GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"),
    ]


def make_source(fake: FakeNvml, **overrides: Any) -> NvmlSource:
    options: dict[str, Any] = {
        "poll_interval": 3600.0,
        "event_timeout": 0.02,
        "call_timeout": 1.0,
        "check_timeout": 1.0,
        "retry_initial": 0.01,
        "retry_max": 0.05,
    }
    options.update(overrides)
    return NvmlSource(fake, **options)


class Collector:
    """Runs source.observations() in the background and keeps what it yields."""

    def __init__(self, source: NvmlSource) -> None:
        self.source = source
        self.seen: list[Observation] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async for observation in self.source.observations():
            self.seen.append(observation)

    async def __aenter__(self) -> Collector:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def wait_for(self, count: int, timeout: float = 5.0) -> list[Observation]:
        await eventually(lambda: len(self.seen) >= count, timeout)
        return self.seen

    def reasons(self, policy: str = "ecs") -> list[tuple[str, bool]]:
        classifier = Policy(policy)
        return [
            (verdict.reason, verdict.impairs) for verdict in (classifier.classify(o.record, NOW) for o in self.seen)
        ]


@contextlib.asynccontextmanager
async def collecting(source: NvmlSource) -> AsyncIterator[Collector]:
    async with Collector(source) as collector:
        yield collector
