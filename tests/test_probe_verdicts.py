"""NVIDIA's standing verdicts from the kernel log to delivery: Xid 154's recovery action names the same action as
NVML's field (one mapping, classify/verdicts.py), the policies decide on them as NVIDIA and ECS would, and nothing
on the way (burst collapse, correlation of one fault across sources, a full spool, the relay) folds a verdict's
withdrawal into the finding that set it, or drops what a copy stated."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from contract.probe import (
    ACTION_DRAIN_AND_RESET,
    ACTION_DRAIN_P2P,
    ACTION_NONE,
    ACTION_REPLACE,
    ACTION_RESET_GPU,
    ACTION_RESTART_BM,
    VERDICT_RECOVERY_ACTION,
    VERDICT_ROW_REMAP_FAILURE,
    GpuFinding,
)
from node_probe.classify.collapse import sent_findings
from node_probe.classify.correlate import ROW_REMAP_FAILURE, Correlator, FaultKey
from node_probe.classify.findings import dedupe_key, immediate_action, make_finding
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.policy import Policy, PolicyConfig, RepeatRule
from node_probe.classify.record import FaultRecord
from node_probe.classify.verdicts import RECOVERY_ACTIONS, recovery_action, statement
from node_probe.delivery.liveness_relay import LivenessRelay, routes_of
from node_probe.delivery.spool import FileSpool, MemorySpool
from node_probe.probe import Probe
from node_probe.sources.base import RecordSource
from node_probe.sources.log_file import KernelLogFileSource
from tests.fake_nvml import NO_INSTANCE, XID, FakeNvml, make_source, two_gpus
from tests.test_one_fault_one_count import probing_sources
from tests.test_probe import FakeReporter, eventually

NOW = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
GPU = "0000:3b:00"  # the stand-in's first GPU


def xid_154(to: str, was: str = "0x0 (None)", pci: str = "0000:b3:00") -> str:
    return f"NVRM: Xid (PCI:{pci}): 154, GPU recovery action changed from {was} to {to}"


def one(line: str) -> FaultRecord:
    (record,) = parse_lines([line])
    return record


def finding(record: FaultRecord, policy: str = "ecs") -> GpuFinding:
    verdict = Policy(policy).classify(record, NOW)
    return make_finding(record, verdict, instance_id="i-1", group="g", source="kmsg", observed_at=NOW)


# --- one mapping for both paths ------------------------------------------------------------------------------

ACTIONS = {
    0: ACTION_NONE,
    1: ACTION_RESET_GPU,
    2: ACTION_RESTART_BM,
    3: ACTION_DRAIN_P2P,
    4: ACTION_DRAIN_AND_RESET,
    5: "",  # Recover IMEX Domain: nothing we do, the catalog's action applies
    6: ACTION_RESTART_BM,  # Bus Reset Required: a reboot surely resets the bus
    7: ACTION_RESTART_BM,
}


@pytest.mark.parametrize("code", sorted(ACTIONS))
def test_the_recovery_action_table_is_nvidias_names_and_codes(code: int) -> None:
    assert recovery_action(code) == ACTIONS[code]
    assert recovery_action(code, RECOVERY_ACTIONS[code].name) == ACTIONS[code]
    assert recovery_action(None, RECOVERY_ACTIONS[code].name.upper()) == ACTIONS[code]


@pytest.mark.parametrize(
    ("code", "name", "action"),
    [
        (6, "Unknown", ""),  # the driver itself disowns the value
        (None, "Unknown", ""),
        (8, "Replace The Rack", ""),  # a newer driver's
        (None, None, ""),
        (2, "OS Reboot", ACTION_RESTART_BM),  # another driver's words for a known value
        (1, "PF FLR", ACTION_RESET_GPU),
    ],
)
def test_a_value_or_name_not_known_asks_for_nothing(code: int | None, name: str | None, action: str) -> None:
    assert recovery_action(code, name) == action


@pytest.mark.parametrize(
    ("to", "action", "nvidia_impairs"),
    [
        ("0x1 (GPU Reset Required)", ACTION_RESET_GPU, True),
        ("0x2 (Node Reboot Required)", ACTION_RESTART_BM, True),
        ("0x3 (Drain P2P)", ACTION_DRAIN_P2P, True),
        ("0x4 (Drain and Reset)", ACTION_DRAIN_AND_RESET, True),
        ("0x5 (Recover IMEX Domain)", "", False),
        ("0x6 (Bus Reset Required)", ACTION_RESTART_BM, True),
        ("0x7 (System Reboot Required)", ACTION_RESTART_BM, True),
        ("0x6 (Unknown)", "", False),
    ],
)
def test_xid_154_states_the_recovery_action_it_announces(to: str, action: str, nvidia_impairs: bool) -> None:
    # Real text, and as kmsg and syslog prefix it: the same record.
    for line in (xid_154(to), f"[ 1843.308145] {xid_154(to)}", f"Nov 22 15:39:14 gpu7 kernel: {xid_154(to)}"):
        record = one(line)
        assert (record.nvidia_verdict, record.nvidia_action) == (VERDICT_RECOVERY_ACTION, action)
        sent = finding(record)
        assert (sent.reason, sent.verdict, sent.immediate_action) == ("XID_154", VERDICT_RECOVERY_ACTION, action)
        assert sent.gpu.pci == "0000:b3:00" and not sent.impairs  # ECS's 18 Xids stay what impairs
        assert finding(record, "nvidia-catalog").impairs is nvidia_impairs


@pytest.mark.parametrize("code", sorted(ACTIONS))
def test_xid_154_and_nvmls_field_name_the_same_action(code: int) -> None:
    name = RECOVERY_ACTIONS[code].name
    before = "0x1 (GPU Reset Required)" if code == 0 else "0x0 (None)"
    record = one(xid_154(f"{code:#x} ({name})", was=before))
    assert record.nvidia_action == recovery_action(code) == ACTIONS[code]


def test_xid_154_back_to_none_withdraws_the_verdict_and_never_impairs() -> None:
    record = one(xid_154("0x0 (None)", was="0x1 (GPU Reset Required)"))
    for policy in ("ecs", "nvidia-catalog"):
        sent = finding(record, policy)
        assert (sent.verdict, sent.immediate_action, sent.impairs) == (VERDICT_RECOVERY_ACTION, ACTION_NONE, False)
    # Not even where the operator makes every Xid 154 impair, or counts them.
    rules = PolicyConfig(add_xids={154}, repeat=[RepeatRule(code=154, count=2, within=timedelta(hours=1))])
    overridden = Policy("nvidia-catalog", rules)
    for _ in range(3):
        assert overridden.classify(record, NOW).rule == "nvidia-catalog:verdict-withdrawn"
    assert Policy("ecs", rules).classify(one(xid_154("0x1 (GPU Reset Required)")), NOW).impairs


def test_an_xid_154_that_does_not_say_its_action_names_none() -> None:
    """NVML's Xid event carries the code alone; the catalog's bucket for 154 (XID_154) is not an action."""
    event = FaultRecord(line=0, raw="", kind="xid", code=154, pci=GPU, message="Xid 154 (NVML event)")
    assert immediate_action(event) == ""
    sent = finding(event)
    assert (sent.verdict, sent.immediate_action) == ("", "")
    unparsed = one("NVRM: Xid (PCI:0000:b3:00): 154, GPU recovery action changed")
    assert (unparsed.nvidia_verdict, immediate_action(unparsed)) == (None, "")
    assert immediate_action(one("NVRM: Xid (PCI:0000:b3:00): 79, GPU has fallen off the bus.")) == "RESTART_BM"


# --- never folded, never dropped ----------------------------------------------------------------------------


def test_the_withdrawal_is_a_burst_of_its_own() -> None:
    lines = [
        xid_154("0x1 (GPU Reset Required)"),
        xid_154("0x0 (None)", was="0x1 (GPU Reset Required)"),
        xid_154("0x1 (GPU Reset Required)"),
    ]
    for name in ("ecs", "nvidia-catalog"):
        sent = list(sent_findings(lines, Policy(name), NOW, timedelta(minutes=5)))
        # The third restates the first within its window: counted in its burst's roll-up, as any repeat is.
        assert [(s.line, s.finding.immediate_action, s.finding.count) for s in sent] == [
            (1, ACTION_RESET_GPU, 1),
            (2, ACTION_NONE, 1),
            (3, ACTION_RESET_GPU, 1),
        ]
        assert sent[-1].first_line == 1
    stated, withdrawn = one(lines[0]), one(lines[1])
    policy = Policy()
    assert dedupe_key(stated, policy.classify(stated, NOW)) != dedupe_key(withdrawn, policy.classify(withdrawn, NOW))


def test_a_copy_stating_a_verdict_is_told_whichever_copy_the_finding_is_made_of() -> None:
    correlator: Correlator[str] = Correlator(timedelta(seconds=3), timedelta(minutes=5))
    key = FaultKey(GPU, None, None, ROW_REMAP_FAILURE)
    remap = f"{VERDICT_ROW_REMAP_FAILURE}={ACTION_REPLACE}"
    # NVML's flag first, then the kernel's impairing Xid 64 within the hold: the finding is the Xid's, stating it.
    correlator.hold(key, "nvml remap failure", "nvml", "NVML_REMAP_FAILURE", False, NOW, remap)
    assert correlator.copy_of(key, "xid 64", "kmsg", "XID_64", True, NOW + timedelta(seconds=1))
    (fault,) = correlator.due(NOW + timedelta(seconds=3))
    assert (fault.primary, fault.stating, fault.impairs) == ("xid 64", "nvml remap failure", True)
    # Stated already: a later copy saying the same is folded.
    later = NOW + timedelta(seconds=30)
    assert correlator.copy_of(key, "dcgm xid 64", "dcgm", "XID_64", True, later)
    # Saying something else (a withdrawal, say) it is not: it goes out on its own.
    assert not correlator.copy_of(key, "other", "nvml", "NVML_OTHER", False, later, f"{VERDICT_ROW_REMAP_FAILURE}=")


def test_a_verdict_stated_after_the_fault_went_out_goes_out_on_its_own() -> None:
    correlator: Correlator[str] = Correlator(timedelta(seconds=3), timedelta(minutes=5))
    key = FaultKey(GPU, None, None, ROW_REMAP_FAILURE)
    remap = f"{VERDICT_ROW_REMAP_FAILURE}={ACTION_REPLACE}"
    correlator.hold(key, "xid 64", "kmsg", "XID_64", True, NOW)
    (fault,) = correlator.due(NOW + timedelta(seconds=3))
    assert fault.stating is None
    # NVML's poll a minute on: the same fault, but the verdict was never told, so it is no copy to swallow.
    later = NOW + timedelta(minutes=1)
    assert not correlator.copy_of(key, "nvml remap failure", "nvml", "NVML_REMAP_FAILURE", True, later, remap)
    assert correlator.hold(key, "nvml remap failure", "nvml", "NVML_REMAP_FAILURE", True, later, remap) == []
    (told,) = correlator.due(later + timedelta(seconds=3))
    assert (told.primary, told.sources) == ("nvml remap failure", ("nvml", "kmsg"))


def test_statements_tell_a_verdict_from_its_withdrawal() -> None:
    stated = one(xid_154("0x1 (GPU Reset Required)"))
    withdrawn = one(xid_154("0x0 (None)", was="0x1 (GPU Reset Required)"))
    assert statement(stated) == "recovery_action=RESET_GPU" and statement(withdrawn) == "recovery_action=NONE"
    assert statement(one("NVRM: Xid (PCI:0000:b3:00): 79, GPU has fallen off the bus.")) == ""


def probing(sources: list[RecordSource], reporter: FakeReporter) -> AbstractAsyncContextManager[Probe]:
    # A short correlation window: the copies of one fault these tests make arrive within it.
    return probing_sources(sources, reporter, correlation_window=timedelta(seconds=1))


async def test_nvmls_xid_event_first_still_gives_the_kernel_lines_verdict(tmp_path: Path) -> None:
    """NVML's Xid event for 154 says no action; the kernel's line for it, a moment later, does. One fault, one
    finding, and it states the recovery action."""
    log = tmp_path / "kern.log"
    log.write_text("")
    fake = FakeNvml(two_gpus())
    nvml = make_source(fake)
    reporter = FakeReporter()
    async with probing([KernelLogFileSource(log, 0.02), nvml], reporter) as probe:
        await eventually(lambda: all(s.status.is_ok for s in (nvml,)) and fake.waits >= 1)
        fake.events.append((0, XID, 154, NO_INSTANCE, NO_INSTANCE))
        await eventually(lambda: probe.stats.records == 1)
        with log.open("a") as handle:
            handle.write(xid_154("0x1 (GPU Reset Required)", pci=GPU) + "\n")
        await eventually(lambda: len(reporter.findings) == 1)
        await asyncio.sleep(0.5)
    (sent,) = reporter.findings
    assert (sent.reason, sent.verdict, sent.immediate_action) == ("XID_154", VERDICT_RECOVERY_ACTION, ACTION_RESET_GPU)
    assert sent.source == "nvml" and sent.sources == ["nvml", f"kernel_log:{log}"]
    assert probe.stats.copies == 1


async def test_a_row_remap_failure_after_its_xid_64_is_told_and_its_clearing_too(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    fake = FakeNvml(two_gpus())
    nvml = make_source(fake, poll_interval=0.05)
    reporter = FakeReporter()
    async with probing([KernelLogFileSource(log, 0.02), nvml], reporter) as probe:
        await eventually(lambda: fake.calls.count("nvmlDeviceGetRemappedRows") >= 2)
        with log.open("a") as handle:
            handle.write(
                f"NVRM: Xid (PCI:{GPU}): 64, pid=57530, Row Remapper Error: (0x00000005d28c03a0) - All reserved "
                "rows for bank are remapped\n"
            )
        await eventually(lambda: len(reporter.findings) == 1)  # the Xid went out before NVML's poll said more
        fake.gpus[0].remapped_rows = (0, 3, 0, 1)
        await eventually(lambda: len(reporter.findings) == 2)
        fake.gpus[0].remapped_rows = (0, 3, 0, 0)
        await eventually(lambda: len(reporter.findings) == 3)
        await asyncio.sleep(0.3)
        assert probe.stats.copies == 0
    xid, failure, cleared = reporter.findings
    assert (xid.reason, xid.impairs, xid.verdict) == ("XID_64", True, "")
    assert (failure.reason, failure.verdict, failure.immediate_action) == (
        "NVML_REMAP_FAILURE",
        VERDICT_ROW_REMAP_FAILURE,
        ACTION_REPLACE,
    )
    assert failure.sources == ["nvml", f"kernel_log:{log}"]  # the same fault, as told before
    assert (cleared.reason, cleared.verdict, cleared.immediate_action, cleared.impairs) == (
        "NVML_REMAP_FAILURE_CLEARED",
        VERDICT_ROW_REMAP_FAILURE,
        ACTION_NONE,
        False,
    )


def test_a_full_spool_keeps_what_states_a_verdict(tmp_path: Path) -> None:
    warning = finding(one("NVRM: Xid (PCI:0000:b3:00): 13, pid=1, name=x, Graphics Exception"))
    withdrawn = finding(one(xid_154("0x0 (None)", was="0x1 (GPU Reset Required)")))
    assert not withdrawn.impairs
    memory = MemorySpool(max_items=1)
    assert memory.append(warning)
    assert not memory.append(warning)  # full: a warning gives way
    assert memory.append(withdrawn)  # the workflow would otherwise hold a verdict NVIDIA withdrew
    file = FileSpool(tmp_path, "i-1", max_bytes=1)  # no room for any finding
    assert not file.append(warning)
    assert file.append(withdrawn)
    assert [f.finding_id if f else None for f in (memory.peek(), file.peek())] == [
        warning.finding_id,
        withdrawn.finding_id,
    ]


async def test_the_relay_forwards_a_verdict_as_it_is() -> None:
    reporter = FakeReporter()
    relay = LivenessRelay(reporter, routes_of([]), "q", relay=True)  # type: ignore[arg-type]
    sent = finding(one(xid_154("0x0 (None)", was="0x1 (GPU Reset Required)")))
    # What the ingest reads off the wire, then relays.
    await relay.send_finding(GpuFinding.model_validate_json(sent.model_dump_json()), "q")
    (relayed,) = reporter.findings
    assert relayed == sent
    assert (relayed.verdict, relayed.immediate_action) == (VERDICT_RECOVERY_ACTION, ACTION_NONE)
