"""The node probe: follow GPU fault sources, classify, collapse bursts, deliver findings at once, heartbeat.

Runs on real hosts (kernel log / kmsg / journald) and in the demo, where each simulated instance follows a
kernel-log file that the fault injector appends real-format lines to. Pipeline per record:
    source -> policy verdict -> burst collapse -> spool (durable when a spool dir is set) -> reporter
Heartbeats run on their own timer and never wait behind findings.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, field_validator

from contract.health import HealthState
from contract.probe import MAX_FINDING_SOURCES, STATE_TRANSITION_KINDS, GpuFinding, Heartbeat, ProbeSourceHealth
from node_probe import host
from node_probe.classify.context import RecentLines
from node_probe.classify.correlate import Correlator, FaultKey, Release, fault_key
from node_probe.classify.dedupe import Burst, BurstCollapser
from node_probe.classify.findings import DedupeKey, burst_rollup, dedupe_key, make_finding, stating
from node_probe.classify.policy import POLICY_NAMES, Policy, PolicyConfig, RepeatMemory, Verdict
from node_probe.classify.verdicts import statement
from node_probe.delivery.cursor import CursorStore, FileCursor, KmsgCursor, cursor_path, open_cursor
from node_probe.delivery.spool import DEFAULT_MAX_BYTES, open_spool
from node_probe.sources.base import Observation, RecordSource
from node_probe.sources.container_runtime import ContainerRuntimeSource, RuntimeSpec
from node_probe.sources.daemons import DaemonSource, DaemonSpec
from node_probe.sources.dcgm_bindings import (
    DEFAULT_THERMAL_LIMIT_C,
    MAX_POWER_LIMIT_W,
    MAX_THERMAL_LIMIT_C,
    MIN_POWER_LIMIT_W,
    MIN_THERMAL_LIMIT_C,
    dcgm_source,
)
from node_probe.sources.journald import JournalCursor, JournaldSource
from node_probe.sources.kmsg import KMSG_PATH, KmsgSource
from node_probe.sources.log_file import KernelLogFileSource
from node_probe.sources.nvml import NvmlSource

if TYPE_CHECKING:
    # Only named here: ingest_reporter loads botocore and boto3, reporter loads temporalio (tens of MiB between
    # them), and a probe needs only the one its delivery uses (node_probe/cli.py imports that one).
    from node_probe.delivery.ingest_reporter import IngestRefused
    from node_probe.delivery.reporter import ReporterProtocol

log = logging.getLogger(__name__)

DEFAULT_TASK_QUEUE = "gpu-autorepair"
# A source that fails (an error it did not expect, a bug) is restarted after a pause that doubles up to this. It
# counts as down until its new run has lasted this long: a source failing on every restart is down, not flapping.
SOURCE_RESTART_MAX_S = 60.0
_STATE_TRANSITIONS = STATE_TRANSITION_KINDS


class ProbeConfig(BaseModel):
    instance_id: str = Field(min_length=1)
    group: str = Field(min_length=1)
    kernel_log: Path | None = None  # followed like tail -F: existing history first, then new lines
    kmsg: bool = False  # follow /dev/kmsg (the ring buffer's history first)
    kmsg_path: Path = KMSG_PATH  # a file in kmsg format stands in for the device in tests and replays
    journald: bool = False  # follow the journal's kernel entries (journalctl -k), this boot's history first
    nvml: bool = False  # NVML events and polled state (the CLI turns it on where NVML initialises)
    nvml_poll_interval: timedelta = timedelta(seconds=60)
    dcgm: bool = False  # health watches (and policy violations with DCGM's bindings; else `dcgmi health -c -j`)
    dcgm_poll_interval: timedelta = timedelta(seconds=60)
    # DCGM's policy limits (with its bindings; dcgmi has no policies). Power None: the GPUs' own enforced limit, read
    # through NVML where the probe uses NVML, else power is not watched (sources/dcgm_bindings.py says why).
    dcgm_thermal_limit_c: int = Field(default=DEFAULT_THERMAL_LIMIT_C, ge=MIN_THERMAL_LIMIT_C, le=MAX_THERMAL_LIMIT_C)
    dcgm_power_limit_w: int | None = Field(default=None, ge=MIN_POWER_LIMIT_W, le=MAX_POWER_LIMIT_W)
    daemons: list[DaemonSpec] = Field(default_factory=list)  # systemd units; a DAEMON finding when one stays down
    daemon_down_threshold: timedelta = timedelta(seconds=60)  # the container runtimes' threshold too
    # docker/containerd: a CONTAINER_RUNTIME finding when one stays down or its API stays silent
    container_runtimes: list[RuntimeSpec] = Field(default_factory=list)
    policy: str = "ecs"
    policy_config: PolicyConfig = Field(default_factory=PolicyConfig)
    heartbeat_interval: timedelta = timedelta(seconds=60)
    poll_interval: timedelta = timedelta(seconds=0.5)
    dedupe_window: timedelta = timedelta(minutes=5)
    # Copies of one fault from several GPU sources within this become one finding (classify/correlate.py); zero:
    # each source's copy is a finding of its own. Later copies within the dedupe window are folded, not sent.
    correlation_window: timedelta = Field(default=timedelta(seconds=3), ge=timedelta(0), le=timedelta(minutes=1))
    task_queue: str = DEFAULT_TASK_QUEUE
    # None: findings wait in memory only (bounded), lost if the probe dies. With a dir, the log sources also keep
    # their read cursors there, so a restart resumes instead of re-reading the history, and the repeat rules keep
    # their recent matches there (this boot's), so a restart does not reset their counts.
    spool_dir: Path | None = None
    spool_max_bytes: int = Field(default=DEFAULT_MAX_BYTES, gt=0)
    retry_max_backoff: timedelta = timedelta(seconds=30)
    # This host's boot id, as /proc/sys/kernel/random/boot_id says; given only where one process plays many hosts
    # (the simulated fleet), each with boots of its own.
    boot_id: str | None = None

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICY_NAMES:
            raise ValueError(f"unknown policy {value!r} (choose from {', '.join(POLICY_NAMES)})")
        return value


@dataclass(slots=True)
class ProbeStats:
    """Counted where each thing happens, never polled: node_probe/metrics.py reads them when Prometheus scrapes."""

    records: int = 0
    suppressed: int = 0  # records folded into a burst
    copies: int = 0  # records that were another source's copy of a fault (classify/correlate.py)
    delivered: int = 0
    dropped: int = 0  # warnings dropped because the spool was full
    heartbeats_sent: int = 0
    heartbeat_failures: int = 0
    findings: Counter[tuple[str, str]] = field(default_factory=Counter)  # made, by (reason, kind)
    failures_by: Counter[str] = field(default_factory=Counter)  # delivery failures, by why (`failure_why`)

    @property
    def delivery_failures(self) -> int:
        """Tries to deliver a finding that failed (each is retried)."""
        return self.failures_by.total()


@dataclass(slots=True)
class DeliveryState:
    """How delivery goes, for the health endpoint (node_probe/health.py): time.monotonic() times, None for never."""

    running_since: float | None = None  # run() began; None once it ended
    heartbeat_at: float | None = None  # the last heartbeat delivered
    heartbeat_error: str | None = None  # why the last one was not; None once one is
    findings_failing_since: float | None = None  # the first failure since a finding was last delivered
    finding_error: str | None = None


@dataclass(slots=True)
class _SourceFailure:
    reason: str
    restarted_at: float | None = None  # time.monotonic() of the restart; None while it waits for it


@dataclass(frozen=True, slots=True)
class _Seen:
    observation: Observation
    verdict: Verdict
    at: datetime


def build_sources(config: ProbeConfig, spooled: Callable[[], bool] = lambda: True) -> list[RecordSource]:
    """`spooled`: whether every finding so far is on disk in the spool (the read cursors wait for it)."""
    poll = config.poll_interval.total_seconds()
    sources: list[RecordSource] = []
    if config.kernel_log is not None:
        # Resume points are kept only beside a file spool: what they skip must have been spooled durably.
        file_cursor = open_cursor(config.spool_dir, config.instance_id, "kernel_log", FileCursor, spooled)
        sources.append(KernelLogFileSource(config.kernel_log, poll, file_cursor))
    if config.kmsg:
        kmsg_cursor = open_cursor(config.spool_dir, config.instance_id, "kmsg", KmsgCursor, spooled)
        sources.append(KmsgSource(config.kmsg_path, poll, kmsg_cursor))
    if config.journald:
        journal_cursor = open_cursor(config.spool_dir, config.instance_id, "journald", JournalCursor, spooled)
        sources.append(JournaldSource(poll, journal_cursor))
    nvml: NvmlSource | None = None
    if config.nvml:
        nvml = NvmlSource(poll_interval=config.nvml_poll_interval.total_seconds())
        sources.append(nvml)
    if config.dcgm:
        # DCGM names GPUs by index; NVML, when on, turns that into the PCI address and UUID.
        lookup = nvml.gpu_identity if nvml is not None else None
        # DCGM's own Python bindings where they import (policy violations as they happen), else dcgmi.
        sources.append(
            dcgm_source(
                poll_interval=config.dcgm_poll_interval.total_seconds(),
                gpu_lookup=lookup,
                thermal_limit_c=config.dcgm_thermal_limit_c,
                power_limit_w=config.dcgm_power_limit_w,
                # Only through the probe's own NVML: --no-nvml keeps the probe off NVML, the power default included.
                nvml=nvml.nvml if nvml is not None else None,
            )
        )
    if config.daemons:
        sources.append(DaemonSource(config.daemons, down_threshold=config.daemon_down_threshold.total_seconds()))
    if config.container_runtimes:
        threshold = config.daemon_down_threshold.total_seconds()
        sources.append(ContainerRuntimeSource(config.container_runtimes, down_threshold=threshold))
    return sources


def _gpu_health(sources: list[ProbeSourceHealth]) -> tuple[HealthState, str | None]:
    gpu_sources = [source for source in sources if source.gpu_source]
    if not gpu_sources:
        return HealthState.INSUFFICIENT_DATA, "no GPU source configured"
    down = [source.reason or source.name for source in gpu_sources if source.state is not HealthState.OK]
    if not down:
        return HealthState.OK, None
    return HealthState.INSUFFICIENT_DATA, "; ".join(down)


def _utcnow() -> datetime:
    return datetime.now(UTC)


def failure_why(exc: Exception) -> str:
    """A delivery failure as a label value: the check that refused it where the ingest said (its Refusal kind:
    not_member, rate_instance, ...), else the error's type (ClientConnectorError, TimeoutError, ...)."""
    refused = _ingest_refusal(exc)
    if refused is not None:
        return refused.kind or f"http_{refused.status}"
    return type(exc).__name__


