"""What every step of a repair does besides its own work: enter its phase, say so (an event, the health workflow's
news, the Web UI's runbook), in the order the steps happened.

The news goes beside the steps, never in front of them, in batches: one `publish_news` activity for the events and the
latest progress made since the last batch went out. Each activity or signal wakes the repair for a workflow task of
its own, and a step that finishes meanwhile waits for that task to end before its own is scheduled: measured in the
200 / 40 demo, the task after `terminate_instance` waited so in 38 repairs of 40. So the news made before a quick step
(`quick_step()`: one AWS call, as drain, launch and terminate are) goes with what follows it, and the step's next task
finds nothing in its way. A step that retries for long holds its news as long; the repair's own page in the Web UI and
its search attributes show its phase at once. Only the last progress, which decides what the health workflow does
next, is the workflow's own signal: Temporal delivers it whatever becomes of an activity.

Each step module (repair_replacement, repair_zones, repair_reboot, repair_evidence, repair_tasks) takes one
RepairContext: the repair's record to read and write, and these. The workflow (workflows/repair.py) makes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from enum import Enum

from temporalio import workflow
from temporalio.exceptions import FailureError

from contract import names
from contract import search_attributes as sa
from contract.event_types import EventDetail
from contract.ids import health_workflow_id
from contract.repair import RepairPhase, RepairProgress
from workflows import repair_runbook
from workflows.group_events import publish, publish_news
from workflows.in_order import InOrder
from workflows.repair_record import RepairRecord

with workflow.unsafe.imports_passed_through():
    from activities.models import MAX_NEWS_EVENTS, FleetEvent, InstanceRef, KnownInstance, RepairNews


class NewsWay(Enum):
    """How a repair's news goes out; histories recorded before a patch replay the way they ran."""

    IN_LINE = "in front of the next step"  # before NEWS_BESIDE_STEPS
    BESIDE = "an activity or signal each, beside the next step"  # before NEWS_TOGETHER
    TOGETHER = "in batches beside the steps"


class RepairContext:
    def __init__(self, record: RepairRecord) -> None:
        self.record = record
        self.instance = InstanceRef(group=record.group, instance_id=record.instance_id)
        self.news_way = NewsWay.IN_LINE  # set by the workflow's run(), from its patches
        self._news = InOrder()
        self._open: RepairNews | None = None  # the batch not sent yet, which new news joins
        self._quick_steps = 0  # in flight: while one is, the open batch waits

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
        if self.news_way is NewsWay.TOGETHER and not finished:
            self._batch().progress = progress
            return
        if self._open is not None:
            self._open.progress = None  # the last progress, told below, is all the health workflow needs
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
        if self.news_way is NewsWay.TOGETHER:
            self._batch().events.append(event)
            return
        # The step is done and recorded in this history: a lost event must not fail (or undo) the repair.
        await self._tell(lambda: publish(event, f"event {detail.TYPE.value}"))

    @contextlib.contextmanager
    def quick_step(self) -> Iterator[None]:
        """Around one quick AWS call: the news made before it goes out after it, with what follows."""
        self._quick_steps += 1
        try:
            yield
        finally:
            self._quick_steps -= 1

    async def flush(self) -> None:
        """Before the workflow closes: news still queued would never go out."""
        await self._news.flush()

    async def _tell(self, send: Callable[[], Awaitable[None]]) -> None:
        """Events and the health workflow's news, in the order the steps happened, beside the next step."""
        if self.news_way is NewsWay.IN_LINE:
            await send()
        else:
            self._news.send(send)

    def _batch(self) -> RepairNews:
        """The batch new news joins: the open one, or a new one queued behind those already out."""
        if self._open is None or len(self._open.events) >= MAX_NEWS_EVENTS:
            batch = self._open = RepairNews(
                health_workflow_id=health_workflow_id(self.record.instance_id),
                signal_request_id=str(workflow.uuid4()),
            )
            self._news.send(lambda: self._send(batch))
        return self._open

    async def _send(self, batch: RepairNews) -> None:
        await workflow.wait_condition(lambda: self._quick_steps == 0)
        if self._open is batch:
            self._open = None
        if not batch.events and batch.progress is None:
            return
        await publish_news(batch, news_summary(batch))


def news_summary(news: RepairNews) -> str:
    """What the Web UI shows for the batch: the phase the health workflow is told of, and the events."""
    told = [f"tell health: {news.progress.phase.value}"] if news.progress is not None else []
    return "; ".join([*told, *(f"event {event.type.value}" for event in news.events)])
