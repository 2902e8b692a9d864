"""The operator's terminal against the real servers: `autorepair describe-instances | history | inject | group`.

The commands run as `python -m operator_cli.main` subprocesses, as an operator runs them, started with asyncio so the
in-process worker sharing this event loop keeps running. Every wait is a poll (tests.harness.eventually).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.testing import ActivityEnvironment

from activities.aws import AwsClients
from activities.fleet import FleetActivities
from activities.models import GroupConfigRequest
from contract.config import TemporalSettings
from contract.groups import AutoRepair, CapacityGroup
from contract.health import CheckType, HealthInput, HealthState
from contract.ids import health_workflow_id, repair_workflow_id, semaphore_workflow_id
from contract.probe import GpuFinding
from contract.repair import PhaseStep, RepairPhase
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.policy import Policy
from operator_cli.arguments import parse_duration, parse_since
from operator_cli.client import workflow_url
from operator_cli.history import phase_durations
from operator_cli.inject import xid_line
from simulator.engine_process import engine_environment
from simulator.events import read_events
from simulator.servers import free_port
from tests.fleet import Fleet, simulated_fleet
from tests.harness import eventually, make_settings, running_worker, unique
from tests.test_health_signals import monitor_only
from worker.settings import Settings
from workflows.models import InstanceHealthView

CHECK_FIELDS = {"type", "status", "statusReason", "lastUpdated", "lastStatusChange"}
REPAIR_PHASES = [
    "WaitingForPermit",
    "Draining",
    "LaunchingReplacement",
    "WaitingForReplacement",
    "StoppingTasks",
    "Terminating",
    "Completed",
]


async def autorepair(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    # Not subprocess.run: a blocking call here would stall the worker running on this event loop.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "operator_cli.main",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def cli_env(settings: Settings) -> dict[str, str]:
    # Wide enough that rich never folds an instance id or a URL in the table output.
    return engine_environment(settings) | {"COLUMNS": "300"}


async def cli_json(settings: Settings, *args: str) -> Any:
    code, out, err = await autorepair(cli_env(settings), *args, "--json")
    assert code == 0, err
    return json.loads(out)


async def described_instances(settings: Settings, *args: str) -> list[dict[str, Any]]:
    """`describe-instances --json`'s instances (shaped like `aws ecs describe-container-instances`), every one
    described: none in its failures."""
    answer = await cli_json(settings, "describe-instances", *args)
    assert answer["failures"] == [], answer
    return list(answer["containerInstances"])


async def describe(fleet: Fleet, instance_id: str) -> dict[str, Any]:
    [entry] = await described_instances(fleet.settings, "--instance", instance_id)
    return dict(entry)


def check(entry: dict[str, Any], kind: str) -> dict[str, Any]:
    return dict(next(d for d in entry["healthStatus"]["details"] if d["type"] == kind))


def assert_one_clear_line(err: str) -> None:
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


async def test_describe_inject_and_history_on_a_simulated_fleet(client: Client, aws_env: str, tmp_path: Path) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        settings, group = fleet.settings, fleet.group
        instances = fleet.sim.live_instances()

        # Visibility lists the group's running health workflows (eventually: search attributes are indexed late).
        entries = await eventually(
            lambda: described_instances(settings, "--group", group),
            lambda e: len(e) == 3 and all(x["healthStatus"]["overallStatus"] == "OK" for x in e),
        )
        assert sorted(e["ec2InstanceId"] for e in entries) == sorted(instances)
        for entry in entries:
            assert {"ec2InstanceId", "healthStatus", "findings", "repair"} <= set(entry)
            assert entry["capacityGroup"] == group and entry["repair"] is None and entry["findings"] == []
            details = entry["healthStatus"]["details"]
            assert {d["type"] for d in details} == {"ACCELERATED_COMPUTE", "AGENT_CONNECTIVITY"}
            assert all(set(d) == CHECK_FIELDS and d["status"] == "OK" for d in details)
            assert entry["workflowUrl"].startswith(f"{settings.temporal.ui_url}/namespaces/")
            # The simulated instance's probe follows its kernel-log file, and says that it works.
            [source] = entry["probeSources"]
            assert source["name"].startswith("kernel_log:") and (source["state"], source["reason"]) == ("OK", None)
        # When each was last heard comes from the group's liveness tracker, and moves on while the probes beat.
        first = {e["ec2InstanceId"]: datetime.fromisoformat(e["lastHeard"]) for e in entries}
        later = await eventually(
            lambda: described_instances(settings, "--group", group),
            lambda e: all(datetime.fromisoformat(x["lastHeard"]) > first[x["ec2InstanceId"]] for x in e),
        )
        # Receipt times travel in whole seconds, rounded up (never earlier than the receipt): at most a second ahead.
        soon = datetime.now(UTC) + timedelta(seconds=1)
        assert all(datetime.fromisoformat(x["lastHeard"]) <= soon for x in later), later

        warned, faulty = instances[:2]
        # An application Xid: the probe's policy calls it a warning; it is counted, never repaired.
        noise = await cli_json(settings, "inject", "--instance", warned, "--group", group, "--xid", "13")
        [finding] = noise["findings"]
        assert (finding["impairs"], finding["reason"], finding["rule"]) == (False, "XID_13", "ecs:not-in-xid-list")
        entry = await eventually(
            lambda: describe(fleet, warned), lambda e: e["warningCounts"].get("0000:00:00/XID_13") == 1
        )
        assert entry["healthStatus"]["overallStatus"] == "OK" and entry["repair"] is None

        # A critical Xid through the same path: parser, policy, finding, signal-with-start; it impairs and repairs.
        critical = await cli_json(settings, "inject", "--instance", faulty, "--group", group, "--xid", "79")
        [finding] = critical["findings"]
        assert (finding["impairs"], finding["reason"], finding["rule"]) == (True, "XID_79", "ecs:xid-list")
        assert finding["source"] == "autorepair-inject" and "injected by autorepair inject" in finding["raw"]
        entry = await eventually(lambda: describe(fleet, faulty), lambda e: e["repair"] is not None)
        assert entry["healthStatus"]["overallStatus"] == "IMPAIRED"
        assert check(entry, "ACCELERATED_COMPUTE")["statusReason"] == "XID_79"
        assert any(f["reason"] == "XID_79" and f["impairs"] for f in entry["findings"])
        assert entry["repair"]["workflow_id"] == repair_workflow_id(faulty, 1) and entry["repair"]["reason"] == "XID_79"

        assert await fleet.repairs_finished(1) == [faulty]
        [replacement] = fleet.replacements_of(faulty)

        records = await eventually(
            lambda: cli_json(settings, "history", "--group", group),
            lambda r: len(r) == 1 and r[0]["outcome"] == "Completed",
        )
        [record] = records
        assert record["instanceId"] == faulty and record["group"] == group and record["attempt"] == 1
        assert record["workflowId"] == repair_workflow_id(faulty, 1)
        assert record["reason"] == "XID_79" and record["replacementInstanceId"] == replacement
        assert record["durationsAvailable"] is True and record["closeTime"] is not None
        assert [p["phase"] for p in record["phases"]] == REPAIR_PHASES
        assert all(p["durationSeconds"] >= 0 for p in record["phases"][:-1])
        assert record["phases"][-1]["durationSeconds"] is None and not any(p["ongoing"] for p in record["phases"])
        assert record["webUiUrl"] == (
            f"{settings.temporal.ui_url}/namespaces/{settings.temporal.namespace}/workflows/"
            f"repair%2F{faulty}%2F1/{record['runId']}"
        )

        # Filters: by instance, by start time.
        assert [r["instanceId"] for r in await cli_json(settings, "history", "--instance", faulty)] == [faulty]
        assert await cli_json(settings, "history", "--instance", warned) == []
        assert len(await cli_json(settings, "history", "--group", group, "--since", "1h")) == 1
        future = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
        assert await cli_json(settings, "history", "--group", group, "--since", future) == []

        # The tables an operator reads.
        code, out, err = await autorepair(cli_env(settings), "history", "--group", group)
        assert code == 0, err
        assert faulty in out and replacement in out and "Completed" in out and "Draining" in out
        code, out, err = await autorepair(cli_env(settings), "describe-instances", "--group", group)
        assert code == 0, err
        assert warned in out and "AGENT_CONNECTIVITY" in out and "XID_13" in out


async def test_group_update_applies_live_is_evented_and_heartbeat_loss_impairs(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        settings, group = fleet.settings, fleet.group
        faulty, lost = fleet.sim.live_instances()[:2]

        # No drain semaphore yet (no repair so far): update-with-start starts it, the update is its first act.
        updated = await cli_json(
            settings, "group", "update", "--name", group, "--auto-repair", "DISABLED", "--max-draining-percent", "50"
        )
        assert updated["overrides"] == {"auto_repair": "DISABLED", "max_draining_percent": 50}
        assert updated["effective"]["auto_repair"] == "DISABLED" and updated["revision"] == 1

        [changed] = await eventually(
            lambda: asyncio.sleep(0, fleet.events("GroupConfigChanged")), lambda e: len(e) == 1
        )
        assert changed["detail"]["changes"] == {
            "auto_repair": {"old": "ENABLED", "new": "DISABLED"},
            "max_draining_percent": {"old": 20, "new": 50},
        }
        assert changed["detail"]["requested_by"] and changed["instance_id"] == ""
        assert changed["workflow_id"] == f"drain-semaphore/{group}"

        # Invalid updates are refused by the update's validator, in one line, and change nothing.
        code, _, err = await autorepair(
            cli_env(settings), "group", "update", "--name", group, "--max-draining-percent", "0"
        )
        assert code == 2
        assert_one_clear_line(err)
        assert "max_draining_percent must be between 1 and 100, not 0" in err
        code, _, err = await autorepair(cli_env(settings), "group", "update", "--name", group)
        assert code == 2 and "nothing to change" in err
        assert_one_clear_line(err)

        described = await cli_json(settings, "group", "describe", "--name", group)
        assert described["semaphoreRunning"] is True and described["revision"] == 1
        assert described["overrides"] == {"auto_repair": "DISABLED", "max_draining_percent": 50}
        assert described["effective"]["auto_repair"] == "DISABLED"
        assert described["effective"]["cluster"] == settings.groups[0].cluster

        # A later fault impairs but is not repaired: the health workflow read the live DISABLED.
        await cli_json(settings, "inject", "--instance", faulty, "--group", group, "--xid", "79")
        entry = await eventually(lambda: describe(fleet, faulty), lambda e: e["repairWithheld"] is not None)
        assert entry["healthStatus"]["overallStatus"] == "IMPAIRED" and entry["repair"] is None
        assert "DISABLED" in entry["repairWithheld"]
        # The impaired ones only, by the HealthStatus search attribute (lower case accepted).
        impaired = await eventually(
            lambda: described_instances(settings, "--group", group, "--status", "impaired"),
            lambda entries: [e["ec2InstanceId"] for e in entries] == [faulty],
        )
        assert impaired[0]["healthStatus"]["overallStatus"] == "IMPAIRED"

        # A heartbeat loss impairs AGENT_CONNECTIVITY once the threshold passes, as a silent probe would.
        injected = await cli_json(settings, "inject", "--instance", lost, "--group", group, "--heartbeat-loss", "10m")
        assert injected["heartbeatLossSeconds"] == 600
        entry = await eventually(
            lambda: describe(fleet, lost), lambda e: check(e, "AGENT_CONNECTIVITY")["status"] == "IMPAIRED"
        )
        assert check(entry, "AGENT_CONNECTIVITY")["statusReason"].startswith("Agent disconnected since ")
        assert check(entry, "ACCELERATED_COMPUTE")["status"] == "OK"
        assert entry["heartbeatsIgnoredUntil"] is not None
        await eventually(lambda: describe(fleet, lost), lambda e: e["repairWithheld"] is not None)
        assert fleet.events("RepairStarted") == []

        # ENABLED again: the instances left impaired are repaired, from the next heartbeat deadline.
        enabled = await cli_json(settings, "group", "update", "--name", group, "--auto-repair", "ENABLED")
        assert enabled["overrides"]["auto_repair"] == "ENABLED" and enabled["revision"] == 2
        assert sorted(await fleet.repairs_finished(2)) == sorted([faulty, lost])
        reasons = {e["instance_id"]: e["detail"]["reason"] for e in fleet.events("RepairStarted")}
        assert reasons[faulty] == "XID_79" and reasons[lost].startswith("Agent disconnected since ")
        assert len(fleet.events("GroupConfigChanged")) == 2


async def test_live_overrides_survive_a_terminated_semaphore_and_reset_drops_them(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    group = unique("g")
    settings = make_settings(client, aws_env, tmp_path / "events.jsonl", group=group, cluster=group)
    fleet_activities = FleetActivities(AwsClients(settings.aws), settings.group, client=client)
    semaphore = client.get_workflow_handle(semaphore_workflow_id(group))

    async def group_config_seen_by_workflows() -> CapacityGroup:
        return await ActivityEnvironment().run(fleet_activities.get_group_config, GroupConfigRequest(group=group))

    async with running_worker(settings, client):
        await cli_json(
            settings, "group", "update", "--name", group, "--auto-repair", "DISABLED", "--max-draining-percent", "50"
        )
        # An operator terminates the semaphore (say it looked stuck). Its overrides are not lost in between...
        await semaphore.terminate("operator: semaphore looked stuck")
        described = await cli_json(settings, "group", "describe", "--name", group)
        assert described["semaphoreRunning"] is False and described["revision"] == 1
        assert described["overrides"] == {"auto_repair": "DISABLED", "max_draining_percent": 50}
        assert (await group_config_seen_by_workflows()).auto_repair is AutoRepair.DISABLED

        # ... and the next run takes them over: here started by the next update, which applies on top.
        updated = await cli_json(settings, "group", "update", "--name", group, "--heartbeat-loss-threshold", "2m")
        assert updated["revision"] == 2
        assert set(updated["overrides"]) == {"auto_repair", "max_draining_percent", "heartbeat_loss_threshold"}
        assert updated["effective"]["auto_repair"] == "DISABLED"

        # --reset: back to the settings, recorded and evented like any other change.
        code, out, err = await autorepair(cli_env(settings), "group", "update", "--name", group, "--reset")
        assert code == 0, err
        assert "revision 3, no live overrides (the settings apply)" in out
        described = await cli_json(settings, "group", "describe", "--name", group)
        assert described["overrides"] == {} and described["effective"]["auto_repair"] == "ENABLED"
        assert (await group_config_seen_by_workflows()).max_draining_percent == settings.groups[0].max_draining_percent
        changes = [
            e["detail"]["changes"] for e in read_events(tmp_path / "events.jsonl") if e["type"] == "GroupConfigChanged"
        ]
        assert len(changes) == 3
        assert changes[-1]["auto_repair"] == {"old": "DISABLED", "new": "ENABLED"}
        assert set(changes[-1]) == {"auto_repair", "max_draining_percent", "heartbeat_loss_threshold"}

        # A reset is taken over like any other state: a later run does not bring the old overrides back.
        await semaphore.terminate("operator: again")
        reset_then_more = await cli_json(settings, "group", "update", "--name", group, "--max-draining-percent", "30")
        assert reset_then_more["overrides"] == {"max_draining_percent": 30} and reset_then_more["revision"] == 4
        await semaphore.terminate("test over")


async def test_workflows_read_the_live_overrides_without_the_semaphores_worker(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    """What repairs and health checks apply is the semaphore's committed configuration (its memo), which the server
    answers alone: a query would wait for a worker, and one that waited behind a busy semaphore's workflow task was
    dropped by Core (benchmarks/SCALE.md, part 2)."""
    group = unique("g")
    settings = make_settings(client, aws_env, tmp_path / "events.jsonl", group=group, cluster=group)
    fleet_activities = FleetActivities(AwsClients(settings.aws), settings.group, client=client)
    semaphore = client.get_workflow_handle(semaphore_workflow_id(group))
    async with running_worker(settings, client):
        await cli_json(settings, "group", "update", "--name", group, "--auto-repair", "DISABLED")
    # No worker polls now; the semaphore still runs.
    seen = await asyncio.wait_for(
        ActivityEnvironment().run(fleet_activities.get_group_config, GroupConfigRequest(group=group)), timeout=5
    )
    assert seen.auto_repair is AutoRepair.DISABLED
    assert (await semaphore.describe()).status == WorkflowExecutionStatus.RUNNING
    await semaphore.terminate("test over")


async def test_unreachable_temporal_and_bad_arguments_give_one_line(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.pop("AUTOREPAIR_CONFIG", None)
    env.update(AUTOREPAIR_TEMPORAL__ADDRESS=f"127.0.0.1:{free_port()}", AUTOREPAIR_LOG_FORMAT="json")
    instance = "i-0123456789abcdef0"
    for args in (
        ["describe-instances", "--group", "g"],
        ["history", "--json"],
        ["group", "describe", "--name", "g"],
        ["group", "update", "--name", "g", "--auto-repair", "DISABLED"],
        ["inject", "--instance", instance, "--group", "g", "--xid", "79"],
    ):
        code, out, err = await autorepair(env, *args)
        assert code == 3, (args, out, err)
        assert_one_clear_line(err)
        assert f"cannot reach Temporal at {env['AUTOREPAIR_TEMPORAL__ADDRESS']}" in err

    for args, expected in (
        (["inject", "--instance", instance, "--group", "g"], "--xid"),
        (["inject", "--instance", instance, "--group", "g", "--xid", "79", "--heartbeat-loss", "1m"], "not allowed"),
        (["inject", "--instance", instance, "--group", "g", "--kernel-line", "hello"], "not a GPU fault line"),
        (["inject", "--instance", instance, "--group", "g", "--heartbeat-loss", "soon"], "not a duration"),
        (["group", "update", "--name", "g", "--heartbeat-loss-threshold", "soon"], "not a duration"),
        (["group", "update", "--name", "g", "--auto-repair", "MAYBE"], "invalid choice"),
        (["history", "--since", "yesterday"], "not a time"),
        (["describe-instances"], "--group"),
        (["describe-instances", "--group", "it's"], "not a valid group name"),
    ):
        code, out, err = await autorepair(env, *args)
        assert code == 2, (args, out, err)
        assert_one_clear_line(err)
        assert expected in err, (args, err)


async def test_withheld_repairs_rereading_their_group_config_continue_as_new_cleanly(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    # An impaired instance whose repair is withheld (auto repair DISABLED) re-reads its group once per threshold.
    # Continue-as-new must land cleanly wherever in that timer-and-read cycle the suggestion comes, and carry the
    # impairment and the withheld decision over. Extra signals shift where the test server's 200-event suggestion
    # lands in the read cycle, so the three cover different offsets.
    instances = [unique("i-held") for _ in range(3)]
    async with monitor_only(client, aws_env, tmp_path, timedelta(seconds=1)) as (settings, group):
        handles = []
        for shift, instance in enumerate(instances):
            fault = GpuFinding(
                finding_id=unique("f"),
                instance_id=instance,
                group=group,
                kind="xid",
                code=79,
                reason="XID_79",
                impairs=True,
                observed_at=datetime.now(UTC),
            )
            handle = await client.start_workflow(
                "InstanceHealthWorkflow",
                HealthInput(instance_id=instance, group=group),
                id=health_workflow_id(instance),
                task_queue=settings.temporal.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                start_signal="gpu_finding",
                start_signal_args=[fault],
            )
            for _ in range(shift):
                await handle.signal("not-a-signal")
            latest = client.get_workflow_handle(health_workflow_id(instance))
            handles.append((latest, (await latest.describe()).run_id))

        async def carried_on(latest: WorkflowHandle[Any, Any], first_run: str | None) -> None:
            await eventually(latest.describe, lambda d: d.run_id != first_run, within=120)
            view = await eventually(
                lambda: latest.query("health", result_type=InstanceHealthView, rpc_timeout=timedelta(seconds=5)),
                lambda v: True,
            )
            gpu = next(d.status for d in view.healthStatus.details if d.type is CheckType.ACCELERATED_COMPUTE)
            assert gpu is HealthState.IMPAIRED and view.repair_withheld is not None

        await asyncio.gather(*(carried_on(latest, first_run) for latest, first_run in handles))
        for latest, _ in handles:
            await latest.terminate("test over")


def test_durations_times_links_and_the_injected_line() -> None:
    assert parse_duration("90") == parse_duration("90s") == parse_duration("PT1M30S") == timedelta(seconds=90)
    assert parse_duration("10m") == parse_duration("pt10m") == timedelta(minutes=10)
    assert parse_duration("2h") == timedelta(hours=2) and parse_duration("P1D") == timedelta(days=1)
    assert parse_since("2025-05-01T12:00:00") == datetime(2025, 5, 1, 12, tzinfo=UTC)
    assert abs(datetime.now(UTC) - parse_since("1h") - timedelta(hours=1)) < timedelta(minutes=1)

    start = datetime(2025, 5, 1, 12, tzinfo=UTC)
    steps = [
        PhaseStep(phase=RepairPhase.WAITING_FOR_PERMIT, started_at=start),
        PhaseStep(phase=RepairPhase.DRAINING, started_at=start + timedelta(seconds=3)),
        PhaseStep(phase=RepairPhase.FAILED, started_at=start + timedelta(seconds=10)),
    ]
    assert [p["durationSeconds"] for p in phase_durations(steps, start + timedelta(seconds=11))] == [3, 7, None]
    running = phase_durations(steps[:2], None)
    assert running[-1]["ongoing"] is True and running[-1]["durationSeconds"] > 7

    temporal = TemporalSettings(ui_url="http://ui:8233/", namespace="prod")
    assert workflow_url(temporal, "repair/i-1", "r1") == "http://ui:8233/namespaces/prod/workflows/repair%2Fi-1/r1"

    [record] = list(parse_lines([xid_line(79, "0000:9b:00")]))
    assert (record.kind, record.code, record.pci) == ("xid", 79, "0000:9b:00")
    verdict = Policy().classify(record, datetime.now(UTC))
    assert verdict.impairs and verdict.reason == "XID_79"


@pytest.fixture(autouse=True)
def _no_config_file(monkeypatch: pytest.MonkeyPatch) -> None:
    # The commands run with the test's settings only, never a developer's AUTOREPAIR_CONFIG.
    monkeypatch.delenv("AUTOREPAIR_CONFIG", raising=False)
