"""The NVML source's warnings that are never repairs (the stand-in for pynvml is tests/fake_nvml.py): clocks slowed by
hardware or heat, and a PCIe link below its maximum. Each appears as one finding with no verdict, clears as a new
episode (the next appearance has the next id), keeps its id across a probe restart within a boot, never impairs under
either policy, and shows live in the probe's /healthz. What a GPU, a driver or a pynvml cannot answer is "not
supported", said once per GPU, never a fault."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pynvml
import pytest

from node_probe.classify.findings import make_finding
from node_probe.classify.policy import POLICY_NAMES, Policy, PolicyConfig
from node_probe.classify.record import FaultRecord
from node_probe.health import ProbeHealth
from node_probe.host import boot_id
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources.nvml import NvmlSource
from node_probe.sources.nvml_warnings import PcieLink, pcie_warning
from tests.fake_nvml import NOW, FakeNvml, collecting, make_source, older_pynvml, two_gpus
from tests.test_probe import FakeReporter, eventually

GPU0 = "0000:3b:00"
GPU0_UUID = "GPU-11111111-2222-3333-4444-555555555555"
IDLE = pynvml.nvmlClocksEventReasonGpuIdle
POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap  # a busy GPU at its power limit: normal, and not idle
HW = pynvml.nvmlClocksEventReasonHwSlowdown
HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown
POWER_BRAKE = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
SW_THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown
BENIGN = (
    IDLE
    | pynvml.nvmlClocksEventReasonApplicationsClocksSetting
    | POWER_CAP
    | pynvml.nvmlClocksEventReasonSyncBoost
    | pynvml.nvmlClocksEventReasonDisplayClockSetting
)
CLOCK_EVENTS = "nvmlDeviceGetCurrentClocksEventReasons"
CLOCK_THROTTLE = "nvmlDeviceGetCurrentClocksThrottleReasons"
PCIE_CALLS = (
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkGeneration",
)
FULL_LINK = (16, 16, 5, 5)


def position(condition: str, episode: int) -> str:
    return f"state:{boot_id()}:{GPU0_UUID}:{condition}:{episode}"


def warnings_of(source: NvmlSource, gpu: str = GPU0) -> list[str]:
    readings = source.gpu_readings()
    return list(readings[gpu]["warnings"]) if gpu in readings and "warnings" in readings[gpu] else []


async def polled(fake: FakeNvml, times: int = 3, call: str = "nvmlDeviceGetCurrPcieLinkWidth") -> None:
    """Until each GPU has been polled `times` more times."""
    start = fake.calls.count(call)
    await eventually(lambda: fake.calls.count(call) >= start + times * len(fake.gpus))


def assert_a_warning(record: FaultRecord, reason: str, observation_position: str) -> None:
    assert (record.kind, record.reason, record.pci, record.uuid) == ("nvml", reason, GPU0, GPU0_UUID)
    assert record.nvidia_verdict is None and record.nvidia_action is None  # no verdict: nothing to withdraw later
    for policy in POLICY_NAMES:
        verdict = Policy(policy).classify(record, NOW)
        assert (verdict.impairs, verdict.rule) == (False, f"{policy}:nvml-warning-only")
        finding = make_finding(
            record, verdict, instance_id="i-1", group="g", source="nvml", observed_at=NOW,
            position=observation_position,
        )  # fmt: skip
        assert (finding.impairs, finding.verdict, finding.immediate_action, finding.reason) == (False, "", "", reason)


# --- clocks slowed -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slowdown:
    bits: int
    reason: str
    condition: str
    named: str  # what the message says of the bits


SLOWDOWNS = [
    Slowdown(HW, "NVML_CLOCKS_HW_SLOWDOWN", "clocks-hw-slowdown", "HwSlowdown (clock event reasons 0xc)"),
    Slowdown(
        HW_THERMAL | POWER_BRAKE,
        "NVML_CLOCKS_HW_SLOWDOWN",
        "clocks-hw-slowdown",
        "HwThermalSlowdown, HwPowerBrakeSlowdown (clock event reasons 0xc4)",
    ),
    Slowdown(
        SW_THERMAL,
        "NVML_CLOCKS_SW_THERMAL_SLOWDOWN",
        "clocks-sw-thermal-slowdown",
        "SwThermalSlowdown (clock event reasons 0x24)",
    ),
]


@pytest.mark.parametrize("slowdown", SLOWDOWNS, ids=[s.named.split(" (")[0] for s in SLOWDOWNS])
async def test_a_slowdown_appears_once_clears_as_a_new_episode_and_keeps_its_id_across_a_restart(
    slowdown: Slowdown,
) -> None:
    fake = FakeNvml(two_gpus())
    gpu = fake.gpus[0]
    source = make_source(fake, poll_interval=0.05)
    async with collecting(source) as collector:
        await polled(fake, 1)
        gpu.clock_reasons = POWER_CAP | slowdown.bits
        await collector.wait_for(1)
        await polled(fake)
        assert len(collector.seen) == 1  # a slowdown that lasts is said once
        assert warnings_of(source) == [slowdown.reason]
        gpu.clock_reasons = POWER_CAP
        await eventually(lambda: not warnings_of(source))
        await polled(fake)
        assert len(collector.seen) == 1  # clearing withdraws nothing: no finding, a new episode
        gpu.clock_reasons = POWER_CAP | slowdown.bits
        await collector.wait_for(2)
    first, again = collector.seen
    assert first.record.message.endswith(f": {slowdown.named}") and again.record.message == first.record.message
    for observation in collector.seen:
        assert_a_warning(observation.record, slowdown.reason, observation.position)
    assert [o.position for o in collector.seen] == [position(slowdown.condition, 0), position(slowdown.condition, 1)]
    async with collecting(make_source(fake)) as restarted:  # the same boot: the same id, dropped downstream
        (observation,) = await restarted.wait_for(1)
    assert observation.position == position(slowdown.condition, 0)


async def test_both_slowdowns_at_once_are_two_warnings() -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[1].clock_reasons = HW_THERMAL | SW_THERMAL
    async with collecting(make_source(fake)) as collector:
        await collector.wait_for(2)
    assert sorted(o.record.reason or "" for o in collector.seen) == [
        "NVML_CLOCKS_HW_SLOWDOWN",
        "NVML_CLOCKS_SW_THERMAL_SLOWDOWN",
    ]
    assert {o.record.pci for o in collector.seen} == {"0000:c1:00"}


async def test_the_benign_clock_reasons_are_never_a_warning() -> None:
    fake = FakeNvml(two_gpus())
    for gpu in fake.gpus:
        gpu.clock_reasons = BENIGN
    source = make_source(fake, poll_interval=0.05)
    async with collecting(source) as collector:
        await polled(fake, 4)
    assert collector.seen == []
    clocks = source.gpu_readings()[GPU0]["clocks"]
    assert clocks["mask"] == hex(BENIGN)
    assert set(clocks["reasons"]) == {
        "GpuIdle",
        "ApplicationsClocksSetting",
        "SwPowerCap",
        "SyncBoost",
        "DisplayClockSetting",
    }


# --- the PCIe link -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("link", "idle", "held", "warns"),
    [
        (PcieLink(16, 16, 5, 5), False, False, False),
        (PcieLink(8, 16, 5, 5), True, False, True),  # lanes missing: whatever the GPU does
        (PcieLink(8, 16, 5, 5), None, False, True),
        (PcieLink(16, 16, 1, 5), True, False, False),  # trained down at idle to save power
        (PcieLink(16, 16, 1, 5), None, False, False),  # idleness unknown: the generation says nothing
        (PcieLink(16, 16, 3, 5), False, False, True),  # slow while it works
        (PcieLink(16, 16, 1, 5), True, True, True),  # seen slow at work: an idle spell neither clears it...
        (PcieLink(16, 16, 1, 5), None, True, True),
        (PcieLink(16, 16, 5, 5), True, True, False),  # ...but a full link does
        (PcieLink(16, 16, 5, 4), False, False, False),  # faster than the stated maximum is no degradation
        (PcieLink(16, 0, 5, 0), False, False, False),  # no maximum known
    ],
)
def test_the_pcie_rule(link: PcieLink, idle: bool | None, held: bool, warns: bool) -> None:
    warning = pcie_warning(link, idle, held)
    assert (warning is not None) is warns
    if warning is not None:
        assert warning.message == f"PCIe link below its maximum: {link.describe()}"


async def test_a_narrow_link_is_a_warning_even_at_idle_and_clears_as_a_new_episode() -> None:
    fake = FakeNvml(two_gpus())
    gpu = fake.gpus[0]
    gpu.clock_reasons = IDLE
    gpu.pcie_link = (8, 16, 4, 5)
    source = make_source(fake, poll_interval=0.05)
    async with collecting(source) as collector:
        await collector.wait_for(1)
        gpu.pcie_link = FULL_LINK
        await eventually(lambda: not warnings_of(source))
        gpu.pcie_link = (4, 16, 5, 5)
        await collector.wait_for(2)
        await polled(fake)
    assert [o.record.message for o in collector.seen] == [
        "PCIe link below its maximum: x8 of x16, gen 4 of 5",
        "PCIe link below its maximum: x4 of x16, gen 5 of 5",
    ]
    for observation in collector.seen:
        assert_a_warning(observation.record, "NVML_PCIE_LINK_DEGRADED", observation.position)
    condition = "pcie-link-degraded"
    assert [o.position for o in collector.seen] == [position(condition, 0), position(condition, 1)]
    async with collecting(make_source(fake)) as restarted:
        (observation,) = await restarted.wait_for(1)
    assert observation.position == position(condition, 0)


async def test_a_generation_below_its_maximum_counts_only_while_the_gpu_works() -> None:
    fake = FakeNvml(two_gpus())
    gpu = fake.gpus[0]
    gpu.clock_reasons = IDLE
    gpu.pcie_link = (16, 16, 1, 5)  # an idle GPU's link trained down to save power
    source = make_source(fake, poll_interval=0.05)
    async with collecting(source) as collector:
        await polled(fake, 4)
        assert collector.seen == []
        gpu.clock_reasons = POWER_CAP  # at work, and the link is still slow
        gpu.pcie_link = (16, 16, 3, 5)
        await collector.wait_for(1)
        gpu.clock_reasons = IDLE  # the job ended: the idle link says nothing, the warning holds
        gpu.pcie_link = (16, 16, 1, 5)
        await polled(fake, 4)
        assert len(collector.seen) == 1 and warnings_of(source) == ["NVML_PCIE_LINK_DEGRADED"]
        gpu.clock_reasons = POWER_CAP  # at work at full speed: cleared
        gpu.pcie_link = FULL_LINK
        await eventually(lambda: not warnings_of(source))
        gpu.pcie_link = (16, 16, 4, 5)
        await collector.wait_for(2)
    assert [o.record.message for o in collector.seen] == [
        "PCIe link below its maximum: x16 of x16, gen 3 of 5",
        "PCIe link below its maximum: x16 of x16, gen 4 of 5",
    ]
    assert [o.position for o in collector.seen] == [position("pcie-link-degraded", n) for n in (0, 1)]


async def test_where_idleness_cannot_be_read_only_the_width_counts() -> None:
    fake = FakeNvml(two_gpus())
    for gpu in fake.gpus:
        gpu.errors = {CLOCK_EVENTS: pynvml.NVML_ERROR_NOT_SUPPORTED, CLOCK_THROTTLE: pynvml.NVML_ERROR_NOT_SUPPORTED}
        gpu.pcie_link = (16, 16, 2, 5)
    fake.gpus[1].pcie_link = (8, 16, 2, 5)
    source = make_source(fake, poll_interval=0.05)
    async with collecting(source) as collector:
        await collector.wait_for(1)
        await polled(fake, 4)
    (observation,) = collector.seen
    assert observation.record.pci == "0000:c1:00"
    assert observation.record.message == "PCIe link below its maximum: x8 of x16, gen 2 of 5"


def test_the_links_maximum_is_read_once_a_session_three_calls_a_gpu_each_poll_after() -> None:
    fake = FakeNvml(two_gpus())
    source = make_source(fake)
    assert source.check().is_ok
    for _ in range(5):
        source.poll_once()
    assert fake.calls.count("nvmlDeviceGetMaxPcieLinkWidth") == 2  # once per GPU
    assert fake.calls.count("nvmlDeviceGetMaxPcieLinkGeneration") == 2
    for call in (CLOCK_EVENTS, "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetCurrPcieLinkGeneration"):
        assert fake.calls.count(call) == 5 * 2
    assert fake.calls.count(CLOCK_THROTTLE) == 0  # the older name only where the newer is missing


# --- not supported -----------------------------------------------------------------------------------------


def not_supported_lines(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if what in r.getMessage() and "not supported" in r.getMessage()]


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND])
async def test_a_gpu_without_clock_reasons_is_never_a_fault_and_is_said_once(
    code: int, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml(two_gpus())
    for gpu in fake.gpus:
        gpu.errors = {CLOCK_EVENTS: code, CLOCK_THROTTLE: code}
        gpu.clock_reasons = HW | SW_THERMAL  # never read
    source = make_source(fake, poll_interval=0.05)
    with caplog.at_level(logging.INFO, logger="node_probe.sources.nvml"):
        async with collecting(source) as collector:
            await polled(fake, 4)
            assert source.status.is_ok
    assert collector.seen == [] and fake.inits == 1
    assert fake.calls.count(CLOCK_EVENTS) == fake.calls.count(CLOCK_THROTTLE) == 2  # once per GPU, then remembered
    assert len(not_supported_lines(caplog, "clock_event_reasons")) == 2
    assert source.gpu_readings()[GPU0]["clocks"] == "not supported"
    assert source.gpu_readings()[GPU0]["pcie"] == dict(zip(PcieLink._fields, FULL_LINK, strict=True))


async def test_a_driver_before_r535_answers_through_the_older_call() -> None:
    fake = FakeNvml(two_gpus())
    for gpu in fake.gpus:
        gpu.errors = {CLOCK_EVENTS: pynvml.NVML_ERROR_FUNCTION_NOT_FOUND}
    fake.gpus[0].clock_reasons = POWER_BRAKE
    source = make_source(fake, poll_interval=0.05)
    async with collecting(source) as collector:
        (observation,) = await collector.wait_for(1)
        await polled(fake, 3)
    assert observation.record.reason == "NVML_CLOCKS_HW_SLOWDOWN"
    assert fake.calls.count(CLOCK_EVENTS) == 2 and fake.calls.count(CLOCK_THROTTLE) > 2


EVENT_REASON_NAMES = [name for name in dir(pynvml) if name.startswith("nvmlClocksEventReason")]


async def test_an_older_pynvml_reads_the_older_names_and_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml(two_gpus())
    older_pynvml(fake, CLOCK_EVENTS, *EVENT_REASON_NAMES)  # before 12.535: only the Throttle names
    fake.gpus[0].clock_reasons = SW_THERMAL
    with caplog.at_level(logging.INFO, logger="node_probe.sources.nvml"):
        async with collecting(make_source(fake)) as collector:
            (observation,) = await collector.wait_for(1)
    assert observation.record.message.endswith(": SwThermalSlowdown (clock event reasons 0x20)")
    assert not_supported_lines(caplog, "clock") == []


async def test_a_pynvml_without_either_call_is_not_supported_said_once(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml(two_gpus())
    older_pynvml(fake, CLOCK_EVENTS, CLOCK_THROTTLE)
    fake.gpus[0].clock_reasons = HW
    source = make_source(fake, poll_interval=0.05)
    with caplog.at_level(logging.INFO, logger="node_probe.sources.nvml"):
        async with collecting(source) as collector:
            await polled(fake, 4)
            assert source.status.is_ok
    assert collector.seen == [] and fake.inits == 1
    lines = not_supported_lines(caplog, "clock event reasons")
    assert len(lines) == 2 and "pynvml lacks" in lines[0]  # once per GPU, not once per poll


@pytest.mark.parametrize("call", PCIE_CALLS)
@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND])
async def test_a_gpu_without_its_pcie_link_is_never_a_fault_and_is_said_once(
    call: str, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml(two_gpus())
    for gpu in fake.gpus:
        gpu.errors = {call: code}
        gpu.pcie_link = (8, 16, 3, 5)
        gpu.clock_reasons = POWER_CAP
    source = make_source(fake, poll_interval=0.05)
    with caplog.at_level(logging.INFO, logger="node_probe.sources.nvml"):
        async with collecting(source) as collector:
            await polled(fake, 4, CLOCK_EVENTS)
            assert source.status.is_ok
    assert collector.seen == [] and fake.inits == 1
    assert fake.calls.count(call) == 2
    assert len(not_supported_lines(caplog, "pcie_link")) == 2
    assert source.gpu_readings()[GPU0]["pcie"] == "not supported"


async def test_a_pynvml_without_the_pcie_calls_is_not_supported_said_once(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeNvml(two_gpus())
    older_pynvml(fake, "nvmlDeviceGetMaxPcieLinkGeneration")
    fake.gpus[0].pcie_link = (8, 16, 5, 5)
    with caplog.at_level(logging.INFO, logger="node_probe.sources.nvml"):
        async with collecting(make_source(fake, poll_interval=0.05)) as collector:
            await polled(fake, 4, CLOCK_EVENTS)
    assert collector.seen == [] and fake.inits == 1
    lines = not_supported_lines(caplog, "pcie_link")
    assert len(lines) == 2 and "pynvml lacks nvmlDeviceGetMaxPcieLinkGeneration" in lines[0]


# --- never a repair, under either policy ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize(
    "reason", ["NVML_CLOCKS_HW_SLOWDOWN", "NVML_CLOCKS_SW_THERMAL_SLOWDOWN", "NVML_PCIE_LINK_DEGRADED"]
)
def test_a_warning_never_impairs_whatever_the_overrides(policy: str, reason: str) -> None:
    record = FaultRecord(line=0, raw="NVML", kind="nvml", code=None, pci=GPU0, message="m", reason=reason)
    config = PolicyConfig(add_xids={0, 79}, add_sxids={0})
    for classifier in (Policy(policy), Policy(policy, config)):
        verdict = classifier.classify(record, NOW)
        assert (verdict.impairs, verdict.reason) == (False, reason)


@pytest.mark.parametrize("policy", POLICY_NAMES)
async def test_through_the_probe_a_warning_goes_out_as_a_warning(policy: str) -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[0].clock_reasons = HW
    fake.gpus[1].pcie_link = (8, 16, 5, 5)
    config = ProbeConfig(instance_id="i-1", group="g", policy=policy, heartbeat_interval=timedelta(seconds=3600))
    reporter = FakeReporter()
    probe = Probe(config, reporter, sources=[make_source(fake)])
    task = asyncio.create_task(probe.run())
    try:
        await eventually(lambda: len(reporter.findings) == 2)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    said = {(f.reason, f.gpu.pci, f.impairs, f.verdict, f.immediate_action) for f in reporter.findings}
    assert said == {
        ("NVML_CLOCKS_HW_SLOWDOWN", GPU0, False, "", ""),
        ("NVML_PCIE_LINK_DEGRADED", "0000:c1:00", False, "", ""),
    }


# --- /healthz ------------------------------------------------------------------------------------------------


def test_healthz_shows_each_gpus_clocks_link_and_warnings_as_the_last_poll_read_them() -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[0].clock_reasons = POWER_CAP | HW_THERMAL
    fake.gpus[1].pcie_link = (8, 16, 4, 5)
    nvml = make_source(fake)
    probe = Probe(ProbeConfig(instance_id="i-1", group="g"), FakeReporter(), sources=[nvml])
    assert nvml.check().is_ok
    probe.delivery.running_since = time.monotonic()  # as probe.run() sets it
    before: Any = ProbeHealth(probe).verdict().checks["gpus"]
    assert before[GPU0] == {"uuid": GPU0_UUID, "clocks": "not read yet", "pcie": "not read yet"}
    nvml.poll_once()
    answer = json.loads(ProbeHealth(probe).verdict().body())
    assert answer["checks"]["gpus"] == {
        GPU0: {
            "uuid": GPU0_UUID,
            "clocks": {"mask": "0x44", "reasons": ["SwPowerCap", "HwThermalSlowdown"]},
            "pcie": {"width": 16, "max_width": 16, "generation": 5, "max_generation": 5},
            "warnings": ["NVML_CLOCKS_HW_SLOWDOWN"],
        },
        "0000:c1:00": {
            "uuid": "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
            "clocks": {"mask": "0x1", "reasons": ["GpuIdle"]},
            "pcie": {"width": 8, "max_width": 16, "generation": 4, "max_generation": 5},
            "warnings": ["NVML_PCIE_LINK_DEGRADED"],
        },
    }
    # No NVML, no GPUs to show: the answer is what it was.
    bare = Probe(ProbeConfig(instance_id="i-1", group="g"), FakeReporter(), sources=[])
    bare.delivery.running_since = time.monotonic()
    assert "gpus" not in ProbeHealth(bare).verdict().checks
