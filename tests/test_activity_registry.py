"""The worker registers what the activity classes declare: every `@activity.defn` method of each class, once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client

from activities.aws import AwsClients
from activities.aws_status import AwsStatusActivities
from activities.events import EventActivities
from activities.evidence import EvidenceActivities
from activities.fleet import FleetActivities
from activities.remediation import RemediationActivities
from activities.workflow_ops import WorkflowOps
from contract.config import AwsSettings, EventSettings
from contract.groups import CapacityGroup


def _declared(cls: type) -> set[str]:
    """Names of the class's methods that carry an activity definition."""
    return {name for name, attr in vars(cls).items() if activity._Definition.from_callable(attr) is not None}


def _registered(instance: Any) -> list[str]:
    return [method.__name__ for method in instance.activities()]


def test_each_activity_class_lists_exactly_its_declared_activities(client: Client, tmp_path: Path) -> None:
    aws = AwsClients(AwsSettings(endpoint_url="http://127.0.0.1:1"))
    group = CapacityGroup(name="g", cluster="c")
    instances = [
        FleetActivities(aws, {"g": group}.__getitem__),
        EventActivities(aws, EventSettings(), client),
        WorkflowOps(client, "tq"),
        AwsStatusActivities(aws, {"g": group}.__getitem__),
        RemediationActivities(aws, {"g": group}.__getitem__, client),
        EvidenceActivities(aws, {"g": group}.__getitem__, client),
    ]
    for instance in instances:
        registered = _registered(instance)
        assert len(registered) == len(set(registered)), f"{type(instance).__name__} lists an activity twice"
        assert set(registered) == _declared(type(instance)), type(instance).__name__
