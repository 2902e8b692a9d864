"""Replacements that fault soon after taking over (issue 25): counted per group and published
(ReplacementFaultedEarly), and replacement_faults_to_hold of them within replacement_fault_window hold the group's
repairs like the breaker, since replacing from a bad capacity pool only feeds it.

On the real dev server, moto over HTTP and the simulated fleet running the real probe. The rule itself, case by case:
tests/test_breaker_rule.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from temporalio.client import Client

from contract.ids import repair_workflow_id
from tests.fleet import Fleet, simulated_fleet
from tests.harness import eventually
from tests.test_ops_cli import cli_json


async def replaced(fleet: Fleet, instance_id: str, repairs: int) -> str:
    """Fault the instance and wait for its repair to complete: the replacement that took over, once healthy."""
    fleet.sim.inject_fault(instance_id, xid=79)
    await fleet.repairs_finished(repairs, within=150)
    [completed] = fleet.events("RepairCompleted", instance_id)
    replacement = completed["detail"]["replacement_instance_id"]
    assert isinstance(replacement, str)
    await eventually(fleet.sim.snapshot, lambda s: replacement in fleet.sim.live_instances() and s.healthy >= 3)
    return str(replacement)


async def holds(fleet: Fleet) -> list[dict[str, Any]]:
    return fleet.events("RepairsHeld")


async def test_replacements_that_fault_soon_after_taking_over_are_published_and_hold_the_group(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(
        client, aws_env, tmp_path, instances=3, group_settings={"replacement_faults_to_hold": 2}
    ) as fleet:
        await fleet.all_healthy(3)
        first = fleet.sim.live_instances()[0]
        second = await replaced(fleet, first, 1)
        assert fleet.events("ReplacementFaultedEarly") == []  # the first fault was no replacement's

        third = await replaced(fleet, second, 2)
        [early] = fleet.events("ReplacementFaultedEarly")
        assert (early["detail"]["replacement_instance_id"], early["detail"]["faulted_early"]) == (second, 1)
        assert (early["detail"]["replacement_faults_to_hold"], early["detail"]["replacement_fault_window"]) == (
            2,
            "86400s",
        )
        assert early["detail"]["reason"] == "XID_79"
        assert fleet.events("RepairsHeld") == []  # one is not yet a pattern

        # The second replacement in a row to fault: the group's repairs are held, its own repair waits.
        fleet.sim.inject_fault(third, xid=79)
        held = await eventually(lambda: holds(fleet), lambda e: len(e) == 1)
        assert held[0]["detail"]["cause"] == "early_replacement_faults"
        assert sorted(held[0]["detail"]["instances"]) == sorted([second, third])
        assert "2 replacements faulted within 24 h of taking over" in held[0]["detail"]["message"]
        assert [e["detail"]["replacement_instance_id"] for e in fleet.events("ReplacementFaultedEarly")] == [
            second,
            third,
        ]
        described = await cli_json(fleet.settings, "group", "describe", "--name", fleet.group)
        assert described["breaker"]["held"]["cause"] == "early_replacement_faults"
        assert described["breaker"]["replacements_faulted_early"] == 2
        await asyncio.sleep(3)  # the permit request has long arrived: still no grant
        assert fleet.events("DrainPermitGranted", third) == []
        assert fleet.events("RepairStarted", third)[0]["workflow_id"] == repair_workflow_id(third, 1)
