"""An event outbox: the events one sink target (a bus, a file, the webhook) did not take at once, kept by Temporal.

Runbook: `publish_event` tried the sink once and it failed, so it handed the event here (signal-with-start on
`event-outbox/<sink>/...`; the events a worker hands over while its previous hand-over is in flight come together).
Send the oldest events to the sink, a batch at a time; when the sink fails, wait (1 s, doubling to 5 min) and try
again from the oldest; give up on an event the sink rejects as malformed, on one still waiting past
`events.outbox_deadline`, and on the oldest when the outbox is full, each recorded by a dead-letter step (an error in
the worker's log, a metric, and the last ones in this workflow's `outbox` query and result). With nothing left
waiting the workflow ends: a running outbox is a backlog, so `publish_event` queues behind it rather than
overtaking. The decisions are workflows/outbox_book.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue, RetryPolicy

from contract import names
from contract.event_outbox import Burial, Delivery, OutboxEntries, OutboxEntry, OutboxRun, OutboxView
from workflows.options import CALL_RETRY, CALL_TIMEOUT
from workflows.outbox_book import Bury, Empty, OutboxBook, Send, WaitUntil
from workflows.signal_input import Rejected, Route, dispatch, worth_logging

with workflow.unsafe.imports_passed_through():
    from activities.events import EventActivities
    from activities.metrics import EVENT_OUTBOX_EVENTS

SIGNALS_PER_RUN = 1_000
# One try per activity: the book decides when to try again, so a sink outage costs a timer per try, not a retry
# storm. A worker that dies mid-delivery is the one case for a second attempt.
DELIVERY_TIMEOUT = timedelta(seconds=60)
DELIVERY_RETRY = RetryPolicy(maximum_attempts=2)


@workflow.defn(name=names.EVENT_OUTBOX_WORKFLOW)
class EventOutboxWorkflow:
    @workflow.init
    def __init__(self, run: OutboxRun) -> None:
        self._book = OutboxBook(run)
        self._rejected = run.rejected_signals
        self._signals_this_run = 0
        self._arrived = False
        self._id = workflow.info().workflow_id
        self._gauge = workflow.metric_meter().create_gauge(
            EVENT_OUTBOX_EVENTS, "Events waiting in an event outbox, by sink and outbox (its workflow id)"
        )

    @workflow.run
    async def run(self, run: OutboxRun) -> OutboxView:
        sink = self._book.target.label()
        while True:
            step = self._book.next_step(workflow.now())
            self._gauge.set(self._book.waiting(), {"sink": self._book.target.sink.value, "outbox": self._id})
            workflow.set_current_details(self._details_markdown())
            if isinstance(step, Bury):
                await workflow.execute_activity_method(
                    EventActivities.dead_letter_events,
                    Burial(target=self._book.target, letters=step.letters),
                    summary=f"dead-letter {len(step.letters)} event(s) for {sink}: {step.letters[0].reason}",
                    start_to_close_timeout=CALL_TIMEOUT,
                    retry_policy=CALL_RETRY,
                )
                self._book.buried(step.letters)
            elif isinstance(step, Send):
                result = await workflow.execute_activity_method(
                    EventActivities.deliver_outboxed_events,
                    Delivery(target=self._book.target, entries=step.entries),
                    summary=f"send {len(step.entries)} waiting event(s) to {sink}",
                    start_to_close_timeout=DELIVERY_TIMEOUT,
                    retry_policy=DELIVERY_RETRY,
                )
                self._book.sent(result.delivered, result.failure, workflow.now())
            elif isinstance(step, WaitUntil):
                self._arrived = False
                with contextlib.suppress(TimeoutError):
                    await workflow.wait_condition(
                        lambda: self._arrived or self._time_to_continue(),
                        timeout=max(step.at - workflow.now(), timedelta(seconds=1)),
                        timeout_summary=f"wait before trying {sink} again",
                    )
            elif isinstance(step, Empty):
                # Signals that came with this workflow task are in the book already; a later one makes the server
                # refuse this completion and run the loop again with it.
                await workflow.wait_condition(workflow.all_handlers_finished)
                if self._book.is_idle():
                    return self._book.view().model_copy(update={"rejected_signals": self._rejected})
            if self._time_to_continue() and not isinstance(step, Bury):
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(self._book.carry(self._rejected))

    @workflow.signal(dynamic=True)
    def on_signal(self, name: str, payloads: Sequence[RawValue]) -> None:
        self._signals_this_run += 1
        routes: dict[str, Route[Any]] = {
            names.SIGNAL_OUTBOX_ENQUEUE: Route(OutboxEntry, self._on_enqueue),
            names.SIGNAL_OUTBOX_ENQUEUE_MANY: Route(OutboxEntries, self._on_enqueue_many),
        }
        dispatch(name, payloads, routes, self._reject)

    def _on_enqueue(self, entry: OutboxEntry) -> None:
        if self._book.add(entry, workflow.now()):
            self._arrived = True

    def _on_enqueue_many(self, batch: OutboxEntries) -> None:
        for entry in batch.entries:
            self._on_enqueue(entry)

    def _reject(self, why: Rejected) -> None:
        self._rejected += 1
        if worth_logging(self._rejected):
            workflow.logger.warning("event outbox dropped a signal: %s", why)

    @workflow.query(name=names.QUERY_OUTBOX)
    def outbox(self) -> OutboxView:
        return self._book.view().model_copy(update={"rejected_signals": self._rejected})

    def _time_to_continue(self) -> bool:
        return workflow.info().is_continue_as_new_suggested() or self._signals_this_run >= SIGNALS_PER_RUN

    def _details_markdown(self) -> str:
        view = self._book.view()
        lines = [
            f"**{view.waiting} event(s) waiting for {self._book.target.label()}**",
            f"- delivered from here: {view.delivered}; dead-lettered: {view.dead_lettered}",
        ]
        if view.oldest_queued_at is not None:
            lines.append(f"- oldest queued at {view.oldest_queued_at.isoformat()}")
        if view.last_error is not None:
            lines.append(f"- last error ({view.last_error.kind}): {view.last_error.error}")
        if view.next_try_at is not None:
            lines.append(f"- next try at {view.next_try_at.isoformat()}")
        return "\n".join(lines)
