"""Failed repairs are retried by the instance's health workflow, each attempt under an id of its own
(`repair/<instance>/<n>`), with a backoff that doubles, until the group's max_repair_attempts; then RepairsExhausted,
and only an operator's `autorepair instance repair` starts another.

End to end on the real dev server, moto over HTTP and the simulated fleet: the engine launches from a launch template
that does not exist, so every attempt drains the instance and fails for real (a permanent EC2 error); the operator
then fixes the template and repairs the instance. Plus the arithmetic and the ids, without servers.
"""

from __future__ import annotations

import asyncio
import re
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.api.enums.v1 import EventType as HistoryEventType
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.converter import default as default_converter
from temporalio.service import RPCError, RPCStatusCode

from contract.groups import MAX_REPAIR_RETRY_DELAY, CapacityGroup
from contract.ids import (
    legacy_repair_workflow_id,
    repair_attempt_of,
    repair_instance_of,
    repair_workflow_id,
)
from contract.repair import RepairPhase
from operator_cli.history import by_incident
from tests.fleet import simulated_fleet
from tests.harness import eventually, unique
from tests.test_forged_signals import group_worker, hold_the_one_permit
from tests.test_health_signals import finding, health_of, start_health
from tests.test_instance_controls import events_of
from tests.test_ops_cli import autorepair, cli_env, cli_json, describe
from tests.test_replacement_attempts import container_status, current_details, set_group
from worker.settings import Settings
from workflows.models import InstanceHealthView, RepairRetry

# Long enough for `describe-instances` (a subprocess) to look between two attempts; short enough for a test.
RETRY_DELAY = timedelta(seconds=5)
ATTEMPTS = 3
NEXT_TRY = re.compile(
    r"repair failed \((?P<error>.+)\), next try at (?P<at>\S+Z) \(attempt (?P<n>\d+) of (?P<of>\d+)\)"
)


async def timer_summaries(client: Client, workflow_id: str) -> list[str]:
    """The summaries of the workflow's timers, as the Web UI shows them in its history."""
    converter = default_converter().payload_converter
    summaries = []
    async for event in client.get_workflow_handle(workflow_id).fetch_history_events():
        if event.event_type == HistoryEventType.EVENT_TYPE_TIMER_STARTED and event.user_metadata.HasField("summary"):
            summaries.append(str(converter.from_payload(event.user_metadata.summary, str)))
    return summaries


