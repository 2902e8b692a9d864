"""Fleet activities: the ECS and EC2 steps of a start-before-stop repair.

Every activity is idempotent, because Temporal may run it again after a timeout or a worker crash: each one
first looks at what AWS already has (the instance already DRAINING, a replacement already tagged for this
impaired instance, the instance already terminated) and treats "already done" as success.

The EC2 and Auto Scaling lookups are in activities/ec2.py, the two ways to launch a replacement in
activities/launch.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from activities.aws import AwsClients
from activities.departures import Departures, departure
from activities.ec2 import GONE_EC2_STATES, REPLACES_TAG, Ec2, tags_of
from activities.ecs import INSTANCE_ID, REGISTERED_STATUSES, Ecs, check_instance_id, resolve_group
from activities.fresh_read import FreshRead
from activities.launch import Launcher
from activities.models import (
    ContainerInstanceRef,
    DrainResult,
    ExpectedGpus,
    GroupCapacity,
    GroupCapacityRequest,
    GroupConfigRequest,
    InstanceRef,
    InstancesGone,
    InstancesGoneRequest,
    InstanceTasks,
    KnownInstance,
    LaunchRequest,
    LaunchResult,
    QuarantineResult,
    ReplacementCheck,
    ReplacementRef,
    ReplacementWait,
    StopTasksRequest,
    StopTasksResult,
    SubnetZones,
    SubnetZonesRequest,
    TaskInfo,
    TasksWait,
    TerminateResult,
)
from activities.workflow_ops import committed_group_config
from contract import names
from contract.evidence import QUARANTINE_TAG
from contract.groups import CapacityGroup, GroupConfigOverrides
from contract.ids import semaphore_workflow_id
from contract.semaphore import ReplacementClaim, ReplacementClaimed

if TYPE_CHECKING:
    from mypy_boto3_ecs.type_defs import ContainerInstanceTypeDef

# The ECS agent's default (ECS_CONTAINER_STOP_TIMEOUT) for a container without stopTimeout, on EC2.
ECS_DEFAULT_STOP_TIMEOUT = 30
ECS_REASON_MAX = 255
# While waiting for ECS registration, look at the EC2 instance itself this often (not every poll, to stay far from
# the EC2 API rate limits with many repairs waiting at once).
EC2_CHECK_EVERY = timedelta(seconds=30)
# The wait's polls of ECS grow by this factor from poll_interval up to a cap: a replacement boots for minutes, and 200
# repairs polling every 2 s would ask ECS 100 times a second, five times its published cluster-read rate (20/s).
POLL_GROWTH = 1.5
POLL_CAP_MAX = timedelta(seconds=30)


def poll_cap(ready_timeout: timedelta, first: timedelta) -> timedelta:
    """A fortieth of the wait, within [first, 30 s]: at the default 20 minutes a replacement that registered is seen
    within 30 s (5 % of a 10-minute boot), and 200 waiting repairs ask ECS under 7 times a second."""
    return max(first, min(ready_timeout / 40, POLL_CAP_MAX))


# Bounds the activity result (and the semaphore's history) whatever an operator drained by hand.
OUT_OF_SERVICE_IDS_MAX = 1_000


log = logging.getLogger(__name__)


def _is_not_found(err: ApplicationError) -> bool:
    """ECS says "not found" with InvalidParameterException / ClientException; EC2 with a *.NotFound code."""
    return (err.type or "").endswith("NotFound") or "not found" in err.message.lower()


class FleetActivities:
    def __init__(
        self,
        aws: AwsClients,
        groups: Callable[[str], CapacityGroup],
        *,
        poll_interval: timedelta = timedelta(seconds=2),
        task_definition_cache_size: int = 256,
        client: Client | None = None,
    ) -> None:
        self._aws = aws
        self._ec2 = Ec2(aws)
        self._ecs = Ecs(aws)
        self._launch = Launcher(aws, self._ec2, self._claim_replacement)
        self._departures = Departures(aws)
        self._groups = groups
        # Reads the live overrides an operator set on the group's drain semaphore; None: settings only.
        self._client = client
        # A surge of workflows asking at once shares one describe of the semaphore, never older than the asking.
        self._live_config = FreshRead(partial(committed_group_config, client)) if client is not None else None
        self._poll_seconds = poll_interval.total_seconds()
        # Task definition revisions are immutable, so their stop timeouts never go stale; bounded (LRU)
        # because a long-running worker sees every revision ever deployed.
        self._stop_timeouts: OrderedDict[str, int] = OrderedDict()
        self._cache_size = task_definition_cache_size

    def activities(self) -> list[Callable[..., Any]]:
        """The bound activity methods, for `Worker(activities=...)`."""
        return [
            self.describe_group_capacity,
            self.get_group_config,
            self.set_draining,
            self.launch_replacement,
            self.await_container_instance_active,
            self.terminate_replacement,
            self.check_replacement,
            self.list_instance_tasks,
            self.wait_for_tasks_to_stop,
            self.stop_tasks,
            self.terminate_instance,
            self.quarantine_instance,
            self.instances_gone,
            self.subnet_zones,
            self.expected_gpus,
        ]

    # --- activities ---------------------------------------------------------------------------------------

    @activity.defn(name="instances_gone")
    async def instances_gone(self, request: InstancesGoneRequest) -> InstancesGone:
        """Which of these silent instances left on purpose, and why (GoneCause): stopped or terminated in EC2, on
        their way out of their Auto Scaling group, deregistered from the group's ECS cluster, interrupted Spot, or
        in a Capacity Block that is ending. They did not fail, so they retire instead of being repaired.

        One read per AWS API for a whole batch of losses (activities/departures.py), never a poll per instance.
        EC2's read failing fails the activity; any other read failing only leaves its instances counted as lost."""
        found = await self._ec2.instances(request.instance_ids)
        try:
            cluster: str | None = self._group(request.group).cluster
        except ApplicationError as err:
            # Not a reason to hold back what EC2 said: without the cluster, ECS is just not asked.
            log.warning("instances_gone: ECS not asked (%s)", err)
            cluster = None
        registrations = partial(self._registrations, cluster) if cluster else None
        lookups = await self._departures.lookups(found, cluster, registrations)
        now = datetime.now(UTC)
        return InstancesGone(
            gone=[gone for _, instance in sorted(found.items()) if (gone := departure(instance, lookups, now))]
        )

    @activity.defn(name="subnet_zones")
    async def subnet_zones(self, request: SubnetZonesRequest) -> SubnetZones:
        """Each subnet's AZ: a repair that may move its launch (allow_other_azs) chooses by AZ."""
        if not request.subnet_ids:
            return SubnetZones(zones={})
        resp = await self._aws.call(
            f"subnets {', '.join(request.subnet_ids)}",
            self._aws.ec2.describe_subnets,
            Filters=[{"Name": "subnet-id", "Values": request.subnet_ids}],
        )
        return SubnetZones(zones={s["SubnetId"]: s["AvailabilityZone"] for s in resp.get("Subnets", [])})

    @activity.defn(name="expected_gpus")
    async def expected_gpus(self, request: InstanceRef) -> ExpectedGpus:
        """The GPUs the instance's type has: a host whose probe sees fewer is missing one."""
        instance = await self._ec2.instance(request.instance_id)
        instance_type = instance.get("InstanceType") if instance is not None else None
        if instance_type is None:
            return ExpectedGpus()
        return ExpectedGpus(instance_type=instance_type, gpus=await self._ec2.gpus_of_type(instance_type))

    @activity.defn(name="describe_group_capacity")
    async def describe_group_capacity(self, request: GroupCapacityRequest) -> GroupCapacity:
        """How many instances the group has in ECS now, and the drain cap that follows from it with the live
        overrides applied."""
        group = request.overrides.apply(self._group(request.group))
        # ACTIVE and DRAINING listed side by side: each is pages in turn.
        listed = await asyncio.gather(
            *(self._ecs.container_instance_arns(group.cluster, status=status) for status in REGISTERED_STATUSES)
        )
        arns = [arn for arns_of_status in listed for arn in arns_of_status]
        container_instances = await self._ecs.describe_container_instances(group.cluster, arns)
        ec2_ids = {ci["ec2InstanceId"] for ci in container_instances if ci.get("ec2InstanceId")}
        members = await self._ec2.members(group, ec2_ids)
        held = set(request.held_instance_ids)
        draining = {ci["ec2InstanceId"] for ci in container_instances if ci.get("status") == "DRAINING"} & (
            members - held
        )
        return GroupCapacity(
            group=group.name,
            instance_count=len(members),
            max_draining=group.max_draining(len(members)),
            out_of_service=len(draining),
            out_of_service_ids=sorted(draining)[:OUT_OF_SERVICE_IDS_MAX],
        )

    @activity.defn(name="get_group_config")
    async def get_group_config(self, request: GroupConfigRequest) -> CapacityGroup:
        # An activity, not a workflow constant: the configuration can change between worker deploys (and live,
        # by `autorepair group update`), and the workflow must see it through history to stay deterministic.
        group = self._group(request.group)
        if not request.live_overrides:
            return group
        return (await self._live_overrides(group.name)).apply(group)

    @activity.defn(name="set_draining")
    async def set_draining(self, ref: InstanceRef) -> DrainResult:
        """Stop ECS placing tasks on the instance. Already DRAINING is success."""
        group = self._group(ref.group)
        # Where the replacement goes (the instance's AZ and subnet) is read beside the drain: one serial call fewer.
        ci, instance = await asyncio.gather(self._drain(group, ref.instance_id), self._ec2.instance(ref.instance_id))
        arn = ci["containerInstanceArn"]
        return DrainResult(
            container_instance_arn=arn,
            availability_zone=(instance or {}).get("Placement", {}).get("AvailabilityZone"),
            subnet_id=(instance or {}).get("SubnetId"),
        )

    async def _drain(self, group: CapacityGroup, instance_id: str) -> ContainerInstanceTypeDef:
        ci = await self._ecs.registered(group, instance_id, "DRAINING")
        await self._ecs.set_status(group.cluster, ci, "DRAINING")
        return ci

    @activity.defn(name="launch_replacement")
    async def launch_replacement(self, request: LaunchRequest) -> LaunchResult:
        """Start the replacement before anything is stopped. Idempotent per attempt: the `replaces` tag and the
        attempt's client token (`launch-token` tag) find the instance a retry of this attempt already launched. The
        workflow's first try at a token, on its activity's first attempt, cannot have launched one: it launches at
        once, one serial call on the repair's path."""
        group = self._group(request.group)
        check_instance_id(request.impaired_instance_id)
        if not (request.first_try and activity.info().attempt == 1):
            existing = await self._launch.existing(request)
            if existing is not None:
                return LaunchResult(replacement_instance_id=existing, already_existed=True)
        if group.launch_template:
            return await self._launch.from_template(group, request)
        if group.auto_scaling_group:
            return await self._launch.in_auto_scaling_group(group, request)
        raise ApplicationError(
            f"capacity group {group.name} has neither launch_template nor auto_scaling_group: "
            "cannot launch a replacement",
            type="GroupNotLaunchable",
            non_retryable=True,
        )

    @activity.defn(name="await_container_instance_active")
    async def await_container_instance_active(self, ref: ReplacementWait) -> ContainerInstanceRef:
        """Wait until the instance's ECS agent has registered it ACTIVE in the group's cluster, until `ready_by`.

        Runs under the workflow's schedule-to-close and heartbeat timeouts. Cancellation arrives as
        CancelledError at the next await (a heartbeat is what lets the server deliver it) and propagates.
        """
        group = self._group(ref.group)
        # A plain InstanceRef (a direct call) has no deadline: the activity's timeout alone ends the wait.
        ready_by = ref.ready_by if isinstance(ref, ReplacementWait) else None
        wait = self._poll_seconds
        cap = poll_cap(group.replacement_ready_timeout, timedelta(seconds=wait)).total_seconds()
        ec2_due = time.monotonic()
        while True:
            ci = await self._ecs.find_container_instance(group, ref.instance_id)
            status = ci.get("status", "UNKNOWN") if ci else "NOT_REGISTERED"
            if ci is not None and status == "ACTIVE":
                return ContainerInstanceRef(container_instance_arn=ci["containerInstanceArn"])
            if time.monotonic() >= ec2_due:
                ec2_due = time.monotonic() + EC2_CHECK_EVERY.total_seconds()
                instance = await self._ec2.instance(ref.instance_id)
                state = (instance or {}).get("State", {}).get("Name")
                # Waiting for an instance that is gone would only end at the timeout; fail now so the workflow
                # can launch another. (Not found just after launch is normal: EC2 is eventually consistent.)
                if state in GONE_EC2_STATES:
                    raise ApplicationError(
                        f"EC2 instance {ref.instance_id} is {state}: it will never register in ECS cluster "
                        f"{group.cluster}",
                        type="InstanceTerminated",
                        non_retryable=True,
                    )
            if ready_by is not None and datetime.now(UTC) >= ready_by:
                # Non-retryable: waiting longer is the one thing that does not help; the workflow gives up on it.
                raise ApplicationError(
                    f"EC2 instance {ref.instance_id} is not ACTIVE in ECS cluster {group.cluster} by "
                    f"{ready_by.astimezone(UTC).isoformat(timespec='seconds')} (replacement_ready_timeout of "
                    f"capacity group {group.name}); ECS says {status}",
                    type="ReplacementNotReady",
                    non_retryable=True,
                )
            activity.heartbeat(status)
            await asyncio.sleep(wait)
            wait = min(wait * POLL_GROWTH, cap)

    @activity.defn(name="terminate_replacement")
    async def terminate_replacement(self, ref: ReplacementRef) -> TerminateResult:
        """Terminate a replacement the repair gave up on (deregistered from ECS first, in case it registered late).
        Already terminated is success. Only an instance tagged as a replacement of this impaired instance: a mixed-up
        id must never take down a serving instance."""
        check_instance_id(ref.instance_id)
        instance = await self._ec2.instance(ref.instance_id)
        if instance is not None:
            state = instance.get("State", {}).get("Name")
            if state in GONE_EC2_STATES:
                return TerminateResult(previous_state=state, already_terminated=True)
            owner = tags_of(instance.get("Tags")).get(REPLACES_TAG)
            if owner != ref.impaired_instance_id:
                raise ApplicationError(
                    f"EC2 instance {ref.instance_id} is not tagged {REPLACES_TAG}={ref.impaired_instance_id} "
                    f"({owner or 'no such tag'}): not terminated as an abandoned replacement",
                    type="NotAReplacement",
                    non_retryable=True,
                )
        # Not found by the lookup (EC2 lags, or it is long gone): TerminateInstances decides, NotFound is success.
        return await self.terminate_instance(KnownInstance(group=ref.group, instance_id=ref.instance_id))

    @activity.defn(name="check_replacement")
    async def check_replacement(self, ref: ReplacementRef) -> ReplacementCheck:
        """One look: does this replacement, launched by an earlier attempt of the repair, serve the group now?"""
        group = self._group(ref.group)
        check_instance_id(ref.instance_id)
        instance = await self._ec2.instance(ref.instance_id)
        state = (instance or {}).get("State", {}).get("Name")
        if instance is None or state != "running":
            return ReplacementCheck(serving=False, why=f"{state or 'not found'} in EC2")
        owner = tags_of(instance.get("Tags")).get(REPLACES_TAG)
        if owner != ref.impaired_instance_id:
            return ReplacementCheck(serving=False, why=f"tagged {REPLACES_TAG}={owner or '(none)'}")
        ci = await self._ecs.find_container_instance(group, ref.instance_id)
        status = ci.get("status") if ci is not None else "not registered"
        if ci is None or status != "ACTIVE" or ci.get("agentConnected") is False:
            return ReplacementCheck(serving=False, why=f"{status} in ECS cluster {group.cluster}")
        return ReplacementCheck(serving=True)

    @activity.defn(name="list_instance_tasks")
    async def list_instance_tasks(self, ref: KnownInstance) -> InstanceTasks:
        """Tasks still meant to run on the instance, each with how long ECS gives it to stop.

        With the container instance known, its tasks are listed beside the look at it (one serial call where none is
        left); a look that finds another registration lists that one's instead."""
        group = self._group(ref.group)
        known = ref.container_instance_arn
        if not known:
            serving = await self._serving_container_instance(group, ref.instance_id, None)
            return InstanceTasks(tasks=[]) if serving is None else await self._tasks_on(group, serving)
        looked, listed = await asyncio.gather(
            self._serving_container_instance(group, ref.instance_id, known),
            self._task_arns_on(group, known),
            return_exceptions=True,
        )
        if isinstance(looked, BaseException):
            raise looked
        if looked is None:
            return InstanceTasks(tasks=[])
        if looked != known:
            return await self._tasks_on(group, looked)
        if isinstance(listed, BaseException):
            raise listed
        return await self._described_tasks(group, listed)

    @activity.defn(name="wait_for_tasks_to_stop")
    async def wait_for_tasks_to_stop(self, wait: TasksWait) -> InstanceTasks:
        """Look at the instance's tasks every `poll_seconds` until none is left, one the workflow has not seen starts,
        or `until`; answer what still runs.

        One activity and a heartbeat a minute instead of a timer and an activity per look: both are billed actions,
        and a drain that waits for its services' replacement tasks can take as long as an instance's boot. A look
        lists the tasks alone (two calls on the repair's path where it ends the wait); whether the instance is still
        there is asked every EC2_CHECK_EVERY, and again at once when a listing fails."""
        known = set(wait.known)
        group = self._group(wait.group)
        arn: str | None = None
        checked_at = float("-inf")
        while True:
            fresh = time.monotonic() - checked_at >= EC2_CHECK_EVERY.total_seconds()
            if fresh:
                arn = await self._serving_container_instance(group, wait.instance_id, wait.container_instance_arn)
                checked_at = time.monotonic()
            try:
                running = InstanceTasks(tasks=[]) if arn is None else await self._tasks_on(group, arn)
            except ApplicationError:
                if fresh:
                    raise
                checked_at = float("-inf")  # deregistered meanwhile, perhaps: ask again before anything else
                continue
            arns = {task.task_arn for task in running.tasks}
            left = (wait.until - datetime.now(UTC)).total_seconds()
            if not arns or not arns <= known or left <= 0:
                return running
            activity.heartbeat(len(arns))
            await asyncio.sleep(min(wait.poll_seconds, left))

    async def _serving_container_instance(
        self, group: CapacityGroup, instance_id: str, known_arn: str | None
    ) -> str | None:
        """The instance's container instance ARN; None once it is deregistered or its EC2 instance is gone (its tasks
        are gone with it). ECS and EC2 are asked side by side."""
        ci, instance = await asyncio.gather(
            self._ecs.container_instance(group, instance_id, known_arn), self._ec2.instance(instance_id)
        )
        if ci is None or instance is None or instance.get("State", {}).get("Name") in GONE_EC2_STATES:
            return None
        return ci["containerInstanceArn"]

    async def _tasks_on(self, group: CapacityGroup, arn: str) -> InstanceTasks:
        return await self._described_tasks(group, await self._task_arns_on(group, arn))

    async def _task_arns_on(self, group: CapacityGroup, arn: str) -> list[str]:
        return await self._ecs.task_arns(group.cluster, containerInstance=arn, desiredStatus="RUNNING")

    async def _described_tasks(self, group: CapacityGroup, arns: list[str]) -> InstanceTasks:
        tasks: list[TaskInfo] = []
        for task in await self._ecs.describe_tasks(group.cluster, arns):
            if task.get("lastStatus") == "STOPPED":
                continue  # stopped, whatever is still desired of it: nothing left to wait for
            timeout = await self._stop_timeout(task["taskDefinitionArn"])
            tasks.append(TaskInfo(task_arn=task["taskArn"], stop_timeout_seconds=timeout))
        return InstanceTasks(tasks=tasks)

    @activity.defn(name="stop_tasks")
    async def stop_tasks(self, request: StopTasksRequest) -> StopTasksResult:
        """Ask ECS to stop each task (SIGTERM, SIGKILL after its stop timeout). Already stopped is success."""
        group = self._group(request.group)
        if not request.task_arns:
            return StopTasksResult(stopped=0)
        current = {t["taskArn"]: t for t in await self._ecs.describe_tasks(group.cluster, request.task_arns)}
        stopped = 0
        for arn in request.task_arns:
            task = current.get(arn)
            # Missing (long gone) or already on its way down: nothing to ask, and it counts as stopped.
            if task is None or task.get("desiredStatus") == "STOPPED" or task.get("lastStatus") == "STOPPED":
                stopped += 1
                continue
            try:
                await self._aws.call(
                    f"task {arn} in cluster {group.cluster}",
                    self._aws.ecs.stop_task,
                    cluster=group.cluster,
                    task=arn,
                    reason=request.reason[:ECS_REASON_MAX],
                )
            except ApplicationError as err:
                if not _is_not_found(err):
                    raise
            stopped += 1
        return StopTasksResult(stopped=stopped)

    @activity.defn(name="terminate_instance")
    async def terminate_instance(self, ref: KnownInstance) -> TerminateResult:
        """Terminate the EC2 instance, then deregister it from ECS. Already gone is success.

        In that order: a termination refused (an IAM policy, say) leaves the instance DRAINING in ECS, where the next
        attempt of the repair finds it; deregistered first, it would be running outside ECS, and no later attempt
        could drain it again."""
        group = self._group(ref.group)
        check_instance_id(ref.instance_id)
        # Its container instance is looked up beside the termination (a read), and deregistered only after it.
        result, ci = await asyncio.gather(
            self._terminate(ref.instance_id),
            self._ecs.container_instance(group, ref.instance_id, ref.container_instance_arn),
        )
        # ECS lets go of a terminated instance by itself, in time: at once here, so the cluster counts it out now.
        await self._deregister_found(group, ci)
        return result

    async def _terminate(self, instance_id: str) -> TerminateResult:
        if activity.info().attempt > 1:
            # A retry: an earlier attempt may have terminated it (and lost its answer): not asked again.
            instance = await self._ec2.instance(instance_id)
            state = (instance or {}).get("State", {}).get("Name")
            if state in GONE_EC2_STATES:
                return TerminateResult(previous_state=state, already_terminated=True)
        # A first attempt is not looked up first (one serial call fewer): TerminateInstances on an instance already
        # shutting down or terminated changes nothing and answers its previous state, which says so.
        try:
            resp = await self._aws.call(
                f"EC2 instance {instance_id}", self._aws.ec2.terminate_instances, InstanceIds=[instance_id]
            )
        except ApplicationError as err:
            if err.type != "InvalidInstanceID.NotFound":
                raise
            return TerminateResult(previous_state=None, already_terminated=True)
        previous = resp.get("TerminatingInstances", [{}])[0].get("PreviousState", {}).get("Name")
        return TerminateResult(previous_state=previous, already_terminated=previous in GONE_EC2_STATES)

    @activity.defn(name="quarantine_instance")
    async def quarantine_instance(self, ref: InstanceRef) -> QuarantineResult:
        """The group's quarantine: tag the instance QUARANTINE_TAG (naming this repair), stop it, deregister it from
        ECS, take it out of the group (its group tag removed). Already stopped is success; terminated by someone
        else is said, not an error. Stopped before deregistered, as terminate_instance terminates first: a refused
        stop leaves it DRAINING, where the repair's next attempt finds it."""
        group = self._group(ref.group)
        check_instance_id(ref.instance_id)
        instance = await self._ec2.instance(ref.instance_id)
        state = (instance or {}).get("State", {}).get("Name")
        if instance is None or state in GONE_EC2_STATES:
            await self._deregister(group, ref.instance_id)
            return QuarantineResult(previous_state=state, gone=True)
        # Tagged and stopped while it still carries its group tag (IAM grants both on group members only), then out
        # of the group: the ingest refuses its probe, and the group no longer counts it.
        await self._ec2.tag(ref.instance_id, {QUARANTINE_TAG: activity.info().workflow_id or ""})
        stopped = state in ("stopping", "stopped")
        if not stopped:
            await self._aws.call(
                f"EC2 instance {ref.instance_id}", self._aws.ec2.stop_instances, InstanceIds=[ref.instance_id]
            )
        await self._deregister(group, ref.instance_id)
        await self._aws.call(
            f"EC2 instance {ref.instance_id}",
            self._aws.ec2.delete_tags,
            Resources=[ref.instance_id],
            Tags=[{"Key": names.GROUP_TAG}],
        )
        return QuarantineResult(previous_state=state, already_stopped=stopped)

    async def _deregister(self, group: CapacityGroup, instance_id: str) -> None:
        await self._deregister_found(group, await self._ecs.find_container_instance(group, instance_id))

    async def _deregister_found(self, group: CapacityGroup, ci: ContainerInstanceTypeDef | None) -> None:
        if ci is None:
            return
        arn = ci["containerInstanceArn"]
        try:
            # force: the tasks had their stop timeouts already; what is left must not block the repair.
            await self._aws.call(
                f"container instance {arn}",
                self._aws.ecs.deregister_container_instance,
                cluster=group.cluster,
                containerInstance=arn,
                force=True,
            )
        except ApplicationError as err:
            if not _is_not_found(err):
                raise

    # --- lookups ------------------------------------------------------------------------------------------

    async def _claim_replacement(self, group: CapacityGroup, impaired: str, candidates: list[str]) -> str | None:
        """The group's drain semaphore arbitrates; the calling repair must hold one of its permits."""
        holder = activity.info().workflow_id
        if self._client is None:
            raise ApplicationError(
                "an Auto Scaling replacement is claimed through the group's drain semaphore: this worker has no "
                "Temporal client",
                type="ReplacementClaimRefused",
                non_retryable=True,
            )
        handle = self._client.get_workflow_handle(semaphore_workflow_id(group.name))
        claim = ReplacementClaim(holder_workflow_id=holder, impaired_instance_id=impaired, candidates=candidates)
        try:
            claimed = await handle.execute_update(names.UPDATE_CLAIM_REPLACEMENT, claim, result_type=ReplacementClaimed)
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            raise ApplicationError(
                cause.message if isinstance(cause, ApplicationError) else str(cause),
                type="ReplacementClaimRefused",
                non_retryable=True,
            ) from err
        return claimed.instance_id

    async def _live_overrides(self, group: str) -> GroupConfigOverrides:
        """The overrides of the group's drain semaphore, or those its last run left when none runs now (the next
        one takes them over). Any error but "no such workflow" is retried: applying the settings alone could undo
        an operator's DISABLED."""
        if self._live_config is None:
            return GroupConfigOverrides()
        state = await self._live_config(group)
        return state.overrides if state is not None else GroupConfigOverrides()

    def _group(self, name: str) -> CapacityGroup:
        return resolve_group(self._groups, name)

    async def _registrations(self, cluster: str, instance_ids: list[str]) -> dict[str, list[str]]:
        """Statuses of the container instances of these EC2 instances in the cluster, [] for one with none. ECS lists
        every status but INACTIVE: an instance deregistered for good has none."""
        ids = [i for i in instance_ids if INSTANCE_ID.match(i)]  # they go into a cluster query expression
        if not ids:
            return {}
        # Real ECS narrows the list with the cluster query; moto ignores `filter` and lists the whole cluster.
        # Matching ec2InstanceId below as well keeps one code path that is right on both.
        arns = await self._ecs.container_instance_arns(cluster, query=f"ec2InstanceId in [{', '.join(ids)}]")
        statuses: dict[str, list[str]] = {i: [] for i in ids}
        for ci in await self._ecs.describe_container_instances(cluster, arns):
            instance_id = ci.get("ec2InstanceId", "")
            if instance_id in statuses:
                statuses[instance_id].append(ci.get("status", ""))
        return statuses

    async def _stop_timeout(self, task_definition_arn: str) -> int:
        """Longest container stop timeout of a task definition; a container without one: agent default."""
        cached = self._stop_timeouts.get(task_definition_arn)
        if cached is not None:
            self._stop_timeouts.move_to_end(task_definition_arn)
            return cached
        resp = await self._aws.call(
            f"task definition {task_definition_arn}",
            self._aws.ecs.describe_task_definition,
            taskDefinition=task_definition_arn,
        )
        containers = resp.get("taskDefinition", {}).get("containerDefinitions", [])
        timeout = max(
            (c.get("stopTimeout") or ECS_DEFAULT_STOP_TIMEOUT for c in containers),
            default=ECS_DEFAULT_STOP_TIMEOUT,
        )
        self._stop_timeouts[task_definition_arn] = timeout
        while len(self._stop_timeouts) > self._cache_size:
            self._stop_timeouts.popitem(last=False)
        return timeout
