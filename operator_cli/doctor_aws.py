"""`autorepair doctor`'s AWS checks: who the credentials are, and that what each group's settings name exists in the
region: the ECS cluster, the launch template (and its version) or the Auto Scaling group, the subnets, the evidence
bucket; and the event bus. Each reads, never changes; a read the credentials may not make is a SKIP that says so."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from activities.daemon_tasks import judge_daemon_services
from activities.launch import LAUNCH_TEMPLATE_ID
from contract.groups import CapacityGroup
from operator_cli.doctor_checks import Doctor, Verdict, error_code, error_message, failed, passed, refused, skipped

NO_IDENTITY = "no AWS identity (see the aws credentials check)"
_LATEST = ("$Latest", "$Default")


def _did_you_mean(wanted: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(wanted, list(known), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


async def aws_identity(doc: Doctor) -> Verdict:
    aws = doc.settings.aws
    where = f"region {aws.region}" + (f", endpoint {aws.endpoint_url}" if aws.endpoint_url else "")
    try:
        identity = await doc.call(doc.sts.get_caller_identity)
    except NoCredentialsError:
        return failed(
            f"no AWS credentials found ({where})",
            "run doctor where the worker runs, with its role, or give credentials: AWS_PROFILE, or "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
        )
    except ClientError as err:
        return failed(f"STS refused the credentials: {error_message(err)}", "renew or replace the credentials")
    except BotoCoreError as err:
        return failed(f"cannot reach AWS ({where}): {err}", "check aws.region, aws.endpoint_url and the network")
    doc.caller_arn = str(identity["Arn"])
    return passed(f"{doc.caller_arn} ({where})")


async def cluster_exists(doc: Doctor, group: CapacityGroup) -> Verdict:
    if doc.caller_arn is None:
        return skipped(NO_IDENTITY)
    region, name = doc.settings.aws.region, group.cluster
    fix = f"create the ECS cluster {name!r} in {region}, or name an existing one in {doc.group_key(group, 'cluster')}"
    try:
        found = await doc.call(doc.ecs.describe_clusters, clusters=[name])
    except ClientError as err:
        if refused(err, "ecs:DescribeClusters") is None:
            raise
        return await _cluster_by_listing(doc, group, fix)
    for cluster in found.get("clusters", []):
        status = cluster.get("status", "")
        if status == "ACTIVE":
            return passed(
                f"ECS cluster {name!r} is ACTIVE, {cluster.get('registeredContainerInstancesCount', 0)} "
                "container instances registered"
            )
        return failed(f"ECS cluster {name!r} is {status}", fix)
    return failed(f"no ECS cluster {name!r} in {region}", await _with_suggestion(doc, name, fix))


async def _with_suggestion(doc: Doctor, name: str, fix: str) -> str:
    try:
        arns = (await doc.call(doc.ecs.list_clusters)).get("clusterArns", [])
    except ClientError:
        return fix
    return _did_you_mean(name, (arn.rsplit("/", 1)[-1] for arn in arns)) + fix


async def _cluster_by_listing(doc: Doctor, group: CapacityGroup, fix: str) -> Verdict:
    """The worker's own policy has no ecs:DescribeClusters: ask what it does call, which names a missing cluster."""
    try:
        await doc.call(doc.ecs.list_container_instances, cluster=group.cluster, maxResults=1)
    except ClientError as err:
        if error_code(err) == "ClusterNotFoundException":
            return failed(f"no ECS cluster {group.cluster!r} in {doc.settings.aws.region}", fix)
        if (refusal := refused(err, "ecs:DescribeClusters or ecs:ListContainerInstances")) is not None:
            return refusal
        raise
    return passed(f"ECS cluster {group.cluster!r} answers")


async def daemon_services_exist(doc: Doctor, group: CapacityGroup) -> Verdict:
    """The named services are ACTIVE and DAEMON-scheduled in the group's cluster: the worker judges no instance by one
    that is not (a typo there must not impair a fleet), so only this check says it is watching nothing."""
    if not group.daemon_services:
        return skipped("the group names no daemon_services")
    if doc.caller_arn is None:
        return skipped(NO_IDENTITY)
    try:
        described = await doc.call(
            doc.ecs.describe_services, cluster=group.cluster, services=list(group.daemon_services)
        )
    except ClientError as err:
        if error_code(err) == "ClusterNotFoundException":
            return skipped(f"no ECS cluster {group.cluster!r} to look in (see its ecs cluster check)")
        if (refusal := refused(err, "ecs:DescribeServices")) is not None:
            return refusal
        raise
    _, problems = judge_daemon_services(described)
    if problems:
        return failed(
            f"in ECS cluster {group.cluster!r}: {'; '.join(problems)}",
            f"name the cluster's ACTIVE DAEMON services in {doc.group_key(group, 'daemon_services')}",
        )
    return passed(f"{', '.join(group.daemon_services)}: ACTIVE, DAEMON-scheduled in {group.cluster!r}")


