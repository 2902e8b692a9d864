"""An operator's cancellation is never swallowed by a step that was running at that moment.

Cancelling a workflow cancels the activity it awaits, and the await then raises ActivityError with a CancelledError
cause (sdk-python#620): a step that treats every ActivityError as "try again" would carry on as if nothing had been
asked. Here the repair is cancelled while its launch call is failing and being retried (the fault-injecting proxy
throttles every RunInstances): it ends CANCELED, says so, and launches nothing more.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus

from contract.ids import health_workflow_id
from simulator.aws_proxy import FlakyAws
from tests.fleet import simulated_fleet
from tests.harness import eventually
from workflows.models import InstanceHealthView


async def test_a_repair_cancelled_while_its_launch_is_retried_ends_cancelled(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    with FlakyAws(aws_env) as aws:
        async with simulated_fleet(client, aws_env, tmp_path, instances=3, engine_proxy=aws) as fleet:
            await fleet.all_healthy(3)
            # Every call fails as a whole (botocore's retries too), so the activity is retried by Temporal.
            throttle = aws.fail("RunInstances", "RequestLimitExceeded", per="call")
            [faulty] = fleet.sim.live_instances()[:1]
            fleet.sim.inject_fault(faulty)
            health = client.get_workflow_handle(health_workflow_id(faulty))
            view = await eventually(
                lambda: health.query("health", result_type=InstanceHealthView), lambda v: v.repair is not None
            )
            assert view.repair is not None
            repair = client.get_workflow_handle(view.repair.workflow_id)
            await eventually(lambda: asyncio.sleep(0, throttle.failed), lambda failed: failed >= 1)

            await repair.cancel()

            await eventually(repair.describe, lambda d: d.status == WorkflowExecutionStatus.CANCELED, within=60)
            [failed] = fleet.events("RepairFailed", faulty)
            assert failed["detail"]["error"] == "cancelled by an operator"
            tries = throttle.matched
            await asyncio.sleep(5)  # past the activity's retry interval: a swallowed cancel would try again
            assert throttle.matched == tries
            assert fleet.replacements_of(faulty) == []
