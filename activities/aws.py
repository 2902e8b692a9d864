"""boto3 clients for the activities, and the one way activities call them.

The same code runs against moto and real AWS: only `AwsSettings.endpoint_url` differs. boto3 is blocking, so
`AwsClients.call` runs each request in a worker thread: the activities stay `async def`, the event loop keeps
heartbeating and delivering cancellation, and the worker needs no activity executor.

The threads are a pool of their own (`AwsCalls`, one per `AwsClients`, sized by the worker's `[worker]
aws_call_threads`), not asyncio's default executor, which is min(32, cpus + 4) threads shared with everything else in
the process. And at most `[aws] max_concurrent_calls_per_api` calls to one API (`service:Operation`) are in flight at
once: a burst of one call (a fleet-wide describe) can neither take every thread nor bring on AWS's throttling of that
API alone. A call over the limit waits on the event loop, holding no thread; a slot is freed when the boto3 call
itself ends, so an activity cancelled while its call is still running does not let another call past the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import boto3
from botocore.config import Config

from activities.errors import aws_errors
from contract.aws_session import new_session
from contract.config import DEFAULT_CALL_THREADS, AwsSettings

if TYPE_CHECKING:
    from mypy_boto3_autoscaling import AutoScalingClient
    from mypy_boto3_ec2 import EC2Client
    from mypy_boto3_ecs import ECSClient
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_ssm import SSMClient

P = ParamSpec("P")
T = TypeVar("T")


class AwsCalls:
    """Where boto3 calls run: `threads` threads of their own, and at most `per_api` calls in flight to one API."""

    def __init__(self, *, threads: int, per_api: int) -> None:
        if threads < 1 or per_api < 1:
            raise ValueError(f"threads and per_api must be at least 1, not {threads} and {per_api}")
        self.threads = threads
        self.per_api = per_api
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="aws-call")
        # Per event loop: an asyncio.Semaphore belongs to the loop that first waits on it.
        self._limits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Semaphore]] = (
            weakref.WeakKeyDictionary()
        )

    def _limit(self, loop: asyncio.AbstractEventLoop, api: str) -> asyncio.Semaphore:
        by_api = self._limits.setdefault(loop, {})
        limit = by_api.get(api)
        if limit is None:
            limit = by_api[api] = asyncio.Semaphore(self.per_api)
        return limit

    async def run(self, api: str, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on one of the threads once `api` has fewer than `per_api` calls in flight."""
        loop = asyncio.get_running_loop()
        limit = self._limit(loop, api)
        await limit.acquire()
        try:
            # As asyncio.to_thread: the call sees the caller's context variables.
            future = self.executor.submit(contextvars.copy_context().run, functools.partial(fn, *args, **kwargs))
        except BaseException:
            limit.release()
            raise

        def release(_: Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits on the limit any more
                loop.call_soon_threadsafe(limit.release)

        # When the call ends, or never starts (cancelled while queued): not when the awaiting task is cancelled.
        future.add_done_callback(release)
        return await asyncio.wrap_future(future)

    async def aclose(self) -> None:
        """Refuse new calls, drop the queued ones, and wait (off the loop) for those running to end."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.executor.shutdown, wait=True)


class AwsClients:
    """The clients the activities use, sharing one session and one retry configuration."""

    def __init__(
        self, settings: AwsSettings, session: boto3.session.Session | None = None, *, threads: int | None = None
    ) -> None:
        session = session or new_session(settings.region)
        self.calls = AwsCalls(threads=threads or DEFAULT_CALL_THREADS, per_api=settings.max_concurrent_calls_per_api)
        config = Config(
            region_name=settings.region,
            # "standard": throttling and transient errors retried with backoff before Temporal sees them.
            retries={"mode": "standard", "max_attempts": settings.max_attempts},
            # A connection per thread: botocore's default pool of 10 would open and discard the rest on every call.
            max_pool_connections=self.calls.threads,
        )
        self.settings = settings
        self._session = session
        self._config = config
        self.ecs: ECSClient = self._client("ecs")
        self.ec2: EC2Client = self._client("ec2")

    # Made on first use (each costs tens of milliseconds of CPU to build): a worker whose groups never detach from an
    # Auto Scaling group, reset a GPU or keep evidence never builds those clients.
    @functools.cached_property
    def autoscaling(self) -> AutoScalingClient:
        return self._client("autoscaling")

    @functools.cached_property
    def ssm(self) -> SSMClient:
        """Run Command: the remediation ladder's GPU reset (activities/remediation.py) and the gate on the host."""
        return self._client("ssm")

    @functools.cached_property
    def s3(self) -> S3Client:
        """The evidence of a repair (activities/evidence.py). Signature v4: a presigned URL the host PUTs to names one
        key. Path-style at a custom endpoint (moto), whose host name has no bucket subdomains."""
        path_style = self.settings.endpoint_url is not None
        addressing = Config(signature_version="s3v4", s3={"addressing_style": "path" if path_style else "virtual"})
        return self._client("s3", self._config.merge(addressing))

    def _client(self, service: Any, config: Config | None = None) -> Any:
        return self._session.client(service, endpoint_url=self.settings.endpoint_url, config=config or self._config)

    async def call(self, resource: str, method: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run one call of these clients (`method`, e.g. `self.ec2.describe_instances`) in their threads, within the
        API's limit; errors become retryable or non-retryable ApplicationErrors. `resource` names what the call is
        about (cluster, instance, launch template) for the error message."""
        name = call_name(method)
        with aws_errors(name, resource):
            return await self.calls.run(name, method, *args, **kwargs)

    async def aclose(self) -> None:
        """Shut the calls' threads down: after the worker, whose activities make the calls (worker/main.py)."""
        await self.calls.aclose()

    async def __aenter__(self) -> AwsClients:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


def call_name(method: Callable[..., Any]) -> str:
    """IAM-style name of a bound client method, e.g. `ec2:RunInstances`, for error messages."""
    client = getattr(method, "__self__", None)
    name = getattr(method, "__name__", repr(method))
    meta = getattr(client, "meta", None)
    if meta is None:
        return name
    service = meta.service_model.service_name
    return f"{service}:{meta.method_to_api_mapping.get(name, name)}"
