"""Each simulated host's own AWS identity, as an EC2 instance profile gives a real one: a role assumed with the
instance id as its session name (moto's IAM and STS). The demo's probes sign their reports to the ingest with it,
so the ingest proves each one exactly as it proves a real host."""

from __future__ import annotations

import json
import threading

import boto3
from botocore.config import Config
from botocore.credentials import ReadOnlyCredentials
from botocore.exceptions import ClientError

HOST_ROLE = "gpu-autorepair-sim-host"
# Who may assume the role: EC2, as for an instance profile (moto does not check it, AWS would).
_TRUST = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}],
}


class HostIdentities:
    """Blocking (boto3): call from a thread. The role is created once, on first use."""

    def __init__(self, endpoint_url: str, region: str = "us-east-1") -> None:
        config = Config(retries={"max_attempts": 3, "mode": "standard"})
        self._iam = boto3.client("iam", endpoint_url=endpoint_url, region_name=region, config=config)
        self._sts = boto3.client("sts", endpoint_url=endpoint_url, region_name=region, config=config)
        self._role_arn: str | None = None
        self._lock = threading.Lock()  # probes ask from several threads at once

    @property
    def account(self) -> str:
        return self._sts.get_caller_identity()["Account"]

    def credentials(self, instance_id: str) -> ReadOnlyCredentials:
        """Fresh credentials of the host `instance_id`: its session name is its instance id."""
        granted = self._sts.assume_role(RoleArn=self._role(), RoleSessionName=instance_id)["Credentials"]
        return ReadOnlyCredentials(granted["AccessKeyId"], granted["SecretAccessKey"], granted["SessionToken"])

    def _role(self) -> str:
        with self._lock:
            if self._role_arn is None:
                try:
                    role = self._iam.create_role(RoleName=HOST_ROLE, AssumeRolePolicyDocument=json.dumps(_TRUST))
                except ClientError as err:
                    if err.response.get("Error", {}).get("Code") != "EntityAlreadyExists":
                        raise
                    role = self._iam.get_role(RoleName=HOST_ROLE)
                self._role_arn = role["Role"]["Arn"]
            return self._role_arn
