"""`autorepair sim` as a process of its own against a real moto server: SIGKILLed and started again, it adopts the
fleet it finds in moto (the same instances, container instances and tasks; nothing launched or registered twice)
and boots what the engine launched while it was down. No ingest here: its probes' reports fail and are retried, which
is what the engine would see of a dead simulator (silence); the ingest's side is tests/test_demo.py's."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import boto3

from contract.config import AwsSettings
from contract.names import GROUP_TAG
from simulator.aws_proxy import Answered, AwsRequest
from simulator.engine_call_log import EngineCallLog, FollowedCallLog
from simulator.engine_process import EngineProcess, engine_environment
from simulator.servers import free_port
from tests.harness import eventually, unique
from worker.settings import Settings


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _container_instances(ecs: Any, cluster: str) -> Counter[str]:
    arns = ecs.list_container_instances(cluster=cluster)["containerInstanceArns"]
    described = ecs.describe_container_instances(cluster=cluster, containerInstances=arns)["containerInstances"]
    return Counter(ci["ec2InstanceId"] for ci in described)


async def test_sim_killed_and_started_again_adopts_its_fleet_from_moto(aws_env: str, tmp_path: Path) -> None:
    group = unique("sim")
    cluster, template, port = f"{group}-cluster", f"{group}-lt", free_port()
    settings = Settings(aws=AwsSettings(endpoint_url=aws_env, region="us-east-1"), health_bind_address=None)
    args = [
        *("--endpoint-url", aws_env, "--ingest", f"http://127.0.0.1:{free_port()}", "--group", group),
        *("--cluster", cluster, "--launch-template", template, "--instances", "3"),
        *("--state-dir", str(tmp_path / "fleet"), "--control", f"127.0.0.1:{port}", "--heartbeat-interval", "1"),
        *("--heartbeat-loss-threshold", "6"),
    ]
    sim = EngineProcess(settings, tmp_path / "sim.log", role="sim", args=args)
    ec2 = boto3.client("ec2", endpoint_url=aws_env, region_name="us-east-1")
    ecs = boto3.client("ecs", endpoint_url=aws_env, region_name="us-east-1")
    control = f"http://127.0.0.1:{port}"
    await sim.start()
    try:
        await sim.listening("127.0.0.1", port, within=120)
        first = await asyncio.to_thread(_get, f"{control}/world")
        assert len(first["live"]) == 3 and first["probes"] == "real" and first["initial_instances"] == first["live"]
        tasks_before = first["running_tasks"]
        assert tasks_before >= 6  # 2 to 4 tasks on each instance

        assert await sim.kill() == -signal.SIGKILL
        # While it is down, the engine launches a replacement from the group's launch template.
        launched = ec2.run_instances(
            LaunchTemplate={"LaunchTemplateName": template, "Version": "$Latest"}, MinCount=1, MaxCount=1
        )["Instances"][0]["InstanceId"]

        await sim.start()
        await sim.listening("127.0.0.1", port, within=120)

        world = await eventually(
            lambda: asyncio.to_thread(_get, f"{control}/world"), lambda seen: launched in seen["live"], within=60
        )
        # The same hosts: the first three still the initial ones, the new one a replacement.
        assert sorted(world["initial_instances"]) == sorted(first["initial_instances"])
        assert world["replacements_running"] == [launched]
        assert world["terminated"] == [] and world["booting"] == []
        # Nothing launched or registered twice: four instances in the group, one container instance each.
        group_instances = [
            i["InstanceId"]
            for r in ec2.describe_instances(Filters=[{"Name": f"tag:{GROUP_TAG}", "Values": [group]}])["Reservations"]
            for i in r["Instances"]
        ]
        assert sorted(group_instances) == sorted([*first["initial_instances"], launched])
        registered = _container_instances(ecs, cluster)
        assert set(registered) == set(group_instances) and set(registered.values()) == {1}
        # The adopted instances' tasks were not started again: only the replacement's are new.
        assert world["running_tasks"] - tasks_before in range(2, 5)
        # What the sim's ECS agents registered, as the demo's proxy asks it.
        arns = await asyncio.to_thread(_get, f"{control}/instances/{launched}/container-instances")
        assert len(arns["arns"]) == 1
        # And whether its SSM agent has yet to run a command: this sim follows no engine, so moto's word stands.
        asked = await asyncio.to_thread(_get, f"{control}/instances/{launched}/commands/4f0c6a4e")
        assert asked == {"not_run": False}
    finally:
        await sim.stop()
    assert sim.starts == 2


def _answered(action: str, instance_id: str | None = None, status: int = 200) -> Answered:
    params = {} if instance_id is None else {"InstanceId.1": instance_id}
    request = AwsRequest(service="ec2", action=action, protocol="query", attempt=1, invocation="x", params=params)
    return Answered(request=request, status=status, answer=b"", elapsed_s=0.01)


def test_the_engines_calls_reach_a_sim_in_another_process_through_the_call_log(tmp_path: Path) -> None:
    """The proxy's listener writes what the engine changed; the sim's reader takes it, from the end of the file as
    it was when the sim started (a sim started again looks at everything anyway), whole lines only."""
    path = tmp_path / "engine-calls.jsonl"
    log = EngineCallLog(path)
    log(_answered("TerminateInstances", "i-0123456789abcdef0"))
    follower = FollowedCallLog(path)  # started after that call: not its news
    log(_answered("RebootInstances", "i-0fedcba9876543210"))
    log(_answered("TerminateInstances", "i-0aaaaaaaaaaaaaaaa", status=400))  # refused: no change
    log(_answered("DescribeInstances"))  # reads change nothing
    with path.open("a") as handle:
        handle.write('{"action": "TerminateInst')  # a line still being written
    taken = follower.take()
    assert taken.instances == {"i-0fedcba9876543210"} and not taken.reconcile
    assert follower.heard == Counter({"RebootInstances": 1})
    with path.open("a") as handle:
        handle.write('ances", "instances": ["i-0bbbbbbbbbbbbbbbb"], "container_instances": [], "commands": []}\n')
    assert follower.take().instances == {"i-0bbbbbbbbbbbbbbbb"}
    assert not follower.take()


def test_a_command_the_engine_sent_is_not_run_in_the_other_process_until_its_agent_ran_it(tmp_path: Path) -> None:
    """The engine asks after an SSM command as soon as SendCommand answers, maybe before the sim's next tick: the
    sim's reader looks at the log again for the question, and the command is not run until its agent says so."""
    path = tmp_path / "engine-calls.jsonl"
    log, follower = EngineCallLog(path), FollowedCallLog(path)
    instance_id, command_id = "i-0123456789abcdef0", "4f0c6a4e-3f5b-4b8e-9d59-2c1b0e7d6a11"
    body = json.dumps({"InstanceIds": [instance_id], "DocumentName": "AWS-RunShellScript"}).encode()
    request = AwsRequest(service="ssm", action="SendCommand", protocol="json", attempt=1, invocation="x", body=body)
    log(Answered(request, 200, json.dumps({"Command": {"CommandId": command_id}}).encode(), 0.01))
    assert follower.not_run(instance_id, command_id)  # no take() in between
    assert not follower.not_run("i-0fedcba9876543210", command_id) and not follower.not_run(instance_id, "other")
    assert follower.take().commands == {instance_id}  # the tick still hears of it, once
    follower.ran(instance_id, [command_id])
    assert not follower.not_run(instance_id, command_id) and not follower.instances_with_commands_to_run()


async def test_the_engine_processes_keep_a_bytecode_cache(tmp_path: Path, monkeypatch: Any) -> None:
    """The worker's sandbox imports the workflow modules for every workflow it creates: its children write and read
    Python's bytecode cache even where the parent's environment turns it off (PYTHONDONTWRITEBYTECODE)."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    module = tmp_path / "cached_here.py"
    module.write_text("VALUE = 1\n")
    env = engine_environment(Settings()) | {"PYTHONPATH": str(tmp_path)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import sys, cached_here; print(sys.dont_write_bytecode)",
        env=env,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert out.decode().strip() == "False"
    assert [p.name for p in (tmp_path / "__pycache__").iterdir()] == [f"cached_here.{sys.implementation.cache_tag}.pyc"]
