"""What the probe sends for a log: each record's verdict, then burst collapse, then a roll-up per burst.

The probe (probe.py, `Probe._consume_once` and `_enqueue_rollups`) applies, per record, the policy's verdict,
then `BurstCollapser.offer` keyed by `findings.dedupe_key` (daemon transitions never collapse), turns the first
record of a burst into a finding with `make_finding`, and a closed burst's count into one `burst_rollup` finding.
`Collapse` is that step, with the same pieces, and `sent_findings` runs it over a whole log as the probe does when
it reads a log's history at start-up: every record at one `now`, so a burst's window never closes before the end.

A storm is hundreds of thousands of records that differ only in where they are. The parser hands them over as runs
(kernel_log.parse_runs), and a run whose verdict is the same for each of its records (no repeat rule counts them,
see Policy.same_verdict_for_repeats) is classified once and offered as `BurstCollapser.offer_run`, which is what
offering each record in turn at one `now` does. The findings are the same; tests/test_collapse.py holds the run path
against the per-record one and against the real Probe.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from typing import Generic, NamedTuple, TypeVar

from contract.probe import STATE_TRANSITION_KINDS, GpuFinding
from node_probe.classify.dedupe import DEFAULT_MAX_KEYS, BurstCollapser
from node_probe.classify.findings import DedupeKey, burst_rollup, dedupe_key, make_finding, record_position
from node_probe.classify.kernel_log import parse_runs
from node_probe.classify.policy import Policy, Verdict
from node_probe.classify.record import FaultRecord

T = TypeVar("T")

# Daemon transitions are not a flood (one per episode, from the source itself), and folding "down" after "back up"
# into a burst would hide that it is down again: each goes out.
STATE_TRANSITIONS = STATE_TRANSITION_KINDS
# Who a log read outside the probe is about: findings need an instance and a group, and `classify` has neither.
CLASSIFY_SOURCE = "classify"
NO_INSTANCE = "-"


class Collapse(Generic[T]):
    """The probe's step between the policy and the spool; `T` is what a burst keeps of its first and last record."""

    def __init__(self, window: timedelta, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.bursts: BurstCollapser[DedupeKey, T] = BurstCollapser(window, max_keys)

    def opens(self, record: FaultRecord, verdict: Verdict, item: T, now: datetime) -> bool:
        """True when the record goes out now as a finding; False when it only counts in an open burst."""
        return record.kind in STATE_TRANSITIONS or self.bursts.offer(dedupe_key(record, verdict), item, now)

    def opens_run(self, first: FaultRecord, verdict: Verdict, items: tuple[T, T], count: int, now: datetime) -> bool:
        """`opens` for `count` records at `now` that share `first`'s verdict and key (`items`: what the burst keeps
        of the first and the last): True when the first goes out as a finding; the others only count."""
        if count == 1:
            return self.opens(first, verdict, items[0], now)
        if first.kind in STATE_TRANSITIONS:
            raise ValueError("daemon transitions never collapse: offer them one by one")
        return self.bursts.offer_run(dedupe_key(first, verdict), items[0], items[1], count, now)


def collapsible(record: FaultRecord, policy: Policy) -> bool:
    """Whether a run of records like this one may be classified and offered at once."""
    return record.kind not in STATE_TRANSITIONS and policy.same_verdict_for_repeats(record)


class SentFinding(NamedTuple):
    """A finding the probe would send, and the input lines it stands for."""

    finding: GpuFinding
    line: int  # the record's line; a roll-up's: the last record it counts
    first_line: int | None = None  # a roll-up's: the burst's first record (which went out on its own)


_Kept = tuple[FaultRecord, Verdict]


def sent_findings(
    lines: Iterable[str],
    policy: Policy,
    now: datetime,
    window: timedelta,
    *,
    source: str = CLASSIFY_SOURCE,
    instance_id: str = NO_INSTANCE,
    group: str = NO_INSTANCE,
) -> Iterator[SentFinding]:
    """The findings the probe would send for a log it reads in one go: the first record of each burst as it comes,
    then a roll-up for each burst that suppressed records, counting them."""

    def finding(kept: _Kept) -> GpuFinding:
        record, verdict = kept
        return make_finding(record, verdict, instance_id=instance_id, group=group, source=source, observed_at=now)

    collapse: Collapse[_Kept] = Collapse(window)
    for run in parse_runs(lines, one_by_one=lambda record: not collapsible(record, policy)):
        first = run.first
        verdict = policy.classify(first, now, source=source, position=record_position(first))
        if collapse.opens_run(first, verdict, ((first, verdict), (run.last, verdict)), run.size, now):
            yield SentFinding(finding((first, verdict)), first.line)
    for burst in collapse.bursts.flush():
        rollup = burst_rollup(finding(burst.first), finding(burst.last), burst.suppressed, now)
        yield SentFinding(rollup, burst.last[0].line, burst.first[0].line)
