"""ECS daemon tasks (issue 25): a group's `daemon_services` with no RUNNING task on an instance, or an UNHEALTHY one,
impairs DAEMON there, read per group by the AWS watch (activities/daemon_tasks.py).

moto lists a DAEMON service and keeps the tasks started with start_task(group="service:<name>"), as ECS names a
service's tasks, but ignores ListTasks' serviceName filter and runs no health checks: the reader checks each task's
group itself (as it must anyway), and the fault proxy says a task is UNHEALTHY (tests/aws_says.py). On the real dev
server and moto over HTTP; the plain rules: tests/test_daemon_task_rules.py.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import boto3
import pytest
from temporalio.client import Client

from activities.aws import AwsClients
from activities.aws_status import AwsStatusReads
from contract.config import AwsSettings
from contract.groups import AutoRepair, CapacityGroup
from contract.health import CheckType, HealthState
from contract.ids import health_workflow_id
from simulator.aws_proxy import FlakyAws
from simulator.fleet_aws import freeze_moto_task_lifecycle
from tests.aws_says import AwsSays
from tests.fleet import simulated_fleet
from tests.harness import eventually, unique
from tests.test_aws_signals import aws_settings, check_of, register
from tests.test_health_signals import health_of
from worker.aws_watch import aws_watch
from workflows.models import InstanceHealthView

DAEMON = "gpu-exporter"
REASON = f"ECS_DAEMON_{DAEMON}"


def ecs(moto: str) -> Any:
    return boto3.client("ecs", endpoint_url=moto, region_name="us-east-1")


def fields(event: dict[str, Any]) -> dict[str, Any]:
    """An event's own fields: under `detail` in the schema_version 2 envelope (contract/events.py), else merged."""
    return dict(event.get("detail") or event)


def container_instances(moto: str, cluster: str) -> dict[str, str]:
    """EC2 instance id -> its container instance's ARN."""
    client = ecs(moto)
    arns = client.list_container_instances(cluster=cluster)["containerInstanceArns"]
    described = client.describe_container_instances(cluster=cluster, containerInstances=arns)["containerInstances"]
    return {ci["ec2InstanceId"]: ci["containerInstanceArn"] for ci in described}


def daemon_service(moto: str, cluster: str, name: str = DAEMON, strategy: str = "DAEMON") -> None:
    client = ecs(moto)
    client.register_task_definition(family=name, containerDefinitions=[{"name": name, "image": name, "memory": 64}])
    client.create_service(cluster=cluster, serviceName=name, taskDefinition=name, schedulingStrategy=strategy)


def start_daemon_task(moto: str, cluster: str, container_instance: str, service: str = DAEMON) -> str:
    """As ECS's daemon scheduler places one: its group names the service."""
    started = ecs(moto).start_task(
        cluster=cluster, taskDefinition=service, containerInstances=[container_instance], group=f"service:{service}"
    )
    return str(started["tasks"][0]["taskArn"])


async def test_the_reader_tells_each_instance_its_missing_daemons_with_a_few_calls_per_group(
    aws_env: str, caplog: pytest.LogCaptureFixture
) -> None:
    freeze_moto_task_lifecycle(aws_env)
    cluster = unique("daemons")
    running, unhealthy, stopped, without = register(aws_env, cluster, 4)
    arns = container_instances(aws_env, cluster)
    daemon_service(aws_env, cluster)
    daemon_service(aws_env, cluster, "web", strategy="REPLICA")
    start_daemon_task(aws_env, cluster, arns[running])
    sick = start_daemon_task(aws_env, cluster, arns[unhealthy])
    ecs(aws_env).stop_task(cluster=cluster, task=start_daemon_task(aws_env, cluster, arns[stopped]))
    start_daemon_task(aws_env, cluster, arns[without], service="web")  # another service's task is not the daemon
    group = CapacityGroup(name="g", cluster=cluster, daemon_services=[DAEMON, "web", "nope"])
    later = datetime.now(UTC) + timedelta(hours=1)  # every instance ACTIVE past daemon_task_grace
    with FlakyAws(aws_env) as proxy, caplog.at_level(logging.WARNING, logger="activities.daemon_tasks"):
        says = AwsSays(proxy)
        says.task_health(sick, "UNHEALTHY")
        async with AwsClients(AwsSettings(endpoint_url=proxy.url, region="us-east-1")) as aws:
            reads = AwsStatusReads(aws)
            seen = await reads.read(group, now=later)
            assert {i: s.daemon_tasks_missing for i, s in seen.items()} == {
                running: [],
                unhealthy: [DAEMON],
                stopped: [DAEMON],
                without: [DAEMON],
            }
            assert seen[running].healthy() and not seen[stopped].healthy()
            # Per group, not per instance: one DescribeServices, one ListTasks and one DescribeTasks for 4 instances.
            assert [proxy.calls(a) for a in ("DescribeServices", "ListTasks", "DescribeTasks")] == [1, 1, 1]
            # A name that is no DAEMON service of the cluster is said, and judged on no instance.
            warned = " ".join(r.getMessage() for r in caplog.records)
            assert "web is REPLICA-scheduled, not DAEMON" in warned and "nope not found (MISSING)" in warned

            # The confirming read of one instance: that instance's tasks only.
            one = await reads.read(group, unhealthy, now=later)
            assert list(one) == [unhealthy] and one[unhealthy].daemon_tasks_missing == [DAEMON]
            says.task_health(sick, "HEALTHY")
            assert (await reads.read(group, unhealthy, now=later))[unhealthy].daemon_tasks_missing == []

            # Registered moments ago: no daemon task yet, and none expected before daemon_task_grace.
            fresh = await reads.read(group, now=datetime.now(UTC))
            assert all(s.daemon_tasks_missing == [] for s in fresh.values())
            # No daemon_services: not one call more than before.
            before = proxy.calls("DescribeServices")
            await reads.read(CapacityGroup(name="g", cluster=cluster), now=later)
            assert proxy.calls("DescribeServices") == before


