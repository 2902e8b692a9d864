"""Activities that talk to Temporal itself: what a workflow cannot do from inside (start an unrelated workflow,
signal-with-start, look at another workflow's status)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from opentelemetry import context as otel_context
from temporalio import activity
from temporalio.client import (
    Client,
    WorkflowContinuedAsNewError,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryRejectedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    QueryRejectCondition,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.models import (
    GroupRef,
    PermitRequestOrder,
    PreviousGroupConfig,
    RepairsOfGroup,
    SignalsToSend,
    SignalTo,
    StartRepairRequest,
    StartRepairResult,
    WithdrawRepairRequest,
    WithdrawRepairResult,
    WorkflowRun,
    WorkflowRuns,
)
from activities.semaphore_start import start_drain_semaphore
from contract import names
from contract import search_attributes as sa
from contract.concurrency import gather_at_most
from contract.groups import GroupConfigState
from contract.ids import legacy_repair_workflow_id, repair_workflow_id, semaphore_workflow_id
from contract.instances import RepairWithdrawal, RepairWithdrawalResult
from contract.repair import RepairInput, RepairPhase
from contract.semaphore import PermitRequest

# Enough closed runs to find the latest: visibility lists the most recently closed first.
_PREVIOUS_RUNS_LOOKED_AT = 20
# How long one start waits for the instance's previous attempt to close, well within the activity's timeout.
PREVIOUS_CLOSE_WAIT = timedelta(seconds=20)
# What the frontend answers for a run that does not exist (or a run id that cannot).
RUN_GONE = frozenset({RPCStatusCode.NOT_FOUND, RPCStatusCode.INVALID_ARGUMENT})
# Calls to the frontend one activity has in flight at once (send_signals' signals, a batch's describes): 200 go in a
# few round trips, neither one after another nor 200 at once.
CALLS_AT_ONCE = 32


async def live_group_config(
    client: Client, group: str, rpc_timeout: timedelta = timedelta(seconds=10)
) -> tuple[GroupConfigState | None, bool]:
    """The group's live configuration and whether its drain semaphore is running: from the running semaphore, else
    what its last run left in its memo (the next run takes that over); (None, False) when none ever ran."""
    handle = client.get_workflow_handle(semaphore_workflow_id(group))
    try:
        state = await handle.query(
            names.QUERY_GROUP_CONFIG,
            result_type=GroupConfigState,
            reject_condition=QueryRejectCondition.NOT_OPEN,
            rpc_timeout=rpc_timeout,
        )
        return state, True
    except WorkflowQueryRejectedError:
        return await committed_group_config(client, group, rpc_timeout), False
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None, False
        raise


async def committed_group_config(
    client: Client, group: str, rpc_timeout: timedelta = timedelta(seconds=10)
) -> GroupConfigState | None:
    """The group's live configuration as its drain semaphore last committed it: the memo it upserts with every change
    and carries across continue-as-new; None when none ever ran or nothing was ever changed. Read by describe, which
    the server answers alone, not by a query: a query of a semaphore busy with a surge's signals waits behind its
    workflow task, and Core drops one that expires there as a failed workflow task (benchmarks/SCALE.md, part 2)."""
    handle = client.get_workflow_handle(semaphore_workflow_id(group))
    try:
        description = await handle.describe(rpc_timeout=rpc_timeout)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    return await description.memo_value(names.GROUP_CONFIG_MEMO, None, type_hint=GroupConfigState)


class WorkflowOps:
    def __init__(self, client: Client, task_queue: str) -> None:
        self._client = client
        self._task_queue = task_queue

    def activities(self) -> list[Callable[..., Any]]:
        """The bound activity methods, for `Worker(activities=...)`."""
        return [
            self.start_repair,
            self.request_drain_permit,
            self.find_running_repairs,
            self.find_closed_workflows,
            self.send_signals,
            self.previous_group_config,
            self.withdraw_repair,
        ]

    @activity.defn
    async def start_repair(self, request: StartRepairRequest) -> StartRepairResult:
        """Start one attempt of the instance's repair, once: a second start of the attempt while it runs (or after
        it closed) is "already done", never a second repair. Attempt 0 is the legacy id, `repair/<instance>`."""
        repair = request.repair
        if repair.attempt:
            workflow_id = repair_workflow_id(repair.instance_id, repair.attempt)
        else:
            workflow_id = legacy_repair_workflow_id(repair.instance_id)
        attributes: list[SearchAttributePair[Any]] = [
            SearchAttributePair(sa.INSTANCE_ID, repair.instance_id),
            SearchAttributePair(sa.CAPACITY_GROUP, repair.group),
            SearchAttributePair(sa.REPAIR_PHASE, RepairPhase.WAITING_FOR_PERMIT.value),
        ]
        if repair.finding is not None and repair.finding.code is not None:
            attributes.append(SearchAttributePair(sa.XID, repair.finding.code))
        # A terminated instance is never repaired twice, even by a late duplicate start; only a repair that ended
        # without replacing it (withdrawn, failed) may be followed by another, when the health workflow says so.
        reuse = (
            WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY
            if request.replaces_token
            else WorkflowIDReusePolicy.REJECT_DUPLICATE
        )

        async def start() -> WorkflowHandle[Any, Any]:
            # A repair is its own story: start it in a fresh trace (one trace per repair), not as one more span of
            # the instance's long-lived health workflow, which would bury it.
            token = otel_context.attach(otel_context.Context())
            try:
                return await self._client.start_workflow(
                    names.REPAIR_WORKFLOW,
                    repair,
                    id=workflow_id,
                    task_queue=self._task_queue,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                    id_reuse_policy=reuse,
                    search_attributes=TypedSearchAttributes(attributes),
                    static_summary=request.summary,
                )
            finally:
                otel_context.detach(token)

        try:
            if request.previous_workflow_id and request.previous_workflow_id != workflow_id:
                await self._closed(request.previous_workflow_id)
            handle = await start()
            running = await self._progress_token(handle)
            if request.replaces_token and running == request.replaces_token:
                # The repair this one replaces was withdrawn and is still closing: once it has, start this one.
                with contextlib.suppress(WorkflowFailureError):
                    await handle.result(follow_runs=False)
                handle = await start()
                running = await self._progress_token(handle)
        except WorkflowAlreadyStartedError:
            return StartRepairResult(workflow_id=workflow_id, already_running=True)
        return StartRepairResult(
            workflow_id=workflow_id,
            already_running=running != repair.progress_token,
            progress_token=running,
        )

    async def _closed(self, workflow_id: str) -> None:
        """Returns once the workflow has closed, however it ended; a retryable error while it has not (it only
        hands its permit back and publishes its last events: seconds)."""
        handle = self._client.get_workflow_handle(workflow_id)
        try:
            await asyncio.wait_for(handle.result(follow_runs=False), PREVIOUS_CLOSE_WAIT.total_seconds())
        except (WorkflowFailureError, WorkflowContinuedAsNewError):
            return
        except TimeoutError:
            raise ApplicationError(
                f"{workflow_id} has not closed yet: the next repair attempt starts once it has",
                type="PreviousRepairClosing",
            ) from None
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise

    async def _progress_token(self, handle: WorkflowHandle[Any, Any]) -> str:
        """The progress token in the start input of the run now under the repair's id: ours when this call started
        it, an earlier one's when a repair was already running (USE_EXISTING)."""
        async for event in handle.fetch_history_events(page_size=1):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            (started,) = await self._client.data_converter.decode(payloads, [RepairInput])
            return str(started.progress_token)
        return ""

    @activity.defn
    async def request_drain_permit(self, order: PermitRequestOrder) -> None:
        """Signal-with-start the group's drain semaphore; the semaphore treats a repeated request as one."""
        request = PermitRequest(
            holder_workflow_id=order.holder_workflow_id,
            holder_run_id=order.holder_run_id,
            instance_id=order.instance_id,
            token=order.token,
            critical=order.critical,
        )
        await start_drain_semaphore(self._client, self._task_queue, order.group, names.SIGNAL_REQUEST, [request])

    @activity.defn
    async def find_running_repairs(self, request: RepairsOfGroup) -> WorkflowRuns:
        """The runs that are running repair workflows of the group, told by their type and their CapacityGroup
        search attribute (set at start by start_repair): the drain semaphore grants permits to nobody else."""
        running = [
            run
            for run, description in await self._describe(request.runs)
            if description is not None
            and description.status == WorkflowExecutionStatus.RUNNING
            and description.workflow_type == names.REPAIR_WORKFLOW
            and description.typed_search_attributes.get(sa.CAPACITY_GROUP) == request.group
        ]
        return WorkflowRuns(runs=running)

    @activity.defn
    async def find_closed_workflows(self, runs: WorkflowRuns) -> WorkflowRuns:
        """Which of these runs have closed (completed, failed, terminated by an operator, timed out)."""
        closed = [
            run
            for run, description in await self._describe(runs.runs)
            if description is None or description.status != WorkflowExecutionStatus.RUNNING
        ]
        return WorkflowRuns(runs=closed)

    @activity.defn
    async def send_signals(self, order: SignalsToSend) -> WorkflowRuns:
        """One signal to each run, side by side, through the frontend (a workflow's own signals reach their
        receivers one at a time through its history); the runs that no longer run come back. A retry sends them all
        again: each receiver takes a repeat as one."""

        async def send(to: SignalTo) -> WorkflowRun | None:
            handle = self._client.get_workflow_handle(to.workflow_id, run_id=to.run_id)
            try:
                await handle.signal(order.signal, to.payload)
            except RPCError as err:
                if err.status not in RUN_GONE:
                    raise
                return WorkflowRun(workflow_id=to.workflow_id, run_id=to.run_id)
            return None

        gone = await gather_at_most(CALLS_AT_ONCE, (send(to) for to in order.to))
        return WorkflowRuns(runs=[run for run in gone if run is not None])

    async def _describe(self, runs: list[WorkflowRun]) -> list[tuple[WorkflowRun, WorkflowExecutionDescription | None]]:
        """Each run with its description; None for a run that does not exist (or a run id that cannot). Side by
        side: a surge's batch of 200 requesters, described one after another, was that many round trips on the way to
        their permits."""

        async def describe(run: WorkflowRun) -> tuple[WorkflowRun, WorkflowExecutionDescription | None]:
            handle = self._client.get_workflow_handle(run.workflow_id, run_id=run.run_id)
            try:
                return run, await handle.describe()
            except RPCError as err:
                if err.status not in RUN_GONE:
                    raise
                return run, None

        return await gather_at_most(CALLS_AT_ONCE, (describe(run) for run in runs))

    @activity.defn
    async def previous_group_config(self, ref: GroupRef) -> PreviousGroupConfig:
        """The live configuration of the group's most recently closed semaphore run, from its memo."""
        workflow_id = semaphore_workflow_id(ref.group)
        query = f"WorkflowId = {sa.quoted(workflow_id)} AND ExecutionStatus != 'Running'"
        closed = [
            execution
            async for execution in self._client.list_workflows(query, limit=_PREVIOUS_RUNS_LOOKED_AT)
            if execution.close_time is not None
        ]
        if not closed:
            return PreviousGroupConfig()
        latest = max(closed, key=lambda execution: execution.close_time or datetime.min)
        state = await latest.memo_value(names.GROUP_CONFIG_MEMO, None, type_hint=GroupConfigState)
        return PreviousGroupConfig(state=state, run_id=latest.run_id)

    @activity.defn
    async def withdraw_repair(self, request: WithdrawRepairRequest) -> WithdrawRepairResult:
        """Ask a repair that waits for its drain permit to stand down, through its `withdraw_repair` update: the
        repair itself decides, so one that got its permit meanwhile is never stopped halfway through a drain."""
        handle = self._client.get_workflow_handle(request.workflow_id)
        withdrawal = RepairWithdrawal(token=request.token, reason=request.reason)
        try:
            await handle.execute_update(names.UPDATE_WITHDRAW_REPAIR, withdrawal, result_type=RepairWithdrawalResult)
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            refused = cause.message if isinstance(cause, ApplicationError) else str(cause)
            return WithdrawRepairResult(withdrawn=False, detail=refused)
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            # Closed already (it failed, or an operator terminated it): it will not touch the instance either.
            return WithdrawRepairResult(withdrawn=True, detail=f"{request.workflow_id} had closed already")
        return WithdrawRepairResult(withdrawn=True, detail=f"{request.workflow_id} withdrawn before draining")
