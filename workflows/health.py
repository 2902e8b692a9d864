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
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy
from temporalio.exceptions import ActivityError

from contract import names
from contract import search_attributes as sa
from contract.groups import AutoRepair, CapacityGroup
from contract.health import HeartbeatLossInjection
from contract.ids import liveness_workflow_id
from contract.instances import FindingsClear, InstanceControlResult, InstanceExclude, InstanceInclude, InstanceRepairNow
from contract.liveness import IgnoreHeartbeats, LivenessChange, shard_of
from contract.probe import GpuFinding, Heartbeat
from contract.repair import RepairProgress
from workflows import health_aws_checks as aws_checks
from workflows import health_aws_rules as aws_rules
from workflows import health_breaker as breaker
from workflows import health_controls as controls
from workflows import health_repairs as repairs
from workflows import health_retry as retry
from workflows.group_config import read_group_config
from workflows.group_events import publish
from workflows.in_order import InOrder
from workflows.instance_health import InstanceHealth
from workflows.model_log import Log
from workflows.models import HealthRun, InstanceHealthView
from workflows.options import CALL_TIMEOUT
from workflows.signal_input import Rejected, decode

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import InstanceRef

# A run accepts at most 10,000 signals and that limit does not raise the continue-as-new suggestion.
SIGNALS_PER_RUN = 2_000
GAME_DAY_RETRY = timedelta(seconds=2)
# A few tries: the count is worth a look, never a stuck loop.
EXPECTED_GPUS_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), maximum_attempts=3)
# A patch id: histories recorded before health changes went out beside the next step (the repair's start) instead of
# in front of it, and before a repair's start read the group and told the breaker side by side.
NEWS_BESIDE_STEPS = "news-beside-steps"
# A patch id: histories recorded before an instance whose probe never reported was marked unmonitored (only the AWS
# watch starts such a workflow).
FIRST_REPORT = "first-report-timeout"
# A patch id: histories recorded before the run loop read the instance type's GPU count (its first heartbeat that
# counts them).
EXPECTED_GPUS = "expected-gpus"

Message = TypeVar("Message")


class WorkflowHost:
    """The model's clock, ids and patch markers are the workflow's, so that a replay decides the same."""

    @property
    def log(self) -> Log:
        return workflow.logger

    def now(self) -> datetime:
        return workflow.now()

    def new_id(self) -> str:
        return str(workflow.uuid4())

    def patched(self, patch_id: str) -> bool:
        return workflow.patched(patch_id)

    def status_changed(self, status: str) -> None:
        """Only on a change of the status: an upsert is an event in the history."""
        if workflow.info().typed_search_attributes.get(sa.HEALTH_STATUS) != status:
            workflow.upsert_search_attributes([sa.HEALTH_STATUS.value_set(status)])


