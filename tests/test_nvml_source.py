"""The NVML source against a stand-in for pynvml.

The stand-in keeps everything of the real module except the C calls: its constants, its exception classes (raised
the way pynvml raises them, `NVMLError(code)`, which picks the `NVMLError_*` subclass), and its ctypes return types
(`c_nvmlEventData_t`, `nvmlPciInfo_t`, `c_nvmlFieldValue_t` arrays, `c_nvmlDevice_t` pointers). A test checks
that every faked function exists in pynvml with the same parameters, so the real module drops in unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import threading
import time
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pynvml
import pytest

from contract.health import HealthState
from node_probe.classify.findings import make_finding
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.policy import Policy
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources.base import Observation
from node_probe.sources.nvml import NvmlSource, nvml_available
from node_probe.sources.nvml_session import normalise_bus_id
from tests.test_probe import FakeReporter, eventually

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
    )

    def __init__(self, gpus: list[FakeGpu]) -> None:
        real = {
            name: getattr(pynvml, name)
            for name in dir(pynvml)
            if name.startswith(("NVML_", "NVMLError", "nvmlEventType", "c_nvml", "nvmlPciInfo", "struct_c_nvml"))
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


# --- the stand-in is faithful -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", FakeNvml.FAKED)
def test_stand_in_functions_exist_in_pynvml_with_the_same_parameters(name: str) -> None:
    real = inspect.signature(getattr(pynvml, name))
    fake = inspect.signature(getattr(FakeNvml([]), name))
    assert list(fake.parameters) == list(real.parameters)


def test_stand_in_raises_pynvml_exception_classes() -> None:
    assert type(nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)) is pynvml.NVMLError_GpuIsLost
    assert type(nvml_error(pynvml.NVML_ERROR_TIMEOUT)) is pynvml.NVMLError_Timeout
    assert isinstance(nvml_error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND), pynvml.NVMLError)


def test_real_pynvml_without_a_driver_is_not_available() -> None:
    # This machine has no NVIDIA driver: nvmlInit raises NVMLError_LibraryNotFound, so --nvml defaults off.
    assert nvml_available() is False


@pytest.mark.parametrize(
    ("bus_id", "pci"),
    [
        ("00000000:3B:00.0", "0000:3b:00"),
        (b"00000000:C1:00.0", "0000:c1:00"),
        ("0000:07:00.0", "0000:07:00"),
        ("00000001:1A:1F.0", "0001:1a:1f"),
        ("0000:3b:00", "0000:3b:00"),
        ("garbage", None),
        ("", None),
        (None, None),
    ],
)
def test_bus_ids_take_the_kernel_logs_shape(bus_id: str | bytes | None, pci: str | None) -> None:
    assert normalise_bus_id(bus_id) == pci


def test_nvml_and_kernel_log_name_a_gpu_alike() -> None:
    line = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."
    (record,) = parse_lines([line])
    info = pynvml.nvmlPciInfo_t()
    info.busId = "00000000:3B:00.0"
    assert normalise_bus_id(info.busId) == record.pci


# --- start ------------------------------------------------------------------------------------------------


def test_check_enumerates_gpus_and_registers_the_supported_events() -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[1].supported_events = XID  # an older GPU: Xid only
    source = make_source(fake)
    assert source.check().is_ok
    assert [(g.index, g.pci, g.uuid, g.name) for g in source.gpus] == [
        (0, "0000:3b:00", "GPU-11111111-2222-3333-4444-555555555555", "NVIDIA H100 80GB HBM3"),
        (1, "0000:c1:00", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "NVIDIA H100 80GB HBM3"),
    ]
    assert fake.gpus[0].registered == XID | DBE | RECOVERY | UNAVAILABLE  # not the single-bit ECC it also offers
    assert fake.gpus[1].registered == XID
    assert source.gpu_identity(1) == ("0000:c1:00", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee")
    assert source.gpu_identity(7) is None


async def test_init_failure_is_insufficient_data_then_recovers_by_itself() -> None:
    fake = FakeNvml(two_gpus())
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    source = make_source(fake)
    status = source.check()
    assert status.state == HealthState.INSUFFICIENT_DATA and "Driver Not Loaded" in (status.reason or "")
    fake.events.append((0, XID, 79, NO_INSTANCE, NO_INSTANCE))
    async with collecting(source) as collector:
        await eventually(lambda: fake.calls.count("nvmlInit") >= 3)  # retried with backoff
        assert not source.status.is_ok and not collector.seen
        fake.init_error = None  # the driver is loaded again
        await collector.wait_for(1)
        assert source.status.is_ok
    assert collector.seen[0].record.code == 79


async def test_no_gpus_is_insufficient_data() -> None:
    source = make_source(FakeNvml([]))
    status = source.check()
    assert status.state == HealthState.INSUFFICIENT_DATA and "no GPUs" in (status.reason or "")


# --- events -----------------------------------------------------------------------------------------------


async def test_xid_79_event_impairs_and_names_the_gpu_by_pci_and_uuid() -> None:
    fake = FakeNvml(two_gpus())
    fake.events.append((1, XID, 79, NO_INSTANCE, NO_INSTANCE))
    source = make_source(fake)
    async with collecting(source) as collector:
        (observation,) = await collector.wait_for(1)
    record = observation.record
    assert (record.kind, record.code, record.pci, record.uuid) == (
        "xid",
        79,
        "0000:c1:00",
        "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
    )
    assert (record.mig_gpu_instance, record.mig_compute_instance) == (None, None)
    for policy in ("ecs", "nvidia-catalog"):
        verdict = Policy(policy).classify(record, NOW)
        assert verdict.impairs and verdict.reason == "XID_79"
    finding = make_finding(
        record, Policy().classify(record, NOW), instance_id="i-1", group="g", source="nvml", observed_at=NOW,
        position=observation.position,
    )  # fmt: skip
    assert finding.gpu.pci == "0000:c1:00" and finding.gpu.uuid == "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
    assert finding.source == "nvml" and finding.kind == "xid"


async def test_xid_13_event_is_a_warning_with_its_mig_instance() -> None:
    fake = FakeNvml(two_gpus())
    fake.events.append((0, XID, 13, 1, 0))
    source = make_source(fake)
    async with collecting(source) as collector:
        (observation,) = await collector.wait_for(1)
        assert collector.reasons("ecs") == [("XID_13", False)]
        assert collector.reasons("nvidia-catalog") == [("XID_13", False)]
    assert (observation.record.mig_gpu_instance, observation.record.mig_compute_instance) == (1, 0)
    assert "GPU-I:1 GPU-CI:0" in observation.record.raw


async def test_unknown_xid_999_is_a_warning() -> None:
    fake = FakeNvml(two_gpus())
    fake.events.append((0, XID, 999, NO_INSTANCE, NO_INSTANCE))
    async with collecting(make_source(fake)) as collector:
        await collector.wait_for(1)
        assert collector.reasons() == [("XID_999", False)]
        assert "unknown Xid" in collector.seen[0].record.message


async def test_timeout_is_no_event() -> None:
    fake = FakeNvml(two_gpus())
    source = make_source(fake)
    async with collecting(source) as collector:
        await eventually(lambda: fake.waits >= 5)
        assert collector.seen == [] and source.status.is_ok
    assert fake.inits == 1  # a timeout never restarts NVML


async def test_double_bit_ecc_and_gpu_unavailable_events() -> None:
    fake = FakeNvml(two_gpus())
    fake.events += [(0, DBE, 0, NO_INSTANCE, NO_INSTANCE), (1, UNAVAILABLE, 0, NO_INSTANCE, NO_INSTANCE)]
    async with collecting(make_source(fake)) as collector:
        await collector.wait_for(2)
        # ECS acts on the Xid (48) the driver logs for a double-bit error, not on the event.
        assert collector.reasons("ecs") == [("NVML_DOUBLE_BIT_ECC", False), ("NVML_GPU_UNAVAILABLE", False)]
        assert collector.reasons("nvidia-catalog") == [("NVML_DOUBLE_BIT_ECC", False), ("NVML_GPU_UNAVAILABLE", True)]


async def test_recovery_action_event_reads_the_field() -> None:
    fake = FakeNvml(two_gpus())
    source = make_source(fake)
    async with collecting(source) as collector:
        await eventually(lambda: fake.waits >= 1)
        fake.gpus[0].recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
        fake.events.append((0, RECOVERY, 0, NO_INSTANCE, NO_INSTANCE))  # eventData not trusted: the field is read
        await collector.wait_for(1)
        assert collector.reasons("nvidia-catalog") == [("NVML_RECOVERY_ACTION_NODE_REBOOT", True)]
        assert collector.reasons("ecs") == [("NVML_RECOVERY_ACTION_NODE_REBOOT", False)]


async def test_gpu_lost_in_the_event_wait_impairs_the_lost_gpu_once() -> None:
    fake = FakeNvml(two_gpus())
    source = make_source(fake)
    async with collecting(source) as collector:
        await eventually(lambda: fake.waits >= 1)
        fake.gpus[1].lost = True
        fake.events += [pynvml.NVML_ERROR_GPU_IS_LOST] * 5  # it keeps saying so
        await collector.wait_for(1)
        await eventually(lambda: not fake.events)
        await asyncio.sleep(0.05)
        assert len(collector.seen) == 1 and source.status.is_ok
    record = collector.seen[0].record
    assert (record.kind, record.pci, record.uuid) == ("gpu_fallen_off_bus", "0000:c1:00", fake.gpus[1].uuid.decode())
    for policy in ("ecs", "nvidia-catalog"):
        verdict = Policy(policy).classify(record, NOW)
        assert verdict.impairs and verdict.reason == "GPU_FALLEN_OFF_BUS"


async def test_gpu_lost_seen_by_the_poll_and_again_after_it_came_back() -> None:
    fake = FakeNvml(two_gpus())
    source = make_source(fake, poll_interval=0.05)
    async with collecting(source) as collector:
        await eventually(lambda: fake.waits >= 1)
        fake.gpus[0].lost = True
        await collector.wait_for(1)
        await asyncio.sleep(0.2)  # more polls: still one finding
        assert len(collector.seen) == 1
        fake.gpus[0].lost = False
        await asyncio.sleep(0.2)
        fake.gpus[0].lost = True
        await collector.wait_for(2)
    first, second = collector.seen
    assert first.record.pci == second.record.pci == "0000:3b:00"
    assert first.position != second.position  # a new episode, a new finding id


async def test_gpu_lost_before_start_is_reported() -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[0].lost = True
    source = make_source(fake, poll_interval=0.05)
    assert source.check().is_ok  # the other GPU and NVML itself work
    async with collecting(source) as collector:
        await collector.wait_for(1)
        fake.gpus[0].lost = False  # it answers again: its identity is read now
        await eventually(lambda: source.gpus[0].pci == "0000:3b:00")
    assert collector.seen[0].record.kind == "gpu_fallen_off_bus" and collector.seen[0].record.pci is None


# --- polled state -----------------------------------------------------------------------------------------


async def test_remap_failure_impairs_under_nvidia_catalog_only_and_pending_is_a_warning() -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[0].remapped_rows = (0, 3, 0, 1)  # failureOccurred
    fake.gpus[1].remapped_rows = (1, 0, 1, 0)  # isPending
    async with collecting(make_source(fake, poll_interval=0.05)) as collector:
        await collector.wait_for(2)
        await asyncio.sleep(0.2)  # polls again: a condition that stays is not re-sent
        assert len(collector.seen) == 2
        assert collector.reasons("ecs") == [("NVML_REMAP_FAILURE", False), ("NVML_REMAP_PENDING", False)]
        assert collector.reasons("nvidia-catalog") == [("NVML_REMAP_FAILURE", True), ("NVML_REMAP_PENDING", False)]
    assert collector.seen[0].record.pci == "0000:3b:00" and "3 uncorrectable" in collector.seen[0].record.message


@pytest.mark.parametrize(
    ("action", "reason", "nvidia_impairs"),
    [
        (1, "NVML_RECOVERY_ACTION_GPU_RESET", True),
        (2, "NVML_RECOVERY_ACTION_NODE_REBOOT", True),
        (3, "NVML_RECOVERY_ACTION_DRAIN_P2P", True),
        (4, "NVML_RECOVERY_ACTION_DRAIN_AND_RESET", True),
        (5, "NVML_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN", False),
    ],
)
async def test_recovery_action_field(action: int, reason: str, nvidia_impairs: bool) -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[1].recovery_action = action
    async with collecting(make_source(fake)) as collector:
        await collector.wait_for(1)
        assert collector.reasons("nvidia-catalog") == [(reason, nvidia_impairs)]
        assert collector.reasons("ecs") == [(reason, False)]
    assert collector.seen[0].record.recovery_action_to_code == action


async def test_recovery_action_none_is_nothing() -> None:
    fake = FakeNvml(two_gpus())
    async with collecting(make_source(fake)) as collector:
        await eventually(lambda: fake.waits >= 2)
        assert collector.seen == []


async def test_uncorrectable_ecc_increase_is_a_warning_each_time_it_grows() -> None:
    fake = FakeNvml(two_gpus())
    async with collecting(make_source(fake, poll_interval=0.05)) as collector:
        await eventually(lambda: fake.calls.count("nvmlDeviceGetTotalEccErrors") >= 2)
        fake.gpus[0].ecc_uncorrected = 2
        await collector.wait_for(1)
        await asyncio.sleep(0.15)
        fake.gpus[0].ecc_uncorrected = 5
        await collector.wait_for(2)
        assert collector.reasons("ecs") == [("NVML_ECC_UNCORRECTED", False)] * 2
        assert collector.reasons("nvidia-catalog") == [("NVML_ECC_UNCORRECTED", False)] * 2
    assert "5 (+3)" in collector.seen[1].record.message


async def test_retired_pages_pending_is_a_warning() -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[0].retired_pending = 1
    async with collecting(make_source(fake)) as collector:
        await collector.wait_for(1)
        assert collector.reasons("nvidia-catalog") == [("NVML_RETIRED_PAGES_PENDING", False)]


async def test_not_supported_and_function_not_found_are_never_faults() -> None:
    fake = FakeNvml(two_gpus())
    for gpu in fake.gpus:
        gpu.errors = {
            "nvmlDeviceGetRemappedRows": pynvml.NVML_ERROR_NOT_SUPPORTED,  # MIG enabled
            "nvmlDeviceGetFieldValues": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,  # an old driver
            "nvmlDeviceGetTotalEccErrors": pynvml.NVML_ERROR_NOT_SUPPORTED,  # ECC off
            "nvmlDeviceGetRetiredPagesPendingStatus": pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
            "nvmlDeviceGetSupportedEventTypes": pynvml.NVML_ERROR_NOT_SUPPORTED,
        }
    source = make_source(fake, poll_interval=0.05)
    async with collecting(source) as collector:
        await asyncio.sleep(0.3)
        assert collector.seen == [] and source.status.is_ok
    # Asked once per GPU, then remembered as unsupported; no events registered, so polling only.
    assert fake.calls.count("nvmlDeviceGetRemappedRows") == 2
    assert fake.waits == 0


async def test_field_value_not_supported_is_not_a_fault() -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[0].field_return = pynvml.NVML_ERROR_NOT_SUPPORTED
    fake.gpus[0].recovery_action = 2  # ignored: the field's own status says not supported
    source = make_source(fake)
    async with collecting(source) as collector:
        await eventually(lambda: fake.waits >= 2)
        assert collector.seen == [] and source.status.is_ok


# --- NVML breaking and coming back ------------------------------------------------------------------------


async def test_event_loop_death_is_insufficient_data_then_recovers() -> None:
    fake = FakeNvml(two_gpus())
    source = make_source(fake)
    statuses: list[bool] = []
    async with collecting(source) as collector:
        await eventually(lambda: fake.waits >= 1)

        def driver_unloaded() -> Any:
            fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)

        fake.events.append(driver_unloaded)
        await eventually(lambda: not source.status.is_ok)
        statuses.append(source.status.is_ok)
        assert "Uninitialized" in (source.status.reason or "")
        fake.init_error = None
        fake.events.append((0, XID, 48, NO_INSTANCE, NO_INSTANCE))
        await collector.wait_for(1)
        assert source.status.is_ok
    assert fake.inits == 2 and fake.shutdowns >= 1


async def test_an_unexpected_exception_in_the_loop_does_not_kill_the_source() -> None:
    fake = FakeNvml(two_gpus())
    source = make_source(fake)

    def bug() -> Any:
        raise RuntimeError("unexpected")

    fake.events += [bug, (0, XID, 79, NO_INSTANCE, NO_INSTANCE)]
    async with collecting(source) as collector:
        await collector.wait_for(1)
        assert source.status.is_ok
    assert fake.inits == 2


async def test_a_hung_call_is_insufficient_data_and_recovers_when_it_returns() -> None:
    fake = FakeNvml(two_gpus())
    source = make_source(fake, call_timeout=0.2)
    release = threading.Event()

    def hang() -> Any:
        release.wait(10)
        raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)

    assert source.check().is_ok
    fake.events += [hang]
    async with collecting(source) as collector:
        await eventually(lambda: not source.status.is_ok)
        assert "did not return" in (source.status.reason or "")
        await asyncio.sleep(0.3)
        # Nothing else was started behind the hung call (a hung driver must not pile up threads).
        assert fake.inits == 1 and threading.active_count() < 50
        assert "has not returned" in (source.status.reason or "")
        release.set()
        fake.events.append((0, XID, 79, NO_INSTANCE, NO_INSTANCE))
        await collector.wait_for(1)
        assert source.status.is_ok


async def test_check_with_a_hung_init_does_not_block_for_long() -> None:
    fake = FakeNvml(two_gpus())
    release = threading.Event()
    real_init = fake.nvmlInit

    def slow_init() -> None:
        release.wait(10)
        real_init()

    fake.nvmlInit = slow_init  # type: ignore[method-assign]
    source = make_source(fake, check_timeout=0.1)
    started = time.monotonic()
    status = source.check()
    # Far under the 10 s hang, whatever the load on this machine: the check gave up, it did not wait.
    assert time.monotonic() - started < 5 and "did not return" in (status.reason or "")
    release.set()
    async with collecting(source) as collector:
        await eventually(lambda: source.status.is_ok)
        assert collector.seen == []
    assert fake.inits == 1  # the late init was used, not repeated


# --- through the probe ------------------------------------------------------------------------------------


async def test_probe_delivers_an_nvml_xid_finding_with_the_gpus_identity(tmp_path: Any) -> None:
    fake = FakeNvml(two_gpus())
    fake.events.append((0, XID, 79, NO_INSTANCE, NO_INSTANCE))
    config = ProbeConfig(instance_id="i-1", group="g", heartbeat_interval=timedelta(seconds=3600))
    reporter = FakeReporter()
    probe = Probe(config, reporter, sources=[make_source(fake)])
    task = asyncio.create_task(probe.run())
    try:
        await eventually(lambda: len(reporter.findings) == 1 and len(reporter.heartbeats) == 1)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    (finding,) = reporter.findings
    assert (finding.kind, finding.reason, finding.impairs, finding.source) == ("xid", "XID_79", True, "nvml")
    assert finding.gpu.pci == "0000:3b:00" and finding.gpu.uuid == "GPU-11111111-2222-3333-4444-555555555555"
    assert reporter.heartbeats[0].gpu_health == HealthState.OK


async def test_heartbeat_is_insufficient_data_while_any_gpu_source_is_down_naming_each(tmp_path: Any) -> None:
    from node_probe.sources.log_file import KernelLogFileSource

    kernel_log = KernelLogFileSource(tmp_path / "missing.log")
    nvml_down = FakeNvml(two_gpus())
    nvml_down.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    nvml = make_source(nvml_down)
    config = ProbeConfig(instance_id="i-1", group="g")
    probe = Probe(config, FakeReporter(), sources=[kernel_log, nvml])
    kernel_log.check()
    nvml.check()
    state, reason = probe.gpu_health()
    assert state == HealthState.INSUFFICIENT_DATA
    assert "missing.log" in (reason or "") and "Driver Not Loaded" in (reason or "")
    # The kernel log alone is not enough: NVML's polled ECC and remap state would go unseen.
    (tmp_path / "missing.log").write_text("")
    kernel_log.check()
    state, reason = probe.gpu_health()
    assert state == HealthState.INSUFFICIENT_DATA and reason is not None
    assert "Driver Not Loaded" in reason and "missing.log" not in reason
    # The heartbeat also says it source by source.
    heartbeat = probe.heartbeat()
    assert [(s.name, s.state) for s in heartbeat.sources] == [
        (kernel_log.name, HealthState.OK),
        ("nvml", HealthState.INSUFFICIENT_DATA),
    ]
    assert "Driver Not Loaded" in (heartbeat.sources[1].reason or "")
    # The driver loads: NVML comes back by itself.
    nvml_down.init_error = None
    nvml.check()
    assert probe.gpu_health() == (HealthState.OK, None)
    assert all(s.state is HealthState.OK and s.reason is None for s in probe.heartbeat().sources)


def test_nvml_is_on_by_default_where_the_driver_library_exists_even_before_the_driver_loads() -> None:
    not_loaded = FakeNvml(two_gpus())
    not_loaded.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    assert nvml_available(not_loaded) is True
    no_library = FakeNvml(two_gpus())
    no_library.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    assert nvml_available(no_library) is False


async def test_a_kernel_log_finding_names_the_gpus_uuid_that_nvml_knows(tmp_path: Any) -> None:
    from node_probe.sources.log_file import KernelLogFileSource

    log_path = tmp_path / "kern.log"
    log_path.write_text("[  100.000000] NVRM: Xid (PCI:0000:c1:00): 79, pid=1, name=x, GPU has fallen off the bus.\n")
    nvml = make_source(FakeNvml(two_gpus()))
    config = ProbeConfig(
        instance_id="i-1", group="g", poll_interval=timedelta(seconds=0.02), heartbeat_interval=timedelta(hours=1)
    )
    reporter = FakeReporter()
    probe = Probe(config, reporter, sources=[nvml, KernelLogFileSource(log_path, 0.02)])
    # NVML is answering before the line is read, as on a host where the probe has been running.
    nvml.check()
    task = asyncio.create_task(probe.run())
    try:
        await eventually(lambda: len(reporter.findings) == 1)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    (finding,) = reporter.findings
    assert finding.source.startswith("kernel_log") and finding.reason == "XID_79"
    assert (finding.gpu.pci, finding.gpu.uuid) == ("0000:c1:00", "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee")


def test_an_nvml_xid_and_the_kernel_logs_line_for_it_are_one_burst() -> None:
    from node_probe.classify.findings import dedupe_key

    (from_log,) = parse_lines(["NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."])
    fake = FakeNvml(two_gpus())
    source = make_source(fake)
    assert source.check().is_ok
    data = pynvml.c_nvmlEventData_t()
    data.device = fake.gpus[0].handle
    data.eventType, data.eventData = XID, 79
    data.gpuInstanceId = data.computeInstanceId = NO_INSTANCE
    session = source._session
    assert session is not None
    ((from_nvml, _),) = source._event_records(session, data)
    policy = Policy()
    key_log = dedupe_key(from_log, policy.classify(from_log, NOW))
    assert key_log == dedupe_key(from_nvml, policy.classify(from_nvml, NOW))
