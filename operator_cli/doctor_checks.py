"""What `autorepair doctor`'s checks share: their verdicts, and the one context each check reads (the worker's
settings, the Temporal client once reached, read-only AWS clients, what the command was told)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError
from pydantic import BaseModel
from temporalio.client import Client

from contract.aws_session import new_session
from contract.config import TemporalSettings, dotted_key
from contract.groups import CapacityGroup
from worker.settings import Settings

if TYPE_CHECKING:
    from mypy_boto3_autoscaling import AutoScalingClient
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ecs import ECSClient
    from mypy_boto3_events import EventBridgeClient
    from mypy_boto3_s3 import S3Client

P = ParamSpec("P")
T = TypeVar("T")

# A preflight answers in seconds or says why not: one retry, and no call waits long on an endpoint that does not answer.
AWS_ATTEMPTS, AWS_CONNECT_TIMEOUT_S, AWS_READ_TIMEOUT_S = 2, 5, 15
# The codes AWS refuses a call with when the caller's policy does not allow it.
DENIED_CODES = frozenset(
    {"AccessDenied", "AccessDeniedException", "UnauthorizedOperation", "UnauthorizedAccess", "AuthorizationError"}
)


class Status(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


class Verdict(BaseModel):
    """What one check found: on FAIL the fix, on SKIP why it could not look."""

    status: Status
    detail: str
    fix: str = ""


class Finding(BaseModel):
    """One line of the report (`-o json`: one object of the list)."""

    check: str
    status: Status
    detail: str
    fix: str = ""


def passed(detail: str) -> Verdict:
    return Verdict(status=Status.PASS, detail=detail)


def failed(detail: str, fix: str) -> Verdict:
    return Verdict(status=Status.FAIL, detail=detail, fix=fix)


def skipped(why: str) -> Verdict:
    return Verdict(status=Status.SKIP, detail=why)


def error_code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def error_message(err: ClientError) -> str:
    return " ".join(str(err.response.get("Error", {}).get("Message", "") or err).split())


def refused(err: ClientError, api: str) -> Verdict | None:
    """SKIP when the credentials here may not make the call that looks: the worker's own policy does not grant every
    read the doctor makes, and a check that cannot look has found nothing wrong."""
    if error_code(err) not in DENIED_CODES:
        return None
    return skipped(f"these credentials may not call {api}: run doctor with credentials that may, to check this")


@dataclass
class Doctor:
    """The context every check reads. Temporal and AWS identity are found by the first checks; the later ones skip
    what those could not reach."""

    settings: Settings
    temporal: TemporalSettings
    ingest_url: str | None = None
    ingest_ca: Path | None = None
    worker_role: str | None = None
    client: Client | None = None
    namespace_found: bool = False
    caller_arn: str | None = None

    def group_key(self, group: CapacityGroup, name: str) -> str:
        """A group's setting as the settings errors name it: groups[1].cluster."""
        return dotted_key(("groups", self.settings.groups.index(group), name))

    @functools.cached_property
    def _session(self) -> boto3.session.Session:
        return new_session(self.settings.aws.region)

    @functools.cached_property
    def _config(self) -> Config:
        return Config(
            region_name=self.settings.aws.region,
            retries={"mode": "standard", "max_attempts": AWS_ATTEMPTS},
            connect_timeout=AWS_CONNECT_TIMEOUT_S,
            read_timeout=AWS_READ_TIMEOUT_S,
        )

    @property
    def _endpoint(self) -> str | None:
        return self.settings.aws.endpoint_url

    @functools.cached_property
    def ecs(self) -> ECSClient:
        return self._session.client("ecs", endpoint_url=self._endpoint, config=self._config)

    @functools.cached_property
    def ec2(self) -> EC2Client:
        return self._session.client("ec2", endpoint_url=self._endpoint, config=self._config)

    @functools.cached_property
    def autoscaling(self) -> AutoScalingClient:
        return self._session.client("autoscaling", endpoint_url=self._endpoint, config=self._config)

    @functools.cached_property
    def events(self) -> EventBridgeClient:
        return self._session.client("events", endpoint_url=self._endpoint, config=self._config)

    @functools.cached_property
    def s3(self) -> S3Client:
        return self._session.client("s3", endpoint_url=self._endpoint, config=self._config)

    # No type stubs are installed for STS and IAM.
    @functools.cached_property
    def sts(self) -> Any:
        return self._session.client("sts", endpoint_url=self._endpoint, config=self._config)

    @functools.cached_property
    def iam(self) -> Any:
        return self._session.client("iam", endpoint_url=self._endpoint, config=self._config)

    async def call(self, method: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """One blocking boto3 call, off the event loop."""
        return await asyncio.to_thread(functools.partial(method, *args, **kwargs))
