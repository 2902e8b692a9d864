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
from collections.abc import Sequence
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import ActivityError, ApplicationError, FailureError, is_cancelled_exception

from contract import event_types as ev
from contract import names
from contract.formats import iso
from contract.ids import semaphore_workflow_id
from contract.instances import RepairWithdrawal, RepairWithdrawalResult
from contract.repair import RepairInput, RepairPhase
from contract.semaphore import PermitDenial
from workflows import repair_evidence as evidence
from workflows import repair_patches, repair_runbook
from workflows import repair_reboot as ladder
from workflows.activity_errors import describe_error
from workflows.group_config import read_group_config
from workflows.models import PermitGrant, PermitRelease, RepairResult, RepairStatus
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.repair_context import NewsWay, RepairContext
from workflows.repair_record import RepairRecord
from workflows.repair_replacement import ReplacementsExhausted, replace
from workflows.repair_tasks import let_tasks_stop
from workflows.signal_input import Rejected, decode, worth_logging

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities
    from activities.models import DrainResult, PermitRequestOrder
    from activities.workflow_ops import WorkflowOps

# Re-ask for the permit now and then: a semaphore that was reset by an operator forgets its waiters.
PERMIT_REQUEST_REFRESH = timedelta(minutes=5)
RUNBOOK = repair_runbook.RUNBOOK


def news_way() -> NewsWay:
    if repair_patches.patched(repair_patches.NEWS_TOGETHER):
        return NewsWay.TOGETHER
    if repair_patches.patched(repair_patches.NEWS_BESIDE_STEPS):
        return NewsWay.BESIDE
    return NewsWay.IN_LINE


