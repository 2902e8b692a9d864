"""What the NVML source finds (the stand-in for pynvml is tests/fake_nvml.py): its events, and the state it polls."""

from __future__ import annotations

import asyncio

import pynvml
import pytest

from node_probe.classify.findings import make_finding
from node_probe.classify.policy import Policy
from tests.fake_nvml import (
    DBE,
    NO_INSTANCE,
    NOW,
    RECOVERY,
    UNAVAILABLE,
    XID,
    FakeNvml,
    collecting,
    make_source,
    two_gpus,
)
from tests.test_probe import eventually

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
    uuid = fake.gpus[1].uuid
    assert isinstance(uuid, bytes)  # the fake's second GPU answers in bytes, as older NVML bindings do
    assert (record.kind, record.pci, record.uuid) == ("gpu_fallen_off_bus", "0000:c1:00", uuid.decode())
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
