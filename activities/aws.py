"""boto3 clients for the activities, and the one way activities call them.

The same code runs against moto and real AWS: only `AwsSettings.endpoint_url` differs. boto3 is blocking, so
`aws_call` runs each request in a worker thread (`asyncio.to_thread`): the activities stay `async def`, the
event loop keeps heartbeating and delivering cancellation, and the worker needs no activity executor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import boto3
from botocore.config import Config

from activities.errors import aws_errors
from contract.config import AwsSettings

if TYPE_CHECKING:
    from mypy_boto3_autoscaling import AutoScalingClient
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ecs import ECSClient
    from mypy_boto3_events import EventBridgeClient
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_ssm import SSMClient

P = ParamSpec("P")
T = TypeVar("T")


class AwsClients:
    """The clients the activities use, sharing one session and one retry configuration."""

    def __init__(self, settings: AwsSettings, session: boto3.session.Session | None = None) -> None:
        # A session of our own: boto3's default session is module-global and not safe to share across threads.
        session = session or boto3.session.Session(region_name=settings.region)
        config = Config(
            region_name=settings.region,
            # "standard": throttling and transient errors retried with backoff before Temporal sees them.
            retries={"mode": "standard", "max_attempts": settings.max_attempts},
            # Activities run concurrently in threads; the default pool of 10 would queue them.
            max_pool_connections=50,
        )
        endpoint = settings.endpoint_url
        self.settings = settings
        self.ecs: ECSClient = session.client("ecs", endpoint_url=endpoint, config=config)
        self.ec2: EC2Client = session.client("ec2", endpoint_url=endpoint, config=config)
        self.events: EventBridgeClient = session.client("events", endpoint_url=endpoint, config=config)
        self.autoscaling: AutoScalingClient = session.client("autoscaling", endpoint_url=endpoint, config=config)
        # Run Command: the remediation ladder's GPU reset (activities/remediation.py).
        self.ssm: SSMClient = session.client("ssm", endpoint_url=endpoint, config=config)
        # The evidence of a repair (activities/evidence.py). Signature v4: a presigned URL the host PUTs to names one
        # key. Path-style at a custom endpoint (moto), whose host name has no bucket subdomains.
        s3_config = config.merge(
            Config(signature_version="s3v4", s3={"addressing_style": "path" if endpoint else "virtual"})
        )
        self.s3: S3Client = session.client("s3", endpoint_url=endpoint, config=s3_config)


def call_name(method: Callable[..., Any]) -> str:
    """IAM-style name of a bound client method, e.g. `ec2:RunInstances`, for error messages."""
    client = getattr(method, "__self__", None)
    name = getattr(method, "__name__", repr(method))
    meta = getattr(client, "meta", None)
    if meta is None:
        return name
    service = meta.service_model.service_name
    return f"{service}:{meta.method_to_api_mapping.get(name, name)}"


async def aws_call(resource: str, method: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run one boto3 call off the event loop; errors become retryable or non-retryable ApplicationErrors.

    `resource` names what the call is about (cluster, instance, launch template) for the error message.
    """
    with aws_errors(call_name(method), resource):
        return await asyncio.to_thread(method, *args, **kwargs)
