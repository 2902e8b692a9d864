"""The worker's tuning is a setting ([worker], worker/tuning.py) that reaches the SDK's Worker, and the activities' AWS
calls run in threads of their own with at most `[aws] max_concurrent_calls_per_api` in flight per API
(activities/aws.py): against fake slow calls, and against moto behind a proxy that counts what reaches "AWS"."""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker, WorkerTuner

import worker.main
from activities.aws import AwsCalls, AwsClients
from contract.config import CONFIG_ENV, DEFAULT_CALL_THREADS, AwsSettings, ConfigError
from contract.groups import CapacityGroup
from simulator.aws_proxy import AwsRequest, FlakyAws
from tests.harness import eventually, make_settings, unique
from worker.main import build_worker, run_worker, worker_aws
from worker.settings import Settings
from worker.tuning import WorkerTuning
from workflows.options import HEARTBEAT_TIMEOUT_MAX, heartbeat_every
from workflows.repair_replacement import ready_heartbeat_timeout


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("AUTOREPAIR_")]:
        monkeypatch.delenv(name)


class InFlight:
    """Counts calls running at once (from any thread) and the most seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.total = 0
        self.most_total = 0

    def enter(self, key: str) -> None:
        with self._lock:
            self.now[key] += 1
            self.total += 1
            self.most[key] = max(self.most[key], self.now[key])
            self.most_total = max(self.most_total, self.total)

    def leave(self, key: str) -> None:
        with self._lock:
            self.now[key] -= 1
            self.total -= 1

    def kinds(self) -> int:
        """How many keys have a call running now."""
        with self._lock:
            return len(+self.now)

    def slow(self, key: str, release: threading.Event | float) -> Callable[[], str]:
        """A blocking call that holds its thread until `release` is set (or for that many seconds)."""

        def call() -> str:
            self.enter(key)
            try:
                if isinstance(release, threading.Event):
                    assert release.wait(30), "never released"
                else:
                    time.sleep(release)
                return threading.current_thread().name
            finally:
                self.leave(key)

        return call


def _aws_clients_in(holder: object, depth: int = 2) -> list[AwsClients]:
    found: list[AwsClients] = []
    for value in vars(holder).values():
        if isinstance(value, AwsClients):
            found.append(value)
        elif depth > 1 and hasattr(value, "__dict__") and not isinstance(value, type):
            found.extend(_aws_clients_in(value, depth - 1))
    return found


# --- [worker] and [aws] as settings ------------------------------------------------------------------------------


def test_the_defaults_are_the_sdks_own_but_the_activities() -> None:
    """Stated defaults, not silent ones: an SDK upgrade that changes its defaults fails here, to be looked at."""
    tuning = WorkerTuning()
    sdk = inspect.signature(Worker.__init__).parameters
    fixed = vars(WorkerTuner.create_fixed())  # what the SDK uses when max_concurrent_* are unset
    assert tuning.max_concurrent_workflow_tasks == fixed["workflow_slot_supplier"].num_slots == 100
    # Ten times the SDK's: a replacement's wait holds an activity for the whole boot (worker/tuning.py says why).
    assert fixed["activity_slot_supplier"].num_slots == 100 and tuning.max_concurrent_activities == 1_000
    assert PollerBehaviorSimpleMaximum(tuning.workflow_task_pollers) == sdk["workflow_task_poller_behavior"].default
    assert PollerBehaviorSimpleMaximum(tuning.activity_task_pollers) == sdk["activity_task_poller_behavior"].default
    assert tuning.max_cached_workflows == sdk["max_cached_workflows"].default
    assert tuning.sticky_queue_schedule_to_start_timeout == sdk["sticky_queue_schedule_to_start_timeout"].default
    # The AWS threads are their own setting: as many as a bare AwsClients gets, whatever the activities.
    assert tuning.aws_threads == DEFAULT_CALL_THREADS == 100
    assert WorkerTuning(max_concurrent_activities=40).aws_threads == DEFAULT_CALL_THREADS
    assert WorkerTuning(max_concurrent_activities=40, aws_call_threads=8).aws_threads == 8
    assert AwsSettings().max_concurrent_calls_per_api == 16


def test_worker_and_aws_tables_are_read_from_the_file_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        "[aws]\nmax_concurrent_calls_per_api = 4\n"
        "[worker]\nmax_concurrent_activities = 30\nmax_cached_workflows = 0\n"
        'sticky_queue_schedule_to_start_timeout = "PT3S"\n'
    )
    monkeypatch.setenv(CONFIG_ENV, str(config))
    monkeypatch.setenv("AUTOREPAIR_WORKER__ACTIVITY_TASK_POLLERS", "9")
    settings = Settings.load()
    assert settings.aws.max_concurrent_calls_per_api == 4
    assert settings.worker.max_concurrent_activities == 30
    assert settings.worker.aws_threads == DEFAULT_CALL_THREADS
    assert settings.worker.max_cached_workflows == 0
    assert settings.worker.sticky_queue_schedule_to_start_timeout == timedelta(seconds=3)
    assert settings.worker.activity_task_pollers == 9


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[worker]\nmax_concurrent_activites = 5\n", r"worker\.max_concurrent_activites: unknown key: did you mean"),
        ("[worker]\nworkflow_task_pollers = 1\n", r"worker\.workflow_task_pollers"),
        ("[worker]\nmax_concurrent_activities = 0\n", r"worker\.max_concurrent_activities"),
        ("[worker]\naws_call_threads = 0\n", r"worker\.aws_call_threads"),
        ("[worker]\nsticky_queue_schedule_to_start_timeout = 0\n", r"must be a positive duration"),
        ("[worker]\nmax_concurrent_workflow_tasks = 1\n", r"at least 2 while max_cached_workflows is not 0"),
        ("[aws]\nmax_concurrent_calls_per_api = 0\n", r"aws\.max_concurrent_calls_per_api"),
    ],
)
def test_bad_tuning_is_refused_in_one_line(text: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    config = tmp_path / "config.toml"
    config.write_text(text)
    monkeypatch.setenv(CONFIG_ENV, str(config))
    with pytest.raises(ConfigError, match=message):
        Settings.load()


def test_one_workflow_task_at_a_time_is_allowed_without_the_cache() -> None:
    settings = Settings(worker={"max_concurrent_workflow_tasks": 1, "max_cached_workflows": 0})
    assert settings.worker.max_concurrent_workflow_tasks == 1
    with pytest.raises(ValidationError, match="at least 2 while max_cached_workflows"):
        Settings(worker={"max_concurrent_workflow_tasks": 1})


def test_a_replacement_wait_heartbeats_by_its_own_timeout_not_once_a_minute() -> None:
    """Each heartbeat is a billed action: at the default 20-minute wait the SDK sends one every 4 minutes (80 % of a
    5-minute timeout), since the worker's throttle no longer caps it at the SDK's default minute."""
    default_wait = CapacityGroup.model_fields["replacement_ready_timeout"].default
    timeout = ready_heartbeat_timeout(default_wait)
    assert timeout == HEARTBEAT_TIMEOUT_MAX == timedelta(minutes=5)
    assert inspect.signature(Worker.__init__).parameters["max_heartbeat_throttle_interval"].default == timedelta(
        seconds=60
    )
    assert heartbeat_every(timeout) == timedelta(minutes=4)
    # A lost worker is noticed within a quarter of a short wait, never under 10 s, never over 5 minutes.
    assert ready_heartbeat_timeout(timedelta(minutes=2)) == timedelta(seconds=30)
    assert ready_heartbeat_timeout(timedelta(seconds=20)) == timedelta(seconds=10)
    assert ready_heartbeat_timeout(timedelta(hours=2)) == timedelta(minutes=5)


# --- the settings reach the SDK's Worker ---------------------------------------------------------------------------


async def test_build_worker_passes_the_tuning_to_the_sdk_worker(client: Client, tmp_path: Path) -> None:
    settings = make_settings(client, "http://127.0.0.1:1", tmp_path / "e.jsonl", group="g", cluster="c")
    settings = settings.model_copy(
        update={
            "worker": WorkerTuning(
                max_concurrent_workflow_tasks=7,
                max_concurrent_activities=11,
                workflow_task_pollers=3,
                activity_task_pollers=2,
                max_cached_workflows=50,
                sticky_queue_schedule_to_start_timeout=timedelta(seconds=4),
                aws_call_threads=6,
            )
        }
    )
    aws = worker_aws(settings)
    try:
        config_of_ec2: Any = aws.ec2.meta.config  # botocore's stubs do not list its options
        assert aws.calls.threads == 6 and config_of_ec2.max_pool_connections == 6
        built = build_worker(settings, client, aws)
        config = built.config()
        assert config.get("max_concurrent_workflow_tasks") == 7
        assert config.get("max_concurrent_activities") == 11
        assert config.get("workflow_task_poller_behavior") == PollerBehaviorSimpleMaximum(3)
        assert config.get("activity_task_poller_behavior") == PollerBehaviorSimpleMaximum(2)
        assert config.get("max_cached_workflows") == 50
        assert config.get("sticky_queue_schedule_to_start_timeout") == timedelta(seconds=4)
        assert config.get("max_heartbeat_throttle_interval") == HEARTBEAT_TIMEOUT_MAX
        # Every activity holding AWS clients (directly or one object down) holds the ones given.
        holders = {id(act.__self__): act.__self__ for act in config.get("activities", []) if hasattr(act, "__self__")}
        found = {type(h).__name__: _aws_clients_in(h) for h in holders.values()}
        with_aws = {name for name, clients in found.items() if clients}
        assert {"FleetActivities", "AwsStatusActivities", "RemediationActivities", "EvidenceActivities"} <= with_aws
        assert all(client is aws for clients in found.values() for client in clients)
    finally:
        await aws.aclose()


async def test_run_worker_shuts_the_aws_threads_down_with_the_worker(
    client: Client, aws_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(client, aws_env, tmp_path / "e.jsonl", group=unique("gpu"), cluster=unique("c"))
    made: list[AwsClients] = []

    def spy(settings: Settings) -> AwsClients:
        made.append(worker_aws(settings))
        return made[-1]

    monkeypatch.setattr(worker.main, "worker_aws", spy)

    async def pollers() -> int:
        resp = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=client.namespace,
                task_queue=TaskQueue(name=settings.temporal.task_queue),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
            )
        )
        return len(resp.pollers)

    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(settings, client, stop))
    try:
        await eventually(pollers, lambda n: n > 0, within=60, every=0.2)
        [aws] = made
        assert aws.calls.threads == settings.worker.aws_threads
        zones = await aws.call("the region", aws.ec2.describe_availability_zones)
        assert zones["AvailabilityZones"]
    finally:
        stop.set()
        await asyncio.wait_for(task, 90)
    with pytest.raises(RuntimeError, match="after shutdown"):
        aws.calls.executor.submit(time.time)


# --- the AWS calls' threads and their limit per API ----------------------------------------------------------------


async def test_at_most_per_api_calls_run_at_once_and_apis_do_not_wait_for_each_other() -> None:
    calls = AwsCalls(threads=50, per_api=3)
    seen = InFlight()
    release = threading.Event()
    try:
        busy = [asyncio.create_task(calls.run("ec2:DescribeInstances", seen.slow("ec2", release))) for _ in range(12)]
        await eventually(lambda: asyncio.sleep(0, seen.now["ec2"]), lambda n: n == 3, within=10, every=0.01)
        # ec2:DescribeInstances is at its limit; another API is not held up by it.
        other = await asyncio.wait_for(calls.run("ecs:ListTasks", seen.slow("ecs", 0.01)), 10)
        assert other.startswith("aws-call")
        await asyncio.sleep(0.2)
        assert seen.now["ec2"] == 3, "a fourth call started while three were in flight"
        release.set()
        names = await asyncio.gather(*busy)
        assert seen.most["ec2"] == 3 and len(names) == 12
    finally:
        release.set()
        await calls.aclose()


async def test_the_threads_are_as_many_as_configured() -> None:
    calls = AwsCalls(threads=4, per_api=100)
    seen = InFlight()
    release = threading.Event()
    try:
        tasks = [asyncio.create_task(calls.run(f"api:{i}", seen.slow("any", release))) for i in range(10)]
        await eventually(lambda: asyncio.sleep(0, seen.total), lambda n: n == 4, within=10, every=0.01)
        await asyncio.sleep(0.2)
        assert seen.total == 4, "more calls ran at once than there are threads"
        release.set()
        names = await asyncio.gather(*tasks)
        assert seen.most_total == 4 and len(set(names)) == 4
        assert all(name.startswith("aws-call") for name in names)
    finally:
        release.set()
        await calls.aclose()


async def test_a_cancelled_call_keeps_its_slot_until_its_thread_is_done() -> None:
    """Cancelling the activity does not stop boto3 in its thread: the call is still in flight at AWS, so it still
    counts against the limit until it returns."""
    calls = AwsCalls(threads=10, per_api=2)
    seen = InFlight()
    release = threading.Event()
    try:
        first = [asyncio.create_task(calls.run("ec2:RunInstances", seen.slow("ec2", release))) for _ in range(2)]
        await eventually(lambda: asyncio.sleep(0, seen.now["ec2"]), lambda n: n == 2, within=10, every=0.01)
        for task in first:
            task.cancel()
        await asyncio.gather(*first, return_exceptions=True)
        assert all(task.cancelled() for task in first)
        later = asyncio.create_task(calls.run("ec2:RunInstances", seen.slow("ec2", 0.01)))
        await asyncio.sleep(0.3)
        assert not later.done() and seen.most["ec2"] == 2, "a call went past two still running in their threads"
        release.set()
        await asyncio.wait_for(later, 10)
        assert seen.most["ec2"] == 2
    finally:
        release.set()
        await calls.aclose()


async def test_aws_calls_reach_aws_at_most_per_api_at_once(aws_env: str) -> None:
    """The real path: activities. `AwsClients.call` on its' boto3 clients, against moto behind a proxy that holds
    each answer 0.3 s and counts the requests it is serving at once, per API."""
    at_aws = InFlight()
    both_apis = threading.Event()

    def held(request: AwsRequest, body: bytes) -> bytes:  # on the proxy's threads, one per request
        at_aws.enter(request.action)
        try:
            # Answers wait (a bounded while) until both APIs have a call at AWS: on a loaded machine the first ECS
            # call can come after every EC2 one is done. With one limit for all APIs both never would.
            if at_aws.kinds() == 2:
                both_apis.set()
            both_apis.wait(10)
            time.sleep(0.3)
            return body
        finally:
            at_aws.leave(request.action)

    with FlakyAws(aws_env) as proxy:
        proxy.rewrite("DescribeInstances", held)
        proxy.rewrite("ListClusters", held)
        aws = AwsClients(
            AwsSettings(endpoint_url=proxy.url, max_concurrent_calls_per_api=3, max_attempts=1), threads=20
        )
        threads: list[str] = []
        aws.ec2.meta.events.register(
            "before-call.ec2.DescribeInstances", lambda **_: threads.append(threading.current_thread().name)
        )
        try:
            results = await asyncio.gather(
                *(aws.call("the fleet", aws.ec2.describe_instances) for _ in range(9)),
                *(aws.call("the clusters", aws.ecs.list_clusters) for _ in range(9)),
            )
        finally:
            await aws.aclose()
    assert len(results) == 18
    assert at_aws.most["DescribeInstances"] == 3 and at_aws.most["ListClusters"] == 3
    assert at_aws.most_total > 3, "the limit is per API, not one for all of them"
    assert len(threads) == 9 and all(name.startswith("aws-call") for name in threads)
