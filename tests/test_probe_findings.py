"""Findings, burst collapse and the reporter's signal-with-start call (the spool: test_spool.py)."""

from __future__ import annotations

import tracemalloc
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio.common import WorkflowIDConflictPolicy

from contract.health import HealthInput, HealthState
from contract.probe import GpuFinding, Heartbeat
from node_probe.classify.dedupe import BurstCollapser
from node_probe.classify.findings import burst_rollup, dedupe_key, finding_id, make_finding
from node_probe.classify.kernel_log import KernelLogParser, parse_lines
from node_probe.classify.policy import Policy, Verdict
from node_probe.classify.record import FaultRecord
from node_probe.delivery.reporter import Reporter

NOW = datetime(2025, 1, 21, 4, 41, 44, tzinfo=UTC)
XID_95 = (
    "[ 1900.000001] NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, "
    "Uncontained: FBHUB. RST: Yes, D-RST: No"
)


def finding(record: FaultRecord, **overrides: Any) -> GpuFinding:
    values: dict[str, Any] = {
        "instance_id": "i-1",
        "group": "g",
        "source": "kernel_log:/var/log/kern.log",
        "observed_at": NOW,
    }
    values.update(overrides)
    return make_finding(record, Policy().classify(record, NOW), **values)


def test_finding_fields_and_stable_ids() -> None:
    lines = ["NVRM: Xid (PCI:0000:3b:00 GPU-I:02 GPU-CI:01): 79, pid=1, name=x, GPU has fallen off the bus."]
    (record,) = parse_lines(lines)
    first = finding(record)
    again = finding(next(iter(parse_lines(lines))), observed_at=NOW + timedelta(hours=1))
    assert first.finding_id == again.finding_id
    assert (first.kind, first.code, first.reason, first.impairs, first.rule) == (
        "xid",
        79,
        "XID_79",
        True,
        "ecs:xid-list",
    )
    assert (first.gpu.pci, first.gpu.mig_gpu_instance, first.gpu.mig_compute_instance) == ("0000:3b:00", 2, 1)
    assert first.message == "GPU has fallen off the bus." and first.raw == lines[0] and first.count == 1
    assert first.observed_at == NOW
    # Another place in the log, or another source, is another finding even with the same text.
    assert finding(record._replace(line=2)).finding_id != first.finding_id
    assert finding(record, source="kmsg").finding_id != first.finding_id
    assert finding(record, position="ino:7:line:1").finding_id != first.finding_id
    assert finding_id("kmsg", "seq:5", "x") == finding_id("kmsg", "seq:5", "x")


def test_kmsg_findings_are_identified_by_sequence_not_line() -> None:
    (a,) = parse_lines(["6,500,1000,-;NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."])
    assert finding(a).finding_id == finding(a._replace(line=99)).finding_id


def test_huge_lines_are_clipped_in_findings() -> None:
    (record,) = parse_lines(["NVRM: Xid (PCI:0000:3b:00): 13, " + "x" * 100_000])
    clipped = finding(record)
    assert len(clipped.raw) <= 4096 and len(clipped.message) <= 1024


def test_burst_collapser_counts_within_the_window_and_reopens_after() -> None:
    bursts: BurstCollapser[str, int] = BurstCollapser(timedelta(minutes=5))
    assert bursts.offer("a", 1, NOW)
    assert not bursts.offer("a", 2, NOW + timedelta(minutes=1))
    assert not bursts.offer("a", 3, NOW + timedelta(minutes=2))
    assert bursts.offer("b", 10, NOW + timedelta(minutes=2))
    assert bursts.expire(NOW + timedelta(minutes=4)) == []
    (closed,) = bursts.expire(NOW + timedelta(minutes=5))
    assert (closed.first, closed.last, closed.count, closed.suppressed) == (1, 3, 3, 2)
    assert bursts.expire(NOW + timedelta(minutes=8)) == []  # "b" had no repeats: nothing to roll up
    assert bursts.offer("a", 4, NOW + timedelta(minutes=9))
    assert len(bursts) == 1


def test_burst_reopening_on_offer_reports_the_closed_one() -> None:
    bursts: BurstCollapser[str, int] = BurstCollapser(timedelta(seconds=10))
    bursts.offer("a", 1, NOW)
    bursts.offer("a", 2, NOW)
    assert bursts.offer("a", 3, NOW + timedelta(seconds=11))
    (closed,) = bursts.expire(NOW + timedelta(seconds=12))
    assert closed.count == 2
    assert [b.count for b in bursts.flush()] == []


def test_burst_collapser_is_bounded_in_keys() -> None:
    bursts: BurstCollapser[int, int] = BurstCollapser(timedelta(hours=1), max_keys=100)
    for key in range(10_000):
        bursts.offer(key, key, NOW)
        bursts.offer(key, key, NOW)
    assert len(bursts) == 100
    assert len(bursts.flush()) <= 200