@workflow.defn(name=names.REPAIR_WORKFLOW)
class InstanceRepairWorkflow:
    @workflow.init
    def __init__(self, input: RepairInput) -> None:
        self._record = RepairRecord(
            input=input, started_at=workflow.now(), permit_token=str(workflow.uuid4()), runbook=RUNBOOK
        )
        self._repair = RepairContext(self._record)
        self._granted = False
        self._permit_requested = False
        # Why its health workflow took it back before it got its permit (an operator's exclude or clear), if it did.
        self._withdrawn: str | None = None
        # Why the semaphore let it go while it was held by the breaker (`--resume --discard-held`), if it did.
        self._discarded: str | None = None

    @workflow.run
    async def run(self, input: RepairInput) -> RepairResult:
        repair, record = self._repair, self._record
        repair.news_way = news_way()
        try:
            # Inside the try: a cancellation or a failure while the group is read is told to the health workflow like
            # any other, which would otherwise wait for this repair's progress for ever.
            group = input.group_config or await read_group_config(input.group, "read group config")
            record.ladder.choose(input, group, workflow.now())
            record.runbook = repair_runbook.for_group(group)
            record.evidence_step = group.evidence_bucket is not None
            await repair.event(ev.RepairStarted(reason=input.reason))
            await self._acquire_permit()
            await repair.event(ev.DrainPermitGranted())

            await repair.enter(RepairPhase.DRAINING)
            with repair.quick_step():
                drained: DrainResult = await workflow.execute_activity_method(
                    FleetActivities.set_draining,
                    repair.instance,
                    summary=f"set {input.instance_id} DRAINING in cluster {group.cluster}",
                    start_to_close_timeout=CALL_TIMEOUT,
                    retry_policy=CALL_RETRY,
                )
            record.container_instance_arn = drained.container_instance_arn
            record.notes[RepairPhase.DRAINING] = drained.container_instance_arn.rsplit("/", 1)[-1]
            await repair.event(ev.Draining())

            if await ladder.fix_in_place(repair, group):
                return await self._completed(*record.ladder.tasks)
            record.replacement = await replace(repair, group, drained)

            stopped, forced = await let_tasks_stop(repair, group)

            await evidence.keep_evidence(repair, group)
            if group.quarantine:
                await evidence.quarantine(repair)
            else:
                await repair.enter(RepairPhase.TERMINATING)
                with repair.quick_step():
                    await workflow.execute_activity_method(
                        FleetActivities.terminate_instance,
                        repair.known_instance(),
                        summary=f"terminate impaired instance {input.instance_id}",
                        start_to_close_timeout=CALL_TIMEOUT,
                        retry_policy=CALL_RETRY,
                    )
                await repair.event(ev.Terminated(evidence=record.evidence))

            return await self._completed(stopped, forced)
        except _Withdrawn as withdrawn:
            await self._failed(RepairPhase.CANCELLED, f"withdrawn before draining: {withdrawn}")
            # Failed, not completed: the instance was not replaced, and a later repair may run under this id.
            raise ApplicationError(
                f"repair of {input.instance_id} {record.error}", type="RepairWithdrawn", non_retryable=True
            ) from None
        except _Discarded as discarded:
            await self._failed(RepairPhase.DISCARDED, f"discarded: {discarded}", ev.RepairDiscarded)
            # Its instance was never touched; its health workflow puts it back to proving its fault.
            raise ApplicationError(
                f"repair of {input.instance_id} {record.error}", type="RepairDiscarded", non_retryable=True
            ) from None
        except asyncio.CancelledError:
            await self._cancelled()
            raise
        except (ActivityError, ReplacementsExhausted) as err:
            if is_cancelled_exception(err):
                # An activity cancelled along with this workflow: the operator's cancellation, not a failure to retry.
                await self._cancelled()
                raise asyncio.CancelledError from err
            await self._failed(RepairPhase.FAILED, describe_error(err))
            raise ApplicationError(
                f"repair of {input.instance_id} failed: {record.error}",
                type="RepairFailed",
                non_retryable=True,
            ) from err
        finally:
            await self._release_permit()
            await repair.flush()

    # --- steps ------------------------------------------------------------------------------------------------

    async def _cancelled(self) -> None:
        await self._failed(RepairPhase.CANCELLED, "cancelled by an operator")

    async def _failed(self, phase: RepairPhase, error: str, event: type[ev.RepairFailed] = ev.RepairFailed) -> None:
        record = self._record
        record.error = error
        await self._repair.enter(phase, finished=True)
        await self._repair.event(event(error=error, reason=record.input.reason, timeline=list(record.timeline)))

    async def _completed(self, stopped: int, forced: int) -> RepairResult:
        """Replaced, or fixed in place (its ladder's fix): the instance's health workflow is told which."""
        record = self._record
        await self._repair.enter(RepairPhase.COMPLETED, finished=True)
        await self._repair.event(
            ev.RepairCompleted(
                replacement_instance_id=record.replacement,
                reason=record.input.reason,
                action=record.ladder.action,
                timeline=list(record.timeline),
                evidence=record.evidence,
            )
        )
        return RepairResult(
            instance_id=record.instance_id,
            replacement_instance_id=record.replacement,
            tasks_stopped=stopped,
            tasks_forced=forced,
            timeline=record.timeline,
            action=record.ladder.action,
            escalated=record.ladder.escalated,
            evidence=record.evidence,
        )

    async def _acquire_permit(self) -> None:
        info = workflow.info()
        order = PermitRequestOrder(
            group=self._record.input.group,
            holder_workflow_id=info.workflow_id,
            holder_run_id=info.run_id,
            instance_id=self._record.input.instance_id,
            token=self._record.permit_token,
            critical=self._record.input.critical,
        )
        while not self._granted and self._withdrawn is None and self._discarded is None:
            await workflow.execute_activity_method(
                WorkflowOps.request_drain_permit,
                order,
                summary=f"ask the drain semaphore of {self._record.input.group} for a permit",
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

    async def _release_permit(self) -> None:
        if not self._permit_requested:
            return
        handle = workflow.get_external_workflow_handle(semaphore_workflow_id(self._record.input.group))
        try:
            record = self._record
            took_over = record.replacement if record.phase is RepairPhase.COMPLETED else None
            release = PermitRelease(
                holder_workflow_id=workflow.info().workflow_id,
                token=record.permit_token,
                replacement_instance_id=took_over,
            )
            await handle.signal(names.SIGNAL_RELEASE, release)
        except FailureError as err:
            # The semaphore is gone (reset by an operator): it holds no permit of ours to release.
            workflow.logger.warning("could not release drain permit: %s", err)
        if self._granted:
            await self._repair.event(ev.DrainPermitReleased())

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
        if grant.token != self._record.permit_token:
            self._record.forged += 1
            if worth_logging(self._record.forged):
                workflow.logger.warning("dropped a permit grant without this repair's request token")
            self._repair.show()
            return
        if not self._granted:
            self._granted = True
            self._record.avoid_azs = grant.avoid_azs
            self._record.notes[RepairPhase.WAITING_FOR_PERMIT] = f"granted at {iso(grant.granted_at, 'seconds')}"

    def _on_denial(self, denial: PermitDenial | Rejected) -> None:
        if isinstance(denial, Rejected):
            self._reject(denial)
        elif denial.token != self._record.permit_token or self._granted:
            self._record.forged += 1
            if worth_logging(self._record.forged):
                workflow.logger.warning("dropped a permit denial without this repair's request token")
        elif self._discarded is None:
            self._discarded = denial.reason or "let go by its drain semaphore"

    def _reject(self, why: Rejected) -> None:
        self._record.rejected += 1
        if worth_logging(self._record.rejected):
            workflow.logger.warning("dropped signal: %s", why)
        self._repair.show()

    @workflow.update(name=names.UPDATE_WITHDRAW_REPAIR)
    def withdraw(self, withdrawal: RepairWithdrawal) -> RepairWithdrawalResult:
        """Its health workflow takes it back (an operator excluded the instance, or cleared its finding)."""
        if self._withdrawn is None:
            self._withdrawn = withdrawal.reason or "withdrawn by its health workflow"
        return RepairWithdrawalResult(withdrawn_at=workflow.now())

    @withdraw.validator
    def _validate_withdraw(self, withdrawal: RepairWithdrawal) -> None:
        # A refused withdrawal leaves no trace in this history; the health workflow gets the message.
        if not self._record.input.progress_token or withdrawal.token != self._record.input.progress_token:
            raise ApplicationError(
                "only the health workflow that started this repair may withdraw it",
                type="ForgedWithdrawal",
                non_retryable=True,
            )
        if self._granted and self._withdrawn is None:
            raise ApplicationError(
                f"{workflow.info().workflow_id} holds its drain permit already ({self._record.phase.value}): "
                "it is left to finish",
                type="RepairPastPermit",
                non_retryable=True,
            )

    @workflow.query(name=names.QUERY_STATUS)
    def status(self) -> RepairStatus:
        return RepairStatus(
            workflow_id=workflow.info().workflow_id,
            instance_id=self._record.input.instance_id,
            group=self._record.input.group,
            reason=self._record.input.reason,
            phase=self._record.phase,
            replacement_instance_id=self._record.replacement,
            error=self._record.error,
            timeline=self._record.timeline,
            rejected_signals=self._record.rejected,
            forged_signals=self._record.forged,
            action=self._record.ladder.action,
            escalated=self._record.ladder.escalated,
            evidence=self._record.evidence,
        )


class _Discarded(Exception):
    """Raised and caught inside run(): the semaphore let the held repair go before it got its permit."""


class _Withdrawn(Exception):
    """Raised and caught inside run(): the repair was withdrawn before it got its permit."""
