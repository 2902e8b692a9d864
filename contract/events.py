"""The event envelope: what every sink (EventBridge, the JSON-lines file, the webhook) receives for each health change
and repair step, and what the readers of those streams (the demo, the benchmarks, the tests) parse.

schema_version 2: the envelope's keys (`schema_version`, `type`, `event_id`, `time`, `group`, `instance_id`,
`workflow_id`, `workflow_url` where the worker knows the Web UI) and the type's own fields under `detail`
(contract/event_types.py), never over the envelope. schema_version 1 had the type's fields merged over the envelope,
so ScheduledEventFound's EC2 event id overwrote the event's own `event_id`; `Event` still reads that shape (a publish
activity scheduled by an older workflow, an event waiting in an outbox, an old JSON-lines file) and upgrades it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final, Literal

from pydantic import BaseModel, Field, model_validator

from contract.event_types import DETAILS, EventDetail, EventType
from contract.formats import iso
from contract.limits import Timestamp

SCHEMA_VERSION: Final = 2
ENVELOPE_KEYS: Final = (
    "schema_version",
    "type",
    "event_id",
    "time",
    "group",
    "instance_id",
    "workflow_id",
    "workflow_url",
)

# EventBridge's detail-type of each event (its Detail is the whole event).
HEALTH_DETAIL_TYPE: Final = "Instance Health Change"
REPAIR_DETAIL_TYPE: Final = "Instance Repair Step"
GROUP_DETAIL_TYPE: Final = "Capacity Group Configuration Change"
CONTROL_DETAIL_TYPE: Final = "Instance Operator Control"
BREAKER_DETAIL_TYPE: Final = "Capacity Group Breaker"
_DETAIL_TYPES: Final = {
    EventType.GROUP_CONFIG_CHANGED: GROUP_DETAIL_TYPE,
    EventType.INSTANCE_EXCLUDED: CONTROL_DETAIL_TYPE,
    EventType.INSTANCE_INCLUDED: CONTROL_DETAIL_TYPE,
    EventType.REPAIR_REQUESTED: CONTROL_DETAIL_TYPE,
    EventType.FINDING_CLEARED: CONTROL_DETAIL_TYPE,
    EventType.REPAIRS_HELD: BREAKER_DETAIL_TYPE,
    EventType.REPAIRS_RESUMED: BREAKER_DETAIL_TYPE,
    EventType.REPLACEMENT_FAULTED_EARLY: BREAKER_DETAIL_TYPE,
    EventType.HEALTH_CHANGED: HEALTH_DETAIL_TYPE,
    EventType.INSTANCE_RETIRED: HEALTH_DETAIL_TYPE,
    EventType.INSTANCE_RETURNED: HEALTH_DETAIL_TYPE,
    EventType.INSTANCE_UNMONITORED: HEALTH_DETAIL_TYPE,
    EventType.SCHEDULED_EVENT_FOUND: HEALTH_DETAIL_TYPE,
}


def detail_type(type: EventType) -> str:
    return _DETAIL_TYPES.get(type, REPAIR_DETAIL_TYPE)


class Event(BaseModel):
    """One event: its envelope, and its type's own fields in `detail` (JSON form)."""

    schema_version: Literal[2] = SCHEMA_VERSION
    type: EventType
    event_id: str = Field(description="Deterministic per workflow step, so consumers can drop redeliveries")
    time: Timestamp
    group: str
    instance_id: str = ""  # empty for a group's or the fleet's event
    workflow_id: str = ""
    workflow_url: str | None = None  # the workflow's Web UI page, where the worker knows the UI's address
    detail: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _from_schema_1(cls, data: Any) -> Any:
        return upgrade_v1(data) if isinstance(data, dict) else data

    @classmethod
    def of(
        cls, detail: EventDetail, *, event_id: str, time: datetime, group: str, instance_id: str, workflow_id: str
    ) -> Event:
        """An event built through its type's model (the only way the workflows build one)."""
        return cls(
            type=detail.TYPE,
            event_id=event_id,
            time=time,
            group=group,
            instance_id=instance_id,
            workflow_id=workflow_id,
            detail=detail.wire(),
        )

    @property
    def detail_type(self) -> str:
        return detail_type(self.type)

    def typed(self) -> EventDetail:
        """The detail read through its type's model (pydantic's ValidationError when it is not of that shape)."""
        model = DETAILS[self.type]
        computed = model.model_computed_fields
        return model.model_validate({k: v for k, v in self.detail.items() if k not in computed})

    def published(self) -> Event:
        """As the sinks receive it: the detail in its model's JSON form, the fields ECS's names add included."""
        return self.model_copy(update={"detail": self.typed().model_dump(mode="json")})

    def line(self) -> dict[str, Any]:
        """The JSON body every sink takes, envelope first."""
        body: dict[str, Any] = {
            "schema_version": self.schema_version,
            "type": self.type.value,
            "event_id": self.event_id,
            "time": iso(self.time),
            "group": self.group,
            "instance_id": self.instance_id,
            "workflow_id": self.workflow_id,
        }
        if self.workflow_url is not None:
            body["workflow_url"] = self.workflow_url
        body["detail"] = self.detail
        return body


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema_version 1 event in version 2's shape; a version 2 event as it is.

    Version 1 came in two forms: the publish activity's input (the envelope, and the type's fields in `fields`) and
    the flat body the sinks received (the type's fields merged over the envelope)."""
    if "schema_version" in data or "detail" in data:
        return data
    scheduled = data.get("type") == EventType.SCHEDULED_EVENT_FOUND.value
    if "fields" in data:
        head = {k: v for k, v in data.items() if k != "fields"}
        own = dict(data["fields"] or {})
        if scheduled and "event_id" in own:
            own["ec2_event_id"] = own.pop("event_id")
    else:
        head = {k: data[k] for k in ENVELOPE_KEYS if k in data}
        own = {k: v for k, v in data.items() if k not in ENVELOPE_KEYS}
        if scheduled and "event_id" in data:
            # The flat body's event_id was EC2's, which had overwritten the event's own: it is all there is of either.
            own.setdefault("ec2_event_id", data["event_id"])
    return head | {"detail": own}
