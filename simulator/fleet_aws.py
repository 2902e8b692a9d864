"""The AWS side of the simulated fleet: what EC2, the ECS agents and the ECS scheduler do, played against moto.

- Setup: the cluster, one task definition per stop timeout, a launch template tagged with the group, and the
  initial instances spread across availability zones.
- The ECS agent: registering a booted instance as a container instance and starting its tasks; deregistering it
  (and stopping its tasks) once the instance is terminated.
- The ECS service scheduler during a drain: cooperative tasks are stopped; stubborn ones stay until StopTask.
- Reading the world back: group instances, container instance statuses, running task counts; the whole group, or
  only the instances and container instances named.
- ECS as the engine asks it: `ecs_instance_lookup` answers ListContainerInstances' `filter` for one instance, which
  moto ignores (it lists the whole cluster: at 1,000 instances, every lookup of one instance took ten calls).
- Following the engine: `EngineCalls` hears the engine's AWS calls (a `FlakyAws` listener in front of moto) and
  keeps what they changed (instances launched, terminated, stopped, rebooted, tagged or detached; container instances
  drained or deregistered; SSM commands sent), so the fleet looks again at those alone.

Every method here blocks (boto3); the fleet runs each in a thread so a worker sharing the event loop never
stalls. The timing (when to boot, when a drain's grace is over) is the fleet's; this module only does the calls.
`FleetAws.calls` counts the calls it made, by API.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError
from pydantic import BaseModel, Field, model_validator

from contract.evidence import EVIDENCE_COMMENT
from contract.names import GPU_RESET_COMMENT, GROUP_TAG, REBOOT_TAG
from simulator.aws_proxy import Answered, AwsRequest
from simulator.nodes import SimNode, SimTask

if TYPE_CHECKING:
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ecs import ECSClient
    from mypy_boto3_ssm import SSMClient

log = logging.getLogger(__name__)

STUBBORN_TAG = "fleet-sim:stubborn"
STARTED_BY = "fleet-sim"
# The fleet's AWS calls in flight at most (its thread pool, and its boto3 clients' connection pools).
AWS_CONCURRENCY = 8
# DescribeInstances takes at most 200 values in one filter; DescribeContainerInstances at most 100 instances.
_EC2_BATCH = 200
_ECS_BATCH = 100
# DescribeInstanceStatus takes at most 100 instance ids.
_STATUS_BATCH = 100


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
        boto_config = Config(retries={"max_attempts": 3, "mode": "standard"}, max_pool_connections=AWS_CONCURRENCY)
        self._ec2: EC2Client = boto3.client("ec2", region_name=region, endpoint_url=endpoint_url, config=boto_config)
        self._ecs: ECSClient = boto3.client("ecs", region_name=region, endpoint_url=endpoint_url, config=boto_config)
        self._ssm: SSMClient = boto3.client("ssm", region_name=region, endpoint_url=endpoint_url, config=boto_config)
        # Every call this object makes, by API (each page of a paginated call counts): what the world costs moto.
        self.calls: Counter[str] = Counter()
        self._calls_lock = threading.Lock()
        for client in (self._ec2, self._ecs, self._ssm):
            client.meta.events.register("before-call", self._count_call)
        # The reboot tag of each group instance as the last observe() read it (REBOOT_TAG): moto's RebootInstances
        # changes nothing, so the tag the engine's reboot step leaves is how the fleet learns of a reboot.
        self.reboot_tags: dict[str, str] = {}

    # --- Setup ----------------------------------------------------------------------------------------------

    def setup(self, instance_count: int) -> list[tuple[str, str]]:
        """Cluster, task definitions, launch template and `instance_count` instances: (instance id, AZ) each."""
        if self.endpoint_url is not None:  # real AWS: nothing to do
            freeze_moto_task_lifecycle(self.endpoint_url)
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

    def adopt(self) -> dict[str, tuple[str, str]]:
        """A fleet that is already there (a simulator started again over the same moto): the task definitions'
        families as setup() named them, and the group's instances (id -> (EC2 state, AZ)); nothing is created."""
        self._families = {t: f"{self.cluster}-job-stop{t}s" for t in sorted(set(self.workload.stop_timeouts_s))}
        instances, self.reboot_tags = self._describe_group()
        return instances

    def registered(self) -> dict[str, tuple[str, str]]:
        """EC2 instance id -> (container instance ARN, status) of every container instance in the cluster."""
        arns: list[str] = []
        for page in self._ecs.get_paginator("list_container_instances").paginate(cluster=self.cluster):
            arns += page["containerInstanceArns"]
        found: dict[str, tuple[str, str]] = {}
        for start in range(0, len(arns), _ECS_BATCH):
            described = self._ecs.describe_container_instances(
                cluster=self.cluster, containerInstances=arns[start : start + _ECS_BATCH]
            )
            for ci in described["containerInstances"]:
                found[ci["ec2InstanceId"]] = (ci["containerInstanceArn"], ci["status"])
        return found

    def running_tasks(self) -> dict[str, list[SimTask]]:
        """Container instance ARN -> its running tasks, as the fleet started them (family, stop timeout, stubborn):
        the whole cluster in pages of 100, so a restart costs calls per 100 tasks, not per instance."""
        timeouts = {family: t for t, family in self._families.items()}
        arns: list[str] = []
        for page in self._ecs.get_paginator("list_tasks").paginate(cluster=self.cluster, desiredStatus="RUNNING"):
            arns += page["taskArns"]
        found: dict[str, list[SimTask]] = {}
        for start in range(0, len(arns), _ECS_BATCH):
            described = self._ecs.describe_tasks(
                cluster=self.cluster, tasks=arns[start : start + _ECS_BATCH], include=["TAGS"]
            )
            for task in described["tasks"]:
                family = task["taskDefinitionArn"].rsplit("/", 1)[-1].split(":", 1)[0]
                tags = {t.get("key"): t.get("value") for t in task.get("tags", [])}
                found.setdefault(task["containerInstanceArn"], []).append(
                    SimTask(
                        arn=task["taskArn"],
                        family=family,
                        stop_timeout_s=timeouts.get(family, min(self.workload.stop_timeouts_s)),
                        stubborn=tags.get(STUBBORN_TAG) == "true",
                    )
                )
        return found

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

    def _count_call(self, model: Any, **_: Any) -> None:
        with self._calls_lock:
            self.calls[model.name] += 1

    def calls_made(self) -> Counter[str]:
        """A copy of `calls`, read safely while other threads add to it."""
        with self._calls_lock:
            return Counter(self.calls)

    def observe(self) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
        """Group instances (id -> (EC2 state, AZ)) and the cluster's container instances (ARN -> status)."""
        instances, self.reboot_tags = self._describe_group()
        return instances, self._container_statuses()

    def observe_instances(self, instance_ids: Collection[str]) -> dict[str, tuple[str, str]]:
        """Those of `instance_ids` that are in the group (id -> (EC2 state, AZ)); one that is not (never was, or its
        group tag is gone) is left out. Their reboot tags are read into `reboot_tags` too."""
        asked = sorted(instance_ids)
        instances: dict[str, tuple[str, str]] = {}
        for start in range(0, len(asked), _EC2_BATCH):
            found, tags = self._describe_group(asked[start : start + _EC2_BATCH])
            instances.update(found)
            for instance_id in asked[start : start + _EC2_BATCH]:
                if instance_id in tags:
                    self.reboot_tags[instance_id] = tags[instance_id]
                else:
                    self.reboot_tags.pop(instance_id, None)
        return instances

    def _describe_group(
        self, instance_ids: list[str] | None = None
    ) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
        """(id -> (EC2 state, AZ), id -> reboot tag) of the group's instances, or of those among `instance_ids`: a
        filter, not InstanceIds, so an id moto does not know is no error."""
        filters: list[Any] = [{"Name": f"tag:{GROUP_TAG}", "Values": [self.group]}]
        if instance_ids is not None:
            # The ids first: moto applies filters in order, and the tag filter over a whole fleet costs it ~8x more.
            filters.insert(0, {"Name": "instance-id", "Values": instance_ids})
        instances: dict[str, tuple[str, str]] = {}
        reboot_tags: dict[str, str] = {}
        paginator = self._ec2.get_paginator("describe_instances")
        for page in paginator.paginate(Filters=filters):
            for reservation in page["Reservations"]:
                for instance in reservation["Instances"]:
                    instances[instance["InstanceId"]] = (
                        instance["State"]["Name"],
                        instance.get("Placement", {}).get("AvailabilityZone", ""),
                    )
                    tags = {t.get("Key"): t.get("Value", "") for t in instance.get("Tags", [])}
                    if tags.get(REBOOT_TAG):
                        reboot_tags[instance["InstanceId"]] = tags[REBOOT_TAG]
        return instances, reboot_tags

    def container_statuses(self, arns: Collection[str]) -> dict[str, str]:
        """ARN -> status of those of `arns` still in the cluster; a deregistered one is left out."""
        asked = sorted(arns)
        statuses: dict[str, str] = {}
        for start in range(0, len(asked), _ECS_BATCH):
            described = self._ecs.describe_container_instances(
                cluster=self.cluster, containerInstances=asked[start : start + _ECS_BATCH]
            )
            for ci in described["containerInstances"]:
                statuses[ci["containerInstanceArn"]] = ci["status"]
        return statuses

    def ssm_commands(self, instance_id: str) -> HostCommands:
        """Every command sent to the instance, its GPU resets and evidence commands among them, from one ListCommands
        (moto records them and runs nothing: the SSM agent's part is the fleet's to play)."""
        commands = self._ssm.list_commands(InstanceId=instance_id).get("Commands", [])
        return HostCommands(
            ids={str(c["CommandId"]) for c in commands if "CommandId" in c},
            resets=_gpu_resets(commands, instance_id),
            evidence=_evidence(commands, instance_id),
        )

    def upload(self, url: str, body: bytes) -> None:
        """PUT to a presigned URL, as the host's curl does: no credentials, only the URL."""
        # urllib would say form-urlencoded, and a server may read the body as a form: bytes, as curl -T sends them.
        request = urllib.request.Request(
            url, data=body, method="PUT", headers={"Content-Type": "application/octet-stream"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def _container_statuses(self) -> dict[str, str]:
        """Container instance ARN -> status of the whole cluster, read from DescribeContainerInstances.

        Not ListContainerInstances' `status` filter: older moto releases ignore it and list every instance.
        """
        arns: list[str] = []
        paginator = self._ecs.get_paginator("list_container_instances")
        for page in paginator.paginate(cluster=self.cluster):
            arns += page["containerInstanceArns"]
        return self.container_statuses(arns)

    def _running_task_arns(self, node: SimNode) -> list[str]:
        assert node.container_instance_arn is not None
        arns: list[str] = []
        paginator = self._ecs.get_paginator("list_tasks")
        for page in paginator.paginate(
            cluster=self.cluster, containerInstance=node.container_instance_arn, desiredStatus="RUNNING"
        ):
            arns += page["taskArns"]
        return arns

    def count(self, instance_ids: Collection[str]) -> dict[str, dict[str, int]]:
        """EC2 states of `instance_ids` (the fleet's unburied instances: the engine's launches are followed at once, and
        the reconcile adopts any other of the group), container instance statuses and running tasks, counted: what a
        snapshot shows of AWS.

        The states from DescribeInstanceStatus, not DescribeInstances: moto renders a whole instance for the latter
        (0.4 s of its CPU for 200, a fifth for the status), and the demo counts every few seconds."""
        ec2: Counter[str] = Counter()
        asked = sorted(instance_ids)
        for start in range(0, len(asked), _STATUS_BATCH):
            answer = self._ec2.describe_instance_status(
                InstanceIds=asked[start : start + _STATUS_BATCH], IncludeAllInstances=True
            )
            ec2.update(status["InstanceState"]["Name"] for status in answer["InstanceStatuses"])
        statuses = self._container_statuses()
        ecs = Counter(statuses.values())
        running = 0
        paginator = self._ecs.get_paginator("list_tasks")
        for page in paginator.paginate(cluster=self.cluster, desiredStatus="RUNNING"):
            running += len(page["taskArns"])
        return {"ec2": dict(ec2), "ecs": dict(ecs), "tasks": {"RUNNING": running}}


@dataclass
class HostCommands:
    """What a host's SSM agent finds sent to it (FleetAws.ssm_commands)."""

    ids: set[str]  # every command, those the fleet plays and those it lets pass (the fix gate's checks)
    resets: list[tuple[str, str]]  # (command id, GPU PCI address), oldest first
    # (command id, the presigned URLs in its script, in its order: kernel log, bug report), oldest first
    evidence: list[tuple[str, list[str]]]


def _gpu_resets(commands: Iterable[Any], instance_id: str) -> list[tuple[str, str]]:
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


def _evidence(commands: Iterable[Any], instance_id: str) -> list[tuple[str, list[str]]]:
    addressed = f"{EVIDENCE_COMMENT} {instance_id} "
    found: list[tuple[str, list[str]]] = []
    for command in sorted(commands, key=lambda c: str(c.get("RequestedDateTime", ""))):
        if str(command.get("Comment", "")).startswith(addressed):
            script = "\n".join(command.get("Parameters", {}).get("commands", []))
            found.append((command["CommandId"], re.findall(r"'(https?://[^']+)'", script)))
    return found


# --- Following the engine -----------------------------------------------------------------------------------------

_INSTANCE_ID = re.compile(r"i-[0-9a-f]{8,17}")
# The ids an EC2 call names: InstanceId.1, ResourceId.1 (tags), InstanceIds.member.1 (Auto Scaling), InstanceId.
_ID_PARAM = re.compile(r"^(InstanceId|ResourceId|InstanceIds\.member)(\.\d+)?$")
_RUN_INSTANCES_ID = re.compile(r"<instanceId>(i-[0-9a-f]{8,17})</instanceId>")
# EC2 and Auto Scaling calls that change an instance the fleet plays (the query protocol: ids in the form).
EC2_CHANGES = frozenset(
    {
        "RunInstances",
        "TerminateInstances",
        "StopInstances",
        "StartInstances",
        "RebootInstances",
        "CreateTags",
        "DeleteTags",
        "DetachInstances",
        "TerminateInstanceInAutoScalingGroup",
    }
)
# Calls that change the group without naming an instance: an Auto Scaling group launches or ends instances itself.
RECONCILE_CHANGES = frozenset({"SetDesiredCapacity", "UpdateAutoScalingGroup", "AttachInstances"})
# ECS calls that change a container instance (the json protocol: ARNs in the body).
ECS_CHANGES = frozenset({"UpdateContainerInstancesState", "DeregisterContainerInstance"})


@dataclass
class Changes:
    """What the engine changed since the fleet last looked."""

    instances: set[str] = field(default_factory=set)  # EC2 instances to describe again
    container_instances: set[str] = field(default_factory=set)  # container instance ARNs (or ids) to describe again
    commands: set[str] = field(default_factory=set)  # instances an SSM command was sent to
    runs: set[tuple[str, str]] = field(default_factory=set)  # (instance, SSM command id) each, for its agent to run
    reconcile: bool = False  # something changed that names no instance: look at the whole group

    def __bool__(self) -> bool:
        return bool(self.instances or self.container_instances or self.commands or self.reconcile)


def changes_heard(answered: Answered) -> tuple[str, Changes] | None:
    """(the API, what it changed) of one answered call; None for a call that changes nothing the fleet plays, or
    that was refused (a refused call changed nothing)."""
    request = answered.request
    if not 200 <= answered.status < 300:
        return None
    action = request.action
    if action in EC2_CHANGES:
        ids = {v for k, v in request.params.items() if _ID_PARAM.match(k) and _INSTANCE_ID.fullmatch(v)}
        if action == "RunInstances":
            ids |= set(_RUN_INSTANCES_ID.findall(answered.answer.decode("utf-8", "replace")))
        return action, Changes(instances=ids)
    if action in RECONCILE_CHANGES:
        return action, Changes(reconcile=True)
    if action in ECS_CHANGES or (action == "SendCommand" and request.service == "ssm"):
        try:
            body = json.loads(request.body or b"{}")
        except ValueError:
            return None
        if action == "SendCommand":
            instances = {str(i) for i in body.get("InstanceIds", [])}
            command_id = _command_id(answered.answer)
            return action, Changes(commands=instances, runs={(i, command_id) for i in instances if command_id})
        named = body.get("containerInstances") or [body.get("containerInstance")]
        return action, Changes(container_instances={str(arn) for arn in named if arn})
    return None


class EngineCalls:
    """The engine's calls that change the world, heard from the proxy in front of moto (`FlakyAws.listen(calls)`):
    the fleet `take()`s what changed on each tick and describes those instances alone.

    Called on the proxy's threads; only successful answers count (a refused call changed nothing). What the log
    misses (a change made behind the proxy's back) the fleet's periodic full look catches.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changes = Changes()
        self._running: dict[str, set[str]] = {}  # instance -> the SSM commands its agent has not yet run
        self.heard: Counter[str] = Counter()  # the changing calls heard, by API

    def __call__(self, answered: Answered) -> None:
        heard = changes_heard(answered)
        if heard is not None:
            self.add(*heard)

    def ran(self, instance_id: str, command_ids: Collection[str]) -> None:
        """The instance's SSM agent ran these commands (those the fleet plays, to the end): SSM says how they ended."""
        with self._lock:
            left = self._running.get(instance_id, set()) - set(command_ids)
            if left:
                self._running[instance_id] = left
            else:
                self._running.pop(instance_id, None)

    def forget(self, instance_id: str) -> None:
        """The instance is gone: its agent runs nothing more (SSM's own answer stands)."""
        with self._lock:
            self._running.pop(instance_id, None)

    def instances_with_commands_to_run(self) -> set[str]:
        """The instances with a command their agent has not run (one that failed to read them tries again)."""
        with self._lock:
            return set(self._running)

    def not_run(self, instance_id: str, command_id: str) -> bool:
        """Whether the instance's agent has yet to run the command (`ssm_invocation_lookup`'s question)."""
        with self._lock:
            return command_id in self._running.get(instance_id, ())

    def add(self, action: str, changes: Changes) -> None:
        """What one call of `action` changed, added to what the next take() returns."""
        with self._lock:
            self.heard[action] += 1
            self._changes.instances.update(changes.instances)
            self._changes.container_instances.update(changes.container_instances)
            self._changes.commands.update(changes.commands)
            # Heard before the SendCommand's answer leaves: the engine never asks after a command not yet known here.
            for instance_id, command_id in changes.runs:
                self._running.setdefault(instance_id, set()).add(command_id)
            self._changes.reconcile |= changes.reconcile

    def take(self) -> Changes:
        """What changed since the last take, and forget it."""
        with self._lock:
            taken, self._changes = self._changes, Changes()
        return taken


def _command_id(answer: bytes) -> str:
    try:
        sent = json.loads(answer or b"{}")
    except ValueError:
        return ""
    command = sent.get("Command") if isinstance(sent, dict) else None
    return str(command.get("CommandId") or "") if isinstance(command, dict) else ""


def ssm_invocation_lookup(not_run: Callable[[str, str], bool]) -> Callable[[AwsRequest], dict[str, object] | None]:
    """A FlakyAws answerer of GetCommandInvocation (`proxy.answer_with("GetCommandInvocation", ...)`): InProgress
    while `not_run(instance, command)`, as SSM says while the host's script runs; moto's own answer after. Moto says
    Success the moment a command is sent: the engine, reading the host's evidence uploads after that Success, found
    them missing when the simulated host had not made them yet (a failure in make test)."""

    def answer(request: AwsRequest) -> dict[str, object] | None:
        try:
            asked = json.loads(request.body or b"{}")
        except ValueError:
            return None
        if not isinstance(asked, dict):
            return None
        command_id, instance_id = str(asked.get("CommandId", "")), str(asked.get("InstanceId", ""))
        if not not_run(instance_id, command_id):
            return None
        return {
            "CommandId": command_id,
            "InstanceId": instance_id,
            "DocumentName": "AWS-RunShellScript",
            "PluginName": "aws:runShellScript",
            "ResponseCode": -1,
            "Status": "InProgress",
            "StatusDetails": "InProgress",
            "StandardOutputContent": "",
            "StandardErrorContent": "",
        }

    return answer


_EC2_INSTANCE_QUERY = re.compile(r"\s*ec2InstanceId\s*==\s*(i-[0-9a-f]{8,17})\s*")


def ecs_instance_lookup(
    arns_of: Callable[[str], Collection[str] | None], endpoint_url: str
) -> Callable[[AwsRequest], dict[str, object] | None]:
    """A FlakyAws answerer of ListContainerInstances (`proxy.answer_with("ListContainerInstances", ...)`) for the
    cluster query `ec2InstanceId == i-...`, answered as ECS does: only that instance's registered container instances.
    Moto ignores the query and lists the whole cluster, a page of 100 per call, so each of the engine's lookups of
    one instance cost a call per 100 instances, every one listing them all (at 1,000 instances, with 200 repairs
    waiting for their replacements, more than moto could answer). `arns_of` names what the fleet registered for the
    instance (the ECS agent's, so all there are); moto is asked only whether those are still registered, one
    DescribeContainerInstances. Any other query, a later page, a cluster moto does not know, or an `arns_of` that
    cannot say (None: the simulator in a process of its own, not answering now) goes to moto."""
    ecs: ECSClient = boto3.client(
        "ecs", region_name="us-east-1", endpoint_url=endpoint_url, config=Config(max_pool_connections=AWS_CONCURRENCY)
    )

    def answer(request: AwsRequest) -> dict[str, object] | None:
        try:
            query = json.loads(request.body or b"{}")
        except ValueError:
            return None
        if not isinstance(query, dict) or query.get("nextToken") or query.get("status"):
            return None
        matched = _EC2_INSTANCE_QUERY.fullmatch(str(query.get("filter") or ""))
        if matched is None or not isinstance(query.get("cluster"), str):
            return None
        known = arns_of(matched.group(1))
        if known is None:
            return None
        candidates = sorted(known)
        if not candidates:
            return {"containerInstanceArns": []}
        try:
            described = ecs.describe_container_instances(cluster=query["cluster"], containerInstances=candidates)
        except ClientError:
            return None  # moto's own answer says what is wrong (an unknown cluster)
        registered = [
            ci["containerInstanceArn"]
            for ci in described.get("containerInstances", [])
            if ci.get("status") != "INACTIVE" and "containerInstanceArn" in ci
        ]
        return {"containerInstanceArns": registered}

    return answer


def freeze_moto_task_lifecycle(endpoint_url: str) -> None:
    """Tasks stop only when someone calls StopTask, as on a real instance.

    By default moto moves a task one step towards STOPPED (lastStatus) on every DescribeTasks, so an engine that
    polls its tasks would see stubborn tasks stop by themselves. The setting is global to the moto server, which
    belongs to the simulated world anyway.
    """
    body = json.dumps({"model_name": "ecs::task", "transition": {"progression": "manual", "times": 1_000_000_000}})
    request = urllib.request.Request(
        f"{endpoint_url.rstrip('/')}/moto-api/state-manager/set-transition", data=body.encode(), method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=5):
            pass
    except OSError as err:
        log.warning("fleet-sim: could not pin moto's task lifecycle: %s", err)
