"""What the probe would send for a log: the parser's runs, the run path of the collapse against the per-record path,
and both against the real Probe reading the same log."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from contract.probe import GpuFinding
from node_probe.classify import kernel_log
from node_probe.classify.collapse import CLASSIFY_SOURCE, Collapse, SentFinding, sent_findings
from node_probe.classify.findings import burst_rollup, make_finding, record_position
from node_probe.classify.kernel_log import KernelLogParser, parse_lines, parse_runs
from node_probe.classify.policy import Policy, PolicyConfig, RepeatRule, Verdict
from node_probe.classify.record import FaultRecord
from node_probe.probe import Probe
from tests.test_probe import FakeReporter, config, eventually, running

NOW = datetime(2025, 6, 1, tzinfo=UTC)
WINDOW = timedelta(minutes=5)
UUID = "GPU-8a2c6ec4-0e1b-7b33-5cdf-3a6d9c3a6b1f"
OTHER_UUID = "GPU-1d2e3f40-5a6b-7c8d-9e0f-a1b2c3d4e5f6"
BANNER = [
    "NVRM: The NVIDIA GPU 0000:b3:00.0",
    "NVRM: (PCI ID: 10de:26b5) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
]
BODIES = [
    "NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. RST: Yes, D-RST: No",
    "NVRM: Xid (PCI:0000:3b:00): 13, pid=77, name=train.py, Graphics Exception",
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:17:00): 45, pid=9, name=x, Ch 00000010, caused by previous Xid 79",
    "nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
    "NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
]
PREFIXES = [
    lambda n: f"[{1000 + n / 1000:12.6f}] ",
    lambda n: f"6,{n},{n * 1000},-;",
    lambda n: f"Jun  1 00:{n // 60 % 60:02d}:{n % 60:02d} host kernel: ",
    lambda n: "",
    lambda n: f"kern  :err   : 2025-06-01T00:00:{n % 60:02d},{n:06d}+00:00 ",
]


def storm_log(seed: int, lines: int = 3000, prefixes: list[Any] = PREFIXES) -> list[str]:
    """A log of storms (runs of one body behind changing stamps) broken up by everything that must end a run or
    must not: noise, NVRM lines that are no record, a GPU named again, the driver reloading, banners (whole, cut,
    escaped), an application quoting the storm's body, CRLF, indentation."""
    rng = random.Random(seed)
    out: list[str] = []
    n = 0
    while len(out) < lines:
        n += 1
        prefix = rng.choice(prefixes)
        roll = rng.random()
        if roll < 0.55:
            body = rng.choice(BODIES)
            out += [prefix(n + i) + body for i in range(rng.randrange(1, 60))]
        elif roll < 0.65:
            out.append(prefix(n) + "usb 1-1: new high-speed USB device number 2 using xhci_hcd")
        elif roll < 0.70:
            out.append(prefix(n) + "NVRM: GPU Board Serial Number: 1653723052734")
        elif roll < 0.75:
            uuid = rng.choice([UUID, OTHER_UUID])
            out.append(prefix(n) + f"NVRM: GPU at PCI:0000:{rng.choice(['3b', 'c1'])}:00: {uuid}")
        elif roll < 0.78:
            out.append(prefix(n) + "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15")
        elif roll < 0.82:
            out += [prefix(n) + piece for piece in BANNER[: rng.randrange(1, 4)]]
        elif roll < 0.85:
            out.append(f"3,{n},{n * 1000},-;" + "\\x0a".join(BANNER))
        elif roll < 0.90:
            out.append(f"Jun  1 00:00:{n % 60:02d} host app[12]: " + rng.choice(BODIES))
        elif roll < 0.95:
            out.append(prefix(n) + rng.choice(BODIES) + "\r\n")
        else:
            out.append("               " + rng.choice(BODIES))
    return out


def content(record: FaultRecord) -> tuple[Any, ...]:
    """A record but for where it is."""
    return record._replace(line=0, raw="", kmsg_seq=None, uptime_s=None, wall_s=None)


def repeats_counted(policy: Policy) -> Any:
    return lambda record: not policy.same_verdict_for_repeats(record)


@pytest.mark.parametrize("seed", range(6))
def test_runs_are_exactly_the_records_in_a_row(seed: int) -> None:
    lines = storm_log(seed)
    expected = list(parse_lines(lines))
    runs = list(parse_runs(lines))
    assert sum(run.size for run in runs) == len(expected)
    assert len(runs) < len(expected) / 3  # storms come as runs, not record by record
    at = 0
    for run in runs:
        assert run.first == expected[at]
        assert run.last == expected[at + run.size - 1]
        assert {content(record) for record in expected[at : at + run.size]} == {content(run.first)}
        at += run.size


def test_records_a_policy_counts_one_by_one_never_form_a_run() -> None:
    lines = storm_log(1)
    policy = Policy(config=PolicyConfig(repeat=[RepeatRule(code=13, count=3, within=timedelta(minutes=10))]))
    runs = list(parse_runs(lines, one_by_one=repeats_counted(policy)))
    assert all(run.size == 1 for run in runs if run.first.code == 13)
    assert any(run.size > 1 for run in runs if run.first.code == 95)
    assert [run.first for run in runs if run.first.code == 13] == [r for r in parse_lines(lines) if r.code == 13]


