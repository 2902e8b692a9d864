"""Every member watched from the moment ECS lists it (issue 25): the worker's AWS watch starts a health workflow for
each container instance of the group it has not seen, so a host whose probe never started is INITIALIZING, then
unmonitored after first_report_timeout (INSUFFICIENT_DATA, an InstanceUnmonitored event, never a repair for that),
and EC2's own checks still reach it.

On the real dev server and moto over HTTP, the simulated fleet with one host whose probe never starts; EC2's status
checks are edited in moto's answers by the fault proxy (tests/aws_says.py), as in test_aws_signals.py.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

from temporalio.client import Client
from temporalio.common import MetricMeter

from activities.aws import AwsClients
from contract.formats import iso
from contract.health import CheckType, HealthState
from contract.ids import health_workflow_id, repair_workflow_id
from simulator.aws_proxy import FlakyAws
from simulator.nodes import SimNode
from simulator.probes import ProbeFleet, run_real_probe
from tests.aws_says import AwsSays, Check
from tests.fleet import assert_start_before_stop, simulated_fleet
from tests.harness import eventually
from tests.test_aws_signals import aws_settings, check_of
from tests.test_health_signals import health_of
from tests.test_ops_cli import cli_json
from worker.aws_watch import aws_watch
from worker.health_gauges import HealthGauges

FIRST_REPORT = timedelta(seconds=4)
UNMONITORED = "UNMONITORED: no report from its probe within first_report_timeout 4s"


class OneSilentHost:
    """The real probe on every host but the first one it is asked to run on, whose probe never starts."""

    def __init__(self) -> None:
        self.silent: str | None = None

    async def __call__(self, fleet: ProbeFleet, node: SimNode) -> None:
        if self.silent in (None, node.instance_id):
            self.silent = node.instance_id
            await asyncio.Event().wait()  # a broken unit, a wrong --group, an AMI without the probe
        await run_real_probe(fleet, node)


async def test_a_member_whose_probe_never_reports_is_unmonitored_never_repaired_for_it_and_ec2_still_counts(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    runner = OneSilentHost()
    with FlakyAws(aws_env) as proxy:
        says = AwsSays(proxy)
        settings = aws_settings(first_report_timeout=FIRST_REPORT)
        async with simulated_fleet(
            client,
            aws_env,
            tmp_path,
            instances=3,
            engine_proxy=proxy,
            group_settings=settings,
            probe_runner=runner,
        ) as fleet:
            await eventually(fleet.sim.snapshot, lambda s: s.healthy == 2 and s.running == 3, within=90)
            silent = runner.silent
            assert silent is not None
            handle = client.get_workflow_handle(health_workflow_id(silent))
            async with AwsClients(fleet.settings.aws) as aws, aws_watch(fleet.settings, client, aws) as [watch]:
                # Started by the watch at its first read, with no probe behind it: unmonitored once the timeout
                # has passed, on a named timer, and said so once.
                view = await eventually(
                    lambda: health_of(handle), lambda v: v.healthStatus.overallStatus is HealthState.INSUFFICIENT_DATA
                )
                accelerated = check_of(view, CheckType.ACCELERATED_COMPUTE)
                agent = check_of(view, CheckType.AGENT_CONNECTIVITY)
                assert accelerated is not None and agent is not None
                assert (accelerated.status, accelerated.statusReason) == (HealthState.INSUFFICIENT_DATA, UNMONITORED)
                assert (agent.status, agent.statusReason) == (HealthState.INSUFFICIENT_DATA, UNMONITORED)
                assert watch.started == 1  # the others' probes had started theirs
                [unmonitored] = fleet.events("InstanceUnmonitored", silent)
                assert unmonitored["detail"]["first_report_timeout"] == "4s"
                started = await handle.describe()
                assert started.start_time is not None
                assert datetime.fromisoformat(unmonitored["time"]) >= started.start_time + FIRST_REPORT
                assert fleet.steps(silent) == ["InstanceUnmonitored"]  # not repaired for it
                # Counted apart, in `group describe` and the instances gauge: watched by AWS alone.
                gauges = HealthGauges(client, [fleet.group], MetricMeter.noop)
                counts = await eventually(gauges.refresh, lambda c: c[fleet.group, "UNMONITORED"] == 1)
                assert (counts[fleet.group, "OK"], counts[fleet.group, "INSUFFICIENT_DATA"]) == (2, 0)
                described = await cli_json(fleet.settings, "group", "describe", "--name", fleet.group)
                assert described["instances"]["UNMONITORED"] == 1 and described["instances"]["OK"] == 2

                # EC2's status check is AWS's word, probe or not: impaired for the grace, replaced.
                t0 = datetime.now(UTC).replace(microsecond=0)
                says.status(silent, system=Check("impaired", since=t0))
                await fleet.repairs_finished(1, within=240)

            await assert_start_before_stop(fleet, silent, tolerating={"InstanceUnmonitored"})
            [repair] = fleet.events("RepairStarted", silent)
            assert repair["workflow_id"] == repair_workflow_id(silent, 1)
            assert (
                repair["detail"]["reason"]
                == f"EC2 system status check impaired since {iso(t0, 'seconds')} (reachability failed)"
            )
            # The hosts whose probes report were never unmonitored.
            assert [e["instance_id"] for e in fleet.events("InstanceUnmonitored")] == [silent]
