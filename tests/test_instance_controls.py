"""`autorepair instance exclude | include | repair | clear` against the real servers: each an update of the instance's
health workflow, refused in one line when it cannot be done, recorded and published as an event when done.

The commands run as `python -m operator_cli.main` subprocesses, as an operator runs them (tests.test_ops_cli).
"""

from __future__ import annotations

import asyncio
import os
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from contract import names
from contract.health import HealthState
from contract.ids import health_workflow_id, repair_workflow_id, semaphore_workflow_id
from contract.instances import InstanceExclude, RepairWithdrawal
from contract.repair import RepairInput, RepairPhase, RepairProgress
from simulator.events import group_events
from tests.fleet import assert_start_before_stop, simulated_fleet
from tests.harness import eventually, unique
from tests.test_forged_signals import group_worker, hold_the_one_permit, semaphore_state
from tests.test_health_signals import finding, health_of, start_health
from tests.test_ops_cli import assert_one_clear_line, autorepair, cli_env, cli_json, describe, described_instances
from worker.settings import Settings
from workflows.models import InstanceHealthView

# Not steps of a repair: what operators did, from the instance's health workflow.
CONTROL_EVENTS = ("InstanceExcluded", "InstanceIncluded", "RepairRequested", "FindingCleared")


async def refused(settings: Settings, *args: str) -> str:
    """Run a control that must be refused: exit status 2 and one line on stderr, which is returned."""
    code, out, err = await autorepair(cli_env(settings), "instance", *args)
    assert code == 2, (args, out, err)
    assert_one_clear_line(err)
    return err


async def progress_token(client: Client, repair_id: str) -> str:
    """The token the health workflow gave its repair, from the repair's start input (its history)."""
    async for event in client.get_workflow_handle(repair_id).fetch_history_events(page_size=1):
        payloads = event.workflow_execution_started_event_attributes.input.payloads
        (started,) = await client.data_converter.decode(payloads, [RepairInput])
        return str(started.progress_token)
    raise AssertionError(f"no history for {repair_id}")


def events_of(settings: Settings, type: str, instance: str) -> list[dict[str, Any]]:
    path = settings.events.jsonl_path
    assert path is not None
    return group_events(path, settings.groups[0].name, type, instance)


