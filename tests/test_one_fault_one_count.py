"""One fault, one count: a double-bit ECC error that the kernel log (Xid 48), NVML (its DoubleBitEccError and Xid
events, then its uncorrectable ECC count) and DCGM (a memory-system failure) each report is one finding naming every
source, and the health workflow counts it once.

The kernel log is a real file read by the real parser; NVML is the real source over the pynvml stand-in
(tests/fake_nvml.py); DCGM is the real source running a real program in dcgmi's place that prints dcgmi's JSON (the
failure sample of tests/test_dcgm_source.py: no real failing `dcgmi health -c -j` output is public)."""

from __future__ import annotations

import asyncio
import contextlib
import stat
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from contract.health import CheckType, HealthState
from contract.probe import GpuFinding
from node_probe.classify.correlate import DBE, Correlator, FaultKey, fault_key
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.policy import PolicyConfig
from node_probe.classify.record import FaultRecord
from node_probe.delivery.reporter import Reporter, ReporterProtocol
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources.base import RecordSource
from node_probe.sources.dcgm import DcgmHealthSource
from node_probe.sources.log_file import KernelLogFileSource
from node_probe.sources.nvml import NvmlSource
from tests.fake_nvml import DBE as NVML_DBE
from tests.fake_nvml import NO_INSTANCE, XID, FakeNvml, make_source, two_gpus
from tests.harness import eventually, unique
from tests.test_dcgm_source import HEALTHY, report
from tests.test_health_signals import check, health_of, monitor_only, start_health
from tests.test_probe import FakeReporter
from tests.test_probe import eventually as soon

GPU0 = "0000:3b:00"  # the stand-in's first GPU (NVML index 0, DCGM GPU 0)
XID_48 = (
    "[ 2211.004212] NVRM: Xid (PCI:0000:3b:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit "
    "error (DBE) has been detected on GPU in the framebuffer at partition 1, subpartition 0.\n"
)
DBE_ON_GPU0 = report(
    "Failure",
    {"GPU": {"0": {"Memory system": ("Failure", ["A volatile double-bit ECC error has occurred on GPU 0."])}}},
)
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def record(kind: str = "xid", code: int | None = 48, reason: str | None = None, pci: str | None = GPU0) -> FaultRecord:
    return FaultRecord(line=1, raw="r", kind=kind, code=code, pci=pci, message="m", reason=reason)  # type: ignore[arg-type]


def test_the_copies_of_one_fault_share_a_key_and_other_faults_do_not() -> None:
    (from_log,) = parse_lines([XID_48])
    key = fault_key(from_log, "XID_48")
    assert key == FaultKey(GPU0, None, None, DBE)
    for copy, reason in [
        (record("nvml", None, "NVML_DOUBLE_BIT_ECC"), "NVML_DOUBLE_BIT_ECC"),
        (record("nvml", None, "NVML_ECC_UNCORRECTED"), "NVML_ECC_UNCORRECTED"),
        (record("dcgm", None, "DCGM_MEMORY_FAIL"), "DCGM_MEMORY_FAIL"),
        (record("dcgm", None, "DCGM_POLICY_DBE"), "DCGM_POLICY_DBE"),  # the bindings' DBE policy violation
        (record("xid", 48), "XID_48"),  # NVML's or DCGM's Xid event
    ]:
        assert fault_key(copy, reason) == key
    assert fault_key(record("xid", 79), "XID_79") == FaultKey(GPU0, None, None, "XID_79")
    assert fault_key(record("xid", 48, pci="0000:c1:00"), "XID_48") != key  # another GPU
    assert fault_key(record("dcgm", None, "DCGM_MEMORY_WARN"), "DCGM_MEMORY_WARN") is None
    assert fault_key(record("xid", 48, pci=None), "XID_48") is None  # no GPU named: never merged


