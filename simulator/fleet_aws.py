"""The AWS side of the simulated fleet: what EC2, the ECS agents and the ECS scheduler do, played against moto.

- Setup: the cluster, one task definition per stop timeout, a launch template tagged with the group, and the
  initial instances spread across availability zones.
- The ECS agent: registering a booted instance as a container instance and starting its tasks; deregistering it
  (and stopping its tasks) once the instance is terminated.
- The ECS service scheduler during a drain: cooperative tasks are stopped; stubborn ones stay until StopTask.
- Reading the world back: group instances, container instance statuses, running task counts.

Every method here blocks (boto3); the fleet runs each in a thread so a worker sharing the event loop never
stalls. The timing (when to boot, when a drain's grace is over) is the fleet's; this module only does the calls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import urllib.request
from collections import Counter
from typing import TYPE_CHECKING

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError
from pydantic import BaseModel, Field, model_validator

from contract.evidence import EVIDENCE_COMMENT
from contract.names import GPU_RESET_COMMENT, GROUP_TAG, REBOOT_TAG
from simulator.nodes import SimNode, SimTask

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ecs import ECSClient
    from mypy_boto3_ssm import SSMClient

log = logging.getLogger(__name__)

STUBBORN_TAG = "fleet-sim:stubborn"
STARTED_BY = "fleet-sim"


class SimWorkload(BaseModel):
    """What runs on each instance."""

    tasks_per_instance: tuple[int, int] = (2, 4)
    stop_timeouts_s: tuple[int, ...] = (2, 4, 6, 8)
    # Chance that an instance also runs one stubborn task (ignores the drain, stops only on StopTask).
    stubborn_fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    task_cpu: int = 256
    task_memory: int = 512

    @model_validator(mode="after")
    def _sane(self) -> SimWorkload:
        low, high = self.tasks_per_instance
        if not 1 <= low <= high:
            raise ValueError("tasks_per_instance must be (low, high) with 1 <= low <= high")
        if not self.stop_timeouts_s or any(not 2 <= t <= 120 for t in self.stop_timeouts_s):
            raise ValueError("stop_timeouts_s must be non-empty, each within ECS's 2..120 s")
        return self

    def plan_tasks(self, rng: random.Random) -> list[tuple[int, bool]]:
        """(stop timeout, stubborn) per task for one instance.

        Drawn on the event loop, never in a thread, so the fleet's rng sequence (and so a seed's fleet) never
        varies with thread timing.
        """
        low, high = self.tasks_per_instance
        plan = [(rng.choice(self.stop_timeouts_s), False) for _ in range(rng.randint(low, high))]
        if rng.random() < self.stubborn_fraction:
            # The last one ignores the drain: only the engine's StopTask after its stop timeout ends it.
            plan[-1] = (plan[-1][0], True)
            if len(plan) == 1:
                plan.insert(0, (rng.choice(self.stop_timeouts_s), False))
        return plan


class FleetAws:
    """One capacity group's EC2 instances and ECS cluster, through blocking boto3 clients."""

    def __init__(
        self,
        *,
        group: str,
        cluster: str,
        launch_template: str,
        region: str,
        endpoint_url: str | None,
        instance_type: str,
        image_id: str,
        availability_zones: int,
        workload: SimWorkload,
    ) -> None:
        self.group = group
        self.cluster = cluster
        self.launch_template = launch_template
        self.region = region
        self.endpoint_url = endpoint_url
        self.instance_type = instance_type
        self.image_id = image_id
        self.availability_zones = availability_zones
        self.workload = workload
        self._families: dict[int, str] = {}  # stop timeout -> task definition family
        # Fewer retries than the engine's: a failed tick is simply retried on the next one.
        boto_config = Config(retries={"max_attempts": 3, "mode": "standard"})
        self._ec2: EC2Client = boto3.client("ec2", region_name=region, endpoint_url=endpoint_url, config=boto_config)
        self._ecs: ECSClient = boto3.client("ecs", region_name=region, endpoint_url=endpoint_url, config=boto_config)
        self._ssm: SSMClient = boto3.client("ssm", region_name=region, endpoint_url=endpoint_url, config=boto_config)
        # The reboot tag of each group instance as the last observe() read it (REBOOT_TAG): moto's RebootInstances
        # changes nothing, so the tag the engine's reboot step leaves is how the fleet learns of a reboot.
        self.reboot_tags: dict[str, str] = {}

    # --- Setup ----------------------------------------------------------------------------------------------

    def setup(self, instance_count: int) -> list[tuple[str, str]]:
        """Cluster, task definitions, launch template and `instance_count` instances: (instance id, AZ) each."""
        self._freeze_moto_task_lifecycle()
        self._ecs.create_cluster(clusterName=self.cluster)
        for stop_timeout in sorted(set(self.workload.stop_timeouts_s)):
            family = f"{self.cluster}-job-stop{stop_timeout}s"
            self._ecs.register_task_definition(
                family=family,
                requiresCompatibilities=["EC2"],
                containerDefinitions=[
                    {
                        "name": "job",
                        "image": "public.ecr.aws/docker/library/python:3.12-slim",
                        "cpu": self.workload.task_cpu,
                        "memory": self.workload.task_memory,
                        "essential": True,
                        "stopTimeout": stop_timeout,
                        "resourceRequirements": [{"type": "GPU", "value": "1"}],
                    }
                ],
            )
            self._families[stop_timeout] = family
        self._ensure_launch_template()
        zones = [
            zone["ZoneName"]
            for zone in self._ec2.describe_availability_zones(Filters=[{"Name": "state", "Values": ["available"]}])[
                "AvailabilityZones"
            ]
        ]
        zones = sorted(zones)[: self.availability_zones] or [f"{self.region}a"]
        # Round-robin across zones, like an ASG balancing its AZs.
        per_zone = Counter(zones[i % len(zones)] for i in range(instance_count))
        launched: list[tuple[str, str]] = []
        for zone in zones:
            if not per_zone[zone]:
                continue
            reservation = self._ec2.run_instances(
                LaunchTemplate={"LaunchTemplateName": self.launch_template, "Version": "$Latest"},
                MinCount=per_zone[zone],
                MaxCount=per_zone[zone],
                Placement={"AvailabilityZone": zone},
            )
            launched += [(instance["InstanceId"], zone) for instance in reservation["Instances"]]
        return launched

    def _freeze_moto_task_lifecycle(self) -> None:
        """Tasks stop only when someone calls StopTask, as on a real instance.

        By default moto moves a task one step towards STOPPED (lastStatus) on every DescribeTasks, so an
        engine that polls its tasks would see stubborn tasks stop by themselves. The setting is global to the
        moto server, which belongs to the simulated world anyway. No endpoint (real AWS): nothing to do.
        """
        if self.endpoint_url is None:
            return
        body = json.dumps(
            {"model_name": "ecs::task", "transition": {"progression": "manual", "times": 1_000_000_000}}
        ).encode()
        request = urllib.request.Request(
            f"{self.endpoint_url.rstrip('/')}/moto-api/state-manager/set-transition", data=body, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=5):
                pass
        except OSError as err:
            log.warning("fleet-sim: could not pin moto's task lifecycle: %s", err)

    def _ensure_launch_template(self) -> None:
        # The group tag lives in the template, so a replacement the engine launches from it is recognised as a
        # member of the group (and picked up by the watch loop) whatever tags the launch call itself passes.
        try:
            self._ec2.create_launch_template(
                LaunchTemplateName=self.launch_template,
                LaunchTemplateData={
                    "ImageId": self.image_id,
                    "InstanceType": self.instance_type,  # type: ignore[typeddict-item]
                    "TagSpecifications": [
                        {
                            "ResourceType": "instance",
                            "Tags": [
                                {"Key": GROUP_TAG, "Value": self.group},
                                {"Key": "Name", "Value": f"{self.group}-node"},
                            ],
                        }
                    ],
                },
            )
        except ClientError as err:
            if "AlreadyExists" not in err.response.get("Error", {}).get("Code", ""):
                raise

    # --- The ECS agent --------------------------------------------------------------------------------------

    def register_and_start_tasks(self, node: SimNode, plan: list[tuple[int, bool]]) -> None:
        """Register the node as a container instance and start its planned tasks; resumes a half-done attempt."""
        document = {
            "instanceId": node.instance_id,
            "availabilityZone": node.availability_zone,
            "region": self.region,
        }
        if node.container_instance_arn is None:
            self._ec2.create_tags(Resources=[node.instance_id], Tags=[{"Key": "Name", "Value": node.name}])
            registered = self._ecs.register_container_instance(
                cluster=self.cluster,
                instanceIdentityDocument=json.dumps(document),
            )
            node.container_instance_arn = registered["containerInstance"]["containerInstanceArn"]
        # One task per plan entry: skip those a failed earlier attempt already started.
        for stop_timeout, stubborn in plan[len(node.tasks) :]:
            family = self._families[stop_timeout]
            started = self._ecs.start_task(
                cluster=self.cluster,
                taskDefinition=family,
                containerInstances=[node.container_instance_arn],
                startedBy=STARTED_BY,
                tags=[{"key": STUBBORN_TAG, "value": "true" if stubborn else "false"}],
            )
            for task in started["tasks"]:
                arn = task["taskArn"]
                node.tasks[arn] = SimTask(arn=arn, family=family, stop_timeout_s=stop_timeout, stubborn=stubborn)

    def deregister_gone(self, node: SimNode) -> None:
        # ECS does this itself when an instance is terminated: its tasks stop and the container instance
        # leaves the cluster. Skipped when the engine already deregistered it (moto answers that with a 500).
        arn = node.container_instance_arn
        if arn is None:
            return
        described = self._ecs.describe_container_instances(cluster=self.cluster, containerInstances=[arn])
        if not described["containerInstances"]:
            return
        for task_arn in self._running_task_arns(node):
            self._ecs.stop_task(cluster=self.cluster, task=task_arn, reason="fleet-sim: instance terminated")
        with contextlib.suppress(ClientError):
            self._ecs.deregister_container_instance(cluster=self.cluster, containerInstance=arn, force=True)

    # --- The ECS service scheduler --------------------------------------------------------------------------

    def move_cooperative_tasks(self, node: SimNode) -> None:
        """The service scheduler's part of a drain: stop every task that honours it; stubborn ones stay."""
        for arn in self._running_task_arns(node):
            task = node.tasks.get(arn)
            if task is not None and task.stubborn:
                continue
            self._ecs.stop_task(cluster=self.cluster, task=arn, reason="fleet-sim: moved off a DRAINING instance")
        log.info("fleet-sim: moved cooperative tasks off draining %s", node.instance_id)

    # --- Reading the world back -----------------------------------------------------------------------------

    def observe(self) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
        """Group instances (id -> (EC2 state, AZ)) and the cluster's container instances (ARN -> status)."""
        instances: dict[str, tuple[str, str]] = {}
        reboot_tags: dict[str, str] = {}
        paginator = self._ec2.get_paginator("describe_instances")
        for page in paginator.paginate(Filters=[{"Name": f"tag:{GROUP_TAG}", "Values": [self.group]}]):
            for reservation in page["Reservations"]:
                for instance in reservation["Instances"]:
                    instances[instance["InstanceId"]] = (
                        instance["State"]["Name"],
                        instance.get("Placement", {}).get("AvailabilityZone", ""),
                    )
                    tags = {t.get("Key"): t.get("Value", "") for t in instance.get("Tags", [])}
                    if tags.get(REBOOT_TAG):
                        reboot_tags[instance["InstanceId"]] = tags[REBOOT_TAG]
        self.reboot_tags = reboot_tags
        return instances, self._container_statuses()

    def gpu_reset_commands(self, instance_id: str) -> list[tuple[str, str]]:
        """The engine's GPU reset commands sent to the instance (moto records them and runs nothing): (command id,
        the GPU's PCI address) each, oldest first. The SSM agent's part of the reset is the fleet's to play."""
        commands = self._ssm.list_commands(InstanceId=instance_id).get("Commands", [])
        found: list[tuple[str, str]] = []
        # By the comment, not InstanceIds: moto adds every instance to a command sent without Targets.
        addressed = f"{GPU_RESET_COMMENT} {instance_id} "
        for command in sorted(commands, key=lambda c: str(c.get("RequestedDateTime", ""))):
            if not str(command.get("Comment", "")).startswith(addressed):
                continue
            lines = command.get("Parameters", {}).get("commands", [])
            words = lines[0].split() if lines else []
            gpu = words[words.index("-i") + 1] if "-i" in words[:-1] else ""
            found.append((command["CommandId"], gpu.removesuffix(".0")))
        return found

    def evidence_commands(self, instance_id: str) -> list[tuple[str, list[str]]]:
        """The engine's evidence commands sent to the instance: (command id, the presigned URLs in its script, in
        the script's order: kernel log, bug report) each, oldest first."""
        commands = self._ssm.list_commands(InstanceId=instance_id).get("Commands", [])
        addressed = f"{EVIDENCE_COMMENT} {instance_id} "
        found: list[tuple[str, list[str]]] = []
        for command in sorted(commands, key=lambda c: str(c.get("RequestedDateTime", ""))):
            if str(command.get("Comment", "")).startswith(addressed):
                script = "\n".join(command.get("Parameters", {}).get("commands", []))
                found.append((command["CommandId"], re.findall(r"'(https?://[^']+)'", script)))
        return found

    def upload(self, url: str, body: bytes) -> None:
        """PUT to a presigned URL, as the host's curl does: no credentials, only the URL."""
        # urllib would say form-urlencoded, and a server may read the body as a form: bytes, as curl -T sends them.
        request = urllib.request.Request(
            url, data=body, method="PUT", headers={"Content-Type": "application/octet-stream"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def _container_statuses(self) -> dict[str, str]:
        """Container instance ARN -> status, read from DescribeContainerInstances.

        Not ListContainerInstances' `status` filter: older moto releases ignore it and list every instance.
        """
        arns: list[str] = []
        paginator = self._ecs.get_paginator("list_container_instances")
        for page in paginator.paginate(cluster=self.cluster):
            arns += page["containerInstanceArns"]
        statuses: dict[str, str] = {}
        for start in range(0, len(arns), 100):  # DescribeContainerInstances takes at most 100
            described = self._ecs.describe_container_instances(
                cluster=self.cluster, containerInstances=arns[start : start + 100]
            )
            for ci in described["containerInstances"]:
                statuses[ci["containerInstanceArn"]] = ci["status"]
        return statuses

    def _running_task_arns(self, node: SimNode) -> list[str]:
        assert node.container_instance_arn is not None
        arns: list[str] = []
        paginator = self._ecs.get_paginator("list_tasks")
        for page in paginator.paginate(
            cluster=self.cluster, containerInstance=node.container_instance_arn, desiredStatus="RUNNING"
        ):
            arns += page["taskArns"]
        return arns

    def count(self) -> dict[str, dict[str, int]]:
        """EC2 states, container instance statuses and running tasks, counted: what a snapshot shows of AWS."""
        instances, statuses = self.observe()
        ec2 = Counter(state for state, _ in instances.values())
        ecs = Counter(statuses.values())
        running = 0
        paginator = self._ecs.get_paginator("list_tasks")
        for page in paginator.paginate(cluster=self.cluster, desiredStatus="RUNNING"):
            running += len(page["taskArns"])
        return {"ec2": dict(ec2), "ecs": dict(ecs), "tasks": {"RUNNING": running}}
