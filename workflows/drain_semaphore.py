"""One drain semaphore per capacity group: never more than max(1, floor(n x pct / 100)) instances draining at once.

Requests and releases arrive as signals; a grant goes back to the requester as a signal. Permits are handed out
first come, first served. A holder that closes without releasing (terminated by an operator, crashed past its
retries) is found by a periodic check and its permit reclaimed, so one lost repair cannot block a group for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import FailureError

from workflows.models import (
    Permit,
    PermitGrant,
    PermitRelease,
    PermitRequest,
    SemaphoreInput,
    SemaphoreView,
)
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.signal_input import Rejected, decode

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import GroupRef, WorkflowRun, WorkflowRuns
    from activities.workflow_ops import WorkflowOps

SIGNAL_REQUEST = "request"
SIGNAL_RELEASE = "release"
SIGNAL_PERMIT_GRANTED = "permit_granted"
SIGNALS_PER_RUN = 2_000


@workflow.defn
class DrainSemaphoreWorkflow:
    @workflow.init
    def __init__(self, input: SemaphoreInput) -> None:
        self._group = input.group
        self._holders: list[Permit] = list(input.holders)
        self._waiters: list[PermitRequest] = list(input.waiters)
        self._max_holders_seen = input.max_holders_seen
        self._rejected = input.rejected_signals
        self._capacity = 1
        self._group_size = 0
        self._signals_this_run = 0
        self._changed = True
        # Kept so the re-sent grants are not garbage collected mid-flight.
        self._regrants: set[asyncio.Task[None]] = set()

    @workflow.run
    async def run(self, input: SemaphoreInput) -> None:
        group = await workflow.execute_activity_method(
            FleetActivities.get_group_config,
            GroupRef(group=self._group),
            summary="read group config",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        while True:
            if self._waiters and self._changed:
                self._changed = False
                await self._grant_what_fits()
            workflow.set_current_details(self._details_markdown())
            if self._time_to_continue():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(
                    SemaphoreInput(
                        group=self._group,
                        holders=self._holders,
                        waiters=self._waiters,
                        max_holders_seen=self._max_holders_seen,
                        rejected_signals=self._rejected,
                    )
                )
            try:
                await workflow.wait_condition(
                    lambda: (self._changed and bool(self._waiters)) or self._time_to_continue(),
                    # Only a group with holders needs watching: their repairs could be closed without a release.
                    timeout=group.permit_reclaim_interval if self._holders else None,
                    timeout_summary="check permit holders are alive",
                )
            except TimeoutError:
                await self._reclaim_closed_holders()

    async def _grant_what_fits(self) -> None:
        capacity = await workflow.execute_activity_method(
            FleetActivities.describe_group_capacity,
            GroupRef(group=self._group),
            summary=f"count instances in {self._group}",
            start_to_close_timeout=CALL_TIMEOUT,
            retry_policy=CALL_RETRY,
        )
        self._capacity, self._group_size = capacity.max_draining, capacity.instance_count
        while self._waiters and len(self._holders) < self._capacity:
            request = self._waiters.pop(0)
            permit = Permit(
                holder_workflow_id=request.holder_workflow_id,
                holder_run_id=request.holder_run_id,
                instance_id=request.instance_id,
                since=workflow.now(),
            )
            self._holders.append(permit)
            self._max_holders_seen = max(self._max_holders_seen, len(self._holders))
            await self._send_grant(permit)

    async def _send_grant(self, permit: Permit) -> None:
        grant = PermitGrant(group=self._group, holder_workflow_id=permit.holder_workflow_id, granted_at=permit.since)
        handle = workflow.get_external_workflow_handle(permit.holder_workflow_id, run_id=permit.holder_run_id)
        try:
            await handle.signal(SIGNAL_PERMIT_GRANTED, grant)
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
        self._holders = [p for p in self._holders if p.holder_workflow_id != holder_workflow_id]
        self._waiters = [w for w in self._waiters if w.holder_workflow_id != holder_workflow_id]
        if len(self._holders) + len(self._waiters) != before:
            self._changed = True

    @workflow.signal(dynamic=True)
    def on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        self._signals_this_run += 1
        if name == SIGNAL_REQUEST:
            request = decode(name, payloads, PermitRequest)
            if isinstance(request, Rejected):
                self._reject(request)
            else:
                self._on_request(request)
        elif name == SIGNAL_RELEASE:
            release = decode(name, payloads, PermitRelease)
            if isinstance(release, Rejected):
                self._reject(release)
            else:
                self._remove(release.holder_workflow_id)
        else:
            self._reject(Rejected(f"unknown signal {name!r}"))

    def _on_request(self, request: PermitRequest) -> None:
        held = next((p for p in self._holders if p.holder_workflow_id == request.holder_workflow_id), None)
        if held is not None:
            # A repeated request from a holder means our grant may not have reached it: send it again.
            self._regrants.add(asyncio.create_task(self._send_grant(held)))
            return
        if any(w.holder_workflow_id == request.holder_workflow_id for w in self._waiters):
            return
        if request.requested_at is None:
            request.requested_at = workflow.now()
        self._waiters.append(request)
        self._changed = True

    def _reject(self, why: Rejected) -> None:
        self._rejected += 1
        workflow.logger.warning("dropped signal for drain semaphore %s: %s", self._group, why)

    @workflow.query
    def state(self) -> SemaphoreView:
        return SemaphoreView(
            group=self._group,
            capacity=self._capacity,
            group_size=self._group_size,
            holders=self._holders,
            waiters=self._waiters,
            max_holders_seen=self._max_holders_seen,
            rejected_signals=self._rejected,
        )

    def _time_to_continue(self) -> bool:
        return workflow.info().is_continue_as_new_suggested() or self._signals_this_run >= SIGNALS_PER_RUN

    def _details_markdown(self) -> str:
        lines = [
            f"Drain cap for `{self._group}`: **{len(self._holders)} / {self._capacity}** draining "
            f"({self._group_size} instances), {len(self._waiters)} waiting",
            "",
        ]
        lines += [f"- draining: `{p.instance_id}` ({p.holder_workflow_id})" for p in self._holders]
        lines += [f"- waiting: `{w.instance_id}` ({w.holder_workflow_id})" for w in self._waiters]
        return "\n".join(lines)