def _ingest_refusal(exc: Exception) -> IngestRefused | None:
    """`exc` as the ingest's refusal, or None. Looked up rather than imported: only the IngestReporter raises one,
    so while its module is not loaded `exc` cannot be one, and a probe reporting straight to Temporal (or a test's
    fake reporter) does not load botocore and boto3 for the check."""
    module = sys.modules.get("node_probe.delivery.ingest_reporter")
    refused: type[IngestRefused] | None = getattr(module, "IngestRefused", None)
    return exc if refused is not None and isinstance(exc, refused) else None


class Probe:
    def __init__(
        self,
        config: ProbeConfig,
        reporter: ReporterProtocol,
        *,
        sources: Sequence[RecordSource] | None = None,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.config = config
        self.stats = ProbeStats()
        self.delivery = DeliveryState()
        self._reporter = reporter
        self._clock = clock
        self._spool = open_spool(config.spool_dir, config.instance_id, config.spool_max_bytes)
        self._sources = list(sources) if sources is not None else build_sources(config, self._all_spooled)
        # The records are this host's own: a log file's lines from before this boot are history, not faults now.
        self._policy = Policy(config.policy, config.policy_config, booted_at=host.boot_time())
        self._nvml = next((source for source in self._sources if isinstance(source, NvmlSource)), None)
        self._by_name = {source.name: source for source in self._sources}
        self._bursts: BurstCollapser[DedupeKey, _Seen] = BurstCollapser(config.dedupe_window)
        # Copies need two sources that see GPU faults (the kernel log and NVML, say); with one there is nothing to
        # correlate, and nothing is held back.
        gpu_sources = sum(1 for source in self._sources if getattr(source, "gpu_source", True))
        hold = config.correlation_window
        self._correlator: Correlator[_Seen] | None = None
        if hold and gpu_sources > 1:
            self._correlator = Correlator(hold, max(hold, config.dedupe_window))
        # The repeat rules' memory, beside the spool: the read cursors mean a restart no longer re-reads (and so
        # re-counts) the history. Saved on the burst-expiry tick (at most a second behind, never per record: a
        # flood of a repeat rule's Xid must not cost a write each) and at shutdown; a record read again after a
        # crash is recognised by its position and not counted twice.
        self._boot_id = config.boot_id or host.boot_id()
        self._repeats: CursorStore[RepeatMemory] | None = None
        if config.spool_dir is not None and config.policy_config.repeat and self._boot_id:
            path = cursor_path(config.spool_dir, config.instance_id, "repeats")
            self._repeats = CursorStore(path, RepeatMemory, min_interval=0)
        self._repeat_changes = 0
        self._pending = asyncio.Event()
        self._failures: dict[int, _SourceFailure] = {}  # by id() of the source
        self._refused_for: str | None = None  # the ingest's reason while it refuses the probe's group

    def _all_spooled(self) -> bool:
        """Whether every record read so far is in the spool, on disk: the read cursors wait for it. A fault held for
        its copies is not there yet."""
        correlator = getattr(self, "_correlator", None)
        return self._spool.on_disk and (correlator is None or not correlator.holding)

    @property
    def pending(self) -> int:
        """Findings not yet delivered."""
        return len(self._spool)

    @property
    def spool_degraded(self) -> bool:
        """The spool's disk fails it (findings wait in memory meanwhile)."""
        return self._spool.degraded

    def source_states(self) -> dict[str, str]:
        """Each configured source's state, by name: "failed" while it restarts after an error it did not expect
        (and until its new run has lasted, see `_consume`), "degraded" while it runs but cannot read (NVML not
        loaded, dcgmi not answering), "ok" while it reads."""
        return {
            source.name: "failed"
            if self._failing(source) is not None
            else ("ok" if source.status.is_ok else "degraded")
            for source in self._configured()
        }

    def source_health(self) -> list[ProbeSourceHealth]:
        """Each configured source, as the heartbeat reports it (DCGM without dcgmi installed is not configured, so
        not listed). A source that failed counts as down until its new run has lasted (see `_consume`)."""
        return [
            ProbeSourceHealth(
                name=source.name,
                state=HealthState.OK if reason is None else HealthState.INSUFFICIENT_DATA,
                # OK, a source may still say how it looked (the container runtime: through its API, or its unit only).
                reason=reason if reason is not None else source.status.reason,
                gpu_source=getattr(source, "gpu_source", True),
            )
            for source in self._configured()
            for reason in (self._down_reason(source),)
        ]

    def _configured(self) -> list[RecordSource]:
        """The sources in use: DCGM without dcgmi installed is not configured, and is neither reported nor counted."""
        return [source for source in self._sources if getattr(source, "configured", True)]

    def gpu_readings(self) -> dict[str, Any] | None:
        """What NVML's last poll read of each GPU that is worth a look but never a repair (clock event reasons, the
        PCIe link, the warnings that hold); None without NVML."""
        return self._nvml.gpu_readings() if self._nvml is not None else None

    def gpu_health(self) -> tuple[HealthState, str | None]:
        """OK while every GPU source works; INSUFFICIENT_DATA (never IMPAIRED) while any is down, the reason naming
        each one that is. A fault only that source would see (DCGM's health watches, NVML's polled ECC state)
        could go unseen, so the instance's GPU health is not known to be OK. Daemons are not a GPU source."""
        return _gpu_health(self.source_health())

    def _failing(self, source: RecordSource) -> _SourceFailure | None:
        failure = self._failures.get(id(source))
        if failure is not None and (
            failure.restarted_at is None or time.monotonic() - failure.restarted_at < SOURCE_RESTART_MAX_S
        ):
            return failure
        return None

    def _down_reason(self, source: RecordSource) -> str | None:
        failure = self._failing(source)
        if failure is not None:
            return failure.reason
        status = source.status
        return None if status.is_ok else status.reason or f"{source.name}: unavailable"

    def heartbeat(self) -> Heartbeat:
        sources = self.source_health()
        state, reason = _gpu_health(sources)
        return Heartbeat(
            instance_id=self.config.instance_id,
            group=self.config.group,
            sent_at=self._clock(),
            gpu_health=state,
            gpu_health_reason=reason,
            sources=sources,
            boot_id=self._boot_id or None,
            gpu_count=len(self._nvml.gpus) if self._nvml is not None and self._nvml.gpus else None,
        )

    async def run(self) -> None:
        """Until cancelled. The first heartbeat goes out at once and says whether the sources can be read."""
        for source in self._sources:
            source.check()
        if self._repeats is not None:
            memory = self._repeats.load()
            if memory is not None and self._policy.restore_repeats(memory, self._boot_id):
                log.info("repeat rules: %d recent matches from before the restart", len(memory.seen))
            self._repeat_changes = self._policy.repeat_changes
        if self.pending:
            log.info("%d findings from an earlier run wait in the spool", self.pending)
            self._pending.set()
        self.delivery.running_since = time.monotonic()
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._heartbeats())
                tasks.create_task(self._deliver())
                tasks.create_task(self._expire_bursts())
                for source in self._sources:
                    tasks.create_task(self._consume(source))
        finally:
            self.delivery.running_since = None
            # Held faults and open bursts' counts would be lost on shutdown; with a file spool they go out next run.
            if self._correlator is not None:
                self._release(self._correlator.flush())
            self._enqueue_rollups(self._bursts.flush())
            self._save_repeats()

    async def close(self) -> None:
        """Close what the reporter holds open (the ingest's HTTP session; Temporal's client has nothing to close)."""
        close = getattr(self._reporter, "close", None)
        if close is not None:
            await close()

    async def _consume(self, source: RecordSource) -> None:
        """Until cancelled. A source that fails is restarted: one source's error must not stop the heartbeats and
        the other sources, which is what letting it end the probe would do."""
        first_pause = min(1.0, SOURCE_RESTART_MAX_S)
        pause = first_pause
        while True:
            started = time.monotonic()
            try:
                await self._consume_once(source)
                return  # a source that ends (a regular file standing in for /dev/kmsg) has nothing more to give
            except Exception as exc:
                if time.monotonic() - started >= SOURCE_RESTART_MAX_S:
                    pause = first_pause  # it had worked for a while: this is a new failure, not the same one again
                log.exception("%s failed; restarting it in %.0fs", source.name, pause)
                failure = _SourceFailure(f"{source.name}: failed ({type(exc).__name__}: {exc}); restarting")
                self._failures[id(source)] = failure
                await asyncio.sleep(pause)
                failure.restarted_at = time.monotonic()
                pause = min(pause * 2, SOURCE_RESTART_MAX_S)

    async def _consume_once(self, source: RecordSource) -> None:
        async for observation in source.observations():
            now = self._clock()
            verdict = self._policy.classify(
                observation.record, now, source=observation.source, position=observation.position
            )
            self.stats.records += 1
            seen = _Seen(observation, verdict, now)
            record = observation.record
            # Daemon transitions are not a flood (one per episode, from the source itself), and folding "down"
            # after "back up" into a burst would hide that it is down again.
            if record.kind in _STATE_TRANSITIONS:
                self._enqueue(self._finding(seen))
                continue
            key = None if self._correlator is None else fault_key(record, verdict.reason)
            if key is not None and self._is_copy(key, seen):
                continue
            # Only the first of a burst becomes a finding here: building one per line of an 800K-line flood
            # would cost more than parsing it.
            if not self._bursts.offer(dedupe_key(record, verdict), seen, now):
                self.stats.suppressed += 1
            elif key is not None:
                self._hold(key, seen)
            else:
                self._enqueue(self._finding(seen))

    def _is_copy(self, key: FaultKey, seen: _Seen) -> bool:
        assert self._correlator is not None
        source, verdict = seen.observation.source, seen.verdict
        states = statement(seen.observation.record)
        if not self._correlator.copy_of(key, seen, source, verdict.reason, verdict.impairs, seen.at, states):
            return False
        self.stats.copies += 1
        log.debug("%s from %s is a copy of a fault seen already on GPU %s", verdict.reason, source, key.gpu)
        return True

    def _hold(self, key: FaultKey, seen: _Seen) -> None:
        assert self._correlator is not None
        source, verdict = seen.observation.source, seen.verdict
        states = statement(seen.observation.record)
        self._release(self._correlator.hold(key, seen, source, verdict.reason, verdict.impairs, seen.at, states))

    def _release(self, faults: Sequence[Release[_Seen]]) -> None:
        """One finding per fault: its chosen copy's, naming every source that saw it, observed when the first did,
        stating NVIDIA's verdict if a copy stated one."""
        for fault in faults:
            primary = fault.primary
            finding = self._finding(_Seen(primary.observation, primary.verdict, fault.first_at))
            if fault.stating is not None:
                finding = stating(finding, fault.stating.observation.record)
            self._enqueue(finding.model_copy(update={"sources": list(fault.sources[:MAX_FINDING_SOURCES])}))

    def _finding(self, seen: _Seen) -> GpuFinding:
        obs = seen.observation
        record = obs.record
        if record.uuid is None and record.pci is not None and self._nvml is not None:
            # The kernel log names a GPU by PCI address only; NVML knows its UUID.
            record = record._replace(uuid=self._nvml.uuid_of(record.pci))
        recent: RecentLines | None = getattr(self._by_name.get(obs.source), "recent", None)
        return make_finding(
            record,
            seen.verdict,
            instance_id=self.config.instance_id,
            group=self.config.group,
            source=obs.source,
            observed_at=seen.at,
            position=obs.position,
            # Only an impairing fault's: it may end in an incident's evidence; a warning's would only cost history.
            context=recent.around(record.raw) if recent is not None and seen.verdict.impairs else (),
        )

    def _enqueue(self, finding: GpuFinding) -> None:
        self.stats.findings[finding.reason, finding.kind] += 1
        if self._spool.append(finding):
            self._pending.set()
        else:
            self.stats.dropped += 1

    def _enqueue_rollups(self, bursts: Sequence[Burst[_Seen]]) -> None:
        now = self._clock()
        for burst in bursts:
            first, last = self._finding(burst.first), self._finding(burst.last)
            self._enqueue(burst_rollup(first, last, burst.suppressed, now))

    async def _expire_bursts(self) -> None:
        window = self.config.dedupe_window.total_seconds()
        if self._correlator is not None:
            window = min(window, self.config.correlation_window.total_seconds())
        tick = max(0.05, min(1.0, window / 4))
        while True:
            await asyncio.sleep(tick)
            if self._correlator is not None:
                self._release(self._correlator.due(self._clock()))
            self._enqueue_rollups(self._bursts.expire(self._clock()))
            self._save_repeats()

    def _save_repeats(self) -> None:
        if self._repeats is not None and self._policy.repeat_changes != self._repeat_changes:
            self._repeat_changes = self._policy.repeat_changes
            self._repeats.update(self._policy.repeat_memory(self._boot_id))

    async def _deliver(self) -> None:
        """Oldest first; a finding leaves the spool only once delivered, so order survives outages."""
        initial = min(0.5, self.config.retry_max_backoff.total_seconds())
        backoff = initial
        while True:
            finding = self._spool.peek()
            if finding is None:
                if len(self._spool):  # findings the spool cannot read just now: try again, not wait for new ones
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self.config.retry_max_backoff.total_seconds())
                    continue
                self._pending.clear()
                await self._pending.wait()
                continue
            if finding.group != self.config.group:
                # Spooled by a run started with another --group (a wrong one, refused): the group is the probe's.
                finding = finding.model_copy(update={"group": self.config.group})
            try:
                await self._reporter.send_finding(finding, self.config.task_queue)
            except Exception as exc:  # unreachable server, timeouts: all mean "try again later"
                self.stats.failures_by[failure_why(exc)] += 1
                if self.delivery.findings_failing_since is None:
                    self.delivery.findings_failing_since = time.monotonic()
                self.delivery.finding_error = str(exc) or type(exc).__name__
                refused = _ingest_refusal(exc)
                if refused is not None and refused.unknown_group:
                    # Every report is refused until the group or the settings are fixed: no point trying sooner.
                    backoff = max(backoff, self.config.retry_max_backoff.total_seconds())
                    self._group_refused(refused)
                log.warning("finding %s not delivered (%s); retrying in %.1fs", finding.reason, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.retry_max_backoff.total_seconds())
                continue
            self._spool.pop()
            self.stats.delivered += 1
            self.delivery.findings_failing_since = self.delivery.finding_error = None
            backoff = initial
            if self._refused_for is not None:
                log.info("the ingest accepts group %r now: %d findings left to deliver", finding.group, self.pending)
                self._refused_for = None

    def _group_refused(self, refused: IngestRefused) -> None:
        """Said once per reason, loudly: nothing gets through until someone fixes --group or the settings."""
        if refused.reason == self._refused_for:
            return
        self._refused_for = refused.reason
        log.error(
            "the ingest refuses this probe's group %r: %s. Every finding is kept in the spool (%d now), none is "
            "dropped; trying again every %.0fs",
            self.config.group,
            refused.reason,
            self.pending,
            self.config.retry_max_backoff.total_seconds(),
        )

    async def _heartbeats(self) -> None:
        interval = self.config.heartbeat_interval.total_seconds()
        while True:
            heartbeat = self.heartbeat()
            try:
                await self._reporter.send_heartbeat(heartbeat, self.config.task_queue)
                self.stats.heartbeats_sent += 1
                self.delivery.heartbeat_at, self.delivery.heartbeat_error = time.monotonic(), None
            except Exception as exc:  # a lost heartbeat is replaced by the next one; nothing to retry
                self.stats.heartbeat_failures += 1
                log.warning("heartbeat not delivered: %s", exc)
                self.delivery.heartbeat_error = str(exc) or type(exc).__name__
            await asyncio.sleep(interval)
