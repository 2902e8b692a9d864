"""The fleet simulator's AWS side against a real moto server, and the local servers the demo starts.

No Temporal and no real probe here: the fleet runs without a client (or with a fake probe runner), so these
tests pin down what the simulator does to EC2/ECS and to the kernel-log files. Conditions are polled with a
generous bound; nothing asserts how fast anything happens.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest

from contract import search_attributes
from contract.names import GROUP_TAG
from simulator.fleet import CRITICAL_XIDS, NOISE_XIDS, SimTiming, SimulatedFleet
from simulator.fleet_aws import SimWorkload
from simulator.nodes import SimNode
from simulator.probes import ProbeFleet
from simulator.servers import MotoServer, TemporalDevServer, port_in_use, search_attribute_args

FAST = SimTiming(
    boot_delay=timedelta(seconds=1),
    drain_grace=timedelta(milliseconds=200),
    watch_interval=timedelta(milliseconds=100),
)


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@pytest.fixture
async def make_fleet(aws_env: str, tmp_path: Path) -> AsyncIterator[Callable[..., SimulatedFleet]]:
    fleets: list[SimulatedFleet] = []

    def make(**kwargs: Any) -> SimulatedFleet:
        group = _unique("g")
        options: dict[str, Any] = {
            "group": group,
            "cluster": f"{group}-cluster",
            "state_dir": tmp_path / group,
            "instances": 4,
            "endpoint_url": aws_env,
            "timing": FAST,
        }
        options.update(kwargs)
        fleet = SimulatedFleet(**options)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        await fleet.close()


@functools.cache  # one client a module: building one costs tens of milliseconds of CPU
def _ecs(endpoint: str) -> Any:
    return boto3.client("ecs", region_name="us-east-1", endpoint_url=endpoint)


@functools.cache
def _ec2(endpoint: str) -> Any:
    return boto3.client("ec2", region_name="us-east-1", endpoint_url=endpoint)


def _running_tasks(endpoint: str, cluster: str, container_instance: str) -> set[str]:
    arns = _ecs(endpoint).list_tasks(cluster=cluster, containerInstance=container_instance, desiredStatus="RUNNING")[
        "taskArns"
    ]
    return set(arns)


async def test_setup_registers_every_instance_with_tasks(make_fleet: Callable[..., SimulatedFleet], aws_env: str):
    fleet = make_fleet(instances=5)
    launched = await fleet.setup(watch=False)
    assert len(launched) == 5

    ecs, ec2 = _ecs(aws_env), _ec2(aws_env)
    active = ecs.list_container_instances(cluster=fleet.cluster, status="ACTIVE")["containerInstanceArns"]
    assert len(active) == 5
    described = ecs.describe_container_instances(cluster=fleet.cluster, containerInstances=active)
    assert {ci["ec2InstanceId"] for ci in described["containerInstances"]} == set(launched)

    reservations = ec2.describe_instances(InstanceIds=launched)["Reservations"]
    instances = [i for r in reservations for i in r["Instances"]]
    assert {i["InstanceType"] for i in instances} == {"p5.48xlarge"}
    assert {i["ImageId"] for i in instances} == {"ami-12c6146b"}
    assert all({"Key": GROUP_TAG, "Value": fleet.group} in i["Tags"] for i in instances)
    assert all(any(t["Key"] == "Name" for t in i["Tags"]) for i in instances)
    assert len({i["Placement"]["AvailabilityZone"] for i in instances}) >= 2

    for instance_id in launched:
        node = fleet.node(instance_id)
        assert node.registered and node.initial
        assert node.container_instance_arn is not None
        running = _running_tasks(aws_env, fleet.cluster, node.container_instance_arn)
        assert running == set(node.tasks) and len(running) >= 2
        assert node.kernel_log.is_file()

    # Stop timeouts vary and come from the task definitions, where the engine reads them.
    timeouts = {task.stop_timeout_s for node in fleet.nodes.values() for task in node.tasks.values()}
    assert len(timeouts) >= 2
    some_task = next(iter(fleet.node(launched[0]).tasks.values()))
    definition = ecs.describe_task_definition(taskDefinition=some_task.family)["taskDefinition"]
    assert definition["containerDefinitions"][0]["stopTimeout"] == some_task.stop_timeout_s


async def test_same_seed_same_workload(make_fleet: Callable[..., SimulatedFleet]):
    plans = []
    for _ in range(2):
        fleet = make_fleet(instances=4, seed=42)
        await fleet.setup(watch=False)
        plans.append(
            [sorted((t.stop_timeout_s, t.stubborn) for t in node.tasks.values()) for node in fleet.nodes.values()]
        )
    assert plans[0] == plans[1]


async def test_new_tagged_instance_is_registered_after_boot_delay(
    make_fleet: Callable[..., SimulatedFleet], aws_env: str
):
    # A boot delay far longer than one tick, so "not yet registered" right after launch is not a race.
    fleet = make_fleet(instances=1, timing=SimTiming(boot_delay=timedelta(seconds=3)))
    await fleet.setup(watch=False)

    # What the engine does: launch from the group's template; the template carries the group tag.
    reservation = _ec2(aws_env).run_instances(
        LaunchTemplate={"LaunchTemplateName": fleet.launch_template, "Version": "$Latest"},
        MinCount=1,
        MaxCount=1,
        Placement={"AvailabilityZone": "us-east-1b"},
    )
    replacement = reservation["Instances"][0]["InstanceId"]

    await fleet.tick()
    node = fleet.node(replacement)
    assert not node.initial and not node.registered

    async def registered() -> bool:
        await fleet.tick()
        return fleet.node(replacement).registered

    await _until(registered, "the replacement to register with ECS")
    node = fleet.node(replacement)
    assert node.container_instance_arn is not None
    assert _running_tasks(aws_env, fleet.cluster, node.container_instance_arn) == set(node.tasks)
    assert node.availability_zone == "us-east-1b"
    active = _ecs(aws_env).list_container_instances(cluster=fleet.cluster, status="ACTIVE")["containerInstanceArns"]
    assert len(active) == 2


async def test_untagged_instance_is_ignored(make_fleet: Callable[..., SimulatedFleet], aws_env: str):
    fleet = make_fleet(instances=1, timing=FAST)
    await fleet.setup(watch=False)
    other = _ec2(aws_env).run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"][0]
    await fleet.tick()
    assert other["InstanceId"] not in fleet.nodes


async def test_draining_moves_cooperative_tasks_but_not_stubborn_ones(
    make_fleet: Callable[..., SimulatedFleet], aws_env: str
):
    fleet = make_fleet(instances=2, workload=SimWorkload(stubborn_fraction=1.0))
    launched = await fleet.setup()  # with the watch loop, as in the demo
    drained, untouched = fleet.node(launched[0]), fleet.node(launched[1])
    assert drained.container_instance_arn and untouched.container_instance_arn
    stubborn = {arn for arn, task in drained.tasks.items() if task.stubborn}
    cooperative = set(drained.tasks) - stubborn
    assert len(stubborn) == 1 and cooperative

    ecs = _ecs(aws_env)
    ecs.update_container_instances_state(
        cluster=fleet.cluster, containerInstances=[drained.container_instance_arn], status="DRAINING"
    )

    async def moved() -> bool:
        return not (_running_tasks(aws_env, fleet.cluster, drained.container_instance_arn or "") & cooperative)

    await _until(moved, "cooperative tasks to leave the draining instance")
    # Give the loop a few more ticks to (wrongly) touch the stubborn task, then check it still runs.
    await asyncio.sleep(0.5)
    assert _running_tasks(aws_env, fleet.cluster, drained.container_instance_arn) == stubborn
    assert _running_tasks(aws_env, fleet.cluster, untouched.container_instance_arn) == set(untouched.tasks)

    # Only the engine's StopTask ends it.
    ecs.stop_task(cluster=fleet.cluster, task=next(iter(stubborn)), reason="repair: stop timeout passed")
    assert _running_tasks(aws_env, fleet.cluster, drained.container_instance_arn) == set()


class _FakeProbe:
    """Stands in for the real probe: records starts and runs until cancelled."""

    def __init__(self) -> None:
        self.starts: list[str] = []

    async def __call__(self, fleet: ProbeFleet, node: SimNode) -> None:
        self.starts.append(node.instance_id)
        await asyncio.Event().wait()


async def test_terminated_instance_is_buried(make_fleet: Callable[..., SimulatedFleet], aws_env: str):
    probe = _FakeProbe()
    fleet = make_fleet(instances=2, probe_runner=probe)
    launched = await fleet.setup(watch=False)
    victim = fleet.node(launched[0])

    async def probes_started() -> bool:
        return sorted(probe.starts) == sorted(launched)

    await _until(probes_started, "a probe per instance")
    assert victim.probe_running

    _ec2(aws_env).terminate_instances(InstanceIds=[victim.instance_id])

    async def buried() -> bool:
        await fleet.tick()
        return fleet.node(victim.instance_id).terminated

    await _until(buried, "the terminated instance to be noticed")
    assert not victim.probe_running
    assert fleet.node(launched[1]).probe_running
    arns = _ecs(aws_env).list_container_instances(cluster=fleet.cluster)["containerInstanceArns"]
    assert victim.container_instance_arn not in arns
    assert victim.instance_id not in fleet.live_instances()


async def test_heartbeat_loss_and_blip(make_fleet: Callable[..., SimulatedFleet]):
    probe = _FakeProbe()
    fleet = make_fleet(instances=2, probe_runner=probe)
    lost, blipped = await fleet.setup(watch=False)

    await fleet.heartbeat_loss(lost)
    assert not fleet.node(lost).probe_running

    await fleet.blip(blipped, timedelta(milliseconds=200))
    assert not fleet.node(blipped).probe_running

    async def back() -> bool:
        return probe.starts.count(blipped) == 2

    await _until(back, "the blipped probe to come back")
    assert fleet.node(blipped).probe_running
    assert probe.starts.count(lost) == 1 and not fleet.node(lost).probe_running


def test_a_blip_must_stay_below_the_threshold():
    with pytest.raises(ValueError):
        SimTiming(blip=timedelta(seconds=7), heartbeat_interval=timedelta(seconds=2))


async def test_injected_lines_parse_as_real_kernel_records(make_fleet: Callable[..., SimulatedFleet]):
    kernel_log = pytest.importorskip("node_probe.classify.kernel_log")
    fleet = make_fleet(instances=1)
    (instance,) = await fleet.setup(watch=False)
    node = fleet.node(instance)
    # A clean boot log holds nothing to report.
    assert list(kernel_log.parse_lines(node.kernel_log.read_text().splitlines())) == []

    written = [fleet.inject_fault(instance, xid) for xid in CRITICAL_XIDS]
    written += [fleet.inject_noise(instance, xid) for xid in NOISE_XIDS]
    records = [r for r in kernel_log.parse_lines(node.kernel_log.read_text().splitlines()) if r.kind == "xid"]
    assert [r.code for r in records] == [*CRITICAL_XIDS, *NOISE_XIDS]
    assert [r.raw for r in records] == written
    assert all(r.pci and r.uptime_s is not None for r in records)

    with pytest.raises(ValueError):
        fleet.inject_fault(instance, 13)
    with pytest.raises(ValueError):
        fleet.inject_noise(instance, 79)


async def test_snapshot_counts_aws_state(make_fleet: Callable[..., SimulatedFleet], aws_env: str):
    fleet = make_fleet(instances=3)
    launched = await fleet.setup(watch=False)
    node = fleet.node(launched[0])
    assert node.container_instance_arn
    _ecs(aws_env).update_container_instances_state(
        cluster=fleet.cluster, containerInstances=[node.container_instance_arn], status="DRAINING"
    )
    snap = await fleet.snapshot()
    assert snap.ec2_states == {"running": 3}
    assert (snap.container_active, snap.container_draining) == (2, 1)
    assert snap.running_tasks == sum(len(n.tasks) for n in fleet.nodes.values())
    # No Temporal client: health is unknown, never guessed.
    assert snap.health == dict.fromkeys(launched)
    assert snap.replacements_running == [] and sorted(snap.initial_instances) == sorted(launched)


async def test_servers_start_ready_and_stop(tmp_path: Path):
    from simulator.servers import free_port

    moto = MotoServer(tmp_path, free_port())
    temporal = TemporalDevServer(tmp_path, free_port(), free_port())
    async with moto, temporal:
        ec2 = boto3.client(
            "ec2",
            region_name="us-east-1",
            endpoint_url=moto.endpoint_url,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        assert ec2.describe_availability_zones()["AvailabilityZones"]
        listing = await asyncio.create_subprocess_exec(
            temporal.binary,
            "operator",
            "search-attribute",
            "list",
            "--address",
            temporal.address,
            "--output",
            "json",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await listing.communicate()
        assert listing.returncode == 0
        registered = json.loads(out)
        text = json.dumps(registered)
        assert all(key.name in text for key in search_attributes.ALL)
        with pytest.raises(RuntimeError, match="already in use"):
            await MotoServer(tmp_path / "second", moto.port).start()
    assert not port_in_use("127.0.0.1", moto.port)
    assert not port_in_use("127.0.0.1", temporal.port)
    assert (tmp_path / "temporal.db").exists() and (tmp_path / "moto.log").exists()
    assert search_attribute_args()[:2] == ["--search-attribute", "RepairPhase=Keyword"]
