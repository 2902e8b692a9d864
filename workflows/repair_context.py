"""What every step of a repair does besides its own work: enter its phase, say so (an event, the health workflow's
news, the Web UI's runbook), in the order the steps happened.

Each step module (repair_replacement, repair_zones, repair_reboot, repair_evidence, repair_tasks) takes one
RepairContext: the repair's record to read and write, and these. The workflow (workflows/repair.py) makes it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from temporalio import workflow
from temporalio.exceptions import FailureError

from contract import names
from contract import search_attributes as sa
from contract.event_types import EventDetail
from contract.ids import health_workflow_id
from contract.repair import RepairPhase
from workflows import repair_runbook
from workflows.group_events import publish
from workflows.in_order import InOrder
from workflows.models import RepairProgress
from workflows.repair_record import RepairRecord

with workflow.unsafe.imports_passed_through():
    from activities.models import FleetEvent, InstanceRef, KnownInstance


class RepairContext:
    def __init__(self, record: RepairRecord) -> None:
        self.record = record
        self.instance = InstanceRef(group=record.group, instance_id=record.instance_id)
        # Set by the workflow's run(): histories from before the patch told each step's news in front of the next.
        self.news_beside_steps = False
        self._news = InOrder()

    def known_instance(self) -> KnownInstance:
        """The impaired instance with its container instance, once set_draining found it."""
        record = self.record
        return KnownInstance(
            group=record.group, instance_id=record.instance_id, container_instance_arn=record.container_instance_arn
        )

    async def enter(self, phase: RepairPhase, finished: bool = False) -> None:
        self.record.enter(phase, workflow.now())
        updates = [sa.REPAIR_PHASE.value_set(phase.value)]
        if finished:
            updates.append(sa.OUTCOME.value_set(phase.value))
        workflow.upsert_search_attributes(updates)
        self.show()
        await self.notify_health(finished)

    def show(self) -> None:
        workflow.set_current_details(repair_runbook.markdown(self.record))

    async def notify_health(self, finished: bool = False) -> None:
        record = self.record
        progress = RepairProgress(
            workflow_id=workflow.info().workflow_id,
            phase=record.phase,
            replacement_instance_id=record.replacement,
            error=record.error,
            finished=finished,
            token=record.input.progress_token,
            in_place_fix=record.ladder.fix if finished else None,
        )
        handle = workflow.get_external_workflow_handle(health_workflow_id(record.instance_id))

        async def tell() -> None:
            try:
                await handle.signal(names.SIGNAL_REPAIR_PROGRESS, progress)
            except FailureError as err:
                workflow.logger.info("health workflow not told of %s: %s", progress.phase.value, err)

        await self._tell(tell)

    async def event(self, detail: EventDetail) -> None:
        event = FleetEvent.of(
            detail,
            event_id=str(workflow.uuid4()),
            time=workflow.now(),
            group=self.record.group,
            instance_id=self.record.instance_id,
            workflow_id=workflow.info().workflow_id,
        )
        # The step is done and recorded in this history: a lost event must not fail (or undo) the repair.
        await self._tell(lambda: publish(event, f"event {detail.TYPE.value}"))

    async def flush(self) -> None:
        """Before the workflow closes: news still queued would never go out."""
        await self._news.flush()

    async def _tell(self, send: Callable[[], Awaitable[None]]) -> None:
        """Events and the health workflow's news, in the order the steps happened, beside the next step."""
        if self.news_beside_steps:
            self._news.send(send)
        else:
            await send()
