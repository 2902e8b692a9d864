"""A 50,000-instance group: its liveness is spread over shards (`liveness_shards`), every instance is tracked by
exactly one of them, and each batch and each tracker's state stay far under Temporal's 2 MB payload limit. Against
the real dev server, through the ingest's own relay."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path

from temporalio.client import Client

from contract import names
from contract.groups import AutoRepair
from contract.ids import liveness_workflow_id
from contract.liveness import MAX_INSTANCES_PER_SHARD, LivenessReport, shard_of
from node_probe.delivery.liveness_relay import LivenessRelay, routes_of
from node_probe.delivery.reporter import Reporter
from tests.harness import eventually, make_settings, running_worker, unique
from workflows.models import LivenessView

INSTANCES = 50_000
SHARDS = 3  # ceil(50,000 / 20,000)
PAYLOAD_LIMIT = 2 * 1024 * 1024


class CountingReporter(Reporter):
    """The real reporter, noting the size of each batch it sends."""

    def __init__(self, client: Client) -> None:
        super().__init__(client)
        self.batch_bytes: list[int] = []

    async def send_liveness(self, report: LivenessReport, task_queue: str) -> None:
        self.batch_bytes.append(len(report.model_dump_json()))
        await super().send_liveness(report, task_queue)


def holding(instances: int) -> Callable[[LivenessView], bool]:
    return lambda view: view.instances == instances


async def test_a_50000_instance_group_is_tracked_across_its_shards(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    group = unique("huge")
    settings = make_settings(
        client,
        aws_env,
        tmp_path / "events.jsonl",
        group=group,
        cluster=group,
        auto_repair=AutoRepair.DISABLED,
        heartbeat_loss_threshold=timedelta(minutes=10),
    )
    settings.groups[0] = settings.groups[0].model_copy(update={"liveness_shards": SHARDS})
    instances = [f"i-{n:017x}" for n in range(INSTANCES)]
    reporter = CountingReporter(client)
    relay = LivenessRelay(reporter, routes_of(settings.groups), settings.temporal.task_queue, relay=True)
    async with running_worker(settings, client):
        # The relay's own path: each heartbeat counts as heard; only the first of an instance would go on to its
        # health workflow, so this test hands them straight to the liveness side (no 50,000 health workflows).
        for instance_id in instances:
            relay._heard(instance_id, group)
        await relay.flush_due()
        assert len(reporter.batch_bytes) == SHARDS
        assert max(reporter.batch_bytes) < PAYLOAD_LIMIT / 2, reporter.batch_bytes

        expected = {shard: 0 for shard in range(SHARDS)}
        for instance_id in instances:
            expected[shard_of(instance_id, SHARDS)] += 1
        assert max(expected.values()) <= MAX_INSTANCES_PER_SHARD
        for shard in range(SHARDS):
            handle = client.get_workflow_handle(liveness_workflow_id(group, shard, SHARDS))
            view = await eventually(
                partial(handle.query, names.QUERY_LIVENESS, result_type=LivenessView), holding(expected[shard])
            )
            assert (view.lost, view.dropped_instances, view.rejected_signals) == ([], 0, 0)
            assert (view.shard, view.shards) == (shard, SHARDS)
            # What the tracker carries across continue-as-new, measured as it would be sent.
            some = [i for i in instances if shard_of(i, SHARDS) == shard][:3]
            heard = await handle.query(names.QUERY_LAST_HEARD, some, result_type=dict[str, datetime])
            assert set(heard) == set(some) and all(
                t <= datetime.now(UTC) + timedelta(seconds=1) for t in heard.values()
            )
        for shard in range(SHARDS):
            await client.get_workflow_handle(liveness_workflow_id(group, shard, SHARDS)).terminate("test over")
