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
from datetime import datetime
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

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
from workflows.breaker import BreakerBook
from workflows.group_config import read_group_config
from workflows.group_events import activity_cause, publish_group_event
from workflows.models import Permit, PermitGrant, PermitRelease, SemaphoreRun, SemaphoreView
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.semaphore_breaker import SemaphoreBreaker
from workflows.semaphore_zones import SemaphoreZones
from workflows.signal_input import Rejected, Route, dispatch, worth_logging

with workflow.unsafe.imports_passed_through():
    from activities.breaker_ops import BreakerOps
    from activities.models import (
        EventType,
        GroupRef,
        RepairsOfGroup,
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
DETAILS_WAITERS = 20
# Impairments reported and not yet counted (the loop counts them at its next turn): bounded like all state.
MAX_REPORTS_PENDING = 10_000
PERMITS_IN_USE = "autorepair_drain_permits_in_use"
PERMITS_WAITING = "autorepair_drain_permits_waiting"


@workflow.defn(name=names.SEMAPHORE_WORKFLOW)
class DrainSemaphoreWorkflow(SemaphoreBreaker, SemaphoreZones):
    @workflow.init
    def __init__(self, input: SemaphoreRun) -> None:
        self._group = input.group
        self._holders: list[Permit] = list(input.holders)
        self._waiters: list[PermitRequest] = list(input.waiters)
        self._max_holders_seen = input.max_holders_seen
        self._rejected = input.rejected_signals
        self._forged = input.forged_signals
        self._dropped_requests = input.dropped_requests
        self._config = input.config or GroupConfigState(group=input.group)
        self._breaker = input.breaker or BreakerBook()
        self._fleet_hold = input.fleet_hold
        self._launch_failures = dict(input.launch_failures)
        # A fresh start asks the fleet breaker whether it holds: its notice went out while no run was listening.
        self._fleet_asked = input.breaker is not None
        self._reported: list[ImpairmentReport] = []
        # A fresh start (not continue-as-new) first takes over what an earlier run left, e.g. one an operator
        # terminated: overrides such as auto_repair=DISABLED must not silently revert to the settings.
        self._config_taken_over = input.config is not None
        # One configuration change at a time: each reads the group, then applies on top of the previous one.
        self._config_lock = asyncio.Lock()
        self._capacity = 1
        self._out_of_service = 0
        self._unheld_draining: set[str] = set()
        self._group_size = 0
        self._signals_this_run = 0
        self._changed = True
        self._fewer_round_trips = False
        self._fleet_reports_beside = False
        self._grants_beside = False
        # Sends the loop does not wait for (fleet reports, grants, re-sent grants, denials of discarded repairs): kept
        # so they are not garbage collected mid-flight, and awaited before continue-as-new.
        self._in_flight: set[asyncio.Task[None]] = set()
        self._measured_at: datetime | None = None
        self._holder_left = False  # since the last count: its instance may still be out of service

    @workflow.run
    async def run(self, input: SemaphoreRun) -> None:
        self._fewer_round_trips = workflow.patched(FEWER_ROUND_TRIPS)
        self._fleet_reports_beside = workflow.patched(FLEET_REPORTS_BESIDE)
        self._grants_beside = workflow.patched(GRANTS_BESIDE)
        async with self._config_lock:
            await self._take_over_previous_config()
        settings = await read_group_config(self._group, "read group settings", live_overrides=False)
        # Applied after the read: an update may have landed while it was in flight.
        group = self._config.overrides.apply(settings)
        self._config = self._config.model_copy(update={"effective": group})
        if not self._fleet_asked:
            self._fleet_asked = True
            answer = await workflow.execute_activity_method(
                BreakerOps.fleet_hold,
                FleetHoldQuery(group=self._group),
                summary="ask the fleet breaker whether it holds repairs",
                start_to_close_timeout=CALL_TIMEOUT,
                retry_policy=CALL_RETRY,
            )
            self._fleet_hold = self._fleet_hold or answer.held
        while True:
            if self._reported:
                await self._count_impairments(self._config.effective or group)
            if self._changed:
                # Every change wakes the loop, so the details and gauges never show a released permit as held.
                self._changed = False
                if self._waiters:
                    await self._grant_what_fits(self._config.effective or group)
            self._show_state()
            if self._time_to_continue():
                await workflow.wait_condition(lambda: workflow.all_handlers_finished() and not self._in_flight)
                workflow.continue_as_new(
                    SemaphoreRun(
                        group=self._group,
                        holders=self._holders,
                        waiters=self._waiters,
                        max_holders_seen=self._max_holders_seen,
                        rejected_signals=self._rejected,
                        forged_signals=self._forged,
                        dropped_requests=self._dropped_requests,
                        config=self._config,
                        breaker=self._breaker,
                        fleet_hold=self._fleet_hold,
                        launch_failures=self._launch_failures,
                    ),
                    memo=self._config_memo(),
                )
            try:
                await workflow.wait_condition(
                    lambda: self._changed or bool(self._reported) or self._time_to_continue(),
                    timeout=self._next_wake(self._config.effective or group),
                    timeout_summary=self._wake_summary(),
                )
            except TimeoutError:
                if self._holders:
                    await self._reclaim_closed_holders()
                self._changed = True  # a maintenance window may have opened

    async def _grant_what_fits(self, group: CapacityGroup) -> None:
        if not self._fewer_round_trips or self._count_due(group):
            await self._measure()
        while self._waiters:
            group = self._config.effective or group  # an update may have landed while we awaited
            while self._reported:
                # Impairments that arrived while we looked count before any grant: never a grant past the rule.
                await self._count_impairments(group)
            if self._holding() or await self._trip_if_over(group, budget=True):
                return  # held: the waiters wait for an operator's resume
            batch = self._fitting([w for w in self._waiters if self._may_run_now(w, group)])
            if not batch:
                return  # no room, or only repairs that wait for a maintenance window
            if group.max_repairs_per_day is not None:
                batch = batch[: max(1, group.max_repairs_per_day - len(self._breaker.grants))]
            genuine = await self._running_repairs_of_group(batch)
            # What arrived while we looked (impairments, a fleet hold) counts before this batch is granted.
            while self._reported:
                await self._count_impairments(group)
            if self._holding() or await self._trip_if_over(group, budget=True):
                return
            if self._fewer_round_trips:
                # Nothing can land between two grants of one step: the batch is decided as a whole, then told.
                waiting = len(self._waiters)
                granted = self._grant(batch, genuine)
                if self._grants_beside:
                    for permit in granted:
                        self._beside(self._send_grant(permit))  # a grant that fails frees its permit (_changed)
                else:
                    await asyncio.gather(*(self._send_grant(permit) for permit in granted))
                if len(self._waiters) == waiting:
                    return  # the room shrank while we looked: the next change wakes us
                continue
            for request in batch:
                if request not in self._waiters:
                    continue  # released while we looked
                # Each grant awaits its signal: a hold, impairments or an update may land between two of a batch.
                if workflow.patched(RECHECK_EACH_GRANT) and await self._held_before_grant():
                    return
                self._waiters.remove(request)
                if request.holder_workflow_id not in genuine:
                    self._forged_signal(f"request for {request.holder_workflow_id}, not a running repair of the group")
                    continue
                if not self._fits(request):
                    self._waiters.insert(0, request)
                    break
                await self._send_grant(self._hold(request))

    def _count_due(self, group: CapacityGroup) -> bool:
        """Counting the group costs a page of ECS and EC2 calls per 100 instances: only when the count may have moved
        under us (a holder left, whose instance may stay DRAINING) or is older than the reclaim interval."""
        if self._measured_at is None or self._holder_left:
            return True
        return workflow.now() - self._measured_at >= group.permit_reclaim_interval

    def _grant(self, batch: Sequence[PermitRequest], genuine: set[str]) -> list[Permit]:
        """The permits of one batch, in order, while they fit; a request from no running repair is dropped."""
        granted: list[Permit] = []
        for request in batch:
            if request not in self._waiters:
                continue  # released while we looked
            if request.holder_workflow_id not in genuine:
                self._waiters.remove(request)
                self._forged_signal(f"request for {request.holder_workflow_id}, not a running repair of the group")
                continue
            if not self._fits(request):
                break
            self._waiters.remove(request)
            granted.append(self._hold(request))
        return granted

    def _hold(self, request: PermitRequest) -> Permit:
        self._take_out_of_service(request.instance_id)
        permit = Permit(
            holder_workflow_id=request.holder_workflow_id,
            holder_run_id=request.holder_run_id,
            instance_id=request.instance_id,
            since=workflow.now(),
            token=request.token,
        )
        self._holders.append(permit)
        self._breaker.granted(workflow.now())
        self._max_holders_seen = max(self._max_holders_seen, len(self._holders))
        return permit

    async def _held_before_grant(self) -> bool:
        group = self._config.effective
        if group is None:
            return self._holding()
        while self._reported:
            await self._count_impairments(group)
        return self._holding() or await self._trip_if_over(group, budget=True)

    async def _running_repairs_of_group(self, requests: Sequence[PermitRequest]) -> set[str]:
        """The requesters that are running repair workflows of this group: a permit goes to nobody else (a
        workflow that never closes would otherwise hold one for ever)."""
        found = await workflow.execute_activity_method(
            WorkflowOps.find_running_repairs,
            RepairsOfGroup(
                group=self._group,
                runs=[WorkflowRun(workflow_id=r.holder_workflow_id, run_id=r.holder_run_id) for r in requests],
            ),
            summary=f"check {len(requests)} permit requests come from repairs of {self._group}",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        return {run.workflow_id for run in found.runs}

    async def _send_grant(self, permit: Permit) -> None:
        grant = PermitGrant(
            group=self._group,
            holder_workflow_id=permit.holder_workflow_id,
            granted_at=permit.since,
            token=permit.token,
            avoid_azs=self._avoid_azs(),
        )
        handle = workflow.get_external_workflow_handle(permit.holder_workflow_id, run_id=permit.holder_run_id)
        try:
            await handle.signal(names.SIGNAL_PERMIT_GRANTED, grant)
        except FailureError as err:
            # The requester closed while it waited: the permit goes to the next in line.
            workflow.logger.warning("grant to %s failed (%s); reclaiming", permit.holder_workflow_id, err)
            self._remove(permit.holder_workflow_id)

    async def _reclaim_closed_holders(self) -> None:
        runs = [WorkflowRun(workflow_id=p.holder_workflow_id, run_id=p.holder_run_id) for p in self._holders]
        closed = await workflow.execute_activity_method(
            WorkflowOps.find_closed_workflows,
            WorkflowRuns(runs=runs),
            summary="find permit holders that closed without releasing",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        for run in closed.runs:
            workflow.logger.warning("reclaiming the permit of closed repair %s", run.workflow_id)
            self._remove(run.workflow_id)

    def _remove(self, holder_workflow_id: str) -> None:
        before = len(self._holders) + len(self._waiters)
        holders = len(self._holders)
        self._holders = [p for p in self._holders if p.holder_workflow_id != holder_workflow_id]
        self._holder_left = self._holder_left or len(self._holders) != holders
        self._waiters = [w for w in self._waiters if w.holder_workflow_id != holder_workflow_id]
        if len(self._holders) + len(self._waiters) != before:
            self._changed = True

    @workflow.signal(dynamic=True)
    def on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        self._signals_this_run += 1
        routes: dict[str, Route[Any]] = {
            names.SIGNAL_REQUEST: Route(PermitRequest, self._on_request),
            names.SIGNAL_RELEASE: Route(PermitRelease, self._on_release),
            names.SIGNAL_IMPAIRED: Route(ImpairmentReport, self._on_impaired),
            names.SIGNAL_FLEET_HOLD: Route(HoldNotice, self._on_fleet_hold),
            names.SIGNAL_LAUNCH_OUTCOME: Route(LaunchOutcome, self._on_launch_outcome),
        }
        dispatch(name, payloads, routes, self._reject)

    def _on_impaired(self, report: ImpairmentReport) -> None:
        if report.group != self._group:
            self._reject(Rejected(f"impairment of {report.instance_id} in group {report.group!r}"))
        elif len(self._reported) < MAX_REPORTS_PENDING:
            self._reported.append(report)

    def _on_request(self, request: PermitRequest) -> None:
        if not request.token or repair_instance_of(request.holder_workflow_id) != (request.instance_id or "?"):
            # Only a repair asks, for its own instance, with a token of its own.
            self._forged_signal(f"request for {request.holder_workflow_id} that no repair would send")
            return
        held = next((p for p in self._holders if p.holder_workflow_id == request.holder_workflow_id), None)
        if held is not None:
            if held.token != request.token:
                self._forged_signal(f"request for holder {held.holder_workflow_id} without its token")
                return
            # A repeated request from a holder means our grant may not have reached it: send it again.
            self._beside(self._send_grant(held))
            return
        if any(w.holder_workflow_id == request.holder_workflow_id for w in self._waiters):
            return
        if len(self._waiters) >= MAX_WAITERS:
            self._dropped_requests += 1
            if worth_logging(self._dropped_requests):
                workflow.logger.warning(
                    "drain semaphore %s: %d waiting already, request dropped", self._group, MAX_WAITERS
                )
            return
        if request.requested_at is None:
            request.requested_at = workflow.now()
        self._waiters.append(request)
        self._changed = True

    def _on_release(self, release: PermitRelease) -> None:
        mine = [p.token for p in self._holders if p.holder_workflow_id == release.holder_workflow_id]
        mine += [w.token for w in self._waiters if w.holder_workflow_id == release.holder_workflow_id]
        if not mine:
            return  # released already, or never held: nothing to do
        if release.token not in mine:
            self._forged_signal(f"release for {release.holder_workflow_id} without its token")
            return
        self._remove(release.holder_workflow_id)

    def _reject(self, why: Rejected) -> None:
        self._rejected += 1
        if worth_logging(self._rejected):
            workflow.logger.warning("dropped signal for drain semaphore %s: %s", self._group, why)

    def _forged_signal(self, why: str) -> None:
        self._forged += 1
        workflow.set_current_details(self._details_markdown())
        if worth_logging(self._forged):
            workflow.logger.warning("dropped forged signal for drain semaphore %s: %s", self._group, why)

    # --- the Auto Scaling replacement arbiter ------------------------------------------------------------------

    @workflow.update(name=names.UPDATE_CLAIM_REPLACEMENT)
    def claim_replacement(self, claim: ReplacementClaim) -> ReplacementClaimed:
        """One new instance of the Auto Scaling group per repair: its earlier claim if still a candidate, else the
        first candidate nobody holds. A claim lasts as long as its permit."""
        self._signals_this_run += 1
        [permit] = [p for p in self._holders if p.holder_workflow_id == claim.holder_workflow_id]
        if permit.replacement_instance_id in claim.candidates:
            return ReplacementClaimed(instance_id=permit.replacement_instance_id)
        taken = {p.replacement_instance_id for p in self._holders}
        chosen = next((c for c in claim.candidates if c not in taken), None)
        if chosen is not None:
            permit.replacement_instance_id = chosen
            workflow.logger.info("replacement %s claimed by the repair of %s", chosen, claim.impaired_instance_id)
        return ReplacementClaimed(instance_id=chosen)

    @claim_replacement.validator
    def _validate_claim(self, claim: ReplacementClaim) -> None:
        holders = [p for p in self._holders if p.holder_workflow_id == claim.holder_workflow_id]
        if not holders or holders[0].instance_id not in ("", claim.impaired_instance_id):
            raise ApplicationError(
                f"{claim.holder_workflow_id} holds no drain permit of group {self._group} for "
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
            await self._resume(update.requested_by, update.discard_held)
            if not update.reset and update.changes() == GroupConfigOverrides():
                return self._config
        async with self._config_lock:
            await self._take_over_previous_config()
            try:
                # Fresh settings; also proves the worker knows the group.
                settings = await read_group_config(
                    self._group, f"read capacity group {self._group} before changing it", live_overrides=False
                )
            except ActivityError as err:
                raise ApplicationError(
                    f"cannot change capacity group {self._group}: {activity_cause(err)}",
                    type="GroupConfigUnavailable",
                    non_retryable=True,
                ) from err
            old = self._config.overrides.apply(settings)
            base = GroupConfigOverrides() if update.reset else self._config.overrides
            overrides = base.model_copy(update=update.changes().model_dump(exclude_none=True))
            new = overrides.apply(settings)
            changed = {name for name in GroupConfigOverrides.model_fields if getattr(old, name) != getattr(new, name)}
            self._config = GroupConfigState(
                group=self._group,
                overrides=overrides,
                effective=new,
                updated_at=workflow.now(),
                updated_by=update.requested_by,
                revision=self._config.revision + 1,
            )
            workflow.upsert_memo(self._config_memo())
            if "max_draining_percent" in changed:
                if self._group_size:
                    self._capacity = new.max_draining(self._group_size)
                # A raised cap may let waiters through now, a lowered one simply grants nothing new.
                self._changed = True
            self._show_state()
            if "heartbeat_loss_threshold" in changed:
                await self._tell_liveness_trackers(new)
            if changed:
                old_values = old.model_dump(mode="json", include=changed)
                new_values = new.model_dump(mode="json", include=changed)
                await publish_group_event(
                    self._group,
                    semaphore_workflow_id(self._group),
                    EventType.GROUP_CONFIG_CHANGED,
                    {
                        "requested_by": update.requested_by,
                        "revision": self._config.revision,
                        "changes": {k: {"old": old_values[k], "new": new_values[k]} for k in sorted(new_values)},
                        "old": old_values,
                        "new": new_values,
                    },
                )
            return self._config

    async def _tell_liveness_trackers(self, group: CapacityGroup) -> None:
        """The threshold moves every deadline: the group's trackers hear of it now, not at their next run."""
        for shard in range(group.liveness_shards):
            tracker = liveness_workflow_id(self._group, shard, group.liveness_shards)
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
            GroupRef(group=self._group),
            summary="take over the live configuration an earlier run left",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        if previous.state is None or previous.state.revision <= self._config.revision:
            return
        self._config = previous.state
        workflow.upsert_memo(self._config_memo())
        workflow.logger.warning(
            "drain semaphore %s took over live configuration revision %d from run %s: %s",
            self._group,
            previous.state.revision,
            previous.run_id,
            previous.state.overrides.model_dump(mode="json", exclude_none=True),
        )

    def _config_memo(self) -> dict[str, object]:
        return {names.GROUP_CONFIG_MEMO: self._config.model_dump(mode="json")} if self._config.revision else {}

    @update_group.validator
    def _validate_update_group(self, update: GroupConfigUpdate) -> None:
        # A rejected update leaves no trace in history; the caller gets this message.
        problems = update.problems(self._config.effective)
        if update.resume and self._breaker.held is None:
            if self._fleet_hold is not None:
                problems.append("repairs are held by the fleet-wide breaker, not the group's: autorepair fleet resume")
            else:
                problems.append(f"repairs of {self._group} are not held: nothing to resume")
        if problems:
            raise ApplicationError(
                f"invalid update of capacity group {self._group}: {'; '.join(problems)}",
                type="InvalidGroupConfigUpdate",
                non_retryable=True,
            )

    @workflow.query(name=names.QUERY_GROUP_CONFIG)
    def group_config(self) -> GroupConfigState:
        return self._config

    @workflow.query(name=names.QUERY_STATE)
    def state(self) -> SemaphoreView:
        return SemaphoreView(
            group=self._group,
            capacity=self._capacity,
            group_size=self._group_size,
            out_of_service=self._out_of_service,
            launch_failures=self._launch_failures,
            # Tokens stay in here: a query is no way to learn one.
            holders=[p.model_copy(update={"token": ""}) for p in self._holders],
            waiters=[w.model_copy(update={"token": ""}) for w in self._waiters],
            max_holders_seen=self._max_holders_seen,
            rejected_signals=self._rejected,
            forged_signals=self._forged,
            dropped_requests=self._dropped_requests,
            breaker=self._breaker_view(),
        )

    def _time_to_continue(self) -> bool:
        return workflow.info().is_continue_as_new_suggested() or self._signals_this_run >= SIGNALS_PER_RUN

    def _show_state(self) -> None:
        """The Web UI's details and the permit gauges: this workflow is the one place that knows both numbers."""
        workflow.set_current_details(self._details_markdown())
        meter = workflow.metric_meter()  # replay-safe: nothing is recorded while replaying
        attributes = {"group": self._group}
        meter.create_gauge(PERMITS_IN_USE, "Drain permits held by repairs").set(len(self._holders), attributes)
        meter.create_gauge(PERMITS_WAITING, "Repairs waiting for a drain permit").set(len(self._waiters), attributes)

    def _details_markdown(self) -> str:
        lines = [
            f"Drain cap for `{self._group}`: **{len(self._holders)} / {self._capacity}** draining "
            f"({self._group_size} instances), {len(self._waiters)} waiting",
            "",
        ]
        if self._out_of_service:
            lines += [f"{self._out_of_service} more DRAINING without a permit (counted against the cap)", ""]
        for hold in (self._breaker.held, self._fleet_hold):
            if hold is not None:
                lines += [f"**HELD since {iso(hold.tripped_at)}**: {hold.message}", ""]
        if self._launch_failures:
            seen = ", ".join(f"{zone} at {iso(at, 'seconds')}" for zone, at in sorted(self._launch_failures.items()))
            lines += [f"Launches met capacity errors in: {seen}", ""]
        lines += [f"- draining: `{p.instance_id}` ({p.holder_workflow_id})" for p in self._holders]
        lines += [f"- waiting: `{w.instance_id}` ({w.holder_workflow_id})" for w in self._waiters[:DETAILS_WAITERS]]
        if len(self._waiters) > DETAILS_WAITERS:
            lines.append(f"- ... and {len(self._waiters) - DETAILS_WAITERS} more waiting")
        if self._rejected:
            lines += ["", f"{self._rejected} malformed signals dropped"]
        if self._forged:
            lines += [
                "",
                f"**{self._forged} forged signals dropped** (not from a repair of this group, or without its token)",
            ]
        if self._dropped_requests:
            lines += ["", f"{self._dropped_requests} requests dropped: {MAX_WAITERS} were waiting already"]
        overrides = self._config.overrides.model_dump(mode="json", exclude_none=True)
        if overrides:
            pairs = ", ".join(f"{k}={v}" for k, v in overrides.items())
            by = f" by {self._config.updated_by}" if self._config.updated_by else ""
            lines += ["", f"Live configuration (revision {self._config.revision}{by}): {pairs}"]
        return "\n".join(lines)
