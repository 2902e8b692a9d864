"""An instance's health as a plain model: what each message does to its checks, and what the health workflow should
do next. No Temporal here: the workflow (workflows/health.py) hands in a HealthHost for the clock, ids, patch
markers and its search attribute, and tests hand in a fake one.

The model keeps the carried state (HealthCarry) and the events to publish (its outbox); the workflow sends them,
starts repairs and runs timers. Which checks there are, and what each does, is the table in workflows/health_checks.py.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Protocol

from activities.models import FleetEvent
from contract import event_types as ev
from contract.config import format_seconds
from contract.formats import iso
from contract.groups import AutoRepair
from contract.health import UNMONITORED, CheckType, HealthState, HeartbeatLossInjection
from contract.ids import health_workflow_id
from contract.instances import ClearedFinding, Exclusion
from contract.liveness import IgnoreHeartbeats, LivenessChange
from contract.probe import GpuFinding, Heartbeat
from contract.repair import FINISHED, RepairPhase, RepairProgress
from workflows import health_aws_rules as aws_rules
from workflows import health_checks as checks
from workflows import health_ladder as ladder
from workflows import health_services as services
from workflows.model_log import Log
from workflows.models import (
    ClaimKind,
    ContainerInstanceHealthStatus,
    HealthCarry,
    HealthCheckResult,
    InstanceHealthView,
    RepairClaim,
    RepairDecision,
    RepairRetry,
    RepairStance,
)
from workflows.signal_input import Rejected, worth_logging

RECENT_FINDINGS = 20
# Recent findings that keep the kernel-log lines around them (the first: a root cause comes before its echoes).
FINDINGS_WITH_CONTEXT = 4
REMEMBERED_FINDING_IDS = 500
# Bounds of the rest of the carried state: past them, new entries are counted as dropped instead of kept.
MAX_WARNING_KINDS = 256
# A patch id: histories recorded before failed repairs were counted and retried (workflows/health_repairs.py).
REPAIR_RETRIES = "repair-retries"
# A patch id: histories recorded before an unmonitored instance's HealthStatus search attribute said UNMONITORED.
UNMONITORED_STATUS = "unmonitored-status"
# ACCELERATED_COMPUTE's reason when the host shows fewer GPUs than its type has (EKS: NvidiaDeviceCountMismatch).
GPU_COUNT_MISMATCH = "GPU_COUNT_MISMATCH"
# The carried fields the health view shows as they are, by their shared name; the rest of the view is derived.
SHOWN_AS_CARRIED = tuple(sorted(set(InstanceHealthView.model_fields) & set(HealthCarry.model_fields)))

StatusKey = list[tuple[CheckType, HealthState, str | None]]


class HealthHost(Protocol):
    """What the model needs of the workflow that runs it."""

    @property
    def log(self) -> Log: ...

    def now(self) -> datetime: ...

    def new_id(self) -> str: ...

    def patched(self, patch_id: str) -> bool: ...

    def status_changed(self, status: str) -> None:
        """The overall status may have moved: the workflow's HealthStatus search attribute follows it (the overall
        status, or UNMONITORED)."""


def excluded_text(exclusion: Exclusion) -> str:
    return f"excluded by {exclusion.by}: {exclusion.reason or 'no reason given'}"


class InstanceHealth:
    def __init__(self, instance_id: str, group: str, state: HealthCarry | None, host: HealthHost) -> None:
        self.instance_id = instance_id
        self.group = group
        self.state = state or HealthCarry()
        self.outbox: list[FleetEvent] = []  # events the run loop publishes, in order
        self.retired = False
        self.tracker_id: str | None = None  # the group's liveness tracker of this instance, once the group is read
        self.tell_tracker_now = False  # a game day to pass to the tracker
        self.signals_this_run = 0
        self.control_in_progress: str | None = None  # an operator control waiting on a repair (health_controls)
        self._host = host
        if self.state.started_at is None:
            now = host.now()
            self.state.started_at = now
            for check in checks.FROM_START:
                self.state.checks[check] = HealthCheckResult(
                    type=check, status=HealthState.INITIALIZING, lastUpdated=now, lastStatusChange=now
                )

    # --- what the instance's status is ------------------------------------------------------------------------------

    def health_status(self) -> ContainerInstanceHealthStatus:
        return checks.health_status(self.state)

    def search_status(self) -> str:
        """What the HealthStatus search attribute says: the overall status, or UNMONITORED (counted apart)."""
        if self.state.unmonitored and self._host.patched(UNMONITORED_STATUS):
            return UNMONITORED
        return self.health_status().overallStatus.value

    def is_impaired(self) -> bool:
        return self.health_status().overallStatus is HealthState.IMPAIRED

    def impairment(self) -> tuple[str, GpuFinding | None]:
        return checks.impairment(self.state)

    def status_key(self) -> StatusKey:
        return [(d.type, d.status, d.statusReason) for d in self.state.checks.values()]

    def set_check(self, check: CheckType, status: HealthState, reason: str | None, now: datetime) -> None:
        checks.set_check(self.state, check, status, reason, now)

    def publish_if_changed(self, before: StatusKey) -> None:
        """One HealthChanged event per change, however many checks one message moved."""
        if self.status_key() == before:
            return
        if not self.is_impaired():
            self.state.impairment_reported = False  # the next impairment is a new one for the breaker
        self._host.status_changed(self.search_status())
        health = self.health_status()
        _, finding = self.impairment()
        self.instance_event(
            ev.HealthChanged(
                overall_status=health.overallStatus,
                details=[ev.HealthCheck.model_validate(d.model_dump()) for d in health.details],
                finding=finding,
            )
        )

    def instance_event(self, detail: ev.EventDetail) -> None:
        self.outbox.append(
            FleetEvent.of(
                detail,
                event_id=self._host.new_id(),
                time=self._host.now(),
                group=self.group,
                instance_id=self.instance_id,
                workflow_id=health_workflow_id(self.instance_id),
            )
        )

    # --- what the repair decision is ------------------------------------------------------------------------------

    @property
    def withheld_for_group(self) -> bool:
        """A repair withheld because the group's auto repair is DISABLED, not because the instance is excluded: only
        then is the group looked at again now and then (an excluded instance waits for `include`)."""
        return self.withheld_why is not None and self.state.excluded is None

    def repair_due(self) -> bool:
        """Whether the run loop should start a repair now: the instance wants one (IMPAIRED, an operator asked, or a
        failed attempt's retry), none is started yet, and no backoff is running."""
        state, now = self.state, self._host.now()
        wanted = self.is_impaired() or state.operator_repair is not None or state.repair_retry.next_at is not None
        backing_off = state.retry_at is not None and now < state.retry_at
        retry_later = state.repair_retry.next_at is not None and now < state.repair_retry.next_at
        return wanted and state.repair_claim is None and not backing_off and not retry_later

    def repair_decision(self) -> RepairDecision:
        """Why it is, or is not, being repaired: one answer derived from the carried state, first match wins."""
        state, now = self.state, self._host.now()
        repair, retry, claim = state.repair, state.repair_retry, state.repair_claim
        if self.retired:
            return RepairDecision(stance=RepairStance.RETIRED, why=state.retired_reason or "replaced")
        if repair is not None and repair.phase not in FINISHED:
            why = f"{repair.workflow_id} is {repair.phase.value}"
            return RepairDecision(stance=RepairStance.REPAIRING, why=why, since=repair.started_at)
        if state.dormant:
            return RepairDecision(stance=RepairStance.DORMANT, why=f"left on purpose: {state.retired_reason}")
        if state.excluded is not None:
            why, since = excluded_text(state.excluded), state.excluded.since
            return RepairDecision(stance=RepairStance.EXCLUDED, why=why, since=since)
        if claim is not None and claim.kind is ClaimKind.WITHHELD:
            return RepairDecision(stance=RepairStance.WITHHELD, why=claim.why, since=claim.since)
        if retry.exhausted:
            return RepairDecision(stance=RepairStance.EXHAUSTED, why=retry.text() or "")
        if retry.next_at is not None and now < retry.next_at:
            return RepairDecision(stance=RepairStance.RETRY_WAITING, why=retry.text() or "", until=retry.next_at)
        if not (self.is_impaired() or state.operator_repair is not None or retry.next_at is not None):
            return RepairDecision(stance=RepairStance.NOT_NEEDED)
        reason, _ = self.repair_reason()
        if state.retry_at is not None and now < state.retry_at:
            why = state.last_activity_error or reason
            return RepairDecision(stance=RepairStance.BACKING_OFF, why=why, until=state.retry_at)
        if claim is not None:
            return RepairDecision(stance=RepairStance.STARTING, why=reason, since=claim.since)
        return RepairDecision(stance=RepairStance.DUE, why=reason)

    def repair_reason(self) -> tuple[str, GpuFinding | None]:
        """An operator's repair says who asked and why; the finding, if any, still names the GPU."""
        reason, finding = self.impairment()
        return self.state.operator_repair or reason, finding

    # --- the repair claim: taken, withheld and released here only ---------------------------------------------------

    @property
    def withheld_why(self) -> str | None:
        """Why an IMPAIRED instance is not being repaired (its group DISABLED, or excluded); None: not withheld."""
        claim = self.state.repair_claim
        return claim.why if claim is not None and claim.kind is ClaimKind.WITHHELD else None

    def take_for_repair(self) -> None:
        """The run loop takes this impairment: its repair starts, unless the group's switch says otherwise
        (withhold_unless_allowed); no other start is due meanwhile."""
        self.state.repair_claim = RepairClaim(kind=ClaimKind.TAKEN, since=self._host.now())

    def withhold(self, why: str) -> None:
        """Taken but not repaired, and why: nothing is started until the claim is released."""
        self.state.repair_claim = RepairClaim(kind=ClaimKind.WITHHELD, why=why, since=self._host.now())

    def release_claim(self) -> None:
        """The decision to repair (or not) is void: the run loop decides anew, if it is still wanted."""
        self.state.repair_claim = None

    def withhold_unless_allowed(self, auto_repair: AutoRepair) -> bool:
        """With the group's switch just read: whether the taken repair may start. Not while the group's auto repair
        is DISABLED (an operator's repair excepted: it is no automatic one), nor while an operator excludes it."""
        state = self.state
        if auto_repair is AutoRepair.DISABLED and state.operator_repair is None:
            self._host.log.info("instance impaired; auto repair DISABLED for group %s, monitoring only", self.group)
            self.withhold(f"auto repair DISABLED for group {self.group} at {iso(self._host.now())}")
            return False
        if state.excluded is not None:  # an operator's: watched, never repaired until `include`
            self.withhold(excluded_text(state.excluded))
            return False
        return True

    def void_withheld_when_healthy(self) -> None:
        if self.withheld_why is not None and not self.is_impaired():
            # Healthy again while repair was DISABLED: the decision not to repair is void, a new fault decides anew.
            self.release_claim()

    def prove_again(self, why: str) -> None:
        """Its held repair was discarded: back to OK until the fault is seen again (a fresh finding, or a heartbeat
        loss that lasts a full threshold from now). The findings stay, listed as cleared by the breaker."""
        self.clear_impairments("the breaker", why)
        self.release_claim()

    def clear_impairments(self, who: str, why: str) -> list[ClearedFinding]:
        """Every clearable impaired check back to OK, its findings listed as cleared by `who`; a cleared heartbeat loss
        is judged afresh by the tracker (still silent a full window from now: lost again)."""
        state = self.state
        state.recheck_loss = checks.impaired(state, CheckType.AGENT_CONNECTIVITY)
        return checks.clear_impaired(state, who, why, self._host.now())

    # --- operator controls (workflows/health_controls.py runs them: validation, withdrawal, events) -----------------

    def on_exclude(self, exclusion: Exclusion, took_back: bool) -> str | None:
        """Excluded from repair; returns the operator repair asked earlier that will not start now, if any. A withheld
        repair (or one just taken back from the drain queue) stays withheld, for the exclusion, while IMPAIRED."""
        state = self.state
        state.excluded = exclusion
        dropped, state.operator_repair = state.operator_repair, None
        if self.withheld_why is not None or took_back:
            # Withheld as for a DISABLED group, with the reason; `include` re-arms it.
            if self.is_impaired():
                self.withhold(excluded_text(exclusion))
            else:
                self.release_claim()
        return dropped

    def on_include(self) -> bool:
        """Included again; whether a withheld repair was re-armed (as when the group is ENABLED again: the run loop
        decides anew, and reads the group's switch)."""
        self.state.excluded = None
        re_armed = self.withheld_why is not None
        if re_armed:
            self.release_claim()
        return re_armed

    def on_repair_asked(self, reason: str) -> None:
        """An operator's repair: the run loop starts it, DISABLED group or not, as a fresh attempt whatever failed
        before (after it, failures count from zero again: health_repairs.py)."""
        self.state.operator_repair = reason
        self.release_claim()
        self.state.repair_retry = self.state.repair_retry.afresh()

    def on_clear(self, who: str, why: str, repair_running: bool) -> list[ClearedFinding]:
        """An operator's verdict that the impairment was false. Unless a repair runs, the decision to repair (or to
        withhold it, or to retry a failed repair) is void with the impairment: a fresh finding decides anew."""
        cleared = self.clear_impairments(who, why)
        if not repair_running:
            self.release_claim()
            self.state.repair_retry = self.state.repair_retry.afresh()
        return cleared

    # --- messages -------------------------------------------------------------------------------------------------

    def reject(self, why: Rejected) -> None:
        self.state.rejected_signals += 1
        if worth_logging(self.state.rejected_signals):
            self._host.log.warning("dropped signal for %s: %s", self.instance_id, why)

    def forged(self, why: str) -> None:
        self.state.forged_signals += 1
        if worth_logging(self.state.forged_signals):
            self._host.log.warning("dropped forged signal for %s: %s", self.instance_id, why)

    def on_finding(self, finding: GpuFinding) -> None:
        state = self.state
        if finding.instance_id != self.instance_id:
            self.reject(Rejected(f"finding for {finding.instance_id} sent to {self.instance_id}"))
            return
        if finding.finding_id in state.seen_finding_ids:
            self.reject(Rejected(f"duplicate finding {finding.finding_id}"))
            return
        state.seen_finding_ids = [*state.seen_finding_ids, finding.finding_id][-REMEMBERED_FINDING_IDS:]
        finding = ladder.from_before_fix(state, finding)
        ladder.note_verdict(state, finding)
        state.findings = _bounded_context([*state.findings, finding][-RECENT_FINDINGS:])
        now = self._host.now()
        # A critical daemon or container runtime down (or back) is ECS's DAEMON or CONTAINER_RUNTIME check.
        if services.took(state, finding, now):
            return
        check = checks.check_of(finding)
        current = state.checks.get(check)
        if not finding.impairs:
            key = f"{finding.gpu.pci or 'unknown'}/{finding.reason}"
            if key in state.warning_counts or len(state.warning_counts) < MAX_WARNING_KINDS:
                state.warning_counts[key] = state.warning_counts.get(key, 0) + finding.count
            else:
                state.dropped_entries += 1
        elif current is not None and current.status is HealthState.IMPAIRED:
            # The first critical fault is the root cause (Xid 79, then "fallen off the bus" about the same GPU).
            current.lastUpdated = now
        else:
            self.set_check(check, HealthState.IMPAIRED, finding.reason, now)

    def on_heartbeat(self, beat: Heartbeat) -> None:
        state = self.state
        if beat.instance_id != self.instance_id:
            self.reject(Rejected(f"heartbeat for {beat.instance_id} sent to {self.instance_id}"))
            return
        now = self._host.now()
        ignored_until = state.heartbeats_ignored_until
        if ignored_until is not None and now < ignored_until:
            # An injected heartbeat loss: the watchdog must see exactly the silence a dead probe leaves.
            return
        state.last_heartbeat = now
        state.probe_sources = beat.sources
        if beat.gpu_count is not None:  # not known (NVML down) is never a missing GPU: the last count stands
            state.gpu_count = beat.gpu_count
        ladder.heard(state, beat)
        if state.dormant:
            self._wake_if_dormant()
            self.set_check(CheckType.AGENT_CONNECTIVITY, HealthState.OK, None, now)
        if state.checks[CheckType.AGENT_CONNECTIVITY].status is HealthState.INITIALIZING or state.unmonitored:
            # The first heartbeat: connected. After that, connectivity is the liveness tracker's call.
            state.unmonitored = False
            self.set_check(CheckType.AGENT_CONNECTIVITY, HealthState.OK, None, now)
        accelerated = state.checks[CheckType.ACCELERATED_COMPUTE]
        if accelerated.status is HealthState.IMPAIRED:
            # A critical GPU fault stays until the instance is replaced; the heartbeat only refreshes it.
            accelerated.lastUpdated = now
        elif beat.gpu_health is HealthState.INSUFFICIENT_DATA:
            self.set_check(
                CheckType.ACCELERATED_COMPUTE,
                HealthState.INSUFFICIENT_DATA,
                beat.gpu_health_reason or "GPU monitoring unavailable",
                now,
            )
        else:
            self.set_check(CheckType.ACCELERATED_COMPUTE, HealthState.OK, None, now)
        self._check_gpu_count(now)

    def first_report_due(self, timeout: timedelta) -> datetime | None:
        """When the instance counts as unmonitored, if its probe has not reported by then; None: it has reported,
        or is unmonitored already."""
        state = self.state
        if state.last_heartbeat is not None or state.seen_finding_ids or state.unmonitored or state.started_at is None:
            return None
        return state.started_at + timeout

    def mark_unmonitored(self, timeout: timedelta) -> None:
        """No report from its probe since it registered: INSUFFICIENT_DATA, never IMPAIRED; AWS's checks still apply.
        Its first heartbeat makes it monitored again."""
        state, now = self.state, self._host.now()
        state.unmonitored = True
        reason = f"{UNMONITORED}: no report from its probe within first_report_timeout {format_seconds(timeout)}"
        for check in checks.FROM_START:
            if state.checks[check].status is HealthState.INITIALIZING:
                self.set_check(check, HealthState.INSUFFICIENT_DATA, reason, now)
        self._host.log.warning("%s: %s", self.instance_id, reason)
        self.instance_event(ev.InstanceUnmonitored(first_report_timeout=format_seconds(timeout)))

    @property
    def gpus_to_read(self) -> bool:
        """The probe counts its GPUs and the instance type's count is not read yet: the run loop reads it."""
        return self.state.gpu_count is not None and not self.state.expected_gpus_read

    def expected_gpus_read(self, instance_type: str | None, gpus: int | None) -> None:
        """What EC2 says the instance's type has (None: not known, never a missing GPU)."""
        self.state.expected_gpus_read = True
        self.state.instance_type, self.state.expected_gpus = instance_type, gpus
        self._check_gpu_count(self._host.now())

    def _check_gpu_count(self, now: datetime) -> None:
        """Fewer GPUs than the type has impairs ACCELERATED_COMPUTE, and stays so until the instance is replaced (or
        a fix in place brings them back), like a GPU fault."""
        state = self.state
        seen, expected = state.gpu_count, state.expected_gpus
        if (
            seen is None
            or expected is None
            or seen >= expected
            or checks.impaired(state, CheckType.ACCELERATED_COMPUTE)
        ):
            return
        reason = f"{GPU_COUNT_MISMATCH}: {seen} of the {expected} GPUs of a {state.instance_type} visible"
        self.set_check(CheckType.ACCELERATED_COMPUTE, HealthState.IMPAIRED, reason, now)

    def on_liveness(self, change: LivenessChange) -> None:
        state = self.state
        if change.instance_id != self.instance_id:
            self.reject(Rejected(f"liveness of {change.instance_id} sent to {self.instance_id}"))
            return
        now = self._host.now()
        repair = state.repair
        if change.gone and self.retired:
            return  # replaced, and closing (its last events going out): the repair's own termination is no news
        if change.gone and (repair is None or repair.phase in FINISHED):
            if change.for_good:
                self._retire(change.gone)
            else:
                self._go_dormant(change.gone, now)
            return
        if change.lost:
            since = iso(change.last_heard) if change.last_heard else "its start"
            reason = f"Agent disconnected since {since}"
            self.set_check(CheckType.AGENT_CONNECTIVITY, HealthState.IMPAIRED, reason, now)
            return
        # The tracker knows the game day too (it ignores receipts until it ends): heard again is heard again.
        state.last_heartbeat = max(state.last_heartbeat or now, change.last_heard or now)
        self._wake_if_dormant()
        self.set_check(CheckType.AGENT_CONNECTIVITY, *aws_rules.probe_heard_again(state, self._host.patched), now)

    def on_heartbeat_loss_injection(self, injection: HeartbeatLossInjection) -> None:
        now = self._host.now()
        until = now + injection.duration
        self.state.heartbeats_ignored_until = until
        self.state.game_day_to_tell = IgnoreHeartbeats(instance_id=self.instance_id, since=now, until=until)
        self.tell_tracker_now = True
        self._host.log.warning(
            "game day: heartbeats of %s ignored until %s (requested by %s)",
            self.instance_id,
            iso(until),
            injection.requested_by or "unknown",
        )

    def on_repair_progress(self, progress: RepairProgress) -> None:
        state = self.state
        repair = state.repair
        if repair is None or progress.workflow_id != repair.workflow_id:
            self.forged(f"repair_progress from {progress.workflow_id}, which this workflow did not start")
            return
        if not state.repair_token or progress.token != state.repair_token:
            self.forged(f"repair_progress claiming to be {progress.workflow_id} without its token")
            return
        repair.phase = progress.phase
        repair.replacement_instance_id = progress.replacement_instance_id or repair.replacement_instance_id
        repair.error = progress.error
        self._count_if_failed(progress)
        if progress.finished and progress.phase is RepairPhase.COMPLETED:
            self.retired = not ladder.fixed_in_place(state, progress, self._host.now())
            if not self.retired:  # fixed in place: healthy again, and repaired anew on a new fault
                self.release_claim()
        elif progress.finished and progress.phase is RepairPhase.DISCARDED:
            self.prove_again(progress.error or "held repair discarded")

    def _count_if_failed(self, progress: RepairProgress) -> None:
        """A finished attempt's outcome: a failure is counted by the run loop (once, even if its progress is told
        twice); a discarded one starts the count afresh."""
        if not progress.finished:
            return
        retry = self.state.repair_retry
        if progress.phase is RepairPhase.FAILED and progress.workflow_id not in (retry.to_count, retry.last_counted):
            if self._host.patched(REPAIR_RETRIES):
                retry.to_count = progress.workflow_id
        elif progress.phase in (RepairPhase.DISCARDED, RepairPhase.COMPLETED):
            # Discarded: back to proving the fault; completed and still here: fixed in place. A new fault starts
            # afresh.
            self.state.repair_retry = RepairRetry()

    # --- leaving --------------------------------------------------------------------------------------------------

    def _go_dormant(self, why: str, now: datetime) -> None:
        """It left on purpose but may come back (stopped, in standby, detached, deregistered): not a fault, never
        repaired, and the workflow stays, costing nothing (no timer), until the instance is heard from again."""
        state = self.state
        state.retired_reason = why
        state.dormant = True
        state.repair_retry = state.repair_retry.afresh()  # a failed repair is not retried while away
        self.set_check(CheckType.AGENT_CONNECTIVITY, HealthState.INSUFFICIENT_DATA, f"left on purpose: {why}", now)
        self._host.log.info("%s left on purpose (%s): dormant until heard from again", self.instance_id, why)
        self.instance_event(ev.InstanceRetired(reason=why, may_return=True))

    def _wake_if_dormant(self) -> None:
        state = self.state
        if not state.dormant:
            return
        state.dormant = False
        self._host.log.info("%s is back (it had left on purpose: %s)", self.instance_id, state.retired_reason)
        self.instance_event(ev.InstanceReturned(left_because=state.retired_reason))
        state.retired_reason = None

    def _retire(self, why: str) -> None:
        """It left on purpose (terminated by someone other than a repair): no fault, nothing to repair, done."""
        self.retired = True
        self.state.retired_reason = why
        self._host.log.info("%s left on purpose (%s): retired, not repaired", self.instance_id, why)
        self.instance_event(ev.InstanceRetired(reason=why, may_return=False))

    # --- what it shows ----------------------------------------------------------------------------------------------

    def view(self) -> InstanceHealthView:
        """The `health` query's answer: the carried fields it shares by name, and what is derived from the model."""
        state = self.state
        return InstanceHealthView(
            **{name: getattr(state, name) for name in SHOWN_AS_CARRIED},
            instance_id=self.instance_id,
            group=self.group,
            healthStatus=self.health_status(),
            recent_findings=state.findings,
            retired=self.retired,
            liveness_workflow_id=self.tracker_id,
            repair_withheld=self.withheld_why,
            repair_decision=self.repair_decision(),
        )

    def details_markdown(self) -> str:
        state, health = self.state, self.health_status()
        lines = [f"**{self.instance_id}** in `{self.group}`: **{health.overallStatus.value}**", ""]
        lines += ["| check | status | reason | since |", "|---|---|---|---|"]
        for d in health.details:
            lines.append(f"| {d.type.value} | {d.status.value} | {d.statusReason or ''} | {iso(d.lastStatusChange)} |")
        if state.repair is not None:
            lines += ["", f"Repair `{state.repair.workflow_id}`: {state.repair.phase.value}"]
        if (retry := state.repair_retry.text()) is not None:
            lines += ["", f"**{retry[0].upper()}{retry[1:]}**"]
        if self.withheld_why:
            lines += ["", f"Not repaired: {self.withheld_why}"]
        ignored_until = state.heartbeats_ignored_until
        if ignored_until is not None and self._host.now() < ignored_until:
            lines += ["", f"Game day: heartbeats ignored until {iso(ignored_until)}"]
        if state.rejected_signals:
            lines += ["", f"{state.rejected_signals} malformed or duplicate signals dropped"]
        if state.forged_signals:
            lines += ["", f"**{state.forged_signals} forged signals dropped** (not from who may send them)"]
        if state.dropped_entries:
            lines += ["", f"{state.dropped_entries} warning kinds or daemons not kept (state is bounded)"]
        if state.excluded is not None:
            since = iso(state.excluded.since)
            lines += ["", f"**Excluded from repair** since {since}: {excluded_text(state.excluded)}"]
        if state.cleared_findings:
            last = state.cleared_findings[-1]
            lines += [
                "",
                f"{len(state.cleared_findings)} impairments cleared as false; last {last.status_reason} "
                f"by {last.cleared_by} at {iso(last.cleared_at)}",
            ]
        return "\n".join(lines)

    def wake_in(self, now: datetime) -> timedelta | None:
        """The next wake of the run loop for a failed repair's retry or a backoff; None: none set here."""
        state, waits = self.state, []
        if state.retry_at is not None and state.repair_claim is None:
            waits.append(max(state.retry_at - now, timedelta(0)))
        next_at = state.repair_retry.next_at
        if next_at is not None and state.repair_claim is None:
            waits.append(max(next_at - now, timedelta(0)))
        return min(waits, default=None)


def _bounded_context(findings: list[GpuFinding]) -> list[GpuFinding]:
    """The carried state stays small: the surrounding lines are kept on the first few findings that have them."""
    with_context = [index for index, f in enumerate(findings) if f.context][FINDINGS_WITH_CONTEXT:]
    for index in with_context:
        findings[index] = findings[index].model_copy(update={"context": []})
    return findings
