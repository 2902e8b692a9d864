"""The event outbox on the wire: what `publish_event` hands a sink's outbox workflow when the sink did not take an event
at once, and what that workflow hands its delivery and dead-letter activities.

Events a sink refused wait in Temporal, not on a worker's disk: a worker replica can die at any moment and any other
carries on. One outbox per sink target (an EventBridge bus, a JSON-lines file, the webhook), named by
`outbox_workflow_id`. A webhook target names no URL: the URL (and the secret that signs each request) is read from the
delivering worker's settings, so neither lands in a workflow history.
"""

from __future__ import annotations

import hashlib
import re
from datetime import timedelta
from enum import StrEnum
from typing import Any, Final, Literal

from pydantic import BaseModel, Field

from contract.limits import Timestamp

OUTBOX_WORKFLOW_PREFIX: Final = "event-outbox/"
# A workflow payload may not exceed 2 MiB (Temporal's blob size limit): what an outbox keeps waiting stays well under,
# whatever `events.outbox_max_events` allows.
MAX_WAITING_BYTES: Final = 1_500_000
# One signal's share of that limit when events are handed over together (OutboxEntries): a larger event goes alone.
MAX_SIGNAL_BYTES: Final = 512_000
MAX_ENTRIES_PER_SIGNAL: Final = 100
# Entries a delivery activity takes at once, oldest first (PutEvents takes up to 10 entries per call).
DELIVERY_BATCH: Final = 10
# Dead letters an outbox keeps in its state (and in its result) for operators to read; the log and the metric have all.
DEAD_LETTERS_KEPT: Final = 50
# Event ids remembered after delivery, so that a retried publish of a delivered event is not queued again.
IDS_REMEMBERED: Final = 2_000
SHOWN_WAITING: Final = 100
FIRST_BACKOFF: Final = timedelta(seconds=1)
MAX_BACKOFF: Final = timedelta(minutes=5)

FailureKind = Literal["transient", "permanent", "rejected"]
BuryReason = Literal["deadline", "rejected", "outbox_full"]


class Sink(StrEnum):
    EVENTBRIDGE = "eventbridge"
    JSONL = "jsonl"
    WEBHOOK = "webhook"


class SinkTarget(BaseModel):
    """Where the waiting events were going. EventBridge names its bus and endpoint, the JSON-lines sink its file."""

    sink: Sink
    region: str | None = None
    endpoint_url: str | None = None
    bus_name: str | None = None
    source: str | None = None
    path: str | None = None

    def label(self) -> str:
        if self.sink is Sink.EVENTBRIDGE:
            return f"event bus {self.bus_name}"
        if self.sink is Sink.JSONL:
            return f"file {self.path}"
        return "the webhook"


def outbox_workflow_id(target: SinkTarget, task_queue: str) -> str:
    """`event-outbox/<task queue>/<sink>[/<readable name>-<digest of the whole target>]`: one outbox per target and
    deployment (two deployments sharing a namespace, on their own task queues, deliver with their own settings)."""
    head = f"{OUTBOX_WORKFLOW_PREFIX}{task_queue}/{target.sink.value}"
    if target.sink is Sink.WEBHOOK:
        return head
    name = target.bus_name if target.sink is Sink.EVENTBRIDGE else (target.path or "").rsplit("/", 1)[-1]
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", name or "")[:40] or "_"
    digest = hashlib.sha256(target.model_dump_json().encode()).hexdigest()[:12]
    return f"{head}/{slug}-{digest}"


class Failure(BaseModel):
    """Why one try at a sink failed. transient: try again later. permanent: the sink itself refuses (a deleted bus, a
    missing permission, a read-only file) until an operator acts; still retried until the deadline, but logged as an
    error. rejected: the event itself is refused (malformed), so no retry can help."""

    error: str
    kind: FailureKind = "transient"


class OutboxEntry(BaseModel):
    """One event waiting for its sink: the event's JSON body as the sink takes it, and why it is waiting."""

    event_id: str
    queued_at: Timestamp
    time: Timestamp
    detail_type: str
    event: dict[str, Any]
    why: Failure | None = None  # the failed first try; None when it queued behind a backlog without one

    def size(self) -> int:
        return len(self.model_dump_json())


class OutboxEntries(BaseModel):
    """Events handed to one outbox in one signal, oldest first."""

    entries: list[OutboxEntry] = Field(min_length=1, max_length=MAX_ENTRIES_PER_SIGNAL)


class DeadLetter(BaseModel):
    entry: OutboxEntry
    reason: BuryReason
    error: str
    at: Timestamp


class OutboxRun(BaseModel):
    """An outbox workflow's input: its target and bounds, and what a previous run carried over."""

    target: SinkTarget
    max_events: int = Field(default=1_000, ge=1)
    deadline: timedelta = timedelta(hours=24)
    waiting: list[OutboxEntry] = Field(default_factory=list)
    to_bury: list[DeadLetter] = Field(default_factory=list)  # given up on, not yet recorded by the dead-letter step
    delivered_ids: list[str] = Field(default_factory=list)
    dead_letters: list[DeadLetter] = Field(default_factory=list)
    delivered: int = 0
    dead_lettered: int = 0
    rejected_signals: int = 0


class Delivery(BaseModel):
    """The delivery activity's input: the oldest waiting entries, to be sent in order until one fails."""

    target: SinkTarget
    entries: list[OutboxEntry]


class DeliveryResult(BaseModel):
    delivered: int
    failure: Failure | None = None


class Burial(BaseModel):
    """The dead-letter activity's input: entries given up on, each with why."""

    target: SinkTarget
    letters: list[DeadLetter]


class OutboxView(BaseModel):
    """The `outbox` query's answer, and the workflow's result when it ends with nothing waiting."""

    target: SinkTarget
    waiting: int
    waiting_bytes: int
    waiting_event_ids: list[str] = Field(default_factory=list)  # the oldest SHOWN_WAITING, oldest first
    oldest_queued_at: Timestamp | None = None
    next_try_at: Timestamp | None = None
    last_error: Failure | None = None
    delivered: int = 0
    dead_lettered: int = 0
    dead_letters: list[DeadLetter] = Field(default_factory=list)
    rejected_signals: int = 0