def test_offering_a_run_is_offering_each_item_in_turn() -> None:
    for opened_before in (False, True):
        one: BurstCollapser[str, int] = BurstCollapser(timedelta(minutes=5))
        run: BurstCollapser[str, int] = BurstCollapser(timedelta(minutes=5))
        if opened_before:
            one.offer("a", 0, NOW)
            run.offer("a", 0, NOW)
        opened = [one.offer("a", item, NOW + timedelta(minutes=1)) for item in range(1, 6)]
        assert run.offer_run("a", 1, 5, 5, NOW + timedelta(minutes=1)) == opened[0]
        assert [(b.first, b.last, b.count) for b in run.flush()] == [(b.first, b.last, b.count) for b in one.flush()]


def test_a_run_needs_a_window() -> None:
    with pytest.raises(ValueError, match="window"):
        BurstCollapser[str, int](timedelta(0)).offer_run("a", 1, 2, 2, NOW)


def test_a_burst_closes_exactly_at_its_window_end_even_next_to_the_calendars_end() -> None:
    bursts: BurstCollapser[str, int] = BurstCollapser(timedelta(seconds=10))
    bursts.offer("a", 1, NOW)
    assert not bursts.offer("a", 2, NOW + timedelta(seconds=9, microseconds=999_999))
    assert bursts.offer("a", 3, NOW + timedelta(seconds=10))
    late = datetime.max.replace(tzinfo=UTC) - timedelta(seconds=1)
    assert bursts.offer("b", 1, late) and not bursts.offer("b", 2, late)  # no close time there: subtraction instead


def test_flood_of_800k_identical_xid95_lines_is_one_burst_with_flat_memory() -> None:
    parser = KernelLogParser()
    policy = Policy()
    bursts: BurstCollapser[Any, FaultRecord] = BurstCollapser(timedelta(minutes=5))
    emitted = 0

    def feed(count: int) -> None:
        nonlocal emitted
        for _ in range(count):
            for record in parser.feed(XID_95):
                verdict = policy.classify(record, NOW)
                emitted += bursts.offer(dedupe_key(record, verdict), record, NOW)

    feed(10_000)  # warm up caches before measuring
    tracemalloc.start()
    try:
        feed(50_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    feed(800_000 - 60_000)
    assert peak < 256 * 1024
    assert emitted == 1
    (burst,) = bursts.flush()
    assert burst.count == 800_000
    assert burst.last.line == 800_000


def test_burst_rollup_carries_the_suppressed_count() -> None:
    records = list(parse_lines([XID_95] * 3))
    first, last = finding(records[0]), finding(records[2])
    rollup = burst_rollup(first, last, suppressed=2, observed_at=NOW + timedelta(minutes=5))
    assert (rollup.count, rollup.reason, rollup.impairs, rollup.raw) == (2, "XID_95", True, last.raw)
    assert rollup.finding_id not in (first.finding_id, last.finding_id)
    assert rollup.finding_id == burst_rollup(first, last, 2, NOW).finding_id


def test_dedupe_key_separates_gpus_mig_instances_and_impairing() -> None:
    a, b, c = parse_lines(
        [
            "NVRM: Xid (PCI:0000:3b:00 GPU-I:01): 13, x",
            "NVRM: Xid (PCI:0000:3b:00 GPU-I:02): 13, x",
            "NVRM: Xid (PCI:0000:5e:00): 13, x",
        ]
    )
    warn, impair = Verdict(False, "XID_13", "r"), Verdict(True, "XID_13", "r")
    keys = {dedupe_key(a, warn), dedupe_key(b, warn), dedupe_key(c, warn), dedupe_key(a, impair)}
    assert len(keys) == 4


# --- reporter -----------------------------------------------------------------------------------------------


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    async def start_workflow(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


async def test_reporter_signals_with_start_to_the_health_workflow() -> None:
    client = FakeClient()
    reporter = Reporter(client)  # type: ignore[arg-type]
    (record,) = parse_lines([XID_95])
    gpu_finding = finding(record, instance_id="i-0abc", group="gpu-a")
    heartbeat = Heartbeat(instance_id="i-0abc", group="gpu-a", sent_at=NOW, gpu_health=HealthState.OK)
    await reporter.send_finding(gpu_finding, "q1")
    await reporter.send_heartbeat(heartbeat, "q1")
    (args, kwargs), (_, hb_kwargs) = client.calls
    assert args == ("InstanceHealthWorkflow", HealthInput(instance_id="i-0abc", group="gpu-a"))
    assert kwargs["id"] == "health/i-0abc"
    assert kwargs["task_queue"] == "q1"
    assert kwargs["id_conflict_policy"] == WorkflowIDConflictPolicy.USE_EXISTING
    assert (kwargs["start_signal"], kwargs["start_signal_args"]) == ("gpu_finding", [gpu_finding])
    assert (hb_kwargs["start_signal"], hb_kwargs["start_signal_args"]) == ("heartbeat", [heartbeat])
    assert hb_kwargs["id"] == "health/i-0abc"