async def launch_template_exists(doc: Doctor, group: CapacityGroup) -> Verdict:
    template = group.launch_template
    if template is None:
        return skipped("the group names no launch_template")
    if group.auto_scaling_group is not None:
        return skipped("the group replaces through its Auto Scaling group, whose own template it launches from")
    if doc.caller_arn is None:
        return skipped(NO_IDENTITY)
    key = doc.group_key(group, "launch_template")
    by_id = LAUNCH_TEMPLATE_ID.match(template) is not None
    describe = doc.ec2.describe_launch_templates
    try:
        answer = await (
            doc.call(describe, LaunchTemplateIds=[template])
            if by_id
            else doc.call(describe, LaunchTemplateNames=[template])
        )
        # moto answers an unknown id with none, AWS with an error.
        found = answer.get("LaunchTemplates", [])
    except ClientError as err:
        if (refusal := refused(err, "ec2:DescribeLaunchTemplates")) is not None:
            return refusal
        if "NotFound" not in error_code(err) and "Malformed" not in error_code(err):
            raise
        found = []
    if not found:
        known = await _template_names(doc)
        return failed(
            f"no launch template {template!r} in {doc.settings.aws.region}",
            f"{_did_you_mean(template, known)}set {key} to an existing template's name or id (lt-...)",
        )
    return await _version_exists(doc, group, template, by_id)


async def _template_names(doc: Doctor) -> list[str]:
    try:
        found = await doc.call(doc.ec2.describe_launch_templates, MaxResults=200)
    except ClientError:
        return []
    names = [t.get("LaunchTemplateName", "") for t in found.get("LaunchTemplates", [])]
    return names + [t.get("LaunchTemplateId", "") for t in found.get("LaunchTemplates", [])]


async def _version_exists(doc: Doctor, group: CapacityGroup, template: str, by_id: bool) -> Verdict:
    version = group.launch_template_version
    if version in _LATEST:
        return passed(f"launch template {template!r} exists ({version})")
    describe = doc.ec2.describe_launch_template_versions
    try:
        answer = await (
            doc.call(describe, LaunchTemplateId=template, Versions=[version])
            if by_id
            else doc.call(describe, LaunchTemplateName=template, Versions=[version])
        )
        versions = answer.get("LaunchTemplateVersions", [])
    except ClientError as err:
        if (refusal := refused(err, "ec2:DescribeLaunchTemplateVersions")) is not None:
            return passed(f"launch template {template!r} exists (version {version} not checked: {refusal.detail})")
        versions = []
    if not versions:
        return failed(
            f"launch template {template!r} has no version {version!r}",
            f"set {doc.group_key(group, 'launch_template_version')} to an existing version, $Latest or $Default",
        )
    return passed(f"launch template {template!r} version {version} exists")


async def auto_scaling_group_exists(doc: Doctor, group: CapacityGroup) -> Verdict:
    name = group.auto_scaling_group
    if name is None:
        return skipped("the group names no auto_scaling_group")
    if doc.caller_arn is None:
        return skipped(NO_IDENTITY)
    try:
        found = await doc.call(doc.autoscaling.describe_auto_scaling_groups, AutoScalingGroupNames=[name])
    except ClientError as err:
        if (refusal := refused(err, "autoscaling:DescribeAutoScalingGroups")) is not None:
            return refusal
        raise
    groups = found.get("AutoScalingGroups", [])
    if not groups:
        return failed(
            f"no Auto Scaling group {name!r} in {doc.settings.aws.region}",
            f"set {doc.group_key(group, 'auto_scaling_group')} to an existing Auto Scaling group's name",
        )
    asg = groups[0]
    return passed(
        f"Auto Scaling group {name!r}: {len(asg.get('Instances', []))} instances, desired {asg.get('DesiredCapacity')}"
    )


