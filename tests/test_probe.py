"""The probe loop with a recording fake reporter: file following, heartbeats, burst roll-ups, outage spooling."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from contract.health import HealthState
from contract.probe import GpuFinding, Heartbeat
from node_probe import host
from node_probe import probe as probe_module
from node_probe.classify.kernel_log import parse_lines
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources.base import Observation, RecordSource, SourceStatus
from node_probe.sources.kmsg import KmsgSource
from node_probe.sources.log_file import KernelLogFileSource
from tests.test_spool import no_free_file_descriptors

XID_79 = "[ 1843.308145] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n"
XID_13 = "[ 1843.400000] NVRM: Xid (PCI:0000:17:00): 13, pid=77, name=train.py, Graphics SM Warp Exception\n"
XID_95 = (
    "[ 1900.000001] NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, "
    "Uncontained: FBHUB. RST: Yes, D-RST: No\n"
)
NOISE = "[ 1843.500000] usb 1-1: new high-speed USB device number 2 using xhci_hcd\n"


class FakeReporter:
    """Records what the probe sends; `failing` simulates an unreachable Temporal."""

    def __init__(self, failing: bool = False) -> None:
        self.findings: list[GpuFinding] = []
        self.heartbeats: list[Heartbeat] = []
        self.task_queues: set[str] = set()
        self.failing = failing
        self.attempts = 0

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None:
        self.attempts += 1
        if self.failing:
            raise ConnectionError("temporal unreachable")
        self.task_queues.add(task_queue)
        self.findings.append(finding)

    async def send_heartbeat(self, heartbeat: Heartbeat, task_queue: str) -> None:
        if self.failing:
            raise ConnectionError("temporal unreachable")
        self.heartbeats.append(heartbeat)


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(probe: Probe) -> AsyncIterator[Probe]:
    task = asyncio.create_task(probe.run())
    try:
        yield probe
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def run_until(probe: Probe, condition: Callable[[], bool]) -> None:
    async with running(probe):
        await eventually(condition)


def config(tmp_path: Path, **overrides: Any) -> ProbeConfig:
    values: dict[str, Any] = {
        "instance_id": "i-0abc",
        "group": "gpu-a",
        "kernel_log": tmp_path / "kern.log",
        "poll_interval": timedelta(seconds=0.02),
        "heartbeat_interval": timedelta(seconds=60),
        "retry_max_backoff": timedelta(seconds=0.05),
        "task_queue": "q-test",
    }
    values.update(overrides)
    return ProbeConfig(**values)


def append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


# --- file following ------------------------------------------------------------


async def collect(source: RecordSource, into: list[Observation]) -> None:
    async for observation in source.observations():
        into.append(observation)


@contextlib.asynccontextmanager
async def following(source: RecordSource) -> AsyncIterator[list[Observation]]:
    seen: list[Observation] = []
    task = asyncio.create_task(collect(source, seen))
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_file_follower_reads_history_then_appended_lines(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(NOISE + XID_79 + NOISE)
    source = KernelLogFileSource(log, poll_interval=0.02)
    async with following(source) as seen:
        await eventually(lambda: len(seen) == 1)
        assert source.status.is_ok
        append(log, NOISE + XID_13[:40])  # a line written in two pieces is one line
        await asyncio.sleep(0.1)
        assert len(seen) == 1
        append(log, XID_13[40:])
        await eventually(lambda: len(seen) == 2)
        append(log, XID_95)
        await eventually(lambda: len(seen) == 3)
    assert [(o.record.line, o.record.code) for o in seen] == [(2, 79), (5, 13), (6, 95)]
    assert seen[1].record.raw == XID_13.rstrip("\n")
    inode = os.stat(log).st_ino
    assert [o.position for o in seen] == [f"ino:{inode}:line:{n}" for n in (2, 5, 6)]
    assert {o.source for o in seen} == {f"kernel_log:{log}"}


async def test_file_follower_follows_rotation_and_truncation(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79)
    source = KernelLogFileSource(log, poll_interval=0.02)
    async with following(source) as seen:
        await eventually(lambda: len(seen) == 1)
        log.rename(tmp_path / "kern.log.1")
        log.write_text(XID_13)
        await eventually(lambda: len(seen) == 2)
        log.write_text("")  # copytruncate
        await asyncio.sleep(0.1)
        append(log, XID_95)
        await eventually(lambda: len(seen) == 3)
    assert [(o.record.line, o.record.code) for o in seen] == [(1, 79), (1, 13), (1, 95)]
    assert seen[0].position != seen[1].position  # same line number, other file: another id


async def test_file_follower_waits_for_a_missing_file(tmp_path: Path) -> None:
    log = tmp_path / "later.log"
    source = KernelLogFileSource(log, poll_interval=0.02)
    assert not source.check().is_ok
    async with following(source) as seen:
        await asyncio.sleep(0.1)
        assert source.status.state == HealthState.INSUFFICIENT_DATA
        assert str(log) in (source.status.reason or "")
        log.write_text(XID_79)
        await eventually(lambda: len(seen) == 1)
        assert source.status.is_ok


async def test_kmsg_source_reads_records_and_identifies_them_by_sequence(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(
        "6,1000,1843308145,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, An uncorrectable double "
        "bit error\n"
        " SUBSYSTEM=pci\n"
        " DEVICE=+pci:0000:3b:00.0\n"
        "6,1001,1843308146,-;usb 1-1: new high-speed USB device\n"
    )
    source = KmsgSource(kmsg, poll_interval=0.02)
    assert source.check().is_ok
    async with following(source) as seen:
        await eventually(lambda: len(seen) == 1)
        append(kmsg, "4,1002,1843308200,-;NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n")
        await eventually(lambda: len(seen) == 2)
    assert [(o.record.kind, o.position) for o in seen] == [
        ("xid", "seq:1000"),
        ("gpu_fallen_off_bus", "seq:1002"),
    ]


# --- the probe -----------------------------------------------------------------


async def test_probe_sends_heartbeat_at_once_and_findings_in_order(tmp_path: Path) -> None:
    (tmp_path / "kern.log").write_text(NOISE + XID_13 + XID_79)
    reporter = FakeReporter()
    probe = Probe(config(tmp_path), reporter)
    async with running(probe):
        await eventually(lambda: len(reporter.heartbeats) >= 1 and len(reporter.findings) == 2)
        append(tmp_path / "kern.log", XID_95)
        await eventually(lambda: len(reporter.findings) == 3)
    heartbeat = reporter.heartbeats[0]
    assert (heartbeat.instance_id, heartbeat.group, heartbeat.gpu_health) == (
        "i-0abc",
        "gpu-a",
        HealthState.OK,
    )
    assert [(f.reason, f.impairs, f.rule) for f in reporter.findings] == [
        ("XID_13", False, "ecs:not-in-xid-list"),
        ("XID_79", True, "ecs:xid-list"),
        ("XID_95", True, "ecs:xid-list"),
    ]
    first = reporter.findings[1]
    assert first.instance_id == "i-0abc" and first.group == "gpu-a" and first.kind == "xid" and first.code == 79
    assert first.gpu.pci == "0000:3b:00" and first.raw == XID_79.rstrip("\n") and first.count == 1
    assert first.source == f"kernel_log:{tmp_path / 'kern.log'}"
    assert reporter.task_queues == {"q-test"}


async def test_restarted_probe_resends_history_with_the_same_finding_ids(tmp_path: Path) -> None:
    (tmp_path / "kern.log").write_text(XID_13 + XID_79)
    ids = []
    for _ in range(2):
        reporter = FakeReporter()
        await run_until(Probe(config(tmp_path), reporter), lambda: len(reporter.findings) == 2)  # noqa: B023
        ids.append([f.finding_id for f in reporter.findings])
    assert ids[0] == ids[1]
    assert len(set(ids[0])) == 2


@pytest.mark.skipif(host.boot_time() is None, reason="no /proc/stat btime here")
async def test_a_kernel_log_spanning_reboots_impairs_only_on_this_boots_faults(tmp_path: Path) -> None:
    """kern.log keeps earlier boots: after a stop and start the instance runs on other hardware, so an Xid 79 from
    before this boot must not replace it."""
    booted = host.boot_time()
    assert booted is not None and booted < time.time()

    def stamped(at: float, line: str) -> str:
        return time.strftime("%b %e %H:%M:%S gpu-7 kernel: ", time.localtime(at)) + line.split("] ", 1)[1]

    earlier_boot = booted - 3 * 86400
    (tmp_path / "kern.log").write_text(stamped(earlier_boot, XID_79) + stamped(time.time(), XID_95))
    reporter = FakeReporter()
    await run_until(Probe(config(tmp_path), reporter), lambda: len(reporter.findings) == 2)
    assert [(f.reason, f.impairs, f.rule) for f in reporter.findings] == [
        ("XID_79", False, "history:previous-boot"),
        ("XID_95", True, "ecs:xid-list"),
    ]


async def test_heartbeat_says_insufficient_data_when_the_kernel_log_is_missing(tmp_path: Path) -> None:
    reporter = FakeReporter()
    probe = Probe(config(tmp_path, heartbeat_interval=timedelta(seconds=0.05)), reporter)
    async with running(probe):
        await eventually(lambda: len(reporter.heartbeats) >= 1)
        assert reporter.heartbeats[0].gpu_health == HealthState.INSUFFICIENT_DATA
        assert "kern.log" in (reporter.heartbeats[0].gpu_health_reason or "")
        (tmp_path / "kern.log").write_text(NOISE)
        await eventually(lambda: reporter.heartbeats[-1].gpu_health == HealthState.OK)
    assert reporter.heartbeats[-1].gpu_health_reason is None


class FailingOnceSource:
    """A GPU source with a bug: its first run raises, its second yields one Xid 79 and then waits, as a quiet
    source does."""

    name = "flaky"

    def __init__(self) -> None:
        self.runs = 0

    @property
    def status(self) -> SourceStatus:
        return SourceStatus.ok()

    def check(self) -> SourceStatus:
        return self.status

    async def observations(self) -> AsyncIterator[Observation]:
        self.runs += 1
        if self.runs == 1:
            raise RuntimeError("unexpected record shape")
        (record,) = parse_lines([XID_79])
        yield Observation(record, "flaky", "line:1")
        await asyncio.Event().wait()


async def test_a_failing_source_is_restarted_and_counts_as_down_meanwhile_and_heartbeats_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(probe_module, "SOURCE_RESTART_MAX_S", 0.5)
    (tmp_path / "kern.log").write_text(XID_13)
    flaky = FailingOnceSource()
    reporter = FakeReporter()
    sources: list[RecordSource] = [KernelLogFileSource(tmp_path / "kern.log", 0.02), flaky]
    probe = Probe(config(tmp_path, heartbeat_interval=timedelta(seconds=0.05)), reporter, sources=sources)
    async with running(probe):
        # The other source and the heartbeats carry on; the failed one is named while it is down.
        await eventually(lambda: any(f.reason == "XID_13" for f in reporter.findings))
        await eventually(
            lambda: any("flaky: failed (RuntimeError" in (h.gpu_health_reason or "") for h in reporter.heartbeats)
        )
        # Restarted, it delivers; once its new run has lasted the restart window, it counts as up again.
        await eventually(lambda: any(f.reason == "XID_79" for f in reporter.findings))
        await eventually(lambda: reporter.heartbeats[-1].gpu_health == HealthState.OK)
    assert flaky.runs == 2


async def test_probe_without_sources_reports_insufficient_data(tmp_path: Path) -> None:
    probe = Probe(config(tmp_path, kernel_log=None), FakeReporter())
    assert probe.heartbeat().gpu_health == HealthState.INSUFFICIENT_DATA


async def test_burst_is_one_finding_then_one_rollup_with_the_count(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("")
    reporter = FakeReporter()
    probe = Probe(config(tmp_path, dedupe_window=timedelta(seconds=0.5)), reporter)
    async with running(probe):
        append(log, XID_95 * 500 + XID_79)
        await eventually(lambda: len(reporter.findings) == 2)
        await asyncio.sleep(0.1)
        assert len(reporter.findings) == 2  # the 499 repeats wait for the window to close
        await eventually(lambda: len(reporter.findings) == 3)
    first, other, rollup = reporter.findings
    assert (first.reason, first.count, other.reason) == ("XID_95", 1, "XID_79")
    assert (rollup.reason, rollup.count, rollup.impairs) == ("XID_95", 499, True)
    assert rollup.finding_id not in {first.finding_id, other.finding_id}
    assert probe.stats.records == 501 and probe.stats.suppressed == 499


async def test_repeat_rule_impair_is_not_swallowed_by_the_warning_burst(tmp_path: Path) -> None:
    from node_probe.classify.policy import PolicyConfig, RepeatRule

    log = tmp_path / "kern.log"
    log.write_text("")
    rule = RepeatRule(code=13, count=3, within=timedelta(minutes=10))
    reporter = FakeReporter()
    probe = Probe(config(tmp_path, policy_config=PolicyConfig(repeat=[rule])), reporter)
    async with running(probe):
        append(log, "NVRM: Xid (PCI:0000:17:00): 13, pid=77, name=train.py, Graphics SM Warp Exception\n" * 3)
        await eventually(lambda: len(reporter.findings) == 2)
    assert [(f.impairs, f.rule) for f in reporter.findings] == [
        (False, "ecs:not-in-xid-list"),
        (True, "override:repeat xid13 3/600s"),
    ]


async def test_findings_wait_out_an_outage_and_arrive_in_order(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_13 + XID_79)
    reporter = FakeReporter(failing=True)
    probe = Probe(config(tmp_path, spool_dir=tmp_path / "spool"), reporter)
    async with running(probe):
        await eventually(lambda: probe.pending == 2 and reporter.attempts >= 3)
        append(log, XID_95)
        await eventually(lambda: probe.pending == 3)
        reporter.failing = False
        await eventually(lambda: len(reporter.findings) == 3)
        assert probe.pending == 0
    assert [f.reason for f in reporter.findings] == ["XID_13", "XID_79", "XID_95"]
    assert probe.stats.delivery_failures >= 3


async def test_spooled_findings_survive_a_probe_restart(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79)
    spool = tmp_path / "spool"
    down = FakeReporter(failing=True)
    probe = Probe(config(tmp_path, spool_dir=spool), down)
    async with running(probe):
        await eventually(lambda: probe.pending == 1)
    log.write_text("")  # the history is gone: only the spool can deliver it now
    up = FakeReporter()
    restarted = Probe(config(tmp_path, spool_dir=spool), up)
    assert restarted.pending == 1
    async with running(restarted):
        await eventually(lambda: len(up.findings) == 1)
    assert up.findings[0].reason == "XID_79"
    assert restarted.pending == 0


async def test_a_spool_that_cannot_be_read_for_a_moment_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79)
    spool = tmp_path / "spool"
    down = FakeReporter(failing=True)
    async with running(probe := Probe(config(tmp_path, spool_dir=spool), down)):
        await eventually(lambda: probe.pending == 1)
    up = FakeReporter()
    restarted = Probe(config(tmp_path, spool_dir=spool), up)
    peeks = 0
    real_peek = restarted._spool.peek

    def first_peek_with_a_full_fd_table() -> GpuFinding | None:
        nonlocal peeks
        peeks += 1
        if peeks > 1:
            return real_peek()
        with no_free_file_descriptors():
            return real_peek()

    monkeypatch.setattr(restarted._spool, "peek", first_peek_with_a_full_fd_table)
    async with running(restarted):
        await eventually(lambda: len(up.findings) == 1)
    assert peeks >= 2 and up.findings[0].reason == "XID_79"


def test_probe_config_rejects_an_unknown_policy(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        config(tmp_path, policy="eks")
