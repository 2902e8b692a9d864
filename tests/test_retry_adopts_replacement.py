"""A retried repair adopts the replacement its failed attempt left serving, instead of launching another.

An attempt can fail after its replacement became ACTIVE: the termination refused (an IAM policy without the
instance's group tag, say). The next attempt, `repair/<instance>/2`, finds that replacement still running, tagged
for this instance and ACTIVE in ECS, and takes it as its own: one p5 launched per incident however often it is retried.
On the real dev server, moto over HTTP and the simulated fleet; the fault proxy refuses the termination.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client

from contract.ids import repair_workflow_id
from simulator.aws_proxy import FlakyAws
from tests.fleet import simulated_fleet
from tests.harness import eventually
from tests.test_remediation_ladder import closed, steps_of
from tests.test_replacement_attempts import current_details, set_group


async def test_a_retried_repair_adopts_the_replacement_the_failed_attempt_left_serving(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    with FlakyAws(aws_env) as proxy:
        async with simulated_fleet(client, aws_env, tmp_path, instances=3, engine_proxy=proxy) as fleet:
            set_group(fleet, repair_retry_delay=timedelta(seconds=2))
            await fleet.all_healthy(3)
            proxy.fail("TerminateInstances", "UnauthorizedOperation")
            faulty = fleet.sim.live_instances()[0]
            fleet.sim.inject_fault(faulty, xid=79)
            first, second = repair_workflow_id(faulty, 1), repair_workflow_id(faulty, 2)

            await eventually(
                lambda: asyncio.sleep(0, steps_of(fleet, first)), lambda steps: "RepairFailed" in steps, within=120
            )
            [launched] = fleet.events("ReplacementLaunched", faulty)
            replacement = launched["detail"]["replacement_instance_id"]
            assert fleet.ec2_state(replacement) == "running" and fleet.ec2_state(faulty) == "running"
            proxy.heal()

            result = await closed(fleet, second)

            assert result.replacement_instance_id == replacement
            assert proxy.calls("RunInstances") == 1 and fleet.replacements_of(faulty) == [replacement]
            steps = steps_of(fleet, second)
            assert "ReplacementLaunched" not in steps and steps.index("ReplacementReady") < steps.index("Terminated")
            [ready] = [e for e in fleet.events("ReplacementReady", faulty) if e["workflow_id"] == second]
            assert ready["detail"]["adopted"] is True and ready["detail"]["replacement_instance_id"] == replacement
            assert fleet.ec2_state(faulty) == "terminated" and fleet.ec2_state(replacement) == "running"
            details = await current_details(client, second)
            adopted = f"[done] Launch a replacement in the same AZ — {replacement}, launched by an earlier attempt"
            assert adopted in details