async def test_clear_and_exclude_withdraw_a_waiting_repair_and_a_draining_one_is_left_alone(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with group_worker(client, aws_env, tmp_path) as settings:
        group = settings.groups[0].name
        # The group's one permit is held by a repair that never moves: every repair of ours waits for a permit.
        blocker = await hold_the_one_permit(client, settings)
        falsely, draining = unique("i-false"), unique("i-draining")
        handles: dict[str, WorkflowHandle[Any, Any]] = {}
        for instance in (falsely, draining):
            handles[instance] = await start_health(client, settings, instance)
            await handles[instance].signal("gpu_finding", finding(instance, group, f"{instance}-f1"))
        for instance in (falsely, draining):
            await eventually(partial(health_of, handles[instance]), lambda v: v.repair is not None)
        await eventually(lambda: semaphore_state(client, group), lambda v: len(v.waiters) == 2)
        first_repair = client.get_workflow_handle(repair_workflow_id(falsely, 1))

        # clear: the check back to OK, the finding kept and marked, the waiting repair withdrawn.
        result = await cli_json(
            settings, "instance", "clear", "--instance", falsely, "--reason", "driver roll-out false positive"
        )
        assert result["overallStatus"] == "OK" and result["action"] == "clear"
        assert f"{repair_workflow_id(falsely, 1)} withdrawn" in result["message"], result
        [cleared] = result["cleared"]
        assert (cleared["check"], cleared["status_reason"], cleared["finding_id"]) == (
            "ACCELERATED_COMPUTE",
            "XID_79",
            f"{falsely}-f1",
        )
        assert cleared["cleared_by"] and cleared["reason"] == "driver roll-out false positive"
        view = await health_of(handles[falsely])
        assert view.healthStatus.overallStatus is HealthState.OK
        assert [f.finding_id for f in view.recent_findings] == [f"{falsely}-f1"]
        assert [c.finding_id for c in view.cleared_findings] == [f"{falsely}-f1"]
        assert view.repair is not None and view.repair.phase is RepairPhase.CANCELLED
        # The repair stood down before touching the instance: it closed, out of the semaphore's waiting line.
        await eventually(first_repair.describe, lambda d: d.status == WorkflowExecutionStatus.FAILED)
        waiting = await eventually(lambda: semaphore_state(client, group), lambda v: len(v.waiters) == 1)
        assert waiting.waiters[0].instance_id == draining
        [failed] = await eventually(
            lambda: asyncio.sleep(0, events_of(settings, "RepairFailed", falsely)), lambda e: len(e) == 1
        )
        assert failed["detail"]["error"].startswith("withdrawn before draining: finding cleared as false by ")
        [event] = events_of(settings, "FindingCleared", falsely)
        assert (
            event["detail"]["requested_by"] == cleared["cleared_by"]
            and event["detail"]["reason"] == "driver roll-out false positive"
        )
        assert event["detail"]["cleared"] == [cleared] and event["detail"]["repair_workflow_id"] == repair_workflow_id(
            falsely, 1
        )
        await eventually(
            lambda: asyncio.sleep(0, events_of(settings, "HealthChanged", falsely)),
            lambda e: e[-1]["detail"]["overall_status"] == "OK",
        )
        [entry] = await described_instances(settings, "--instance", falsely)
        assert entry["clearedFindings"] == [cleared] and entry["excluded"] is None
        err = await refused(settings, "clear", "--instance", falsely)
        assert "nothing to clear: no check of" in err

        # A fresh finding impairs it again, and a new attempt starts under an id of its own.
        await handles[falsely].signal("gpu_finding", finding(falsely, group, f"{falsely}-f2"))
        view = await eventually(
            lambda: health_of(handles[falsely]),
            lambda v: v.repair is not None and v.repair.phase is RepairPhase.WAITING_FOR_PERMIT,
        )
        assert view.healthStatus.overallStatus is HealthState.IMPAIRED
        assert view.repair is not None and view.repair.workflow_id == repair_workflow_id(falsely, 2)
        second_repair = client.get_workflow_handle(repair_workflow_id(falsely, 2))
        assert (await first_repair.describe()).status == WorkflowExecutionStatus.FAILED

        # exclude withdraws that one too, and withholds the repair, saying why; include starts a new one.
        excluded = await cli_json(settings, "instance", "exclude", "--instance", falsely, "--reason", "bisecting")
        assert "withdrawn" in excluded["message"] and excluded["excluded"]["reason"] == "bisecting"
        assert excluded["repairWithheld"] == f"excluded by {excluded['excluded']['by']}: bisecting"
        await eventually(second_repair.describe, lambda d: d.status == WorkflowExecutionStatus.FAILED)
        included = await cli_json(settings, "instance", "include", "--instance", falsely)
        assert "its repair starts now" in included["message"] and included["excluded"] is None
        view = await eventually(
            lambda: health_of(handles[falsely]),
            lambda v: v.repair is not None and v.repair.phase is RepairPhase.WAITING_FOR_PERMIT,
        )
        assert view.repair_withheld is None and view.excluded is None
        # Withdrawn attempts are not retried by themselves: each new one here came from a finding or an `include`.
        assert view.repair is not None and view.repair.workflow_id == repair_workflow_id(falsely, 3)
        assert view.repair_retry.failed == 0 and view.repair_retry.text() is None
        [event] = events_of(settings, "InstanceIncluded", falsely)
        assert event["detail"]["excluded_reason"] == "bisecting" and event["detail"]["repair_re_armed"] is True

        # A repair past its permit (its progress says Draining) is not taken back: clear is refused, and exclude
        # leaves it to finish, saying so.
        draining_repair = repair_workflow_id(draining, 1)
        token = await progress_token(client, draining_repair)
        progress = RepairProgress(workflow_id=draining_repair, phase=RepairPhase.DRAINING, token=token)
        await handles[draining].signal(names.SIGNAL_REPAIR_PROGRESS, progress)
        await eventually(
            lambda: health_of(handles[draining]),
            lambda v: v.repair is not None and v.repair.phase is RepairPhase.DRAINING,
        )
        err = await refused(settings, "clear", "--instance", draining)
        assert f"{draining_repair} is Draining already" in err and "will be replaced" in err
        excluded = await cli_json(settings, "instance", "exclude", "--instance", draining)
        assert f"{draining_repair} is Draining already: it is left to finish" in excluded["message"]
        assert (await health_of(handles[draining])).repair_withheld is None
        err = await refused(settings, "exclude", "--instance", draining, "--reason", "again")
        assert "is already excluded by" in err and "include it first" in err
        err = await refused(settings, "repair", "--instance", draining, "--reason", "now")
        assert "include it first" in err

        # Nothing a caller sends wedges it: bad payloads are refused before they reach the workflow; a withdrawal
        # without the repair's token is refused by the repair.
        malformed: list[list[Any]] = [["junk"], [{"requested_by": "x" * 1_000}], [None], [], [{}, {}]]
        for args in malformed:
            with pytest.raises(WorkflowUpdateFailedError):
                await handles[draining].execute_update(names.UPDATE_INCLUDE_INSTANCE, args=args)
        with pytest.raises(WorkflowUpdateFailedError) as forged:
            await client.get_workflow_handle(draining_repair).execute_update(
                names.UPDATE_WITHDRAW_REPAIR, RepairWithdrawal(token="guess", reason="forged")
            )
        assert "only the health workflow that started this repair" in str(forged.value.cause)
        view = await health_of(handles[draining])
        assert view.excluded is not None and view.repair is not None
        for handle in (handles[falsely], handles[draining]):
            assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING

        third_repair = client.get_workflow_handle(repair_workflow_id(falsely, 3))
        for handle in (*handles.values(), blocker, client.get_workflow_handle(draining_repair), third_repair):
            await handle.terminate("test over")
        await client.get_workflow_handle(semaphore_workflow_id(group)).terminate("test over")


async def test_exclude_include_and_repair_now_on_a_simulated_fleet(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=3) as fleet:
        await fleet.all_healthy(3)
        settings, group = fleet.settings, fleet.group
        kept, chosen = fleet.sim.live_instances()[:2]

        # exclude: watched and reported as usual, never repaired; the decision says who and why.
        excluded = await cli_json(settings, "instance", "exclude", "--instance", kept, "--reason", "maintenance")
        who = excluded["excluded"]["by"]
        assert who and excluded["excluded"]["reason"] == "maintenance" and excluded["overallStatus"] == "OK"
        await cli_json(settings, "inject", "--instance", kept, "--group", group, "--xid", "79")
        entry = await eventually(lambda: describe(fleet, kept), lambda e: e["repairWithheld"] is not None)
        assert entry["repairWithheld"] == f"excluded by {who}: maintenance"
        assert entry["healthStatus"]["overallStatus"] == "IMPAIRED" and entry["repair"] is None
        assert entry["excluded"]["by"] == who and entry["excluded"]["since"]
        code, out, err = await autorepair(cli_env(settings), "describe-instances", "--instance", kept)
        assert code == 0, err
        assert "excluded from repair" in out and "maintenance" in out
        [event] = fleet.events("InstanceExcluded", kept)
        assert (event["detail"]["requested_by"], event["detail"]["reason"], event["detail"]["repair"]) == (
            who,
            "maintenance",
            None,
        )
        assert fleet.events("RepairStarted") == []

        # include: still impaired, so its repair starts.
        included = await cli_json(settings, "instance", "include", "--instance", kept, "--reason", "done")
        assert "its repair starts now" in included["message"]
        assert await fleet.repairs_finished(1) == [kept]
        await assert_start_before_stop(fleet, kept, tolerating=CONTROL_EVENTS)
        assert fleet.events("RepairStarted", kept)[0]["detail"]["reason"] == "XID_79"

        # repair now, on an instance that is OK: through the group's drain semaphore like any repair.
        started = await cli_json(
            settings, "instance", "repair", "--instance", chosen, "--reason", "NCCL hangs on this host"
        )
        assert started["overallStatus"] == "OK" and started["repair"]["workflowId"] == repair_workflow_id(chosen, 1)
        assert "started" in started["message"]
        err = await refused(settings, "repair", "--instance", chosen, "--reason", "twice")
        assert f"{chosen} is being repaired already: {repair_workflow_id(chosen, 1)} is " in err
        assert sorted(await fleet.repairs_finished(2)) == sorted([kept, chosen])
        await assert_start_before_stop(fleet, chosen, tolerating=CONTROL_EVENTS)
        [requested] = fleet.events("RepairRequested", chosen)
        assert (
            requested["detail"]["requested_by"],
            requested["detail"]["reason"],
            requested["detail"]["overall_status"],
        ) == (
            who,
            "NCCL hangs on this host",
            "OK",
        )
        assert (
            fleet.events("RepairStarted", chosen)[0]["detail"]["reason"] == f"operator {who}: NCCL hangs on this host"
        )
        assert len(fleet.events("DrainPermitGranted")) == 2

        # Retired (replaced) and unknown instances are refused in the operator's terms.
        retired = client.get_workflow_handle(health_workflow_id(chosen))
        await eventually(retired.describe, lambda d: d.status == WorkflowExecutionStatus.COMPLETED)
        err = await refused(settings, "exclude", "--instance", chosen)
        assert f"instance {chosen} has retired (it was replaced by i-" in err
        err = await refused(settings, "include", "--instance", "i-0000000000nobody")
        assert "unknown instance i-0000000000nobody: no health workflow" in err
        # The update itself on a closed workflow: the server refuses it; the workflow's view is its last.
        view = await retired.result(rpc_timeout=None)
        assert InstanceHealthView.model_validate(view).retired
        with pytest.raises(RPCError) as closed:
            await retired.execute_update(names.UPDATE_EXCLUDE_INSTANCE, InstanceExclude(reason="late"))
        assert closed.value.status == RPCStatusCode.NOT_FOUND


async def test_instance_commands_need_their_arguments() -> None:
    env = {k: v for k, v in os.environ.items() if k != "AUTOREPAIR_CONFIG"}
    for args, expected in (
        (["instance", "repair", "--instance", "i-1"], "--reason"),
        (["instance", "exclude"], "--instance"),
        (["instance", "clear", "--instance", "it's"], "not a valid instance id"),
        (["instance"], "choose exclude, include, repair, clear"),
        (["instance", "exclude", "--instance", "i-1", "--reason", "x" * 200], "reason: String should have at most 128"),
    ):
        code, out, err = await autorepair(env, *args)
        assert code == 2, (args, out, err)
        assert_one_clear_line(err)
        assert expected in err, (args, err)