async def capacity_provider_exists(doc: Doctor, group: CapacityGroup) -> Verdict:
    """A group that replaces through its Auto Scaling group is, in ECS's terms, a capacity provider of its cluster:
    one of the cluster's capacity providers is ACTIVE and backed by that Auto Scaling group. None is a cluster and
    an Auto Scaling group that do not belong together (a typo in either), found here rather than at the first
    replacement, which would join a cluster that never places work on it."""
    name = group.auto_scaling_group
    if name is None:
        return skipped("the group launches from a launch template: no Auto Scaling group to back a capacity provider")
    if doc.caller_arn is None:
        return skipped(NO_IDENTITY)
    try:
        clusters = (await doc.call(doc.ecs.describe_clusters, clusters=[group.cluster])).get("clusters", [])
        names = [n for cluster in clusters for n in cluster.get("capacityProviders", [])]
        providers = (
            (await doc.call(doc.ecs.describe_capacity_providers, capacityProviders=names)).get("capacityProviders", [])
            if names
            else []
        )
    except ClientError as err:
        if (refusal := refused(err, "ecs:DescribeClusters or ecs:DescribeCapacityProviders")) is not None:
            return refusal
        raise
    backing = [
        p
        for p in providers
        if str(p.get("autoScalingGroupProvider", {}).get("autoScalingGroupArn", "")).endswith(
            f":autoScalingGroupName/{name}"
        )
    ]
    if not backing:
        listed = ", ".join(names) or "none"
        return failed(
            f"no capacity provider of ECS cluster {group.cluster!r} is backed by Auto Scaling group {name!r} "
            f"(the cluster's: {listed})",
            f"add one for it to the cluster (aws ecs create-capacity-provider, then put-cluster-capacity-providers), "
            f"or correct {doc.group_key(group, 'cluster')} or {doc.group_key(group, 'auto_scaling_group')}",
        )
    provider = backing[0]
    if provider.get("status") != "ACTIVE":
        return failed(
            f"capacity provider {provider.get('name')!r} for {name!r} is {provider.get('status')}",
            "create an ACTIVE one for the Auto Scaling group and add it to the cluster",
        )
    scaling = provider.get("autoScalingGroupProvider", {}).get("managedScaling", {}).get("status", "DISABLED")
    return passed(f"capacity provider {provider.get('name')!r} of {group.cluster!r}, managed scaling {scaling}")


async def subnets_exist(doc: Doctor, group: CapacityGroup) -> Verdict:
    if not group.subnets:
        return skipped("the group names no subnets")
    if doc.caller_arn is None:
        return skipped(NO_IDENTITY)
    try:
        found = await doc.call(doc.ec2.describe_subnets, Filters=[{"Name": "subnet-id", "Values": list(group.subnets)}])
    except ClientError as err:
        if (refusal := refused(err, "ec2:DescribeSubnets")) is not None:
            return refusal
        raise
    zones = {s["SubnetId"]: s.get("AvailabilityZone", "?") for s in found.get("Subnets", [])}
    missing = [subnet for subnet in group.subnets if subnet not in zones]
    if missing:
        return failed(
            f"no subnet {', '.join(missing)} in {doc.settings.aws.region}",
            f"remove or correct {'it' if len(missing) == 1 else 'them'} in {doc.group_key(group, 'subnets')}",
        )
    return passed(", ".join(f"{subnet} in {zones[subnet]}" for subnet in group.subnets))


async def evidence_bucket_exists(doc: Doctor, group: CapacityGroup) -> Verdict:
    bucket = group.evidence_bucket
    if bucket is None:
        return skipped("the group names no evidence_bucket")
    if doc.caller_arn is None:
        return skipped(NO_IDENTITY)
    try:
        await doc.call(doc.s3.head_bucket, Bucket=bucket)
    except ClientError as err:
        if error_code(err) in ("404", "NoSuchBucket", "NotFound"):
            return failed(
                f"no S3 bucket {bucket!r}",
                f"create it (with the retention your support process needs), or correct "
                f"{doc.group_key(group, 'evidence_bucket')}",
            )
        if error_code(err) in ("403", "AccessDenied"):
            # HeadBucket is authorised as s3:ListBucket, which the worker's policy does not grant.
            return skipped(f"these credentials may not look at bucket {bucket!r} (s3:ListBucket)")
        raise
    return passed(f"S3 bucket {bucket!r} exists")


async def event_bus_exists(doc: Doctor) -> Verdict:
    events = doc.settings.events
    if not events.eventbridge:
        return skipped("events.eventbridge is off")
    if doc.caller_arn is None:
        return skipped(NO_IDENTITY)
    try:
        await doc.call(doc.events.describe_event_bus, Name=events.bus_name)
    except ClientError as err:
        if error_code(err) == "ResourceNotFoundException":
            return failed(
                f"no EventBridge bus {events.bus_name!r} in {doc.settings.aws.region}",
                f"create it (aws events create-event-bus --name {events.bus_name}), or set events.bus_name to an "
                "existing bus (or events.eventbridge = false)",
            )
        if (refusal := refused(err, "events:DescribeEventBus")) is not None:
            return refusal
        raise
    return passed(f"EventBridge bus {events.bus_name!r} exists")
