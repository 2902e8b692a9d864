"""simulator/moto_main.py reads an EC2 resource's tags from moto's own index: the same answer as moto's, found
without scanning every tag of every resource."""

from __future__ import annotations

import boto3
from moto import mock_aws
from moto.backends import get_backend
from moto.ec2.models.core import TaggedEC2Resource

from simulator.moto_main import _tags


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
