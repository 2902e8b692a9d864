"""One drain semaphore per capacity group: never more than max(1, floor(n x pct / 100)) instances draining at once.

Requests and releases arrive as signals; a grant goes back to the requester as a signal. Permits are handed out
first come, first served. A holder that closes without releasing (terminated by an operator, crashed past its
retries) is found by a periodic check and its permit reclaimed, so one lost repair cannot block a group for good.

The semaphore is also the group's entity for live configuration: `autorepair group update` sends the
`update_group` update (validated, recorded in this history, published as a GroupConfigChanged event), the
overrides ride along continue-as-new, and `FleetActivities.get_group_config` reads them with the
`group_config` query, so every workflow of the group sees a change without a worker restart. They are also kept in
the run's memo: a semaphore started after an operator terminated the last one takes them over from there.
`--reset` drops them (back to the worker's settings).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

from contract import event_types as ev
from contract import names
from contract.breaker import (
    FleetHoldQuery,
    HoldNotice,
    ImpairmentReport,
)
from contract.formats import iso
from contract.groups import CapacityGroup, GroupConfigOverrides, GroupConfigState, GroupConfigUpdate
from contract.ids import liveness_workflow_id, repair_instance_of, semaphore_workflow_id
from contract.semaphore import LaunchOutcome, PermitRequest, ReplacementClaim, ReplacementClaimed
from workflows.group_config import read_group_config
from workflows.group_events import activity_cause, publish_group_event
from workflows.models import Permit, PermitGrant, PermitRelease, SemaphoreRun, SemaphoreView
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.semaphore_breaker import SemaphoreBreaker
from workflows.semaphore_state import SemaphoreState
from workflows.side_tasks import SideTasks
from workflows.signal_input import Rejected, Route, dispatch, worth_logging

with workflow.unsafe.imports_passed_through():
    from activities.breaker_ops import BreakerOps
    from activities.models import (
        GroupRef,
        RepairsOfGroup,
        SignalsToSend,
        SignalTo,
        WorkflowRun,
        WorkflowRuns,
    )
    from activities.workflow_ops import WorkflowOps

SIGNALS_PER_RUN = 2_000
# The waiting line is carried across continue-as-new: bounded, and far above any real group's repairs.
MAX_WAITERS = 500
# A patch id: histories recorded before each grant of a batch looked again at holds and impairments.
RECHECK_EACH_GRANT = "recheck-each-grant"
# A patch id: histories recorded before a grant pass counted the group only when it had to, granted a batch in one
# step and sent its grants side by side (one round trip for a batch, not one per grant).
FEWER_ROUND_TRIPS = "fewer-round-trips"
# A patch id: histories recorded before impairments went to the fleet breaker beside the grant pass, not in front of it.
FLEET_REPORTS_BESIDE = "fleet-reports-beside-grants"
# A patch id: histories recorded before a batch's grants went out beside the next batch (requests that arrived while a
# batch was checked waited for every grant of it to be acknowledged, several workflow tasks, before their own check).
GRANTS_BESIDE = "grants-beside-next-batch"
# A patch id: histories recorded before a batch's grants went out by one activity through the frontend. Sent by the
# workflow, each grant is a transfer task and two events on this one history, taken one at a time: 200 grants sent
# at once reached their repairs over 220 s on the dev server (benchmarks/SCALE.md).
GRANTS_BY_ACTIVITY = "grants-by-activity"
# A patch id: histories recorded before the impairments counted together went to the fleet breaker by one activity
# (each by an activity of its own: 200 on this history at 1,000 / 200).
FLEET_REPORTS_TOGETHER = "fleet-reports-together"
DETAILS_WAITERS = 20
# Impairments reported and not yet counted (the loop counts them at its next turn): bounded like all state.
MAX_REPORTS_PENDING = 10_000
PERMITS_IN_USE = "autorepair_drain_permits_in_use"
PERMITS_WAITING = "autorepair_drain_permits_waiting"
REPAIRS_HELD = "autorepair_repairs_held"
INSTANCES_OUT_OF_SERVICE = "autorepair_instances_out_of_service"


@workflow.defn(name=names.SEMAPHORE_WORKFLOW)
class DrainSemaphoreWorkflow:
    @workflow.init
    def __init__(self, input: SemaphoreRun) -> None:
        self._state = SemaphoreState.from_run(input)
        self._side = SideTasks()
        self._duties = SemaphoreBreaker(self._state, self._side, self._show_state)
        # A fresh start asks the fleet breaker whether it holds: its notice went out while no run was listening.
        self._fleet_asked = input.breaker is not None
        # A fresh start (not continue-as-new) first takes over what an earlier run left, e.g. one an operator
        # terminated: overrides such as auto_repair=DISABLED must not silently revert to the settings.
        self._config_taken_over = input.config is not None
        # One configuration change at a time: each reads the group, then applies on top of the previous one.
        self._config_lock = asyncio.Lock()
        self._signals_this_run = 0
        self._fewer_round_trips = False
        self._grants_beside = False
        self._grants_by_activity = False

    @workflow.run
    async def run(self, input: SemaphoreRun) -> None:
        self._fewer_round_trips = self._duties.fewer_round_trips = workflow.patched(FEWER_ROUND_TRIPS)
        self._duties.fleet_reports_beside = workflow.patched(FLEET_REPORTS_BESIDE)
        self._duties.fleet_reports_together = workflow.patched(FLEET_REPORTS_TOGETHER)
        self._grants_beside = workflow.patched(GRANTS_BESIDE)
        self._grants_by_activity = workflow.patched(GRANTS_BY_ACTIVITY)
        async with self._config_lock:
            await self._take_over_previous_config()
        settings = await read_group_config(self._state.group, "read group settings", live_overrides=False)
        # Applied after the read: an update may have landed while it was in flight.
        group = self._state.config.overrides.apply(settings)
        self._state.config = self._state.config.model_copy(update={"effective": group})
        if not self._fleet_asked:
            self._fleet_asked = True
            answer = await workflow.execute_activity_method(
                BreakerOps.fleet_hold,
                FleetHoldQuery(group=self._state.group),
                summary="ask the fleet breaker whether it holds repairs",
                start_to_close_timeout=CALL_TIMEOUT,
                retry_policy=CALL_RETRY,
            )
            self._state.fleet_hold = self._state.fleet_hold or answer.held
        while True:
            if self._state.reported:
                await self._duties.count_impairments(self._state.config.effective or group)
            if self._state.changed:
                # Every change wakes the loop, so the details and gauges never show a released permit as held.
                self._state.changed = False
                if self._state.waiters:
                    await self._grant_what_fits(self._state.config.effective or group)
            self._show_state()
            if self._time_to_continue():
                await workflow.wait_condition(lambda: workflow.all_handlers_finished() and self._side.idle)
                workflow.continue_as_new(
                    self._state.carried(),
                    memo=self._config_memo(),
                )
            try:
                await workflow.wait_condition(
                    lambda: self._state.changed or bool(self._state.reported) or self._time_to_continue(),
                    timeout=self._duties.next_wake(self._state.config.effective or group),
                    timeout_summary=self._duties.wake_summary(),
                )
            except TimeoutError:
                if self._state.holders:
                    await self._reclaim_closed_holders()
                self._state.changed = True  # a maintenance window may have opened

    async def _grant_what_fits(self, group: CapacityGroup) -> None:
        if not self._fewer_round_trips or self._state.count_due(workflow.now(), group.permit_reclaim_interval):
            await self._duties.measure()
        while self._state.waiters:
            group = self._state.config.effective or group  # an update may have landed while we awaited
            while self._state.reported:
                # Impairments that arrived while we looked count before any grant: never a grant past the rule.
                await self._duties.count_impairments(group)
            if self._state.holding() or await self._duties.trip_if_over(group, budget=True):
                return  # held: the waiters wait for an operator's resume
            batch = self._state.fitting([w for w in self._state.waiters if self._duties.may_run_now(w, group)])
            if not batch:
                return  # no room, or only repairs that wait for a maintenance window
            if group.max_repairs_per_day is not None:
                batch = batch[: max(1, group.max_repairs_per_day - len(self._state.breaker.grants))]
            genuine = await self._running_repairs_of_group(batch)
            # What arrived while we looked (impairments, a fleet hold) counts before this batch is granted.
            while self._state.reported:
                await self._duties.count_impairments(group)
            if self._state.holding() or await self._duties.trip_if_over(group, budget=True):
                return
            if self._fewer_round_trips:
                # Nothing can land between two grants of one step: the batch is decided as a whole, then told.
                waiting = len(self._state.waiters)
                granted = self._grant(batch, genuine)
                if self._grants_by_activity and len(granted) > 1:
                    # A lone grant goes as before: an activity would cost it one more billed action.
                    self._side.start(self._send_grants(granted))  # a grant that fails frees its permit
                elif self._grants_beside or self._grants_by_activity:
                    for permit in granted:
                        self._side.start(self._send_grant(permit))  # a grant that fails frees its permit (_changed)
                else:
                    await asyncio.gather(*(self._send_grant(permit) for permit in granted))
                if len(self._state.waiters) == waiting:
                    return  # the room shrank while we looked: the next change wakes us
                continue
            for request in batch:
                if request not in self._state.waiters:
                    continue  # released while we looked
                # Each grant awaits its signal: a hold, impairments or an update may land between two of a batch.
                if workflow.patched(RECHECK_EACH_GRANT) and await self._held_before_grant():
                    return
                self._state.waiters.remove(request)
                if request.holder_workflow_id not in genuine:
                    self._forged_signal(f"request for {request.holder_workflow_id}, not a running repair of the group")
                    continue
                if not self._state.fits(request):
                    self._state.waiters.insert(0, request)
                    break
                await self._send_grant(self._state.hold(request, workflow.now()))

    def _grant(self, batch: Sequence[PermitRequest], genuine: set[str]) -> list[Permit]:
        """The permits of one batch, in order, while they fit; a request from no running repair is dropped."""
        granted: list[Permit] = []
        for request in batch:
            if request not in self._state.waiters:
                continue  # released while we looked
            if request.holder_workflow_id not in genuine:
                self._state.waiters.remove(request)
                self._forged_signal(f"request for {request.holder_workflow_id}, not a running repair of the group")
                continue
            if not self._state.fits(request):
                break
            self._state.waiters.remove(request)
            granted.append(self._state.hold(request, workflow.now()))
        return granted

    async def _held_before_grant(self) -> bool:
        group = self._state.config.effective
        if group is None:
            return self._state.holding()
        while self._state.reported:
            await self._duties.count_impairments(group)
        return self._state.holding() or await self._duties.trip_if_over(group, budget=True)

    async def _running_repairs_of_group(self, requests: Sequence[PermitRequest]) -> set[str]:
        """The requesters that are running repair workflows of this group: a permit goes to nobody else (a
        workflow that never closes would otherwise hold one for ever)."""
        found = await workflow.execute_activity_method(
            WorkflowOps.find_running_repairs,
            RepairsOfGroup(
                group=self._state.group,
                runs=[WorkflowRun(workflow_id=r.holder_workflow_id, run_id=r.holder_run_id) for r in requests],
            ),
            summary=f"check {len(requests)} permit requests come from repairs of {self._state.group}",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        return {run.workflow_id for run in found.runs}

    def _grant_of(self, permit: Permit) -> PermitGrant:
        return PermitGrant(
            group=self._state.group,
            holder_workflow_id=permit.holder_workflow_id,
            granted_at=permit.since,
            token=permit.token,
            avoid_azs=self._state.avoid_azs(workflow.now()),
        )

    async def _send_grants(self, permits: Sequence[Permit]) -> None:
        """A batch's grants in one activity; the permit of a repair that no longer runs goes to the next in line."""
        order = SignalsToSend(
            signal=names.SIGNAL_PERMIT_GRANTED,
            to=[
                SignalTo(
                    workflow_id=p.holder_workflow_id,
                    run_id=p.holder_run_id,
                    payload=self._grant_of(p).model_dump(mode="json"),
                )
                for p in permits
            ],
        )
        shown = ", ".join(p.instance_id or p.holder_workflow_id for p in permits[:3])
        gone = await workflow.execute_activity_method(
            WorkflowOps.send_signals,
            order,
            summary=f"grant {len(permits)} drain permit(s): {shown}{', ...' if len(permits) > 3 else ''}",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        for run in gone.runs:
            workflow.logger.warning("grant to %s failed (it no longer runs); reclaiming", run.workflow_id)
            self._state.remove(run.workflow_id)

    async def _send_grant(self, permit: Permit) -> None:
        grant = self._grant_of(permit)
        handle = workflow.get_external_workflow_handle(permit.holder_workflow_id, run_id=permit.holder_run_id)
        try:
            await handle.signal(names.SIGNAL_PERMIT_GRANTED, grant)
        except FailureError as err:
            # The requester closed while it waited: the permit goes to the next in line.
            workflow.logger.warning("grant to %s failed (%s); reclaiming", permit.holder_workflow_id, err)
            self._state.remove(permit.holder_workflow_id)

    async def _reclaim_closed_holders(self) -> None:
        runs = [WorkflowRun(workflow_id=p.holder_workflow_id, run_id=p.holder_run_id) for p in self._state.holders]
        closed = await workflow.execute_activity_method(
            WorkflowOps.find_closed_workflows,
            WorkflowRuns(runs=runs),
            summary="find permit holders that closed without releasing",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        for run in closed.runs:
            workflow.logger.warning("reclaiming the permit of closed repair %s", run.workflow_id)
            self._state.remove(run.workflow_id)

    @workflow.signal(dynamic=True)
    def on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        self._signals_this_run += 1
        routes: dict[str, Route[Any]] = {
            names.SIGNAL_REQUEST: Route(PermitRequest, self._on_request),
            names.SIGNAL_RELEASE: Route(PermitRelease, self._on_release),
            names.SIGNAL_IMPAIRED: Route(ImpairmentReport, self._on_impaired),
            names.SIGNAL_FLEET_HOLD: Route(HoldNotice, self._duties.on_fleet_hold),
            names.SIGNAL_LAUNCH_OUTCOME: Route(LaunchOutcome, self._on_launch_outcome),
        }
        dispatch(name, payloads, routes, self._reject)

    def _on_impaired(self, report: ImpairmentReport) -> None:
        if report.group != self._state.group:
            self._reject(Rejected(f"impairment of {report.instance_id} in group {report.group!r}"))
        elif len(self._state.reported) < MAX_REPORTS_PENDING:
            self._state.reported.append(report)

    def _on_request(self, request: PermitRequest) -> None:
        if not request.token or repair_instance_of(request.holder_workflow_id) != (request.instance_id or "?"):
            # Only a repair asks, for its own instance, with a token of its own.
            self._forged_signal(f"request for {request.holder_workflow_id} that no repair would send")
            return
        held = next((p for p in self._state.holders if p.holder_workflow_id == request.holder_workflow_id), None)
        if held is not None:
            if held.token != request.token:
                self._forged_signal(f"request for holder {held.holder_workflow_id} without its token")
                return
            # A repeated request from a holder means our grant may not have reached it: send it again.
            self._side.start(self._send_grant(held))
            return
        if any(w.holder_workflow_id == request.holder_workflow_id for w in self._state.waiters):
            return
        if len(self._state.waiters) >= MAX_WAITERS:
            self._state.dropped_requests += 1
            if worth_logging(self._state.dropped_requests):
                workflow.logger.warning(
                    "drain semaphore %s: %d waiting already, request dropped", self._state.group, MAX_WAITERS
                )
            return
        if request.requested_at is None:
            request.requested_at = workflow.now()
        self._state.waiters.append(request)
        self._state.changed = True

    def _on_release(self, release: PermitRelease) -> None:
        mine = [p.token for p in self._state.holders if p.holder_workflow_id == release.holder_workflow_id]
        mine += [w.token for w in self._state.waiters if w.holder_workflow_id == release.holder_workflow_id]
        if not mine:
            return  # released already, or never held: nothing to do
        if release.token not in mine:
            self._forged_signal(f"release for {release.holder_workflow_id} without its token")
            return
        self._state.remove(release.holder_workflow_id)
        if release.replacement_instance_id:
            self._state.took_over(release.replacement_instance_id, workflow.now())

    def _on_launch_outcome(self, outcome: LaunchOutcome) -> None:
        forged = self._state.launch_outcome(outcome, workflow.now())
        if forged is not None:
            self._forged_signal(forged)

    def _reject(self, why: Rejected) -> None:
        self._state.rejected += 1
        if worth_logging(self._state.rejected):
            workflow.logger.warning("dropped signal for drain semaphore %s: %s", self._state.group, why)

    def _forged_signal(self, why: str) -> None:
        self._state.forged += 1
        workflow.set_current_details(self._details_markdown())
        if worth_logging(self._state.forged):
            workflow.logger.warning("dropped forged signal for drain semaphore %s: %s", self._state.group, why)

    # --- the Auto Scaling replacement arbiter ------------------------------------------------------------------

    @workflow.update(name=names.UPDATE_CLAIM_REPLACEMENT)
    def claim_replacement(self, claim: ReplacementClaim) -> ReplacementClaimed:
        """One new instance of the Auto Scaling group per repair: its earlier claim if still a candidate, else the
        first candidate nobody holds. A claim lasts as long as its permit."""
        self._signals_this_run += 1
        [permit] = [p for p in self._state.holders if p.holder_workflow_id == claim.holder_workflow_id]
        if permit.replacement_instance_id in claim.candidates:
            return ReplacementClaimed(instance_id=permit.replacement_instance_id)
        taken = {p.replacement_instance_id for p in self._state.holders}
        chosen = next((c for c in claim.candidates if c not in taken), None)
        if chosen is not None:
            permit.replacement_instance_id = chosen
            workflow.logger.info("replacement %s claimed by the repair of %s", chosen, claim.impaired_instance_id)
        return ReplacementClaimed(instance_id=chosen)

    @claim_replacement.validator
    def _validate_claim(self, claim: ReplacementClaim) -> None:
        holders = [p for p in self._state.holders if p.holder_workflow_id == claim.holder_workflow_id]
        if not holders or holders[0].instance_id not in ("", claim.impaired_instance_id):
            raise ApplicationError(
                f"{claim.holder_workflow_id} holds no drain permit of group {self._state.group} for "
                f"{claim.impaired_instance_id}: only a repair that drains may claim a replacement",
                type="ReplacementClaimRefused",
                non_retryable=True,
            )

    # --- live group configuration --------------------------------------------------------------------------

    @workflow.update(name=names.UPDATE_GROUP)
    async def update_group(self, update: GroupConfigUpdate) -> GroupConfigState:
        """Change the group's configuration now, or resume held repairs; each stays in this history and goes out as
        an event."""
        self._signals_this_run += 1
        if update.resume:
            await self._duties.resume(update.requested_by, update.discard_held)
            if not update.reset and update.changes() == GroupConfigOverrides():
                return self._state.config
        async with self._config_lock:
            await self._take_over_previous_config()
            try:
                # Fresh settings; also proves the worker knows the group.
                settings = await read_group_config(
                    self._state.group,
                    f"read capacity group {self._state.group} before changing it",
                    live_overrides=False,
                )
            except ActivityError as err:
                raise ApplicationError(
                    f"cannot change capacity group {self._state.group}: {activity_cause(err)}",
                    type="GroupConfigUnavailable",
                    non_retryable=True,
                ) from err
            old = self._state.config.overrides.apply(settings)
            base = GroupConfigOverrides() if update.reset else self._state.config.overrides
            overrides = base.model_copy(update=update.changes().model_dump(exclude_none=True))
            new = overrides.apply(settings)
            changed = {name for name in GroupConfigOverrides.model_fields if getattr(old, name) != getattr(new, name)}
            self._state.config = GroupConfigState(
                group=self._state.group,
                overrides=overrides,
                effective=new,
                updated_at=workflow.now(),
                updated_by=update.requested_by,
                revision=self._state.config.revision + 1,
            )
            workflow.upsert_memo(self._config_memo())
            if "max_draining_percent" in changed:
                if self._state.group_size:
                    self._state.capacity = new.max_draining(self._state.group_size)
                # A raised cap may let waiters through now, a lowered one simply grants nothing new.
                self._state.changed = True
            self._show_state()
            if "heartbeat_loss_threshold" in changed:
                await self._tell_liveness_trackers(new)
            if changed:
                old_values = old.model_dump(mode="json", include=changed)
                new_values = new.model_dump(mode="json", include=changed)
                await publish_group_event(
                    self._state.group,
                    semaphore_workflow_id(self._state.group),
                    ev.GroupConfigChanged(
                        requested_by=update.requested_by,
                        revision=self._state.config.revision,
                        changes={k: ev.ConfigChange(old=old_values[k], new=new_values[k]) for k in sorted(new_values)},
                        old=old_values,
                        new=new_values,
                    ),
                )
            return self._state.config

    async def _tell_liveness_trackers(self, group: CapacityGroup) -> None:
        """The threshold moves every deadline: the group's trackers hear of it now, not at their next run."""
        for shard in range(group.liveness_shards):
            tracker = liveness_workflow_id(self._state.group, shard, group.liveness_shards)
            try:
                await workflow.get_external_workflow_handle(tracker).signal(names.SIGNAL_GROUP_CHANGED, group)
            except Exception as err:  # not started yet: it reads the configuration when it starts
                workflow.logger.info("tracker %s not told of the new threshold: %s", tracker, err)

    async def _take_over_previous_config(self) -> None:
        if self._config_taken_over:
            return
        self._config_taken_over = True
        previous = await workflow.execute_activity_method(
            WorkflowOps.previous_group_config,
            GroupRef(group=self._state.group),
            summary="take over the live configuration an earlier run left",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        if previous.state is None or previous.state.revision <= self._state.config.revision:
            return
        self._state.config = previous.state
        workflow.upsert_memo(self._config_memo())
        workflow.logger.warning(
            "drain semaphore %s took over live configuration revision %d from run %s: %s",
            self._state.group,
            previous.state.revision,
            previous.run_id,
            previous.state.overrides.model_dump(mode="json", exclude_none=True),
        )

    def _config_memo(self) -> dict[str, object]:
        return (
            {names.GROUP_CONFIG_MEMO: self._state.config.model_dump(mode="json")} if self._state.config.revision else {}
        )

    @update_group.validator
    def _validate_update_group(self, update: GroupConfigUpdate) -> None:
        # A rejected update leaves no trace in history; the caller gets this message.
        problems = update.problems(self._state.config.effective)
        if update.resume and self._state.breaker.held is None:
            if self._state.fleet_hold is not None:
                problems.append("repairs are held by the fleet-wide breaker, not the group's: autorepair fleet resume")
            else:
                problems.append(f"repairs of {self._state.group} are not held: nothing to resume")
        if problems:
            raise ApplicationError(
                f"invalid update of capacity group {self._state.group}: {'; '.join(problems)}",
                type="InvalidGroupConfigUpdate",
                non_retryable=True,
            )

    @workflow.query(name=names.QUERY_GROUP_CONFIG)
    def group_config(self) -> GroupConfigState:
        return self._state.config

    @workflow.query(name=names.QUERY_STATE)
    def state(self) -> SemaphoreView:
        return SemaphoreView(
            group=self._state.group,
            capacity=self._state.capacity,
            group_size=self._state.group_size,
            out_of_service=self._state.out_of_service,
            launch_failures=self._state.launch_failures,
            # Tokens stay in here: a query is no way to learn one.
            holders=[p.model_copy(update={"token": ""}) for p in self._state.holders],
            waiters=[w.model_copy(update={"token": ""}) for w in self._state.waiters],
            max_holders_seen=self._state.max_holders_seen,
            rejected_signals=self._state.rejected,
            forged_signals=self._state.forged,
            dropped_requests=self._state.dropped_requests,
            breaker=self._duties.view(),
        )

    def _time_to_continue(self) -> bool:
        return workflow.info().is_continue_as_new_suggested() or self._signals_this_run >= SIGNALS_PER_RUN

    def _show_state(self) -> None:
        """The Web UI's details and the permit gauges: this workflow is the one place that knows both numbers."""
        workflow.set_current_details(self._details_markdown())
        meter = workflow.metric_meter()  # replay-safe: nothing is recorded while replaying
        attributes = {"group": self._state.group}
        meter.create_gauge(PERMITS_IN_USE, "Drain permits held by repairs").set(len(self._state.holders), attributes)
        meter.create_gauge(PERMITS_WAITING, "Repairs waiting for a drain permit").set(
            len(self._state.waiters), attributes
        )
        meter.create_gauge(REPAIRS_HELD, "1 while the group's breaker or the fleet's holds its repairs").set(
            1 if self._state.holding() else 0, attributes
        )
        meter.create_gauge(
            INSTANCES_OUT_OF_SERVICE, "Instances DRAINING without a drain permit, counted against the drain cap"
        ).set(self._state.out_of_service, attributes)

    def _details_markdown(self) -> str:
        state = self._state
        lines = [
            f"Drain cap for `{state.group}`: **{len(state.holders)} / {state.capacity}** draining "
            f"({state.group_size} instances), {len(state.waiters)} waiting",
            "",
        ]
        if state.out_of_service:
            lines += [f"{state.out_of_service} more DRAINING without a permit (counted against the cap)", ""]
        for hold in (state.breaker.held, state.fleet_hold):
            if hold is not None:
                lines += [f"**HELD since {iso(hold.tripped_at)}**: {hold.message}", ""]
        if state.launch_failures:
            seen = ", ".join(f"{zone} at {iso(at, 'seconds')}" for zone, at in sorted(state.launch_failures.items()))
            lines += [f"Launches met capacity errors in: {seen}", ""]
        lines += [f"- draining: `{p.instance_id}` ({p.holder_workflow_id})" for p in state.holders]
        lines += [f"- waiting: `{w.instance_id}` ({w.holder_workflow_id})" for w in state.waiters[:DETAILS_WAITERS]]
        if len(state.waiters) > DETAILS_WAITERS:
            lines.append(f"- ... and {len(state.waiters) - DETAILS_WAITERS} more waiting")
        if state.rejected:
            lines += ["", f"{state.rejected} malformed signals dropped"]
        if state.forged:
            lines += [
                "",
                f"**{state.forged} forged signals dropped** (not from a repair of this group, or without its token)",
            ]
        if state.dropped_requests:
            lines += ["", f"{state.dropped_requests} requests dropped: {MAX_WAITERS} were waiting already"]
        overrides = state.config.overrides.model_dump(mode="json", exclude_none=True)
        if overrides:
            pairs = ", ".join(f"{k}={v}" for k, v in overrides.items())
            by = f" by {state.config.updated_by}" if state.config.updated_by else ""
            lines += ["", f"Live configuration (revision {state.config.revision}{by}): {pairs}"]
        return "\n".join(lines)
