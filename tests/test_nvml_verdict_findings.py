"""NVIDIA's standing verdicts as the NVML source states them (the stand-in for pynvml is tests/fake_nvml.py): the R575+
flags and a row-remapping failure, each appearing and clearing, and the recovery action's values, back to None
included. Each finding names its verdict and action; one that clears says ACTION_NONE, so that the health workflow
lets go of the verdict; ids are stable across probe restarts within a boot, as the other state findings' are."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import pynvml
import pytest

from contract.probe import (
    ACTION_DRAIN_AND_RESET,
    ACTION_DRAIN_P2P,
    ACTION_NONE,
    ACTION_REPLACE,
    ACTION_RESET_GPU,
    ACTION_RESTART_BM,
    NVIDIA_VERDICTS,
    VERDICT_CHANNEL_REPAIR_PENDING,
    VERDICT_RECOVERY_ACTION,
    VERDICT_ROW_REMAP_FAILURE,
    VERDICT_SRAM_THRESHOLD_EXCEEDED,
    VERDICT_TPC_REPAIR_PENDING,
    VERDICT_UNREPAIRABLE_MEMORY,
)
from node_probe.classify.findings import make_finding
from node_probe.classify.policy import Policy
from node_probe.host import boot_id
from node_probe.sources.base import Observation
from tests.fake_nvml import (
    NO_INSTANCE,
    NOW,
    RECOVERY,
    FakeGpu,
    FakeNvml,
    collecting,
    make_source,
    older_pynvml,
    two_gpus,
)
from tests.test_probe import eventually

GPU0_UUID = "GPU-11111111-2222-3333-4444-555555555555"


@dataclass(frozen=True)
class Flag:
    """How to raise one flag on the stand-in, and what its findings must say."""

    verdict: str
    reason: str
    action: str
    condition: str  # in the finding's position
    nvidia_impairs: bool
    function: str  # the pynvml call that reads it

    def set(self, gpu: FakeGpu, on: bool) -> None:
        value = int(on)
        if self.verdict == VERDICT_SRAM_THRESHOLD_EXCEEDED:
            gpu.sram_threshold_exceeded = value
        elif self.verdict == VERDICT_UNREPAIRABLE_MEMORY:
            gpu.unrepairable_memory = value
        elif self.verdict == VERDICT_CHANNEL_REPAIR_PENDING:
            gpu.repair_status = (value, gpu.repair_status[1])
        elif self.verdict == VERDICT_TPC_REPAIR_PENDING:
            gpu.repair_status = (gpu.repair_status[0], value)
        else:
            gpu.remapped_rows = (0, 3 if on else 0, 0, value)


FLAGS = [
    Flag(
        VERDICT_SRAM_THRESHOLD_EXCEEDED,
        "NVML_SRAM_THRESHOLD_EXCEEDED",
        ACTION_REPLACE,
        "sram-threshold-exceeded",
        True,
        "nvmlDeviceGetSramEccErrorStatus",
    ),
    Flag(
        VERDICT_UNREPAIRABLE_MEMORY,
        "NVML_UNREPAIRABLE_MEMORY",
        ACTION_REPLACE,
        "unrepairable-memory",
        True,
        "nvmlDeviceGetUnrepairableMemoryFlag_v1",
    ),
    Flag(
        VERDICT_CHANNEL_REPAIR_PENDING,
        "NVML_CHANNEL_REPAIR_PENDING",
        ACTION_RESET_GPU,
        "channel-repair-pending",
        False,  # like a row remapping pending: the reset its verdict asks for applies it
        "nvmlDeviceGetRepairStatus",
    ),
    Flag(
        VERDICT_TPC_REPAIR_PENDING,
        "NVML_TPC_REPAIR_PENDING",
        ACTION_RESET_GPU,
        "tpc-repair-pending",
        False,
        "nvmlDeviceGetRepairStatus",
    ),
    Flag(
        VERDICT_ROW_REMAP_FAILURE,
        "NVML_REMAP_FAILURE",
        ACTION_REPLACE,
        "remap-failure",
        True,
        "nvmlDeviceGetRemappedRows",
    ),
]


def position(condition: str, episode: int) -> str:
    return f"state:{boot_id()}:{GPU0_UUID}:{condition}:{episode}"


def impairs(observation: Observation, policy: str) -> bool:
    return Policy(policy).classify(observation.record, NOW).impairs


def test_the_verdict_names_are_the_contracts() -> None:
    assert {flag.verdict for flag in FLAGS} | {VERDICT_RECOVERY_ACTION} == set(NVIDIA_VERDICTS)


@pytest.mark.parametrize("flag", FLAGS, ids=[flag.verdict for flag in FLAGS])
async def test_a_flag_appearing_then_clearing_states_then_withdraws_its_verdict(flag: Flag) -> None:
    fake = FakeNvml(two_gpus())
    gpu = fake.gpus[0]
    async with collecting(make_source(fake, poll_interval=0.05)) as collector:
        await eventually(lambda: fake.calls.count(flag.function) >= 2)
        flag.set(gpu, True)
        await collector.wait_for(1)
        await asyncio.sleep(0.2)  # polled again: a flag that stays is not stated again
        assert len(collector.seen) == 1
        flag.set(gpu, False)
        await collector.wait_for(2)
        flag.set(gpu, True)
        await collector.wait_for(3)
    appeared, cleared, again = collector.seen
    for observation, action, reason in [
        (appeared, flag.action, flag.reason),
        (cleared, ACTION_NONE, f"{flag.reason}_CLEARED"),
        (again, flag.action, flag.reason),
    ]:
        record = observation.record
        assert (record.kind, record.pci, record.uuid) == ("nvml", "0000:3b:00", GPU0_UUID)
        assert (record.nvidia_verdict, record.nvidia_action, record.reason) == (flag.verdict, action, reason)
        finding = make_finding(
            record, Policy().classify(record, NOW), instance_id="i-1", group="g", source="nvml", observed_at=NOW,
            position=observation.position,
        )  # fmt: skip
        assert (finding.verdict, finding.immediate_action, finding.reason) == (flag.verdict, action, reason)
        assert not impairs(observation, "ecs")  # ECS's 18 Xids stay what impairs
    assert impairs(appeared, "nvidia-catalog") is flag.nvidia_impairs
    assert not impairs(cleared, "nvidia-catalog")  # a verdict withdrawn never impairs
    assert [o.position for o in collector.seen] == [
        position(flag.condition, 0),
        position(f"{flag.condition}-cleared", 0),
        position(flag.condition, 1),
    ]


@pytest.mark.parametrize("flag", FLAGS, ids=[flag.verdict for flag in FLAGS])
async def test_a_restarted_probe_states_a_standing_flag_again_with_the_same_id(flag: Flag) -> None:
    fake = FakeNvml(two_gpus())
    flag.set(fake.gpus[0], True)
    ids = []
    for _ in range(2):  # a probe, then the probe restarted within the same boot
        async with collecting(make_source(fake)) as collector:
            (observation,) = await collector.wait_for(1)
        ids.append(observation.position)
    assert ids == [position(flag.condition, 0)] * 2


@pytest.mark.parametrize(
    ("function", "code"),
    [
        ("nvmlDeviceGetSramEccErrorStatus", pynvml.NVML_ERROR_NOT_SUPPORTED),  # a GPU before Hopper
        ("nvmlDeviceGetUnrepairableMemoryFlag_v1", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND),  # a driver before R575
        ("nvmlDeviceGetRepairStatus", pynvml.NVML_ERROR_NOT_SUPPORTED),
        ("nvmlDeviceGetRepairStatus", pynvml.NVML_ERROR_FUNCTION_NOT_FOUND),
    ],
)
async def test_a_gpu_or_driver_without_the_flag_is_never_a_fault(function: str, code: int) -> None:
    fake = FakeNvml(two_gpus())
    for gpu in fake.gpus:
        gpu.errors = {function: code}
        gpu.sram_threshold_exceeded = gpu.unrepairable_memory = 1
        gpu.repair_status = (1, 1)
    source = make_source(fake, poll_interval=0.05)
    async with collecting(source) as collector:
        await eventually(lambda: fake.calls.count("nvmlDeviceGetRemappedRows") >= 6)
        assert source.status.is_ok
    # Asked once per GPU, then remembered as not supported; the other flags still count.
    assert fake.calls.count(function) == 2
    said = {o.record.reason for o in collector.seen}
    assert len(collector.seen) == 2 * len(said)  # each flag the GPUs answer for, once per GPU
    unread = {"nvmlDeviceGetSramEccErrorStatus": {"NVML_SRAM_THRESHOLD_EXCEEDED"}}.get(
        function,
        {"NVML_UNREPAIRABLE_MEMORY"}
        if function == "nvmlDeviceGetUnrepairableMemoryFlag_v1"
        else {"NVML_CHANNEL_REPAIR_PENDING", "NVML_TPC_REPAIR_PENDING"},
    )
    everything = {"NVML_SRAM_THRESHOLD_EXCEEDED", "NVML_UNREPAIRABLE_MEMORY"}
    everything |= {"NVML_CHANNEL_REPAIR_PENDING", "NVML_TPC_REPAIR_PENDING"}
    assert said == everything - unread


SRAM = "NVML_SRAM_THRESHOLD_EXCEEDED"
UNREPAIRABLE = "NVML_UNREPAIRABLE_MEMORY"
REPAIRS = {"NVML_CHANNEL_REPAIR_PENDING", "NVML_TPC_REPAIR_PENDING"}


@pytest.mark.parametrize(
    ("missing", "unread"),
    [
        (("nvmlDeviceGetSramEccErrorStatus",), {SRAM}),
        (("c_nvmlEccSramErrorStatus_v1_t",), {SRAM}),  # the function without its struct
        (("nvmlDeviceGetUnrepairableMemoryFlag_v1", "nvmlDeviceGetRepairStatus"), {UNREPAIRABLE, *REPAIRS}),
        (
            (
                "nvmlDeviceGetSramEccErrorStatus",
                "c_nvmlEccSramErrorStatus_v1_t",
                "nvmlDeviceGetUnrepairableMemoryFlag_v1",
                "nvmlDeviceGetRepairStatus",
            ),
            {SRAM, UNREPAIRABLE, *REPAIRS},
        ),
    ],
)
async def test_an_older_pynvml_without_the_calls_is_not_supported_said_once(
    missing: tuple[str, ...], unread: set[str], caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml(two_gpus())
    older_pynvml(fake, *missing)
    for gpu in fake.gpus:
        gpu.sram_threshold_exceeded = gpu.unrepairable_memory = 1
        gpu.repair_status = (1, 1)
    source = make_source(fake, poll_interval=0.05)
    with caplog.at_level(logging.INFO, logger="node_probe.sources.nvml"):
        async with collecting(source) as collector:
            await eventually(lambda: fake.calls.count("nvmlDeviceGetRemappedRows") >= 6)
            assert source.status.is_ok
    assert fake.inits == 1  # no AttributeError reached the source: it never restarted
    lacking = [r.getMessage() for r in caplog.records if "pynvml lacks" in r.getMessage()]
    calls = 1 if unread == {SRAM} else 2 if SRAM not in unread else 3  # the checks that cannot be made
    assert len(lacking) == 2 * calls  # once per GPU, not once per poll
    assert {o.record.reason for o in collector.seen} == {SRAM, UNREPAIRABLE, *REPAIRS} - unread
    assert len(collector.seen) == 2 * (4 - len(unread))  # each flag this pynvml can read, once per GPU


async def test_the_sram_status_is_read_through_a_pointer_to_a_versioned_struct() -> None:
    """pynvml 13.x passes the status argument to NVML as it is: given the struct itself, ctypes would pass it by
    value. The stand-in takes only a pointer to the struct with its version set, as NVML would need."""
    fake = FakeNvml(two_gpus())
    fake.gpus[1].sram_threshold_exceeded = 1
    async with collecting(make_source(fake)) as collector:
        (observation,) = await collector.wait_for(1)
    assert observation.record.reason == "NVML_SRAM_THRESHOLD_EXCEEDED" and observation.record.pci == "0000:c1:00"


# --- the recovery action ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "reason", "action"),
    [
        (1, "NVML_RECOVERY_ACTION_GPU_RESET", ACTION_RESET_GPU),
        (2, "NVML_RECOVERY_ACTION_NODE_REBOOT", ACTION_RESTART_BM),
        (3, "NVML_RECOVERY_ACTION_DRAIN_P2P", ACTION_DRAIN_P2P),
        (4, "NVML_RECOVERY_ACTION_DRAIN_AND_RESET", ACTION_DRAIN_AND_RESET),
        (5, "NVML_RECOVERY_ACTION_RECOVER_IMEX_DOMAIN", ""),
        (6, "NVML_RECOVERY_ACTION_BUS_RESET", ACTION_RESTART_BM),
        (7, "NVML_RECOVERY_ACTION_SYSTEM_REBOOT", ACTION_RESTART_BM),
        (42, "NVML_RECOVERY_ACTION_42", ""),  # a value no pynvml names yet
    ],
)
async def test_each_recovery_action_states_its_verdict_and_back_to_none_withdraws_it(
    code: int, reason: str, action: str
) -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[0].recovery_action = code
    async with collecting(make_source(fake, poll_interval=0.05)) as collector:
        await collector.wait_for(1)
        fake.gpus[0].recovery_action = 0
        await collector.wait_for(2)
        await asyncio.sleep(0.2)  # None that stays is not said again
        assert len(collector.seen) == 2
    stated, withdrawn = collector.seen
    assert stated.record.reason == reason
    assert (stated.record.nvidia_verdict, stated.record.nvidia_action) == (VERDICT_RECOVERY_ACTION, action)
    assert withdrawn.record.reason == "NVML_RECOVERY_ACTION_NONE"
    assert (withdrawn.record.nvidia_verdict, withdrawn.record.nvidia_action) == (VERDICT_RECOVERY_ACTION, ACTION_NONE)
    assert (withdrawn.record.recovery_action_from_code, withdrawn.record.recovery_action_to_code) == (code, 0)
    assert not impairs(stated, "ecs") and not impairs(withdrawn, "ecs")
    assert impairs(stated, "nvidia-catalog") is (action not in ("", ACTION_NONE))
    assert not impairs(withdrawn, "nvidia-catalog")
    assert [o.position for o in collector.seen] == [position(f"recovery-{code}", 0), position("recovery-0", 1)]


async def test_the_recovery_actions_ids_count_each_value_apart_and_survive_a_restart() -> None:
    fake = FakeNvml(two_gpus())
    async with collecting(make_source(fake, poll_interval=0.05)) as collector:
        for n, code in enumerate([1, 0, 1, 0, 2]):
            await asyncio.sleep(0.1)
            fake.gpus[0].recovery_action = code
            await collector.wait_for(n + 1)
    assert [o.position for o in collector.seen] == [
        position("recovery-1", 0),
        position("recovery-0", 1),
        position("recovery-1", 1),
        position("recovery-0", 2),
        position("recovery-2", 0),
    ]
    async with collecting(make_source(fake)) as restarted:  # within the same boot: the same id, dropped there
        (observation,) = await restarted.wait_for(1)
    assert observation.position == position("recovery-2", 0)


async def test_a_recovery_action_event_back_to_none_withdraws_the_verdict() -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[1].recovery_action = 2
    async with collecting(make_source(fake)) as collector:
        await collector.wait_for(1)
        fake.gpus[1].recovery_action = 0
        fake.events.append((1, RECOVERY, 0, NO_INSTANCE, NO_INSTANCE))
        await collector.wait_for(2)
    assert [o.record.nvidia_action for o in collector.seen] == [ACTION_RESTART_BM, ACTION_NONE]
    assert collector.seen[1].record.pci == "0000:c1:00"


async def test_where_the_field_is_not_supported_the_events_data_says_it() -> None:
    fake = FakeNvml(two_gpus())
    fake.gpus[0].field_return = pynvml.NVML_ERROR_NOT_SUPPORTED
    async with collecting(make_source(fake)) as collector:
        await eventually(lambda: fake.waits >= 1)
        fake.events.append((0, RECOVERY, 1, NO_INSTANCE, NO_INSTANCE))
        await collector.wait_for(1)
        fake.events.append((0, RECOVERY, 0, NO_INSTANCE, NO_INSTANCE))
        await collector.wait_for(2)
    assert [(o.record.reason, o.record.nvidia_action) for o in collector.seen] == [
        ("NVML_RECOVERY_ACTION_GPU_RESET", ACTION_RESET_GPU),
        ("NVML_RECOVERY_ACTION_NONE", ACTION_NONE),
    ]


async def test_a_newer_pynvmls_recovery_action_is_named_from_its_constant_and_asks_nothing() -> None:
    fake: Any = FakeNvml(two_gpus())
    fake.NVML_GPU_RECOVERY_ACTION_REPLACE_THE_RACK = 9
    fake.gpus[0].recovery_action = 9
    async with collecting(make_source(fake)) as collector:
        (observation,) = await collector.wait_for(1)
    record = observation.record
    assert record.reason == "NVML_RECOVERY_ACTION_REPLACE_THE_RACK" and record.recovery_action_to == "Replace The Rack"
    assert (record.nvidia_verdict, record.nvidia_action) == (VERDICT_RECOVERY_ACTION, "")
