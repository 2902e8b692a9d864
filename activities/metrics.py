"""Our own metrics, derived from the event stream in `publish_event`.

Every health change and repair step already flows through `publish_event`, so counting there needs no workflow
code (workflow metrics would have to be replay-safe) and no second source of truth. The instruments come from the
activity's Temporal metric meter: they land on the same Prometheus endpoint as Temporal's own runtime metrics
(`metrics_bind_address`), with the meter's `namespace`, `task_queue` and `activity_type` labels added.

Counters are per worker process and start at zero when it starts: sum them over workers and use `increase()`/`rate()`.
Their names here lack the `_total` the exporter appends (worker/telemetry.py: counters_total_suffix), so
`autorepair_repairs_started` is scraped as `autorepair_repairs_started_total`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any

from pydantic import BaseModel, ValidationError
from temporalio.common import MetricMeter

from activities.models import EventType, FleetEvent
from contract.health import CheckType, HealthState
from contract.probe import GpuFinding
from contract.repair import PhaseStep

HEALTH_CHANGES = "autorepair_health_changes"
REPAIRS_STARTED = "autorepair_repairs_started"
REPAIRS_COMPLETED = "autorepair_repairs_completed"
REPAIRS_FAILED = "autorepair_repairs_failed"
PERMITS_GRANTED = "autorepair_drain_permits_granted"
PERMITS_RELEASED = "autorepair_drain_permits_released"
REPLACEMENT_LAUNCH_FAILURES = "autorepair_replacement_launch_failures"
FINDING_TO_IMPAIRED = "autorepair_finding_to_impaired_seconds"
REPAIR_DURATION = "autorepair_repair_duration_seconds"
REPAIR_PHASE_DURATION = "autorepair_repair_phase_duration_seconds"
# The event outboxes (activities/events.py, workflows/event_outbox.py), per sink (`sink`: eventbridge, jsonl, webhook).
EVENTS_QUEUED = "autorepair_events_queued"
EVENT_RETRIES = "autorepair_event_retries"
EVENTS_DEAD_LETTERED = "autorepair_events_dead_lettered"
EVENT_OUTBOX_EVENTS = "autorepair_event_outbox_events"

# Temporal's exporter gives every histogram the same default buckets, meant for milliseconds (50 ... 10,000); ours
# are in seconds, so worker/telemetry.py passes these overrides to PrometheusConfig.
_SIGNAL_LATENCY_BUCKETS = [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900]
_REPAIR_BUCKETS = [1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 43200, 86400]
HISTOGRAM_BUCKETS: Mapping[str, Sequence[float]] = {
    FINDING_TO_IMPAIRED: _SIGNAL_LATENCY_BUCKETS,
    REPAIR_DURATION: _REPAIR_BUCKETS,
    REPAIR_PHASE_DURATION: _REPAIR_BUCKETS,
}

# A status reason is a label value: it must come from a small set. Probe reasons are codes (XID_79, SXID_20034,
# GPU_FALLEN_OFF_BUS); the heartbeat watchdog's reason carries a timestamp, which would make a series per repair.
_CODE_REASON = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")
_AGENT_REASON_PREFIX = "Agent disconnected"


def reason_label(reason: object) -> str:
    if not isinstance(reason, str) or not reason:
        return "UNKNOWN"
    if _CODE_REASON.match(reason):
        return reason
    if reason.startswith(_AGENT_REASON_PREFIX):
        return CheckType.AGENT_CONNECTIVITY.value
    return "OTHER"


class _Timeline(BaseModel):
    steps: list[PhaseStep]


class EventMetrics:
    """The instruments, created from one meter; `record` turns one event into metric updates."""

    def __init__(self, meter: MetricMeter) -> None:
        self._health_changes = meter.create_counter(
            HEALTH_CHANGES, "Health status changes of instances, by the overall status changed to"
        )
        self._started = meter.create_counter(REPAIRS_STARTED, "Repairs started, by group and reason")
        self._completed = meter.create_counter(REPAIRS_COMPLETED, "Repairs completed, by group and reason")
        self._failed = meter.create_counter(REPAIRS_FAILED, "Repairs failed or cancelled, by group and reason")
        self._granted = meter.create_counter(PERMITS_GRANTED, "Drain permits granted to repairs")
        self._released = meter.create_counter(PERMITS_RELEASED, "Drain permits released by repairs")
        self._launch_failures = meter.create_counter(
            REPLACEMENT_LAUNCH_FAILURES, "Failed replacement launch attempts (retried with backoff)"
        )
        self._finding_to_impaired = meter.create_histogram_float(
            FINDING_TO_IMPAIRED, "From the probe observing a critical GPU finding to the instance being IMPAIRED", "s"
        )
        self._repair_duration = meter.create_histogram_float(
            REPAIR_DURATION, "Closed repairs, from start to completion or failure", "s"
        )
        self._phase_duration = meter.create_histogram_float(
            REPAIR_PHASE_DURATION, "Time spent in each phase of closed repairs", "s"
        )

    def record(self, event: FleetEvent) -> None:
        group = {"group": event.group}
        fields = event.detail
        if event.type is EventType.HEALTH_CHANGED:
            status = fields.get("overall_status")
            self._health_changes.add(1, group | {"status": status if isinstance(status, str) else "UNKNOWN"})
            latency = _finding_to_impaired(event)
            if latency is not None:
                self._finding_to_impaired.record(latency, group)
        elif event.type is EventType.REPAIR_STARTED:
            self._started.add(1, group | {"reason": reason_label(fields.get("reason"))})
        elif event.type is EventType.REPAIR_COMPLETED:
            self._completed.add(1, group | {"reason": reason_label(fields.get("reason"))})
            self._record_timeline(fields.get("timeline"), group)
        elif event.type is EventType.REPAIR_FAILED:
            self._failed.add(1, group | {"reason": reason_label(fields.get("reason"))})
            self._record_timeline(fields.get("timeline"), group)
        elif event.type is EventType.DRAIN_PERMIT_GRANTED:
            self._granted.add(1, group)
        elif event.type is EventType.DRAIN_PERMIT_RELEASED:
            self._released.add(1, group)
        elif event.type is EventType.REPLACEMENT_LAUNCH_FAILED:
            self._launch_failures.add(1, group)

    def _record_timeline(self, raw: Any, labels: dict[str, str]) -> None:
        """Per-phase durations from the repair's timeline: each phase lasts until the next one starts. The last
        step is the outcome (Completed, Failed or Cancelled)."""
        if not isinstance(raw, list) or len(raw) < 2:
            return  # events from repairs started before the timeline was added to RepairCompleted/RepairFailed
        try:
            steps = _Timeline(steps=raw).steps
        except ValidationError:
            return
        labels = labels | {"outcome": steps[-1].phase.value}
        for step, following in pairwise(steps):
            seconds = (following.started_at - step.started_at).total_seconds()
            self._phase_duration.record(max(seconds, 0.0), labels | {"phase": step.phase.value})
        total = (steps[-1].started_at - steps[0].started_at).total_seconds()
        self._repair_duration.record(max(total, 0.0), labels)


def _finding_to_impaired(event: FleetEvent) -> float | None:
    """Seconds from the finding to IMPAIRED, only on the event that made ACCELERATED_COMPUTE IMPAIRED.

    Later HealthChanged events of an impaired instance (its agent reconnecting, say) carry the same finding; the
    check's `lastStatusChange` equals the event's time only on the change itself, so those are not counted again.
    """
    raw = event.detail.get("finding")
    details = event.detail.get("details")
    if not isinstance(raw, dict) or not isinstance(details, list):
        return None
    accelerated = next(
        (d for d in details if isinstance(d, dict) and d.get("type") == CheckType.ACCELERATED_COMPUTE.value), None
    )
    if accelerated is None or accelerated.get("status") != HealthState.IMPAIRED.value:
        return None
    try:
        changed = datetime.fromisoformat(str(accelerated.get("lastStatusChange")).replace("Z", "+00:00"))
        finding = GpuFinding.model_validate(raw)
    except (ValueError, ValidationError):
        return None
    if changed != event.time:
        return None
    observed = finding.observed_at if finding.observed_at.tzinfo else finding.observed_at.replace(tzinfo=UTC)
    # The probe's clock is not the workflow's: a host clock running ahead must not record a negative latency.
    return max((event.time - observed).total_seconds(), 0.0)


class OutboxMetrics:
    """The event outboxes' counters, from the activity's meter (none: counted nowhere)."""

    def __init__(self, meter: MetricMeter | None) -> None:
        meter = meter or MetricMeter.noop
        self._queued = meter.create_counter(
            EVENTS_QUEUED, "Events publish_event handed to an outbox, by sink and cause (error kind or backlog)"
        )
        self._retries = meter.create_counter(
            EVENT_RETRIES, "Tries from an outbox, by sink and outcome (delivered, transient_error, permanent_error)"
        )
        self._dead = meter.create_counter(
            EVENTS_DEAD_LETTERED, "Events given up on, by sink and reason (deadline, rejected, outbox_full)"
        )

    def queued(self, sink: str, cause: str) -> None:
        self._queued.add(1, {"sink": sink, "cause": cause})

    def retried(self, sink: str, outcome: str) -> None:
        self._retries.add(1, {"sink": sink, "outcome": outcome})

    def dead_lettered(self, sink: str, reason: str) -> None:
        self._dead.add(1, {"sink": sink, "reason": reason})