@pytest.mark.timeout(600)
async def test_failed_repairs_are_retried_with_backoff_exhausted_then_repaired_by_an_operator(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(
        client, aws_env, tmp_path, instances=3, engine_launch_template="no-such-template"
    ) as fleet:
        set_group(fleet, repair_retry_delay=RETRY_DELAY, max_repair_attempts=ATTEMPTS)
        await fleet.all_healthy(3)
        faulty = fleet.sim.live_instances()[0]
        fleet.sim.inject_fault(faulty)
        attempts = [repair_workflow_id(faulty, n) for n in range(1, ATTEMPTS + 1)]

        # Between two attempts describe-instances says what failed, when the next one starts, and which it is.
        entry = await eventually(
            lambda: describe(fleet, faulty),
            lambda e: e["repairRetry"] is not None and not e["repairRetry"]["exhausted"],
            within=240,
            every=0.2,
        )
        retry = entry["repairRetry"]
        said = NEXT_TRY.fullmatch(retry["text"])
        assert said is not None, retry
        n = int(said["n"])
        assert n in (2, 3) and int(said["of"]) == ATTEMPTS and retry["failedAttempts"] == n - 1
        assert "no-such-template" in said["error"] and said["error"] == retry["error"]
        assert datetime.fromisoformat(said["at"]).replace(microsecond=0) == (
            datetime.fromisoformat(retry["nextTryAt"]).replace(microsecond=0)
        )

        [exhausted] = await eventually(
            lambda: asyncio.sleep(0, fleet.events("RepairsExhausted")), lambda e: len(e) == 1, within=240
        )
        assert (exhausted["detail"]["attempts"], exhausted["detail"]["max_repair_attempts"]) == (ATTEMPTS, ATTEMPTS)
        assert exhausted["detail"]["repair_workflow_id"] == attempts[-1] and exhausted["instance_id"] == faulty
        assert "no-such-template" in exhausted["detail"]["error"]

        # Each attempt ran under its own id for the same reason, drained the instance, failed, and closed as failed.
        started = fleet.events("RepairStarted", faulty)
        assert {e["detail"]["reason"] for e in started} == {exhausted["detail"]["reason"]} and exhausted["detail"][
            "reason"
        ].startswith("XID_")
        failed = await eventually(
            lambda: asyncio.sleep(0, fleet.events("RepairFailed", faulty)), lambda e: len(e) == ATTEMPTS
        )
        assert [e["workflow_id"] for e in started] == attempts
        assert [e["workflow_id"] for e in failed] == attempts
        assert all("no-such-template" in e["detail"]["error"] for e in failed)
        assert [e["workflow_id"] for e in fleet.events("Draining", faulty)] == attempts
        for workflow_id in attempts:
            handle = client.get_workflow_handle(workflow_id)
            await eventually(handle.describe, lambda d: d.status == WorkflowExecutionStatus.FAILED)
        # The backoff doubles: each retry started no sooner than its wait after the failure before it.
        for k in range(1, ATTEMPTS):
            waited = datetime.fromisoformat(started[k]["time"]) - datetime.fromisoformat(failed[k - 1]["time"])
            assert RETRY_DELAY * 2 ** (k - 1) <= waited < RETRY_DELAY * 2 ** (k - 1) + timedelta(seconds=60), k
        summaries = await timer_summaries(client, f"health/{faulty}")
        for k in range(2, ATTEMPTS + 1):
            wait = f"repair failed: start attempt {k} of {ATTEMPTS} at "
            assert any(s.startswith(wait) for s in summaries), summaries

        # Exhausted: nothing more by itself. The instance is left DRAINING and running, never replaced.
        health = client.get_workflow_handle(f"health/{faulty}", result_type=InstanceHealthView)
        view = await health_of(health)
        assert view.repair_retry.exhausted and view.repair_retry.next_at is None
        assert view.repair is not None and view.repair.workflow_id == attempts[-1]
        assert view.repair.phase is RepairPhase.FAILED
        assert fleet.ec2_state(faulty) == "running" and fleet.replacements_of(faulty) == []
        assert container_status(fleet, faulty) == "DRAINING"
        entry = await describe(fleet, faulty)
        assert entry["repairRetry"]["text"] == f"repairs exhausted after {ATTEMPTS} attempts"
        assert entry["repairRetry"]["exhausted"] is True and entry["repairRetry"]["nextTryAt"] is None
        code, out, err = await autorepair(cli_env(fleet.settings), "describe-instances", "--instance", faulty)
        assert code == 0, err
        assert f"{faulty}: repairs exhausted after {ATTEMPTS} attempts" in out, out
        details = await current_details(client, f"health/{faulty}")
        assert f"Repairs exhausted after {ATTEMPTS} attempts" in details, details

        # The operator fixes the template and repairs it: a fresh attempt, which replaces it start-before-stop.
        set_group(fleet, launch_template=f"{fleet.group}-lt")
        result = await cli_json(
            fleet.settings, "instance", "repair", "--instance", faulty, "--reason", "launch template fixed"
        )
        fourth = repair_workflow_id(faulty, ATTEMPTS + 1)
        assert result["repair"]["workflowId"] == fourth, result
        assert await fleet.repairs_finished(1) == [faulty]
        assert [e["workflow_id"] for e in fleet.events("RepairStarted", faulty)] == [*attempts, fourth]
        [launched] = fleet.events("ReplacementLaunched", faulty)
        [terminated] = fleet.events("Terminated", faulty)
        [completed] = fleet.events("RepairCompleted", faulty)
        assert launched["workflow_id"] == terminated["workflow_id"] == completed["workflow_id"] == fourth
        [replacement] = fleet.replacements_of(faulty)
        assert completed["detail"]["replacement_instance_id"] == replacement
        assert fleet.ec2_state(faulty) == "terminated" and fleet.ec2_state(replacement) == "running"
        assert len(fleet.events("RepairsExhausted")) == 1
        retired = await health.result()
        assert retired.retired and retired.repair_retry.failed == 0 and not retired.repair_retry.exhausted

        # `history` shows the incident's attempts together and in order.
        records = await eventually(
            lambda: cli_json(fleet.settings, "history", "--instance", faulty),
            lambda r: len(r) == ATTEMPTS + 1 and r[-1]["outcome"] == "Completed",
        )
        assert [r["workflowId"] for r in records] == [*attempts, fourth]
        assert [r["attempt"] for r in records] == list(range(1, ATTEMPTS + 2))
        assert [r["outcome"] for r in records] == ["Failed"] * ATTEMPTS + ["Completed"]


async def test_a_repair_an_operator_cancelled_is_not_retried(client: Client, aws_env: str, tmp_path: Path) -> None:
    async with group_worker(client, aws_env, tmp_path) as settings:
        group = settings.groups[0].name
        settings.groups[0] = settings.groups[0].model_copy(update={"repair_retry_delay": timedelta(seconds=1)})
        # The group's one permit is held by a repair that never moves: ours waits for a permit until cancelled.
        blocker = await hold_the_one_permit(client, settings)
        instance = unique("i-cancelled")
        health = await start_health(client, settings, instance)
        await health.signal("gpu_finding", finding(instance, group, f"{instance}-f1"))
        first = client.get_workflow_handle(repair_workflow_id(instance, 1))
        await eventually(
            partial(health_of, health), lambda v: v.repair is not None and v.repair.workflow_id == first.id
        )
        # Cancelled only once it has started: a cancel that lands while it still reads its group's config fails it
        # before its RepairStarted, which the end of this test counts.
        await eventually(
            lambda: asyncio.sleep(0, events_of(settings, "RepairStarted", instance)), lambda e: len(e) == 1
        )

        await first.cancel()  # `temporal workflow cancel --workflow-id repair/<instance>/1`
        await eventually(first.describe, lambda d: d.status == WorkflowExecutionStatus.CANCELED)
        await eventually(
            partial(health_of, health), lambda v: v.repair is not None and v.repair.phase is RepairPhase.CANCELLED
        )
        [cancelled] = await eventually(
            lambda: asyncio.sleep(0, events_of(settings, "RepairFailed", instance)), lambda e: len(e) == 1
        )
        assert cancelled["detail"]["error"] == "cancelled by an operator"
        # Well past the retry delay and its doubling: a failed repair would have had its next attempt by now.
        await asyncio.sleep(5)
        view = await health_of(health)
        assert view.repair is not None and view.repair.workflow_id == first.id
        assert view.repair.phase is RepairPhase.CANCELLED
        assert view.repair_retry == RepairRetry() and view.repair_retry.text() is None
        assert [e["workflow_id"] for e in events_of(settings, "RepairStarted", instance)] == [first.id]
        with pytest.raises(RPCError) as missing:
            await client.get_workflow_handle(repair_workflow_id(instance, 2)).describe()
        assert missing.value.status == RPCStatusCode.NOT_FOUND

        # An operator's repair starts the next attempt.
        result = await cli_json(settings, "instance", "repair", "--instance", instance, "--reason", "after cancel")
        assert result["repair"]["workflowId"] == repair_workflow_id(instance, 2), result
        for handle in (health, blocker, client.get_workflow_handle(repair_workflow_id(instance, 2))):
            await handle.terminate("test over")
        await client.get_workflow_handle(f"drain-semaphore/{group}").terminate("test over")


# --- without servers ---------------------------------------------------------------------------------------------


def test_the_wait_before_a_retry_doubles_from_the_group_delay_up_to_a_day() -> None:
    group = CapacityGroup(name="g", cluster="c")
    assert (group.repair_retry_delay, group.max_repair_attempts) == (timedelta(minutes=10), 4)
    assert [group.repair_retry_wait(failed) for failed in range(0, 5)] == [
        timedelta(0),
        timedelta(minutes=10),
        timedelta(minutes=20),
        timedelta(minutes=40),
        timedelta(minutes=80),
    ]
    fast = group.model_copy(update={"repair_retry_delay": timedelta(seconds=5)})
    assert [fast.repair_retry_wait(failed).total_seconds() for failed in (1, 2, 3)] == [5, 10, 20]
    slow = group.model_copy(update={"repair_retry_delay": timedelta(hours=10)})
    assert [slow.repair_retry_wait(failed) for failed in (1, 2, 3)] == [
        timedelta(hours=10),
        timedelta(hours=20),
        MAX_REPAIR_RETRY_DELAY,
    ]
    assert slow.repair_retry_wait(10_000) == MAX_REPAIR_RETRY_DELAY


def test_retry_settings_are_validated() -> None:
    base = {"name": "g", "cluster": "c"}
    settings = Settings(groups=[base | {"repair_retry_delay": "PT30S", "max_repair_attempts": 10}])
    assert settings.groups[0].repair_retry_delay == timedelta(seconds=30)
    for attempts in (0, 11):
        with pytest.raises(ValidationError, match="max_repair_attempts"):
            Settings(groups=[base | {"max_repair_attempts": attempts}])
    with pytest.raises(ValidationError) as caught:
        Settings(groups=[base | {"repair_retry_delay": "P1DT1S"}])
    assert [e["loc"] for e in caught.value.errors()] == [("groups", 0, "repair_retry_delay")]
    assert "at most 86400s" in str(caught.value)
    with pytest.raises(ValidationError, match="positive duration"):
        Settings(groups=[base | {"repair_retry_delay": 0}])


def test_repair_ids_of_attempts_and_the_legacy_id() -> None:
    instance = "i-0123456789abcdef0"
    assert repair_workflow_id(instance, 1) == f"repair/{instance}/1"
    assert repair_workflow_id(instance, 12) == f"repair/{instance}/12"
    assert legacy_repair_workflow_id(instance) == f"repair/{instance}"
    with pytest.raises(ValueError):
        repair_workflow_id(instance, 0)
    for attempt in (1, 2, 10):
        assert repair_attempt_of(repair_workflow_id(instance, attempt)) == (instance, attempt)
    assert repair_attempt_of(legacy_repair_workflow_id(instance)) == (instance, 0)
    assert repair_instance_of(f"repair/{instance}/3") == repair_instance_of(f"repair/{instance}") == instance
    for other in ("health/i-1", "repair/", "drain-semaphore/g", ""):
        assert repair_attempt_of(other) is None
    # Not an attempt number: part of a (strange) instance id, read as a legacy id.
    assert repair_attempt_of("repair/i-1/01") == ("i-1/01", 0)
    assert repair_attempt_of("repair/i-1/x") == ("i-1/x", 0)


def test_history_lists_an_incidents_attempts_together_and_in_order() -> None:
    def record(instance: str, attempt: int | None, start: str) -> dict[str, Any]:
        return {"instanceId": instance, "attempt": attempt, "startTime": f"2025-01-01T00:{start}Z"}

    newest_first = [
        record("i-b", 1, "09:00"),
        record("i-a", 3, "08:00"),
        record("i-a", 2, "05:00.250000"),
        record("i-a", None, "01:00"),
        record("i-a", 1, "03:00"),
    ]
    ordered = by_incident(newest_first)
    assert [(r["instanceId"], r["attempt"]) for r in ordered] == [
        ("i-b", 1),
        ("i-a", None),
        ("i-a", 1),
        ("i-a", 2),
        ("i-a", 3),
    ]


def test_the_retry_is_told_in_one_sentence() -> None:
    at = datetime.fromisoformat("2025-03-01T12:00:05.123456+00:00")
    retry = RepairRetry(failed=1, max_attempts=4, error="InvalidLaunchTemplateName: no such template", next_at=at)
    assert retry.text() == (
        "repair failed (InvalidLaunchTemplateName: no such template), next try at 2025-03-01T12:00:05Z (attempt 2 of 4)"
    )
    assert RepairRetry(failed=4, max_attempts=4, exhausted=True).text() == "repairs exhausted after 4 attempts"
    assert RepairRetry().text() is None and RepairRetry(failed=2, max_attempts=4).text() is None
