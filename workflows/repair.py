"""One repair per impaired instance, start-before-stop, under the group's drain cap.

Runbook:
  1. Acquire a drain permit from the group's semaphore.
  2. Set the container instance DRAINING, so no new task lands on it.
  3. Launch a replacement in the same group and availability zone (retried with backoff; never skipped).
  4. Wait until the replacement is registered and ACTIVE. One that is not within replacement_ready_timeout is
     terminated and another launched (3-4 again), at most max_replacement_attempts; then the repair fails, leaving
     the instance DRAINING (workflows/repair_replacement.py).
  5. Let the instance's tasks stop, each within its own stop timeout (durable timers); stop what is left.
  6. Terminate the impaired instance. Only now: its replacement is already serving. Where the group keeps
     evidence, it is stored in S3 first; with its quarantine, the instance is stopped and kept instead
     (workflows/repair_evidence.py).
  7. Release the permit, whatever happened above.
Under a group's `remediation = "reboot-first"`, a fault NVIDIA says a GPU reset or a reboot clears is first handled
in place after step 2, and replaced (3-6) only when that does not work (workflows/repair_reboot.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ActivityError, ApplicationError, FailureError, is_cancelled_exception

from contract import names
from contract import search_attributes as sa
from contract.formats import iso
from contract.groups import CapacityGroup
from contract.ids import health_workflow_id, semaphore_workflow_id
from contract.instances import RepairWithdrawal, RepairWithdrawalResult
from contract.repair import PhaseStep, RepairInput, RepairPhase
from contract.semaphore import PermitDenial
from workflows import repair_evidence as evidence
from workflows import repair_reboot as ladder
from workflows.group_config import read_group_config
from workflows.group_events import publish
from workflows.in_order import InOrder
from workflows.models import PermitGrant, PermitRelease, RepairProgress, RepairResult, RepairStatus
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.repair_replacement import ReplacementsExhausted, replace
from workflows.repair_replacement import describe_error as _describe
from workflows.signal_input import Rejected, decode, worth_logging

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import (
        DrainResult,
        EventType,
        FleetEvent,
        InstanceRef,
        PermitRequestOrder,
        StopTasksRequest,
    )
    from activities.workflow_ops import WorkflowOps

# A patch id: histories recorded before a step's event and its news to the health workflow went out beside the next
# step instead of in front of it.
NEWS_BESIDE_STEPS = "news-beside-steps"
# Re-ask for the permit now and then: a semaphore that was reset by an operator forgets its waiters.
PERMIT_REQUEST_REFRESH = timedelta(minutes=5)


RUNBOOK = [
    (RepairPhase.WAITING_FOR_PERMIT, "Acquire a drain permit"),
    (RepairPhase.DRAINING, "Set the container instance DRAINING"),
    (RepairPhase.LAUNCHING_REPLACEMENT, "Launch a replacement in the same AZ"),
    (RepairPhase.WAITING_FOR_REPLACEMENT, "Wait for the replacement to be ACTIVE"),
    (RepairPhase.STOPPING_TASKS, "Let tasks stop within their stop timeouts"),
    (RepairPhase.TERMINATING, "Terminate the impaired instance"),
]


@workflow.defn(name=names.REPAIR_WORKFLOW)
class InstanceRepairWorkflow:
    @workflow.init
    def __init__(self, input: RepairInput) -> None:
        self._input = input
        self._instance = InstanceRef(group=input.group, instance_id=input.instance_id)
        self._granted = False
        self._permit_requested = False
        self._phase = RepairPhase.WAITING_FOR_PERMIT
        self._notes: dict[RepairPhase, str] = {}
        self._replacement: str | None = None
        self._error: str | None = None
        self._rejected = 0
        self._forged = 0
        # Why its health workflow took it back before it got its permit (an operator's exclude or clear), if it did.
        self._withdrawn: str | None = None
        # Why the semaphore let it go while it was held by the breaker (`--resume --discard-held`), if it did.
        self._discarded: str | None = None
        # Put in our permit request; the semaphore's grant must carry it back, and our release shows it.
        self._permit_token = str(workflow.uuid4())
        self._avoid_azs: list[str] = []  # from the grant: AZs the group's launches found out of capacity
        self._timeline = [PhaseStep(phase=RepairPhase.WAITING_FOR_PERMIT, started_at=workflow.now())]
        self._ladder = ladder.Ladder()
        self._evidence_taken = False
        self._evidence: str | None = None  # the incident's evidence in S3, once stored (workflows/repair_evidence.py)
        self._runbook = RUNBOOK
        self._evidence_step = False  # the group keeps evidence: the ladder's runbook shows the step too
        self._news = InOrder()
        self._news_beside_steps = False

    @workflow.run
    async def run(self, input: RepairInput) -> RepairResult:
        self._news_beside_steps = workflow.patched(NEWS_BESIDE_STEPS)
        try:
            # Inside the try: a cancellation or a failure while the group is read is told to the health workflow like
            # any other, which would otherwise wait for this repair's progress for ever.
            group = await read_group_config(input.group, "read group config")
            ladder.choose(self, group)
            self._runbook = evidence.runbook(RUNBOOK, group)
            self._evidence_step = group.evidence_bucket is not None
            await self._event(EventType.REPAIR_STARTED, reason=input.reason)
            await self._acquire_permit()
            await self._event(EventType.DRAIN_PERMIT_GRANTED)

            await self._enter(RepairPhase.DRAINING)
            drained: DrainResult = await workflow.execute_activity_method(
                FleetActivities.set_draining,
                self._instance,
                summary=f"set {input.instance_id} DRAINING in cluster {group.cluster}",
                start_to_close_timeout=CALL_TIMEOUT,
                retry_policy=CALL_RETRY,
            )
            self._notes[RepairPhase.DRAINING] = drained.container_instance_arn.rsplit("/", 1)[-1]
            await self._event(EventType.DRAINING)

            if await ladder.fix_in_place(self, group):
                return await self._completed(*self._ladder.tasks)
            self._replacement = await replace(self, group, drained)

            await self._enter(RepairPhase.STOPPING_TASKS)
            stopped, forced = await self._let_tasks_stop(group)
            self._notes[RepairPhase.STOPPING_TASKS] = f"{stopped} tasks, {forced} stopped at their timeout"
            await self._event(EventType.TASKS_STOPPED, tasks=stopped, forced=forced)

            await evidence.keep_evidence(self, group)
            if group.quarantine:
                await evidence.quarantine(self)
            else:
                await self._enter(RepairPhase.TERMINATING)
                await workflow.execute_activity_method(
                    FleetActivities.terminate_instance,
                    self._instance,
                    summary=f"terminate impaired instance {input.instance_id}",
                    start_to_close_timeout=CALL_TIMEOUT,
                    retry_policy=CALL_RETRY,
                )
                await self._event(EventType.TERMINATED, **self._evidence_link())

            return await self._completed(stopped, forced)
        except _Withdrawn as withdrawn:
            self._error = f"withdrawn before draining: {withdrawn}"
            await self._enter(RepairPhase.CANCELLED, finished=True)
            await self._event(EventType.REPAIR_FAILED, error=self._error, reason=input.reason, timeline=self._steps())
            # Failed, not completed: the instance was not replaced, and a later repair may run under this id.
            raise ApplicationError(
                f"repair of {input.instance_id} {self._error}", type="RepairWithdrawn", non_retryable=True
            ) from None
        except _Discarded as discarded:
            self._error = f"discarded: {discarded}"
            await self._enter(RepairPhase.DISCARDED, finished=True)
            await self._event(
                EventType.REPAIR_DISCARDED, error=self._error, reason=input.reason, timeline=self._steps()
            )
            # Its instance was never touched; its health workflow puts it back to proving its fault.
            raise ApplicationError(
                f"repair of {input.instance_id} {self._error}", type="RepairDiscarded", non_retryable=True
            ) from None
        except asyncio.CancelledError:
            await self._cancelled()
            raise
        except (ActivityError, ReplacementsExhausted) as err:
            if is_cancelled_exception(err):
                # An activity cancelled along with this workflow: the operator's cancellation, not a failure to retry.
                await self._cancelled()
                raise asyncio.CancelledError from err
            self._error = _describe(err)
            await self._enter(RepairPhase.FAILED, finished=True)
            await self._event(EventType.REPAIR_FAILED, error=self._error, reason=input.reason, timeline=self._steps())
            raise ApplicationError(
                f"repair of {input.instance_id} failed: {self._error}",
                type="RepairFailed",
                non_retryable=True,
            ) from err
        finally:
            await self._release_permit()
            await self._news.flush()

    # --- steps ------------------------------------------------------------------------------------------------

    async def _cancelled(self) -> None:
        self._error = "cancelled by an operator"
        await self._enter(RepairPhase.CANCELLED, finished=True)
        await self._event(EventType.REPAIR_FAILED, error=self._error, reason=self._input.reason, timeline=self._steps())

    async def _completed(self, stopped: int, forced: int) -> RepairResult:
        """Replaced, or fixed in place (self._ladder.fix): the instance's health workflow is told which."""
        await self._enter(RepairPhase.COMPLETED, finished=True)
        await self._event(
            EventType.REPAIR_COMPLETED,
            replacement_instance_id=self._replacement,
            reason=self._input.reason,
            action=self._ladder.action.value,
            timeline=self._steps(),
            **self._evidence_link(),
        )
        return RepairResult(
            instance_id=self._input.instance_id,
            replacement_instance_id=self._replacement,
            tasks_stopped=stopped,
            tasks_forced=forced,
            timeline=self._timeline,
            action=self._ladder.action,
            escalated=self._ladder.escalated,
            evidence=self._evidence,
        )

    async def _acquire_permit(self) -> None:
        info = workflow.info()
        order = PermitRequestOrder(
            group=self._input.group,
            holder_workflow_id=info.workflow_id,
            holder_run_id=info.run_id,
            instance_id=self._input.instance_id,
            token=self._permit_token,
            critical=self._input.critical,
        )
        while not self._granted and self._withdrawn is None and self._discarded is None:
            await workflow.execute_activity_method(
                WorkflowOps.request_drain_permit,
                order,
                summary=f"ask the drain semaphore of {self._input.group} for a permit",
                start_to_close_timeout=CALL_TIMEOUT,
                retry_policy=CALL_RETRY,
            )
            self._permit_requested = True
            try:
                await workflow.wait_condition(
                    lambda: self._granted or self._withdrawn is not None or self._discarded is not None,
                    timeout=PERMIT_REQUEST_REFRESH,
                    timeout_summary="waiting for a drain permit",
                )
            except TimeoutError:
                continue
        if self._withdrawn is not None:
            # Taken back before the permit, or in the same moment: nothing was done to the instance; the permit, if
            # it came, goes back in the `finally` of run().
            raise _Withdrawn(self._withdrawn)
        if self._discarded is not None and not self._granted:
            raise _Discarded(self._discarded)

    async def _let_tasks_stop(self, group: CapacityGroup) -> tuple[int, int]:
        """Give every task its own stop timeout, counted from the start of this step, then stop what is left."""
        started = workflow.now()
        deadlines: dict[str, datetime] = {}
        forced: set[str] = set()
        while True:
            running = await workflow.execute_activity_method(
                FleetActivities.list_instance_tasks,
                self._instance,
                summary=f"list tasks still running on {self._input.instance_id}",
                start_to_close_timeout=CALL_TIMEOUT,
                retry_policy=CALL_RETRY,
            )
            if not running.tasks:
                return len(deadlines), len(forced)
            for task in running.tasks:
                deadlines.setdefault(task.task_arn, started + timedelta(seconds=task.stop_timeout_seconds))
            now = workflow.now()
            overdue = [t.task_arn for t in running.tasks if deadlines[t.task_arn] <= now and t.task_arn not in forced]
            if overdue:
                await workflow.execute_activity_method(
                    FleetActivities.stop_tasks,
                    StopTasksRequest(
                        group=self._input.group,
                        task_arns=overdue,
                        reason=f"gpu-autorepair: stop timeout reached while draining {self._input.instance_id}",
                    ),
                    summary=f"stop {len(overdue)} tasks past their stop timeout",
                    start_to_close_timeout=CALL_TIMEOUT,
                    retry_policy=CALL_RETRY,
                )
                forced.update(overdue)
                continue
            pending = [deadlines[t.task_arn] for t in running.tasks if t.task_arn not in forced]
            next_deadline = min(pending) if pending else now + group.task_poll_interval
            wait = max(min(group.task_poll_interval, next_deadline - now), timedelta(seconds=1))
            await workflow.sleep(
                wait,
                summary=f"{len(running.tasks)} tasks draining; next stop timeout at {iso(next_deadline, 'seconds')}",
            )

    async def _release_permit(self) -> None:
        if not self._permit_requested:
            return
        handle = workflow.get_external_workflow_handle(semaphore_workflow_id(self._input.group))
        try:
            release = PermitRelease(holder_workflow_id=workflow.info().workflow_id, token=self._permit_token)
            await handle.signal(names.SIGNAL_RELEASE, release)
        except FailureError as err:
            # The semaphore is gone (reset by an operator): it holds no permit of ours to release.
            workflow.logger.warning("could not release drain permit: %s", err)
        if self._granted:
            await self._event(EventType.DRAIN_PERMIT_RELEASED)

    # --- bookkeeping ------------------------------------------------------------------------------------------

    async def _enter(self, phase: RepairPhase, finished: bool = False) -> None:
        self._phase = phase
        self._timeline.append(PhaseStep(phase=phase, started_at=workflow.now()))
        updates = [sa.REPAIR_PHASE.value_set(phase.value)]
        if finished:
            updates.append(sa.OUTCOME.value_set(phase.value))
        workflow.upsert_search_attributes(updates)
        workflow.set_current_details(self._runbook_markdown())
        await self._notify_health(finished)

    async def _notify_health(self, finished: bool = False) -> None:
        progress = RepairProgress(
            workflow_id=workflow.info().workflow_id,
            phase=self._phase,
            replacement_instance_id=self._replacement,
            error=self._error,
            finished=finished,
            token=self._input.progress_token,
            in_place_fix=self._ladder.fix if finished else None,
        )
        handle = workflow.get_external_workflow_handle(health_workflow_id(self._input.instance_id))

        async def tell() -> None:
            try:
                await handle.signal(names.SIGNAL_REPAIR_PROGRESS, progress)
            except FailureError as err:
                workflow.logger.info("health workflow not told of %s: %s", progress.phase.value, err)

        await self._tell(tell)

    def _evidence_link(self) -> dict[str, str]:
        return {"evidence": self._evidence} if self._evidence is not None else {}

    def _steps(self) -> list[dict[str, Any]]:
        # Closing events carry the phase timeline; activities/metrics.py turns it into per-phase durations.
        return [s.model_dump(mode="json") for s in self._timeline]

    async def _event(self, type: EventType, **fields: Any) -> None:
        event = FleetEvent(
            event_id=str(workflow.uuid4()),
            time=workflow.now(),
            type=type,
            group=self._input.group,
            instance_id=self._input.instance_id,
            workflow_id=workflow.info().workflow_id,
            fields=fields,
        )
        # The step is done and recorded in this history: a lost event must not fail (or undo) the repair.
        await self._tell(lambda: publish(event, f"event {type.value}"))

    async def _tell(self, send: Callable[[], Awaitable[None]]) -> None:
        """Events and the health workflow's news, in the order the steps happened, beside the next step."""
        if self._news_beside_steps:
            self._news.send(send)
        else:
            await send()

    @workflow.signal(dynamic=True)
    def on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        try:
            self._on_signal(name, payloads)
        except Exception as err:  # a handler's own failure is bad input too: it must never fail the task
            self._reject(Rejected(f"signal {name!r} failed in its handler: {type(err).__name__}: {err}"[:500]))

    def _on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        if name == names.SIGNAL_PERMIT_DENIED:
            self._on_denial(decode(name, payloads, PermitDenial))
            return
        if name != names.SIGNAL_PERMIT_GRANTED:
            self._reject(Rejected(f"unknown signal {name!r}"))
            return
        grant = decode(name, payloads, PermitGrant)
        if isinstance(grant, Rejected):
            self._reject(grant)
            return
        if grant.token != self._permit_token:
            self._forged += 1
            if worth_logging(self._forged):
                workflow.logger.warning("dropped a permit grant without this repair's request token")
            workflow.set_current_details(self._runbook_markdown())
            return
        if not self._granted:
            self._granted = True
            self._avoid_azs = grant.avoid_azs
            self._notes[RepairPhase.WAITING_FOR_PERMIT] = f"granted at {iso(grant.granted_at, 'seconds')}"

    def _on_denial(self, denial: PermitDenial | Rejected) -> None:
        if isinstance(denial, Rejected):
            self._reject(denial)
        elif denial.token != self._permit_token or self._granted:
            self._forged += 1
            if worth_logging(self._forged):
                workflow.logger.warning("dropped a permit denial without this repair's request token")
        elif self._discarded is None:
            self._discarded = denial.reason or "let go by its drain semaphore"

    def _reject(self, why: Rejected) -> None:
        self._rejected += 1
        if worth_logging(self._rejected):
            workflow.logger.warning("dropped signal: %s", why)
        workflow.set_current_details(self._runbook_markdown())

    @workflow.update(name=names.UPDATE_WITHDRAW_REPAIR)
    def withdraw(self, withdrawal: RepairWithdrawal) -> RepairWithdrawalResult:
        """Its health workflow takes it back (an operator excluded the instance, or cleared its finding)."""
        if self._withdrawn is None:
            self._withdrawn = withdrawal.reason or "withdrawn by its health workflow"
        return RepairWithdrawalResult(withdrawn_at=workflow.now())

    @withdraw.validator
    def _validate_withdraw(self, withdrawal: RepairWithdrawal) -> None:
        # A refused withdrawal leaves no trace in this history; the health workflow gets the message.
        if not self._input.progress_token or withdrawal.token != self._input.progress_token:
            raise ApplicationError(
                "only the health workflow that started this repair may withdraw it",
                type="ForgedWithdrawal",
                non_retryable=True,
            )
        if self._granted and self._withdrawn is None:
            raise ApplicationError(
                f"{workflow.info().workflow_id} holds its drain permit already ({self._phase.value}): "
                "it is left to finish",
                type="RepairPastPermit",
                non_retryable=True,
            )

    @workflow.query(name=names.QUERY_STATUS)
    def status(self) -> RepairStatus:
        return RepairStatus(
            workflow_id=workflow.info().workflow_id,
            instance_id=self._input.instance_id,
            group=self._input.group,
            reason=self._input.reason,
            phase=self._phase,
            replacement_instance_id=self._replacement,
            error=self._error,
            timeline=self._timeline,
            rejected_signals=self._rejected,
            forged_signals=self._forged,
            action=self._ladder.action,
            escalated=self._ladder.escalated,
            evidence=self._evidence,
        )

    def _runbook_markdown(self) -> str:
        reason = self._input.reason
        gpu = self._input.finding.gpu.pci if self._input.finding and self._input.finding.gpu.pci else None
        title = f"### Repair of `{self._input.instance_id}` in `{self._input.group}`"
        lines = [title, f"Reason: **{reason}**" + (f" on GPU `{gpu}`" if gpu else ""), ""]
        rung = ladder.runbook_lines(self)  # the remediation ladder's steps, when it takes the rung in place
        lines += rung if rung is not None else ladder.header_lines(self)
        order = [phase for phase, _ in self._runbook]
        current = order.index(self._phase) if self._phase in order else len(order)
        for index, (phase, text) in enumerate(self._runbook if rung is None else []):
            mark = "done" if index < current else ("**now**" if index == current else "next")
            note = self._notes.get(phase)
            lines.append(f"{index + 1}. [{mark}] {text}" + (f" — {note}" if note else ""))
        if self._phase in (RepairPhase.COMPLETED, RepairPhase.FAILED, RepairPhase.CANCELLED, RepairPhase.DISCARDED):
            lines += ["", f"Outcome: **{self._phase.value}**" + (f" — {self._error}" if self._error else "")]
        if self._rejected:
            lines += ["", f"{self._rejected} malformed signals dropped"]
        if self._forged:
            lines += ["", f"**{self._forged} forged permit grants dropped** (without this repair's request token)"]
        return "\n".join(lines)


class _Discarded(Exception):
    """Raised and caught inside run(): the semaphore let the held repair go before it got its permit."""


class _Withdrawn(Exception):
    """Raised and caught inside run(): the repair was withdrawn before it got its permit."""
