"""The events' schema: one model per type, the checked-in JSON Schemas equal to what the models generate, the
envelope never shadowed by a type's field, and events of schema_version 1 still read (an activity scheduled by an
older workflow, an entry waiting in an outbox, an old JSON-lines file)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from activities.events import current_entry, event_body
from contract import event_types as ev
from contract.event_outbox import OutboxEntry
from contract.event_schemas import DEFAULT_DIR, differences, main, rendered
from contract.events import ENVELOPE_KEYS, Event
from tests.event_schema_check import problems
from workflows.fix_gate import GateCheck
from workflows.models import HealthCheckResult

AT = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
NOT_BEFORE = datetime(2026, 12, 9, 0, 0, tzinfo=UTC)


def test_checked_in_schemas_are_the_generated_ones() -> None:
    assert differences(DEFAULT_DIR) == [], "run: python -m contract.event_schemas"
    assert main(["--check"]) == 0


def test_check_says_what_is_stale(tmp_path: Path) -> None:
    main([str(tmp_path)])
    assert differences(tmp_path) == []
    (tmp_path / "Draining.json").write_text("{}\n")
    (tmp_path / "Gone.json").write_text("{}\n")
    (tmp_path / "Terminated.json").unlink()
    assert differences(tmp_path) == [
        "Terminated.json: missing",
        "Gone.json: no such event type",
        "Draining.json: differs from its model",
    ]
    assert main([str(tmp_path), "--check"]) == 1
    main([str(tmp_path)])
    assert differences(tmp_path) == [] and len(rendered()) == len(ev.EventType)


def test_one_model_per_type_and_no_field_shadows_the_envelope() -> None:
    assert set(ev.DETAILS) == set(ev.EventType)
    for type, model in ev.DETAILS.items():
        assert model.TYPE is type
        fields = set(model.model_fields) | set(model.model_computed_fields)
        assert not fields & set(ENVELOPE_KEYS), f"{type.value} has a field named as the envelope's"


def test_the_shapes_events_carry_follow_their_records() -> None:
    """Extra keys pass (an event is never unbuildable in a workflow), so the field lists are kept equal here."""
    assert list(ev.HealthCheck.model_fields) == list(HealthCheckResult.model_fields)
    assert list(ev.GateResult.model_fields) == list(GateCheck.model_fields)


def test_a_misspelt_field_is_refused_where_the_event_is_built() -> None:
    with pytest.raises(ValidationError, match="replacement_instance"):
        ev.ReplacementLaunched(replacement_instance="i-1", attempt=1)  # type: ignore[call-arg]


def scheduled(event_id: str = "ours-1") -> Event:
    return Event.of(
        ev.ScheduledEventFound(
            code="instance-retirement",
            ec2_event_id="instance-event-0123456789abcdef0",
            description="The instance is running on degraded hardware",
            deadline=NOT_BEFORE,
            repair_at=NOT_BEFORE.replace(day=8),
        ),
        event_id=event_id,
        time=AT,
        group="gpu",
        instance_id="i-1",
        workflow_id="health/i-1",
    )


def test_the_ec2_event_id_lives_in_detail_and_the_event_keeps_its_own() -> None:
    body = event_body(scheduled(), "http://ui/health/i-1")
    assert problems(body) == []
    assert body["event_id"] == "ours-1" and body["workflow_url"] == "http://ui/health/i-1"
    assert body["detail"]["ec2_event_id"] == "instance-event-0123456789abcdef0"
    assert body["detail"]["deadline"] == "2026-12-09T00:00:00Z" and body["detail"]["not_after"] is None


def test_an_activity_input_of_schema_1_is_published_in_schema_2() -> None:
    """A publish_event scheduled by a workflow of the older worker: its `fields`, EC2's id among them."""
    old = {
        "event_id": "ours-1",
        "time": "2026-12-01T10:00:00Z",
        "type": "ScheduledEventFound",
        "group": "gpu",
        "instance_id": "i-1",
        "workflow_id": "health/i-1",
        "fields": {
            "code": "instance-retirement",
            "event_id": "instance-event-0123456789abcdef0",
            "description": "The instance is running on degraded hardware",
            "deadline": "2026-12-09T00:00:00Z",
            "not_after": None,
            "repair_at": "2026-12-08T00:00:00Z",
        },
    }
    assert event_body(Event.model_validate(old)) == event_body(scheduled())


def test_a_flat_line_of_schema_1_is_read_in_schema_2() -> None:
    flat: dict[str, Any] = {
        "time": "2026-12-01T10:00:00Z",
        "type": "HealthChanged",
        "group": "gpu",
        "instance_id": "i-1",
        "workflow_id": "health/i-1",
        "event_id": "ours-2",
        "overall_status": "OK",
        "details": [],
        "finding": None,
        "healthChecks": [],
    }
    event = Event.model_validate(flat)
    assert (event.event_id, event.schema_version, event.detail["overall_status"]) == ("ours-2", 2, "OK")
    typed = event.typed()
    assert isinstance(typed, ev.HealthChanged) and typed.overall_status == "OK"
    assert problems(event_body(event)) == []


def test_an_outbox_entry_of_schema_1_is_delivered_in_schema_2_with_its_own_id() -> None:
    """The flat ScheduledEventFound of schema 1 had EC2's id in place of its own; the entry kept the event's."""
    flat = event_body(scheduled()) | {"event_id": "instance-event-0123456789abcdef0"}
    flat |= flat.pop("detail")
    del flat["schema_version"], flat["ec2_event_id"]
    entry = OutboxEntry(event_id="ours-1", queued_at=AT, time=AT, detail_type="Instance Health Change", event=flat)
    upgraded = current_entry(entry)
    assert upgraded.event == json.loads(json.dumps(event_body(scheduled())))
    assert current_entry(upgraded) == upgraded  # already of schema 2: as it is