@workflow.defn(name=names.HEALTH_WORKFLOW)
class InstanceHealthWorkflow:
    @workflow.init
    def __init__(self, input: HealthRun) -> None:
        # Here, not in run(): with signal-with-start the first signal is handled before run() starts.
        self._host = WorkflowHost()
        self._health = InstanceHealth(input.instance_id, input.group, input.carry, self._host)
        self._news = InOrder()
        self._news_beside_steps = False
        # The instance type's GPUs are not read in this run: its history is from before, or EC2 did not answer.
        self._skip_expected_gpus = False

    # --- the runbook ------------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, input: HealthRun) -> InstanceHealthView:
        health, state = self._health, self._health.state
        if workflow.info().typed_search_attributes.get(sa.INSTANCE_ID) is None:
            workflow.upsert_search_attributes(
                [sa.INSTANCE_ID.value_set(health.instance_id), sa.CAPACITY_GROUP.value_set(health.group)]
            )
        self._news_beside_steps = workflow.patched(NEWS_BESIDE_STEPS)
        self._host.status_changed(health.search_status())
        group = await retry.group_config(state, health.instance_id, health.group)
        health.tracker_id = liveness_workflow_id(
            health.group, shard_of(health.instance_id, group.liveness_shards), group.liveness_shards
        )
        workflow.set_current_details(health.details_markdown())

        config_read_at = workflow.now()
        while True:
            with contextlib.suppress(TimeoutError):  # a timer of _next_wake's: what it was for is checked below
                await workflow.wait_condition(
                    lambda: (
                        bool(health.outbox)
                        or health.tell_tracker_now
                        or state.recheck_loss
                        or state.repair_retry.to_count is not None
                        or health.repair_due()
                        or health.retired
                        or aws_rules.due(state, workflow.now())
                        or (health.gpus_to_read and not self._skip_expected_gpus)
                        or self._time_to_continue()
                    ),
                    timeout=self._next_wake(group, config_read_at),
                    timeout_summary=self._wake_summary(),
                )
            if health.withheld_for_group and workflow.now() - config_read_at >= group.heartbeat_loss_threshold:
                group = await self._reread_group_config(group)
                config_read_at = workflow.now()
            if state.repair_retry.to_count is not None:
                await repairs.count_failure(health, group)
            if aws_rules.due(state, workflow.now()):
                await aws_checks.advance(health, group)
            if health.gpus_to_read and not self._skip_expected_gpus:
                await self._read_expected_gpus()
            due = health.first_report_due(group.first_report_timeout)
            if due is not None and workflow.now() >= due and workflow.patched(FIRST_REPORT):
                before = health.status_key()
                health.mark_unmonitored(group.first_report_timeout)
                health.publish_if_changed(before)
            while health.outbox:
                event = health.outbox.pop(0)
                if self._news_beside_steps:
                    self._news.send(functools.partial(publish, event, "publish health change"))
                else:
                    await publish(event, "publish health change")
            if state.game_day_to_tell is not None:
                await self._tell_tracker(state.game_day_to_tell)
            if state.recheck_loss:
                await breaker.recheck_loss(state, health.instance_id, health.tracker_id)
            if health.repair_due() and not health.retired:
                try:
                    await repairs.start(health, self._news_beside_steps)
                    retry.succeeded(state)
                except ActivityError as err:  # never a failed workflow: the impairment stays, tried again later
                    health.release_claim()
                    retry.failed(state, health.instance_id, "starting the repair", err)
            workflow.set_current_details(health.details_markdown())
            if health.retired:
                await self._news.flush()
                return health.view()
            if self._time_to_continue():
                await self._news.flush()
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(HealthRun(instance_id=health.instance_id, group=health.group, carry=state))

    async def _read_expected_gpus(self) -> None:
        """How many GPUs the instance's type has, once: a host whose probe counts fewer is missing one."""
        health = self._health
        if not workflow.patched(EXPECTED_GPUS):
            self._skip_expected_gpus = True
            return
        try:
            found = await workflow.execute_activity_method(
                FleetActivities.expected_gpus,
                InstanceRef(group=health.group, instance_id=health.instance_id),
                summary=f"how many GPUs has the instance type of {health.instance_id}?",
                start_to_close_timeout=CALL_TIMEOUT,
                retry_policy=EXPECTED_GPUS_RETRY,
            )
        except ActivityError as err:
            # Not knowing is never a missing GPU: the next run asks again.
            workflow.logger.warning("GPUs of %s's instance type not read: %s", health.instance_id, err.cause)
            self._skip_expected_gpus = True
            return
        before = health.status_key()
        health.expected_gpus_read(found.instance_type, found.gpus)
        health.publish_if_changed(before)

    def _next_wake(self, group: CapacityGroup, config_read_at: datetime) -> timedelta | None:
        """A healthy instance sets no timer. One whose repair is withheld looks at its group once per threshold;
        a game day not yet passed to the tracker (it may not exist yet) is tried again shortly."""
        health, now, waits = self._health, workflow.now(), []
        if health.withheld_for_group:
            waits.append(max(config_read_at + group.heartbeat_loss_threshold - now, timedelta(0)))
        if health.state.game_day_to_tell is not None:
            waits.append(GAME_DAY_RETRY)
        if (retry_in := health.wake_in(now)) is not None:
            waits.append(retry_in)
        if (aws := aws_rules.wake(health.state, now)) is not None:
            waits.append(aws)
        due = health.first_report_due(group.first_report_timeout)
        if due is not None and workflow.patched(FIRST_REPORT):
            waits.append(max(due - now, timedelta(0)))
        return min(waits, default=None)

    def _wake_summary(self) -> str:
        state = self._health.state
        if state.retry_at is not None and state.repair_claim is None:
            return "try starting the repair again"
        if (retry_text := repairs.wake_summary(state)) is not None:
            return retry_text
        if (aws := aws_rules.wake_summary(state)) is not None:
            return aws
        if state.game_day_to_tell is not None:
            return "game day: pass it to the liveness tracker again"
        if state.last_heartbeat is None and not state.seen_finding_ids and not state.unmonitored:
            return "no report from the probe yet: unmonitored at first_report_timeout"
        return "repair withheld: look at the group's configuration again"

    async def _tell_tracker(self, ignore: IgnoreHeartbeats) -> None:
        """Pass a game day on; kept and retried while the tracker cannot be told (behind the ingest it starts with
        the first batch, a moment after this workflow) and the game day is not over."""
        health = self._health
        health.tell_tracker_now = False
        tracker = health.tracker_id
        assert tracker is not None  # set before the loop that calls this
        try:
            await workflow.get_external_workflow_handle(tracker).signal(names.SIGNAL_IGNORE_HEARTBEATS, ignore)
        except Exception as err:
            if workflow.now() < ignore.until:
                workflow.logger.info("game day for %s not passed to %s yet: %s", health.instance_id, tracker, err)
                return
            workflow.logger.warning("game day for %s never reached %s: %s", health.instance_id, tracker, err)
        health.state.game_day_to_tell = None

    async def _reread_group_config(self, group: CapacityGroup) -> CapacityGroup:
        """The group as it is now; re-arms a repair withheld while the group was DISABLED."""
        health = self._health
        try:
            group = await read_group_config(health.group, "re-read group config: is auto repair back on?")
        except ActivityError as err:
            # E.g. the group was removed from the settings: keep what we had.
            workflow.logger.warning("group %s not re-read (%s)", health.group, err.cause)
            return group
        if health.withheld_for_group and group.auto_repair is AutoRepair.ENABLED:
            workflow.logger.info("auto repair ENABLED again for group %s", health.group)
            health.release_claim()
        return group

    def _time_to_continue(self) -> bool:
        return workflow.info().is_continue_as_new_suggested() or self._health.signals_this_run >= SIGNALS_PER_RUN

    # --- signals and query --------------------------------------------------------------------------------------

    @workflow.signal(dynamic=True)
    def on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        """Every signal comes through here, so that no input, however malformed, can fail the workflow task."""
        health = self._health
        health.signals_this_run += 1
        before = health.status_key()
        try:
            self._dispatch(name, payloads)
        except Exception as err:  # a handler's own failure is bad input too: it must never fail the task
            health.reject(Rejected(f"signal {name!r} failed in its handler: {type(err).__name__}: {err}"[:500]))
        health.void_withheld_when_healthy()
        health.publish_if_changed(before)

    def _dispatch(self, name: str, payloads: Sequence[RawValue]) -> None:
        health = self._health
        if name == names.SIGNAL_GPU_FINDING:
            self._accept(decode(name, payloads, GpuFinding), health.on_finding)
        elif name == names.SIGNAL_HEARTBEAT:
            self._accept(decode(name, payloads, Heartbeat), health.on_heartbeat)
        elif name == names.SIGNAL_REPAIR_PROGRESS:
            self._accept(decode(name, payloads, RepairProgress), health.on_repair_progress)
        elif name == names.SIGNAL_LIVENESS:
            self._accept(decode(name, payloads, LivenessChange), health.on_liveness)
        elif name == names.SIGNAL_INJECT_HEARTBEAT_LOSS:
            self._accept(decode(name, payloads, HeartbeatLossInjection), health.on_heartbeat_loss_injection)
        elif name == names.SIGNAL_AWS_STATUS:
            aws_checks.on_signal(health, name, payloads)
        else:
            health.reject(Rejected(f"unknown signal {name!r}"))

    def _accept(self, value: Message | Rejected, handler: Callable[[Message], Any]) -> None:
        if isinstance(value, Rejected):
            self._health.reject(value)
        else:
            handler(value)

    @workflow.query(name=names.QUERY_HEALTH)
    def health(self) -> InstanceHealthView:
        return self._health.view()

    # --- operator controls: validators refuse without a trace (workflows/health_controls.py) ----------------------

    @workflow.update(name=names.UPDATE_EXCLUDE_INSTANCE)
    async def exclude_instance(self, request: InstanceExclude) -> InstanceControlResult:
        return await controls.exclude(self._health, request)

    @exclude_instance.validator
    def _validate_exclude(self, request: InstanceExclude) -> None:
        controls.refuse_exclude(self._health, request)

    @workflow.update(name=names.UPDATE_INCLUDE_INSTANCE)
    async def include_instance(self, request: InstanceInclude) -> InstanceControlResult:
        return await controls.include(self._health, request)

    @include_instance.validator
    def _validate_include(self, request: InstanceInclude) -> None:
        controls.refuse_include(self._health, request)

    @workflow.update(name=names.UPDATE_REPAIR_INSTANCE)
    async def repair_instance(self, request: InstanceRepairNow) -> InstanceControlResult:
        return await controls.repair_now(self._health, request)

    @repair_instance.validator
    def _validate_repair(self, request: InstanceRepairNow) -> None:
        controls.refuse_repair(self._health, request)

    @workflow.update(name=names.UPDATE_CLEAR_FINDINGS)
    async def clear_findings(self, request: FindingsClear) -> InstanceControlResult:
        return await controls.clear(self._health, request)

    @clear_findings.validator
    def _validate_clear(self, request: FindingsClear) -> None:
        controls.refuse_clear(self._health, request)
