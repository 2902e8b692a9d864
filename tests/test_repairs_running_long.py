"""Repairs running longer than they should (issue 26's "a repair stuck past its expected duration"): a gauge counted
from Temporal visibility per group, which the AutorepairRepairRunningLong alert reads. On the real dev server: a repair
workflow no worker picks up stands in for one stuck on a step."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio.client import Client
from temporalio.common import MetricMeter, SearchAttributePair, TypedSearchAttributes

from contract import names
from contract import search_attributes as sa
from contract.repair import RepairInput
from tests.harness import eventually
from worker.health_gauges import HealthGauges


async def test_a_repair_running_past_the_setting_is_counted_for_its_group_only(client: Client) -> None:
    handle = await client.start_workflow(
        names.REPAIR_WORKFLOW,
        RepairInput(instance_id="i-stuck", group="p5", reason="XID_79"),
        id="repair/i-stuck/1",
        task_queue="nobody-polls-this",  # it never takes a step: stuck from the start
        search_attributes=TypedSearchAttributes([SearchAttributePair(sa.CAPACITY_GROUP, "p5")]),
    )
    try:
        gauges = HealthGauges(client, ["p5", "p4d"], MetricMeter.noop, long_after=timedelta(seconds=2))
        assert (await gauges.refresh_repairs())["p5"] == 0  # just started
        await asyncio.sleep(2.5)
        counts = await eventually(gauges.refresh_repairs, lambda c: c["p5"] == 1, within=30)
        assert counts["p4d"] == 0
    finally:
        await handle.terminate("test over")