def test_copies_join_while_held_later_ones_are_folded_and_a_later_impairment_still_goes_out() -> None:
    correlator: Correlator[str] = Correlator(timedelta(seconds=3), timedelta(minutes=5))
    key = FaultKey(GPU0, None, None, DBE)
    assert correlator.hold(key, "kernel", "kernel_log", "XID_48", False, T0) == []
    assert correlator.copy_of(key, "nvml", "nvml", "NVML_DOUBLE_BIT_ECC", False, T0 + timedelta(seconds=1))
    # The same view again is a repeat, for burst collapse to count: not a copy.
    assert not correlator.copy_of(key, "kernel again", "kernel_log", "XID_48", False, T0 + timedelta(seconds=2))
    assert correlator.due(T0 + timedelta(seconds=2)) == []
    assert correlator.holding  # the log's cursor waits: what it read is not in the spool yet
    (fault,) = correlator.due(T0 + timedelta(seconds=3))
    assert not correlator.holding
    assert (fault.primary, fault.sources, fault.first_at, fault.impairs) == (
        "kernel",
        ("kernel_log", "nvml"),
        T0,
        False,
    )
    # A minute later the polled count is the same fault, told already.
    assert correlator.copy_of(key, "poll", "nvml", "NVML_ECC_UNCORRECTED", False, T0 + timedelta(minutes=1))
    # DCGM's failure impairs where what went out did not: it is not swallowed.
    later = T0 + timedelta(minutes=1, seconds=1)
    assert not correlator.copy_of(key, "dcgm", "dcgm", "DCGM_MEMORY_FAIL", True, later)
    assert correlator.hold(key, "dcgm", "dcgm", "DCGM_MEMORY_FAIL", True, later) == []
    (again,) = correlator.due(later + timedelta(seconds=3))
    assert (again.primary, again.sources, again.impairs) == ("dcgm", ("dcgm", "kernel_log", "nvml"), True)
    assert correlator.copies == 2
    correlator.due(T0 + timedelta(minutes=7))
    assert len(correlator) == 0  # past the memory: forgotten


def test_an_impairing_copy_is_what_goes_out_and_room_is_bounded() -> None:
    correlator: Correlator[str] = Correlator(timedelta(seconds=3), timedelta(minutes=5), max_keys=2)
    keys = [FaultKey(f"0000:{n:02x}:00", None, None, DBE) for n in range(3)]
    correlator.hold(keys[0], "nvml warning", "nvml", "NVML_DOUBLE_BIT_ECC", False, T0)
    assert correlator.copy_of(keys[0], "kernel xid 48", "kernel_log", "XID_48", True, T0)
    correlator.hold(keys[1], "b", "nvml", "NVML_DOUBLE_BIT_ECC", False, T0)
    (evicted,) = correlator.hold(keys[2], "c", "nvml", "NVML_DOUBLE_BIT_ECC", False, T0)
    assert (evicted.primary, evicted.sources, evicted.impairs) == ("kernel xid 48", ("nvml", "kernel_log"), True)
    assert {fault.primary for fault in correlator.flush()} == {"b", "c"}
    assert correlator.held == 0


def test_an_old_finding_without_sources_still_parses() -> None:
    old = (
        '{"finding_id": "f1", "instance_id": "i-1", "group": "g", "kind": "xid", "code": 48, "reason": "XID_48", '
        '"impairs": true, "source": "kmsg", "observed_at": "2025-01-01T00:00:00Z"}'
    )
    assert GpuFinding.model_validate_json(old).sources == []


def fake_dcgmi(tmp_path: Path) -> tuple[Path, Path]:
    """A real program in dcgmi's place: `health -c -j` prints the file's JSON; `health -s a` succeeds."""
    answer = tmp_path / "dcgmi-answer.json"
    answer.write_text(HEALTHY)
    program = tmp_path / "dcgmi"
    program.write_text(f'#!/bin/sh\n[ "$2" = -c ] && cat {answer}\nexit 0\n')
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    return program, answer


class Host:
    """A host's three GPU sources, and how to make GPU 0 suffer one double-bit ECC error in all of them."""

    def __init__(self, tmp_path: Path, *, dcgm: bool = True) -> None:
        self.kernel_log = tmp_path / "kern.log"
        self.kernel_log.write_text("")
        self.nvml_lib = FakeNvml(two_gpus())
        self.nvml: NvmlSource = make_source(self.nvml_lib, poll_interval=0.1)
        self.sources: list[RecordSource] = [KernelLogFileSource(self.kernel_log, 0.05), self.nvml]
        self.dcgm_answer: Path | None = None
        if dcgm:
            dcgmi, self.dcgm_answer = fake_dcgmi(tmp_path)
            self.sources.append(DcgmHealthSource(str(dcgmi), poll_interval=0.1, gpu_lookup=self.nvml.gpu_identity))

    async def double_bit_error(self, probe: Probe) -> None:
        """As a real one shows: the driver's line, NVML's events, the count at NVML's next poll, DCGM's next poll.
        One after the other, so that which copy comes first (and is the finding) is known."""
        before = probe.stats.records
        with self.kernel_log.open("a") as log:
            log.write(XID_48)
        await soon(lambda: probe.stats.records == before + 1)
        self.nvml_lib.events += [(0, NVML_DBE, 0, NO_INSTANCE, NO_INSTANCE), (0, XID, 48, NO_INSTANCE, NO_INSTANCE)]
        self.nvml_lib.gpus[0].ecc_uncorrected = 1
        await soon(lambda: probe.stats.records == before + 4)
        if self.dcgm_answer is not None:
            self.dcgm_answer.write_text(DBE_ON_GPU0)
            await soon(lambda: probe.stats.records == before + 5)