def test_a_storm_is_one_run_and_the_parser_builds_its_first_and_last_records_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = [f"[{1900 + n / 1e5:12.6f}] {BODIES[0]}\n" for n in range(10_000)]
    expected = list(parse_lines(lines))
    built: list[int] = []
    place = kernel_log._place

    def counted(*args: Any) -> FaultRecord:
        built.append(args[1])
        return place(*args)

    monkeypatch.setattr(kernel_log, "_place", counted)
    ((first, size, last),) = parse_runs(lines)
    assert (first, size, last) == (expected[0], 10_000, expected[-1])
    assert last.uptime_s == 1900.09999 and built == [1, 10_000]
    parser = KernelLogParser()
    assert len(parser.feed(lines[0])) == 1
    assert parser.take_repeats(iter(lines[1:])) == (9_999, None)
    assert parser.last_repeat() == expected[-1] and parser.lines_seen == 10_000


def test_a_line_that_does_not_repeat_is_handed_back_untouched() -> None:
    parser = KernelLogParser()
    parser.feed("[ 1.000000] " + BODIES[0])
    for other in ("[ 2.000000] " + BODIES[1], "app[1]: " + BODIES[0], "[ 2.5] usb 1-1: hello", BANNER[0]):
        assert parser.take_repeats(iter([other, "[ 3.000000] " + BODIES[0]])) == (0, other)
    assert parser.take_repeats(iter([])) == (0, None)
    assert parser.lines_seen == 1 and parser.last_repeat() is None
    parser.feed(BANNER[0])  # a banner pending: nothing repeats until it completes or is dropped
    assert parser.take_repeats(iter(["[ 4.000000] " + BODIES[0]])) == (0, "[ 4.000000] " + BODIES[0])


def reference(lines: list[str], policy: Policy) -> list[SentFinding]:
    """The probe's per-record step (Probe._consume_once, _enqueue_rollups at the end) over the whole log."""
    collapse: Collapse[tuple[FaultRecord, Verdict]] = Collapse(WINDOW)

    def finding(kept: tuple[FaultRecord, Verdict]) -> GpuFinding:
        return make_finding(kept[0], kept[1], instance_id="-", group="-", source=CLASSIFY_SOURCE, observed_at=NOW)

    sent = []
    for record in parse_lines(lines):
        verdict = policy.classify(record, NOW, source=CLASSIFY_SOURCE, position=record_position(record))
        if collapse.opens(record, verdict, (record, verdict), NOW):
            sent.append(SentFinding(finding((record, verdict)), record.line))
    for burst in collapse.bursts.flush():
        rollup = burst_rollup(finding(burst.first), finding(burst.last), burst.suppressed, NOW)
        sent.append(SentFinding(rollup, burst.last[0].line, burst.first[0].line))
    return sent


POLICIES = {
    "ecs": lambda: Policy(),
    "nvidia-catalog": lambda: Policy("nvidia-catalog"),
    "repeat-rules": lambda: Policy(
        config=PolicyConfig(
            add_xids={13},
            add_sxids={20034},
            repeat=[
                RepeatRule(code=13, count=3, within=timedelta(minutes=10)),
                RepeatRule(kind="sxid", code=20034, count=2, within=timedelta(seconds=30)),
            ],
        )
    ),
}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(4))
def test_the_run_path_sends_what_the_per_record_path_sends(seed: int, policy: str) -> None:
    lines = storm_log(seed)
    runs = list(sent_findings(lines, POLICIES[policy](), NOW, WINDOW))
    assert runs == reference(lines, POLICIES[policy]())
    assert any(sent.finding.count > 50 for sent in runs)


def comparable(finding: GpuFinding) -> tuple[Any, ...]:
    """What a finding says, but for who sent it, from where and when (the ids follow from the source)."""
    return (
        finding.kind,
        finding.code,
        finding.reason,
        finding.impairs,
        finding.rule,
        finding.gpu,
        finding.message,
        finding.raw,
        finding.count,
    )


async def test_classify_collapse_sends_what_the_real_probe_sends(tmp_path: Path) -> None:
    """The real Probe reading the log at start-up, its clock stopped so that every record falls in one window, then
    moved on so that the bursts close and their roll-ups go out. Uptime stamps only: the probe's policy knows this
    host's boot time, and a syslog stamp from another day would be another boot's history."""
    lines = storm_log(3, 2000, prefixes=PREFIXES[:2] + PREFIXES[3:4])
    (tmp_path / "kern.log").write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines))
    expected = list(sent_findings(lines, Policy(), NOW, WINDOW))
    records = sum(1 for _ in parse_lines(lines))
    clock = [NOW]
    reporter = FakeReporter()
    probe = Probe(config(tmp_path, dedupe_window=timedelta(seconds=1)), reporter, clock=lambda: clock[0])
    async with running(probe):
        await eventually(lambda: probe.stats.records == records)
        clock[0] = NOW + timedelta(minutes=1)
        await eventually(lambda: len(reporter.findings) == len(expected))
    assert [comparable(f) for f in reporter.findings] == [comparable(s.finding) for s in expected]


def test_a_burst_from_the_first_line_to_the_last_is_one_finding_and_one_rollup() -> None:
    lines = [f"[{1900 + n / 1e5:12.6f}] {BODIES[0]}" for n in range(5000)]
    first, rollup = sent_findings(lines, Policy(), NOW, WINDOW)
    assert (first.line, first.first_line, first.finding.count, first.finding.impairs) == (1, None, 1, True)
    assert (rollup.line, rollup.first_line, rollup.finding.count) == (5000, 1, 4999)
    assert rollup.finding.raw == lines[-1]


def test_a_zero_window_cannot_take_runs() -> None:
    with pytest.raises(ValueError, match="window"):
        list(sent_findings([BODIES[0]] * 3, Policy(), NOW, timedelta(0)))
