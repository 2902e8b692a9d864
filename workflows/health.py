"""One health workflow per instance: the ECS container-instance health status, fed by the node probe.

Runbook it automates:
  1. Until the probe's first heartbeat the instance is INITIALIZING.
  2. A critical GPU finding makes ACCELERATED_COMPUTE IMPAIRED (the probe's policy decides what is critical); it
     stays so until the instance is replaced. A critical daemon down makes DAEMON IMPAIRED until it is back up.
  3. AGENT_CONNECTIVITY is the group's liveness tracker's call (workflows/liveness.py): it says when the instance
     has not been heard for the group's threshold, and when it is heard again. Heartbeats reach this workflow only
     when something in them changed, so a healthy instance costs nothing here.
  4. The probe saying its GPU sources are down makes ACCELERATED_COMPUTE INSUFFICIENT_DATA, never IMPAIRED.
  5. Every change of status is published as a HealthChanged event and kept in the HealthStatus search attribute.
  6. On IMPAIRED, if the group's auto repair is ENABLED, start the instance's repair once; if DISABLED, watch only,
     and look at the group again once per threshold: an instance left impaired is repaired once it is ENABLED. A
     repair that fails is retried with backoff, each attempt under an id of its own (workflows/health_repairs.py).
  7. Game days: `inject_heartbeat_loss` makes the tracker (and this workflow) ignore heartbeats for a while, as if
     the probe were silent.
  8. Operators' controls of one instance are updates (workflows/health_controls.py): exclude from repair, include,
     repair now, clear a false finding.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ActivityError

from contract import names
from contract import search_attributes as sa
from contract.formats import iso
from contract.groups import AutoRepair, CapacityGroup
from contract.health import SEVERITY, CheckType, HealthState, HeartbeatLossInjection
from contract.ids import health_workflow_id, liveness_workflow_id
from contract.instances import FindingsClear, InstanceControlResult, InstanceExclude, InstanceInclude, InstanceRepairNow
from contract.liveness import IgnoreHeartbeats, LivenessChange, shard_of
from contract.probe import GpuFinding, Heartbeat
from contract.repair import RepairPhase
from workflows import health_aws_checks as aws_checks
from workflows import health_breaker as breaker
from workflows import health_controls as controls
from workflows import health_ladder as ladder
from workflows import health_repairs as repairs
from workflows import health_retry as retry
from workflows import health_services as services
from workflows.group_config import read_group_config
from workflows.group_events import publish
from workflows.in_order import InOrder
from workflows.models import (
    ContainerInstanceHealthStatus,
    HealthCarry,
    HealthCheckResult,
    HealthRun,
    InstanceHealthView,
    RepairProgress,
)
from workflows.signal_input import Rejected, decode, worth_logging

with workflow.unsafe.imports_passed_through():
    from activities.models import EventType, FleetEvent

RECENT_FINDINGS = 20
# Recent findings that keep the kernel-log lines around them (the first: a root cause comes before its echoes).
FINDINGS_WITH_CONTEXT = 4
REMEMBERED_FINDING_IDS = 500
# Bounds of the rest of the carried state: past them, new entries are counted as dropped instead of kept.
MAX_WARNING_KINDS = 256
# A run accepts at most 10,000 signals and that limit does not raise the continue-as-new suggestion.
SIGNALS_PER_RUN = 2_000
GAME_DAY_RETRY = timedelta(seconds=2)
# A patch id: histories recorded before health changes went out beside the next step (the repair's start) instead of
# in front of it, and before a repair's start read the group and told the breaker side by side.
NEWS_BESIDE_STEPS = "news-beside-steps"


@workflow.defn(name=names.HEALTH_WORKFLOW)
class InstanceHealthWorkflow:
    @workflow.init
    def __init__(self, input: HealthRun) -> None:
        self._instance_id = input.instance_id
        self._group = input.group
        self._state = input.carry or HealthCarry()
        self._outbox: list[FleetEvent] = []
        self._news = InOrder()
        self.news_beside_steps = False
        self._signals_this_run = 0
        self._retired = False
        self._tell_tracker_now = False
        self._tracker_id: str | None = None
        self._control_in_progress: str | None = None  # an operator control waiting on a repair (health_controls)
        # Here, not in run(): with signal-with-start the first signal is handled before run() starts.
        if self._state.started_at is None:
            now = workflow.now()
            self._state.started_at = now
            for check in (CheckType.ACCELERATED_COMPUTE, CheckType.AGENT_CONNECTIVITY):
                self._state.checks[check] = HealthCheckResult(
                    type=check, status=HealthState.INITIALIZING, lastUpdated=now, lastStatusChange=now
                )

    # --- the runbook ------------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, input: HealthRun) -> InstanceHealthView:
        if workflow.info().typed_search_attributes.get(sa.INSTANCE_ID) is None:
            workflow.upsert_search_attributes(
                [sa.INSTANCE_ID.value_set(self._instance_id), sa.CAPACITY_GROUP.value_set(self._group)]
            )
        self.news_beside_steps = workflow.patched(NEWS_BESIDE_STEPS)
        self._sync_status_attribute()
        group = await retry.group_config(self._state, self._instance_id, self._group)
        self._tracker_id = liveness_workflow_id(
            self._group, shard_of(self._instance_id, group.liveness_shards), group.liveness_shards
        )
        workflow.set_current_details(self._details_markdown())

        config_read_at = workflow.now()
        while True:
            with contextlib.suppress(TimeoutError):  # a timer of _next_wake's: what it was for is checked below
                await workflow.wait_condition(
                    lambda: (
                        bool(self._outbox)
                        or self._tell_tracker_now
                        or self._state.recheck_loss
                        or self._state.repair_retry.to_count is not None
                        or self._repair_due()
                        or self._retired
                        or aws_checks.due(self._state)
                        or self._time_to_continue()
                    ),
                    timeout=self._next_wake(group, config_read_at),
                    timeout_summary=self._wake_summary(),
                )
            if (
                controls.withheld_for_group(self._state)
                and workflow.now() - config_read_at >= group.heartbeat_loss_threshold
            ):
                group = await self._reread_group_config(group)
                config_read_at = workflow.now()
            if self._state.repair_retry.to_count is not None:
                await repairs.count_failure(self, group)
            if aws_checks.due(self._state):
                await aws_checks.advance(self, group)
            while self._outbox:
                event = self._outbox.pop(0)
                if self.news_beside_steps:
                    self._news.send(functools.partial(publish, event, "publish health change"))
                else:
                    await publish(event, "publish health change")
            if self._state.game_day_to_tell is not None:
                await self._tell_tracker(self._state.game_day_to_tell)
            if self._state.recheck_loss:
                await breaker.recheck_loss(self._state, self._instance_id, self._tracker_id)
            if self._repair_due() and not self._retired:
                try:
                    await repairs.start(self)
                    retry.succeeded(self._state)
                except ActivityError as err:  # never a failed workflow: the impairment stays, tried again later
                    self._state.repair_requested = False
                    retry.failed(self._state, self._instance_id, "starting the repair", err)
            workflow.set_current_details(self._details_markdown())
            if self._retired:
                await self._news.flush()
                return self._view()
            if self._time_to_continue():
                await self._news.flush()
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(HealthRun(instance_id=self._instance_id, group=self._group, carry=self._state))

    def _next_wake(self, group: CapacityGroup, config_read_at: datetime) -> timedelta | None:
        """A healthy instance sets no timer. One whose repair is withheld looks at its group once per threshold;
        a game day not yet passed to the tracker (it may not exist yet) is tried again shortly."""
        waits = []
        if controls.withheld_for_group(self._state):
            waits.append(max(config_read_at + group.heartbeat_loss_threshold - workflow.now(), timedelta(0)))
        if self._state.game_day_to_tell is not None:
            waits.append(GAME_DAY_RETRY)
        if self._state.retry_at is not None and not self._state.repair_requested:
            waits.append(max(self._state.retry_at - workflow.now(), timedelta(0)))
        if (retry := repairs.wake(self._state)) is not None:
            waits.append(retry)
        if (aws := aws_checks.wake(self._state)) is not None:
            waits.append(aws)
        return min(waits, default=None)

    def _wake_summary(self) -> str:
        if self._state.retry_at is not None and not self._state.repair_requested:
            return "try starting the repair again"
        if (retry := repairs.wake_summary(self._state)) is not None:
            return retry
        if (aws := aws_checks.wake_summary(self._state)) is not None:
            return aws
        if self._state.game_day_to_tell is not None:
            return "game day: pass it to the liveness tracker again"
        return "repair withheld: look at the group's configuration again"

    async def _tell_tracker(self, ignore: IgnoreHeartbeats) -> None:
        """Pass a game day on; kept and retried while the tracker cannot be told (behind the ingest it starts with
        the first batch, a moment after this workflow) and the game day is not over."""
        self._tell_tracker_now = False
        tracker = self._tracker_id
        assert tracker is not None  # set before the loop that calls this
        try:
            await workflow.get_external_workflow_handle(tracker).signal(names.SIGNAL_IGNORE_HEARTBEATS, ignore)
        except Exception as err:
            if workflow.now() < ignore.until:
                workflow.logger.info("game day for %s not passed to %s yet: %s", self._instance_id, tracker, err)
                return
            workflow.logger.warning("game day for %s never reached %s: %s", self._instance_id, tracker, err)
        self._state.game_day_to_tell = None

    async def _reread_group_config(self, group: CapacityGroup) -> CapacityGroup:
        """The group as it is now; re-arms a repair withheld while the group was DISABLED."""
        try:
            group = await self._group_config(summary="re-read group config: is auto repair back on?")
        except ActivityError as err:
            # E.g. the group was removed from the settings: keep what we had.
            workflow.logger.warning("group %s not re-read (%s)", self._group, err.cause)
            return group
        if controls.withheld_for_group(self._state) and group.auto_repair is AutoRepair.ENABLED:
            workflow.logger.info("auto repair ENABLED again for group %s", self._group)
            self._state.repair_withheld = None
            self._state.repair_requested = False
        return group

    async def _group_config(self, summary: str | None = None) -> CapacityGroup:
        return await read_group_config(self._group, summary)

    # --- signals and query --------------------------------------------------------------------------------------

    @workflow.signal(dynamic=True)
    def on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        """Every signal comes through here, so that no input, however malformed, can fail the workflow task."""
        self._signals_this_run += 1
        before = self._status_key()
        try:
            self._dispatch(name, payloads)
        except Exception as err:  # a handler's own failure is bad input too: it must never fail the task
            self._reject(Rejected(f"signal {name!r} failed in its handler: {type(err).__name__}: {err}"[:500]))
        if self._state.repair_withheld is not None and not self._is_impaired():
            # Healthy again while repair was DISABLED: the decision not to repair is void, a new fault decides anew.
            self._state.repair_withheld = None
            self._state.repair_requested = False
        self._publish_if_changed(before)

    def _dispatch(self, name: str, payloads: Sequence[RawValue]) -> None:
        if name == names.SIGNAL_GPU_FINDING:
            self._accept(decode(name, payloads, GpuFinding), self._on_finding)
        elif name == names.SIGNAL_HEARTBEAT:
            self._accept(decode(name, payloads, Heartbeat), self._on_heartbeat)
        elif name == names.SIGNAL_REPAIR_PROGRESS:
            self._accept(decode(name, payloads, RepairProgress), self._on_repair_progress)
        elif name == names.SIGNAL_LIVENESS:
            self._accept(decode(name, payloads, LivenessChange), self._on_liveness)
        elif name == names.SIGNAL_INJECT_HEARTBEAT_LOSS:
            self._accept(decode(name, payloads, HeartbeatLossInjection), self._on_heartbeat_loss_injection)
        elif name == names.SIGNAL_AWS_STATUS:
            aws_checks.on_signal(self, name, payloads)
        else:
            self._reject(Rejected(f"unknown signal {name!r}"))

    @workflow.query(name=names.QUERY_HEALTH)
    def health(self) -> InstanceHealthView:
        return self._view()

    # --- operator controls: validators refuse without a trace (workflows/health_controls.py) ----------------------

    @workflow.update(name=names.UPDATE_EXCLUDE_INSTANCE)
    async def exclude_instance(self, request: InstanceExclude) -> InstanceControlResult:
        return await controls.exclude(self, request)

    @exclude_instance.validator
    def _validate_exclude(self, request: InstanceExclude) -> None:
        controls.refuse_exclude(self, request)

    @workflow.update(name=names.UPDATE_INCLUDE_INSTANCE)
    async def include_instance(self, request: InstanceInclude) -> InstanceControlResult:
        return await controls.include(self, request)

    @include_instance.validator
    def _validate_include(self, request: InstanceInclude) -> None:
        controls.refuse_include(self, request)

    @workflow.update(name=names.UPDATE_REPAIR_INSTANCE)
    async def repair_instance(self, request: InstanceRepairNow) -> InstanceControlResult:
        return await controls.repair_now(self, request)

    @repair_instance.validator
    def _validate_repair(self, request: InstanceRepairNow) -> None:
        controls.refuse_repair(self, request)

    @workflow.update(name=names.UPDATE_CLEAR_FINDINGS)
    async def clear_findings(self, request: FindingsClear) -> InstanceControlResult:
        return await controls.clear(self, request)

    @clear_findings.validator
    def _validate_clear(self, request: FindingsClear) -> None:
        controls.refuse_clear(self, request)

    def _accept(self, value: object, handler: object) -> None:
        if isinstance(value, Rejected):
            self._reject(value)
        else:
            handler(value)  # type: ignore[operator]

    def _reject(self, why: Rejected) -> None:
        self._state.rejected_signals += 1
        if worth_logging(self._state.rejected_signals):
            workflow.logger.warning("dropped signal for %s: %s", self._instance_id, why)

    def _forged(self, why: str) -> None:
        self._state.forged_signals += 1
        if worth_logging(self._state.forged_signals):
            workflow.logger.warning("dropped forged signal for %s: %s", self._instance_id, why)

    def _on_finding(self, finding: GpuFinding) -> None:
        if finding.instance_id != self._instance_id:
            self._reject(Rejected(f"finding for {finding.instance_id} sent to {self._instance_id}"))
            return
        if finding.finding_id in self._state.seen_finding_ids:
            self._reject(Rejected(f"duplicate finding {finding.finding_id}"))
            return
        self._state.seen_finding_ids = [*self._state.seen_finding_ids, finding.finding_id][-REMEMBERED_FINDING_IDS:]
        finding = ladder.from_before_fix(self._state, finding)
        self._state.findings = _bounded_context([*self._state.findings, finding][-RECENT_FINDINGS:])
        now = workflow.now()
        # A critical daemon or container runtime down (or back) is ECS's DAEMON or CONTAINER_RUNTIME check.
        if services.took(self._state, finding, now, self._set_check):
            return
        check = CheckType.DAEMON if finding.kind == "daemon" else CheckType.ACCELERATED_COMPUTE
        current = self._state.checks.get(check)
        if not finding.impairs:
            key = f"{finding.gpu.pci or 'unknown'}/{finding.reason}"
            if key in self._state.warning_counts or len(self._state.warning_counts) < MAX_WARNING_KINDS:
                self._state.warning_counts[key] = self._state.warning_counts.get(key, 0) + finding.count
            else:
                self._state.dropped_entries += 1
        elif current is not None and current.status is HealthState.IMPAIRED:
            # The first critical fault is the root cause (Xid 79, then "fallen off the bus" about the same GPU).
            current.lastUpdated = now
        else:
            self._set_check(check, HealthState.IMPAIRED, finding.reason, now)

    def _on_heartbeat(self, beat: Heartbeat) -> None:
        if beat.instance_id != self._instance_id:
            self._reject(Rejected(f"heartbeat for {beat.instance_id} sent to {self._instance_id}"))
            return
        now = workflow.now()
        ignored_until = self._state.heartbeats_ignored_until
        if ignored_until is not None and now < ignored_until:
            # An injected heartbeat loss: the watchdog must see exactly the silence a dead probe leaves.
            return
        self._state.last_heartbeat = now
        self._state.probe_sources = beat.sources
        ladder.heard(self._state, beat)
        if self._state.dormant:
            self._wake_if_dormant()
            self._set_check(CheckType.AGENT_CONNECTIVITY, HealthState.OK, None, now)
        if self._state.checks[CheckType.AGENT_CONNECTIVITY].status is HealthState.INITIALIZING:
            # The first heartbeat: connected. After that, connectivity is the liveness tracker's call.
            self._set_check(CheckType.AGENT_CONNECTIVITY, HealthState.OK, None, now)
        accelerated = self._state.checks[CheckType.ACCELERATED_COMPUTE]
        if accelerated.status is HealthState.IMPAIRED:
            # A critical GPU fault stays until the instance is replaced; the heartbeat only refreshes it.
            accelerated.lastUpdated = now
        elif beat.gpu_health is HealthState.INSUFFICIENT_DATA:
            self._set_check(
                CheckType.ACCELERATED_COMPUTE,
                HealthState.INSUFFICIENT_DATA,
                beat.gpu_health_reason or "GPU monitoring unavailable",
                now,
            )
        else:
            self._set_check(CheckType.ACCELERATED_COMPUTE, HealthState.OK, None, now)

    def _on_liveness(self, change: LivenessChange) -> None:
        if change.instance_id != self._instance_id:
            self._reject(Rejected(f"liveness of {change.instance_id} sent to {self._instance_id}"))
            return
        now = workflow.now()
        repair = self._state.repair
        if change.gone and self._retired:
            return  # replaced, and closing (its last events going out): the repair's own termination is no news
        if change.gone and (repair is None or repair.phase in controls.FINISHED):
            if change.for_good:
                self._retire(change.gone)
            else:
                self._go_dormant(change.gone, now)
            return
        if change.lost:
            since = iso(change.last_heard) if change.last_heard else "its start"
            reason = f"Agent disconnected since {since}"
            self._set_check(CheckType.AGENT_CONNECTIVITY, HealthState.IMPAIRED, reason, now)
            return
        # The tracker knows the game day too (it ignores receipts until it ends): heard again is heard again.
        self._state.last_heartbeat = max(self._state.last_heartbeat or now, change.last_heard or now)
        self._wake_if_dormant()
        self._set_check(CheckType.AGENT_CONNECTIVITY, *aws_checks.probe_heard_again(self._state), now)

    def _go_dormant(self, why: str, now: datetime) -> None:
        """It left on purpose but may come back (stopped, in standby, detached, deregistered): not a fault, never
        repaired, and this workflow stays, costing nothing (no timer), until the instance is heard from again."""
        self._state.retired_reason = why
        self._state.dormant = True
        self._state.repair_retry = self._state.repair_retry.afresh()  # a failed repair is not retried while away
        self._set_check(CheckType.AGENT_CONNECTIVITY, HealthState.INSUFFICIENT_DATA, f"left on purpose: {why}", now)
        workflow.logger.info("%s left on purpose (%s): dormant until heard from again", self._instance_id, why)
        self._instance_event(EventType.INSTANCE_RETIRED, reason=why, may_return=True)

    def _wake_if_dormant(self) -> None:
        if not self._state.dormant:
            return
        self._state.dormant = False
        workflow.logger.info("%s is back (it had left on purpose: %s)", self._instance_id, self._state.retired_reason)
        self._instance_event(EventType.INSTANCE_RETURNED, left_because=self._state.retired_reason)
        self._state.retired_reason = None

    def _instance_event(self, type: EventType, **fields: Any) -> None:
        self._outbox.append(
            FleetEvent(
                event_id=str(workflow.uuid4()),
                time=workflow.now(),
                type=type,
                group=self._group,
                instance_id=self._instance_id,
                workflow_id=health_workflow_id(self._instance_id),
                fields=fields,
            )
        )

    def _retire(self, why: str) -> None:
        """It left on purpose (terminated by someone other than a repair): no fault, nothing to repair, done."""
        self._retired = True
        self._state.retired_reason = why
        workflow.logger.info("%s left on purpose (%s): retired, not repaired", self._instance_id, why)
        self._instance_event(EventType.INSTANCE_RETIRED, reason=why, may_return=False)

    def _on_heartbeat_loss_injection(self, injection: HeartbeatLossInjection) -> None:
        until = workflow.now() + injection.duration
        self._state.heartbeats_ignored_until = until
        self._state.game_day_to_tell = IgnoreHeartbeats(
            instance_id=self._instance_id, since=workflow.now(), until=until
        )
        self._tell_tracker_now = True
        workflow.logger.warning(
            "game day: heartbeats of %s ignored until %s (requested by %s)",
            self._instance_id,
            iso(until),
            injection.requested_by or "unknown",
        )

    def _on_repair_progress(self, progress: RepairProgress) -> None:
        repair = self._state.repair
        if repair is None or progress.workflow_id != repair.workflow_id:
            self._forged(f"repair_progress from {progress.workflow_id}, which this workflow did not start")
            return
        if not self._state.repair_token or progress.token != self._state.repair_token:
            self._forged(f"repair_progress claiming to be {progress.workflow_id} without its token")
            return
        repair.phase = progress.phase
        repair.replacement_instance_id = progress.replacement_instance_id or repair.replacement_instance_id
        repair.error = progress.error
        repairs.on_progress(self._state, progress)
        if progress.finished and progress.phase is RepairPhase.COMPLETED:
            self._retired = not ladder.fixed_in_place(self._state, progress, workflow.now())
        elif progress.finished and progress.phase is RepairPhase.DISCARDED:
            breaker.prove_again(self._state, progress.error or "held repair discarded")

    # --- status bookkeeping -------------------------------------------------------------------------------------

    def _set_check(self, check: CheckType, status: HealthState, reason: str | None, now: datetime) -> None:
        current = self._state.checks.get(check)
        if current is not None and current.status is status:
            # ECS's lastStatusChange is when the status changed: a new reason for it (dcgmi failing one way, then
            # another) is an update, else a grace or age read from it would restart (Karpenter #2833).
            current.statusReason, current.lastUpdated = reason, now
            return
        self._state.checks[check] = HealthCheckResult(
            type=check, status=status, statusReason=reason, lastUpdated=now, lastStatusChange=now
        )

    def _status_key(self) -> list[tuple[CheckType, HealthState, str | None]]:
        return [(d.type, d.status, d.statusReason) for d in self._state.checks.values()]

    def _publish_if_changed(self, before: list[tuple[CheckType, HealthState, str | None]]) -> None:
        """One HealthChanged event per change, however many checks one signal moved."""
        if self._status_key() == before:
            return
        if not self._is_impaired():
            self._state.impairment_reported = False  # the next impairment is a new one for the breaker
        self._sync_status_attribute()
        health = self._health_status()
        _, finding = self._impairment()
        self._instance_event(
            EventType.HEALTH_CHANGED,
            overall_status=health.overallStatus.value,
            details=[d.model_dump(mode="json") for d in health.details],
            finding=finding.model_dump(mode="json") if finding else None,
        )

    def _sync_status_attribute(self) -> None:
        """Only on a change of the overall status: an upsert is an event in the history."""
        overall = self._health_status().overallStatus.value
        if workflow.info().typed_search_attributes.get(sa.HEALTH_STATUS) != overall:
            workflow.upsert_search_attributes([sa.HEALTH_STATUS.value_set(overall)])

    def _health_status(self) -> ContainerInstanceHealthStatus:
        details = sorted(self._state.checks.values(), key=lambda d: d.type.value)
        overall = min((d.status for d in details), key=SEVERITY.index, default=HealthState.INITIALIZING)
        return ContainerInstanceHealthStatus(overallStatus=overall, details=details)

    def _impairment(self) -> tuple[str, GpuFinding | None]:
        """The reason to repair, preferring the GPU finding that caused it (it names the Xid and the GPU)."""
        for kind in (
            CheckType.ACCELERATED_COMPUTE,
            CheckType.DAEMON,
            CheckType.CONTAINER_RUNTIME,
            CheckType.EC2_STATUS,
        ):
            check = self._state.checks.get(kind)
            if check is not None and check.status is HealthState.IMPAIRED:
                finding = next((f for f in self._state.findings if f.impairs and f.reason == check.statusReason), None)
                return check.statusReason or kind.value, finding
        agent = self._state.checks.get(CheckType.AGENT_CONNECTIVITY)
        return (agent.statusReason if agent and agent.statusReason else "AGENT_CONNECTIVITY"), None

    def _is_impaired(self) -> bool:
        return self._health_status().overallStatus is HealthState.IMPAIRED

    def _repair_due(self) -> bool:
        wanted = self._is_impaired() or self._state.operator_repair is not None or repairs.wanted(self._state)
        due = retry.may_try_now(self._state) and repairs.may_start_now(self._state)
        return wanted and not self._state.repair_requested and due

    def _time_to_continue(self) -> bool:
        return workflow.info().is_continue_as_new_suggested() or self._signals_this_run >= SIGNALS_PER_RUN

    def _view(self) -> InstanceHealthView:
        return InstanceHealthView(
            instance_id=self._instance_id,
            group=self._group,
            healthStatus=self._health_status(),
            recent_findings=self._state.findings,
            warning_counts=self._state.warning_counts,
            repair=self._state.repair,
            last_heartbeat=self._state.last_heartbeat,
            rejected_signals=self._state.rejected_signals,
            retired=self._retired,
            retired_reason=self._state.retired_reason,
            forged_signals=self._state.forged_signals,
            dropped_entries=self._state.dropped_entries,
            repair_withheld=self._state.repair_withheld,
            heartbeats_ignored_until=self._state.heartbeats_ignored_until,
            probe_sources=self._state.probe_sources,
            liveness_workflow_id=self._tracker_id,
            last_activity_error=self._state.last_activity_error,
            excluded=self._state.excluded,
            cleared_findings=self._state.cleared_findings,
            repair_retry=self._state.repair_retry,
            boot_id=self._state.boot_id,
            last_in_place_fix=self._state.last_in_place_fix,
        )

    def _details_markdown(self) -> str:
        health = self._health_status()
        lines = [f"**{self._instance_id}** in `{self._group}`: **{health.overallStatus.value}**", ""]
        lines += ["| check | status | reason | since |", "|---|---|---|---|"]
        for d in health.details:
            lines.append(f"| {d.type.value} | {d.status.value} | {d.statusReason or ''} | {iso(d.lastStatusChange)} |")
        if self._state.repair is not None:
            r = self._state.repair
            lines += ["", f"Repair `{r.workflow_id}`: {r.phase.value}"]
        lines += repairs.details_lines(self._state)
        if self._state.repair_withheld:
            lines += ["", f"Not repaired: {self._state.repair_withheld}"]
        ignored_until = self._state.heartbeats_ignored_until
        if ignored_until is not None and workflow.now() < ignored_until:
            lines += ["", f"Game day: heartbeats ignored until {iso(ignored_until)}"]
        if self._state.rejected_signals:
            lines += ["", f"{self._state.rejected_signals} malformed or duplicate signals dropped"]
        if self._state.forged_signals:
            lines += ["", f"**{self._state.forged_signals} forged signals dropped** (not from who may send them)"]
        if self._state.dropped_entries:
            lines += ["", f"{self._state.dropped_entries} warning kinds or daemons not kept (state is bounded)"]
        lines += controls.details_lines(self._state)
        return "\n".join(lines)


def _bounded_context(findings: list[GpuFinding]) -> list[GpuFinding]:
    """The carried state stays small: the surrounding lines are kept on the first few findings that have them."""
    with_context = [index for index, f in enumerate(findings) if f.context][FINDINGS_WITH_CONTEXT:]
    for index in with_context:
        findings[index] = findings[index].model_copy(update={"context": []})
    return findings