@contextlib.asynccontextmanager
async def probing(host: Host, config: ProbeConfig, reporter: ReporterProtocol) -> AsyncIterator[Probe]:
    probe = Probe(config, reporter, sources=host.sources)
    task = asyncio.create_task(probe.run())
    try:
        yield probe
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def config(instance: str = "i-1", group: str = "g", **kwargs: object) -> ProbeConfig:
    return ProbeConfig.model_validate(
        {
            "instance_id": instance,
            "group": group,
            "heartbeat_interval": timedelta(hours=1),
            "poll_interval": timedelta(seconds=0.05),
            "retry_max_backoff": timedelta(seconds=1),
            **kwargs,
        }
    )


async def test_kernel_nvml_and_dcgm_copies_of_one_fault_are_one_finding_naming_all_three(tmp_path: Path) -> None:
    host = Host(tmp_path)
    reporter = FakeReporter()
    async with probing(host, config(), reporter) as probe:
        await soon(lambda: all(source.status.is_ok for source in host.sources))
        await host.double_bit_error(probe)
        await soon(lambda: len(reporter.findings) == 1)
        await asyncio.sleep(1.0)  # nothing else follows: no second finding, no roll-up of the copies
    (finding,) = reporter.findings
    assert (finding.reason, finding.impairs, finding.gpu.pci) == ("XID_48", True, GPU0)
    assert finding.source == f"kernel_log:{host.kernel_log}" and finding.count == 1
    assert finding.sources == [f"kernel_log:{host.kernel_log}", "nvml", "dcgm"]
    # The kernel's line, NVML's two events and its polled count, DCGM's failure: five records, one fault.
    assert (probe.stats.records, probe.stats.copies, probe.stats.suppressed) == (5, 4, 0)


async def test_one_gpu_source_holds_nothing_back(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_48)
    reporter = FakeReporter()
    # A window of a minute, and half of it to deliver: delivered at all means not held, however loaded the machine.
    window = timedelta(minutes=1)
    async with probing_sources([KernelLogFileSource(log, 0.05)], reporter, correlation_window=window) as probe:
        await soon(lambda: len(reporter.findings) == 1, timeout=30.0)
    assert reporter.findings[0].sources == [] and probe.stats.copies == 0


@contextlib.asynccontextmanager
async def probing_sources(sources: list[RecordSource], reporter: FakeReporter, **settings: Any) -> AsyncIterator[Probe]:
    probe = Probe(config(**settings), reporter, sources=sources)
    task = asyncio.create_task(probe.run())
    try:
        yield probe
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.timeout(180)
async def test_the_health_workflow_counts_the_fault_once(client: Client, aws_env: str, tmp_path: Path) -> None:
    """As an impairment (the ECS policy acts on Xid 48), and as a warning where the policy does not."""
    async with monitor_only(client, aws_env, tmp_path) as (settings, group):
        queue = settings.temporal.task_queue
        impaired, warned = unique("i"), unique("i")
        handles = {instance: await start_health(client, settings, instance) for instance in (impaired, warned)}
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        everywhere, no_dcgm = Host(tmp_path / "a"), Host(tmp_path / "b", dcgm=False)
        warned_config = config(warned, group, task_queue=queue, policy_config=PolicyConfig(remove_xids={48}))
        async with (
            probing(everywhere, config(impaired, group, task_queue=queue), Reporter(client)) as first,
            probing(no_dcgm, warned_config, Reporter(client)) as other,
        ):
            await soon(lambda: all(s.status.is_ok for s in [*everywhere.sources, *no_dcgm.sources]))
            await everywhere.double_bit_error(first)
            await no_dcgm.double_bit_error(other)
            await soon(lambda: first.stats.delivered >= 1 and other.stats.delivered >= 1, timeout=60)
            await asyncio.sleep(1.0)  # a copy sent on its own would have gone out by now
            for probe in (first, other):
                assert (probe.stats.delivered, probe.pending) == (1, 0), (probe.stats, probe.pending)
            view = await eventually(lambda: health_of(handles[impaired]), lambda v: bool(v.recent_findings))
            quiet = await eventually(lambda: health_of(handles[warned]), lambda v: bool(v.recent_findings))
    (finding,) = view.recent_findings
    assert finding.reason == "XID_48" and len(finding.sources) == 3
    detail = next(d for d in view.healthStatus.details if d.type is CheckType.ACCELERATED_COMPUTE)
    # Without correlation NVML's double-bit event and its count would each be counted here as a warning.
    assert detail.statusReason == "XID_48" and view.warning_counts == {}
    (warning,) = quiet.recent_findings
    assert not warning.impairs and warning.sources == [f"kernel_log:{no_dcgm.kernel_log}", "nvml"]
    assert quiet.warning_counts == {f"{GPU0}/XID_48": 1}
    assert check(quiet, CheckType.ACCELERATED_COMPUTE) is not HealthState.IMPAIRED
