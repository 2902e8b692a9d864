"""Record real workflow histories for the replay test: `python -m tests.histories.record`.

Run it when a workflow change is released: the histories it writes stand for workflows that were running on the
released code, and tests/test_replay.py proves the new code still replays them (else: `workflow.patched`).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import boto3
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from contract import names
from contract.ids import (
    fleet_breaker_workflow_id,
    health_workflow_id,
    liveness_workflow_id,
    repair_workflow_id,
    semaphore_workflow_id,
)
from simulator.events import read_events
from simulator.servers import MotoServer, TemporalDevServer, free_port
from tests.fleet import simulated_fleet
from tests.harness import eventually
from workflows.models import LivenessView

HERE = Path(__file__).parent


async def record() -> None:
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    state = Path(tempfile.mkdtemp(prefix="record-histories-"))
    async with (
        MotoServer(state / "moto", port=free_port()) as moto,
        TemporalDevServer(state / "temporal", port=free_port(), ui_port=free_port()) as temporal,
    ):
        client = await Client.connect(temporal.address, data_converter=pydantic_data_converter)
        group = "recorded"
        # The repair keeps its evidence, the host's part included: its history has those steps too.
        bucket = "recorded-evidence"
        boto3.client("s3", endpoint_url=moto.endpoint_url, region_name="us-east-1").create_bucket(Bucket=bucket)
        evidence = {"evidence_bucket": bucket, "bug_report": True}
        async with simulated_fleet(
            client, moto.endpoint_url, state, instances=3, group=group, seed=1, group_settings=evidence
        ) as fleet:
            await eventually(fleet.sim.snapshot, lambda s: s.healthy == 3)
            faulty = fleet.sim.live_instances()[0]
            fleet.sim.inject_fault(faulty, xid=79)
            await eventually(
                lambda: asyncio.sleep(0, read_events(fleet.events_path)),
                lambda events: any(e["type"] == "DrainPermitReleased" for e in events),
            )
            # The replaced instance falls silent: the tracker declares it lost, finds its health workflow closed and
            # forgets it, so the liveness history holds a loss too.
            tracker = client.get_workflow_handle(liveness_workflow_id(group))
            await eventually(
                lambda: tracker.query(names.QUERY_LIVENESS, result_type=LivenessView), lambda v: v.forgotten >= 1
            )
        for name, workflow_id in (
            ("repair", repair_workflow_id(faulty)),
            ("health", health_workflow_id(faulty)),
            ("semaphore", semaphore_workflow_id(group)),
            ("liveness", liveness_workflow_id(group)),
            # It counted the one impairment its semaphore passed on; nothing tripped.
            ("fleet_breaker", fleet_breaker_workflow_id(fleet.settings.temporal.task_queue)),
        ):
            history = await client.get_workflow_handle(workflow_id).fetch_history()
            (HERE / f"{name}.json").write_text(history.to_json())
            print(f"recorded {name}: {len(history.events)} events")


if __name__ == "__main__":
    asyncio.run(record())
