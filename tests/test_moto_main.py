"""simulator/moto_main.py's fixes to moto: an EC2 resource's tags read from moto's own index (the same answer as
moto's, found without scanning every tag of every resource), ECS's answer to deregistering a container instance
that is not there, an SSM command for the instances it names, and its serializer's field names worked out once (the
same answers)."""

from __future__ import annotations

import json
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from moto import mock_aws
from moto.backends import get_backend
from moto.core.serialize import AttributePicker, XFormedAttributePicker
from moto.ec2.models.core import TaggedEC2Resource
from moto.ssm.models import Command

from simulator.moto_main import _command_for_named, _command_init, _once, _tags
from tests.harness import unique


@mock_aws
def test_the_indexed_tags_are_moto_s_own_answer() -> None:
    ec2 = boto3.client("ec2", region_name="us-east-1")
    tagged = ec2.run_instances(
        ImageId="ami-12c6146b",
        MinCount=3,
        MaxCount=3,
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "gpu-autorepair:group", "Value": "gpu-a"}]}],
    )["Instances"]
    plain = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"]
    ec2.create_tags(Resources=[tagged[0]["InstanceId"]], Tags=[{"Key": "Name", "Value": "first"}])
    backend = get_backend("ec2")["123456789012"]["us-east-1"]
    for described in [*tagged, *plain]:
        instance = backend.get_instance(described["InstanceId"])
        assert _tags(instance) == TaggedEC2Resource.get_tags(instance)
    assert [t["key"] for t in _tags(backend.get_instance(tagged[0]["InstanceId"]))] == ["gpu-autorepair:group", "Name"]
    assert _tags(backend.get_instance(plain[0]["InstanceId"])) == []


def test_a_container_instance_deregistered_twice_is_not_found_the_second_time(aws_env: str) -> None:
    """As ECS answers, a ClientException saying "not found", which the engine counts as already done; moto alone
    answered HTTP 500 (a bare Exception), which botocore retried five times and failed the activity's attempt."""
    config = Config(retries={"max_attempts": 1, "mode": "standard"})
    ecs = boto3.client("ecs", endpoint_url=aws_env, region_name="us-east-1", config=config)
    ec2 = boto3.client("ec2", endpoint_url=aws_env, region_name="us-east-1")
    cluster = unique("cluster")
    ecs.create_cluster(clusterName=cluster)
    [instance] = ec2.run_instances(ImageId="ami-12c6146b", MinCount=1, MaxCount=1)["Instances"]
    document = json.dumps({"instanceId": instance["InstanceId"], "availabilityZone": "us-east-1a"})
    registered = ecs.register_container_instance(cluster=cluster, instanceIdentityDocument=document)
    arn = registered["containerInstance"]["containerInstanceArn"]

    ecs.deregister_container_instance(cluster=cluster, containerInstance=arn, force=True)
    with pytest.raises(ClientError) as refused:
        ecs.deregister_container_instance(cluster=cluster, containerInstance=arn, force=True)
    error = refused.value.response["Error"]
    assert (error["Code"], refused.value.response["ResponseMetadata"]["HTTPStatusCode"]) == ("ClientException", 400)
    assert "not found" in error["Message"].lower()


@mock_aws
def test_a_command_sent_to_instances_is_for_those_alone() -> None:
    """As in SSM: InstanceIds without Targets are the command's instances; moto alone added every instance."""
    ec2 = boto3.client("ec2", region_name="us-east-1")
    ssm = boto3.client("ssm", region_name="us-east-1")
    ids = [i["InstanceId"] for i in ec2.run_instances(ImageId="ami-12c6146b", MinCount=3, MaxCount=3)["Instances"]]
    Command.__init__ = _command_for_named  # type: ignore[method-assign]
    try:
        sent = ssm.send_command(
            InstanceIds=[ids[0]], DocumentName="AWS-RunShellScript", Parameters={"commands": ["true"]}
        )["Command"]
        targeted = ssm.send_command(
            Targets=[{"Key": "instance-id", "Values": [ids[1]]}],
            DocumentName="AWS-RunShellScript",
            Parameters={"commands": ["true"]},
        )["Command"]
    finally:
        Command.__init__ = _command_init  # type: ignore[method-assign]
    assert sent["InstanceIds"] == [ids[0]]
    assert [c["CommandId"] for c in ssm.list_commands(InstanceId=ids[0])["Commands"]] == [sent["CommandId"]]
    assert ssm.list_commands(InstanceId=ids[2])["Commands"] == []
    assert ids[1] in ssm.list_commands(CommandId=targeted["CommandId"])["Commands"][0]["InstanceIds"]


@mock_aws
def test_the_serializer_s_names_worked_out_once_give_moto_s_own_answers() -> None:
    """Each answer the same as moto's own, field for field, however often it is asked."""
    ec2 = boto3.client("ec2", region_name="us-east-1")
    ecs = boto3.client("ecs", region_name="us-east-1")
    ids = [
        i["InstanceId"]
        for i in ec2.run_instances(
            ImageId="ami-12c6146b",
            MinCount=3,
            MaxCount=3,
            TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "g", "Value": "a"}]}],
        )["Instances"]
    ]
    ecs.create_cluster(clusterName="c")
    document = json.dumps({"instanceId": ids[0], "availabilityZone": "us-east-1a"})
    arn = ecs.register_container_instance(cluster="c", instanceIdentityDocument=document)["containerInstance"][
        "containerInstanceArn"
    ]

    def answers() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = [
            dict(ec2.describe_instances(InstanceIds=ids)),
            dict(ec2.describe_instance_status(InstanceIds=ids, IncludeAllInstances=True)),
            dict(ecs.describe_container_instances(cluster="c", containerInstances=[arn])),
            dict(ecs.describe_clusters(clusters=["c"])),
        ]
        for answer in found:
            answer.pop("ResponseMetadata")  # its request id differs every time
        return found

    moto_s = answers()
    pickers = {picker: picker.get_possible_keys for picker in (AttributePicker, XFormedAttributePicker)}
    for picker, possible_keys in pickers.items():
        picker.get_possible_keys = _once(possible_keys)  # type: ignore[method-assign,assignment]
    try:
        once, twice = answers(), answers()
    finally:
        for picker, possible_keys in pickers.items():
            picker.get_possible_keys = possible_keys  # type: ignore[method-assign]
    assert once == moto_s and twice == moto_s
    assert moto_s[0]["Reservations"][0]["Instances"][0]["Tags"] == [{"Key": "g", "Value": "a"}]
