"""The NVML source's life (the stand-in for pynvml is tests/fake_nvml.py): the stand-in is faithful, the source
starts, and NVML breaking and coming back (an init that fails, a loop that dies, a call that hangs) never kills
it."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import Any

import pynvml
import pytest

from contract.health import HealthState
from node_probe.classify.kernel_log import parse_lines
from node_probe.sources.nvml import nvml_available
from node_probe.sources.nvml_session import normalise_bus_id
from tests.fake_nvml import (
    DBE,
    NO_INSTANCE,
    RECOVERY,
    UNAVAILABLE,
    XID,
    FakeNvml,
    collecting,
    make_source,
    nvml_error,
    two_gpus,
)
from tests.test_probe import eventually

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


async def test_nvml_started_again_does_not_tell_again_what_it_had_read() -> None:
    """A broken session started again is not a new boot: the volatile ECC count and the standing flag the last
    session read are not told again (told again, the count went out as a fault of its own where it had gone out as
    another source's copy: seen in tests/test_one_fault_one_count.py under load); what changes after is."""
    fake = FakeNvml(two_gpus())
    fake.gpus[0].ecc_uncorrected = 1
    fake.gpus[0].retired_pending = 1
    async with collecting(make_source(fake, poll_interval=0.05)) as collector:
        await collector.wait_for(2)

        def session_broken() -> Any:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)

        fake.events.append(session_broken)
        await eventually(lambda: fake.inits == 2)
        polled = fake.calls.count("nvmlDeviceGetTotalEccErrors")
        await eventually(lambda: fake.calls.count("nvmlDeviceGetTotalEccErrors") >= polled + 4)
        assert len(collector.seen) == 2
        fake.gpus[0].ecc_uncorrected = 3
        await collector.wait_for(3)
    reasons = [reason for reason, _ in collector.reasons("ecs")]
    assert sorted(reasons[:2]) == ["NVML_ECC_UNCORRECTED", "NVML_RETIRED_PAGES_PENDING"]
    assert reasons[2] == "NVML_ECC_UNCORRECTED" and "3 (+2)" in collector.seen[2].record.message


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
    # Other tests' sources leave their idle NVML threads behind in this process: count this source's only.
    threads = threading.active_count()
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
        assert fake.inits == 1 and threading.active_count() - threads < 10
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