async def test_a_stopped_daemon_task_impairs_daemon_on_its_instance_only_and_its_return_clears_it(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    grace = timedelta(seconds=3)
    settings = aws_settings(daemon_services=[DAEMON], daemon_task_grace=grace)
    with FlakyAws(aws_env) as proxy:
        says = AwsSays(proxy)
        # DISABLED: the impairment is watched, never repaired, so that the task's return can clear it.
        async with simulated_fleet(
            client,
            aws_env,
            tmp_path,
            instances=3,
            engine_proxy=proxy,
            group_settings=settings,
            auto_repair=AutoRepair.DISABLED,
        ) as fleet:
            await fleet.all_healthy(3)
            stopped, sick, fine = fleet.sim.live_instances()
            arns = container_instances(aws_env, fleet.group)
            daemon_service(aws_env, fleet.group)
            tasks = {i: start_daemon_task(aws_env, fleet.group, arns[i]) for i in (stopped, sick, fine)}
            says.task_health(tasks[sick], "UNHEALTHY")
            ecs(aws_env).stop_task(cluster=fleet.group, task=tasks[stopped], reason="test: the daemon died")
            t0 = datetime.now(UTC)

            async def daemon(instance_id: str) -> InstanceHealthView:
                return await health_of(client.get_workflow_handle(health_workflow_id(instance_id)))

            def impaired(view: InstanceHealthView) -> bool:
                check = check_of(view, CheckType.DAEMON)
                return check is not None and check.status is HealthState.IMPAIRED

            async with AwsClients(fleet.settings.aws) as aws, aws_watch(fleet.settings, client, aws):
                for instance_id in (stopped, sick):
                    view = await eventually(partial(daemon, instance_id), impaired, within=60)
                    check = check_of(view, CheckType.DAEMON)
                    assert check is not None and check.statusReason == REASON
                    assert check.lastStatusChange >= t0 + grace  # not before its grace
                    assert view.healthStatus.overallStatus is HealthState.IMPAIRED
                # The instance whose daemon task runs, healthy, was never impaired: its DAEMON check never set.
                assert check_of(await daemon(fine), CheckType.DAEMON) is None
                assert all(fields(e)["overall_status"] != "IMPAIRED" for e in fleet.events("HealthChanged", fine))

                # ECS's daemon scheduler starts it again: DAEMON is OK again.
                start_daemon_task(aws_env, fleet.group, arns[stopped])
                view = await eventually(lambda: daemon(stopped), lambda v: not impaired(v), within=60)
                assert check_of(view, CheckType.DAEMON) is not None
                assert view.healthStatus.overallStatus is HealthState.OK
                assert impaired(await daemon(sick))  # the unhealthy one still is

            changes = [fields(e) for e in fleet.events("HealthChanged", stopped)]
            [changed] = [c for c in changes if c["overall_status"] == "IMPAIRED"]  # one impairment, one event
            assert [d["statusReason"] for d in changed["details"] if d["type"] == "DAEMON"] == [REASON]
            assert fleet.events("RepairStarted") == []  # DISABLED: told, never repaired
