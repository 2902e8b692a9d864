"""The AWS proxy answers as slowly as AWS does: each call held for a delay from its API's range, concurrent calls
held side by side (not one after another), and the delay covering moto's own time. Real moto over HTTP, real boto3."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ReadTimeoutError

from simulator.aws_proxy import AWS_LATENCY_MS, FlakyAws


def ec2(url: str) -> Any:
    config = Config(retries={"mode": "standard", "total_max_attempts": 1}, max_pool_connections=20)
    return boto3.client("ec2", region_name="us-east-1", endpoint_url=url, config=config)


def timed(call: Callable[[], object]) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def test_each_call_waits_at_least_its_apis_delay_and_other_apis_their_own(aws_env: str) -> None:
    with FlakyAws(aws_env) as proxy:
        client = ec2(proxy.url)
        fast = min(timed(client.describe_regions) for _ in range(3))
        proxy.slow("DescribeInstances", 0.4, 0.5)
        proxy.slow("*", 0.2)
        took = [timed(client.describe_instances) for _ in range(3)]
        other = timed(client.describe_regions)
    # Lower bounds only: a loaded machine may add time, never take it away.
    assert all(t >= 0.4 for t in took), took
    assert other >= 0.2, other
    assert fast < 0.2, fast  # no rule: as fast as moto (a lower bound for the rules above to mean anything)


def test_concurrent_calls_are_held_side_by_side_not_queued(aws_env: str) -> None:
    with FlakyAws(aws_env) as proxy:
        proxy.slow("DescribeInstances", 2.0)
        client = ec2(proxy.url)
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda _: client.describe_instances(), range(8)))
        took = time.monotonic() - started
        peak = proxy.peak_in_flight
    # Queued, the proxy would hold one call at a time; side by side, all eight overlap in their two-second hold. The
    # overlap is counted, not timed: a loaded machine slows moto, it does not make the proxy hold calls in turn.
    assert peak == 8, peak
    assert took >= 2.0, took


def test_the_aws_profile_covers_every_call_and_stays_in_its_ranges(aws_env: str) -> None:
    assert AWS_LATENCY_MS["*"] == (50, 300)
    assert all(0 < low <= high for low, high in AWS_LATENCY_MS.values())
    with FlakyAws(aws_env) as proxy:
        proxy.like_aws()
        client = ec2(proxy.url)
        took = [timed(client.describe_instances) for _ in range(4)]
        proxy.heal()  # faults go; the latency stays
        healed = timed(client.describe_instances)
    low = AWS_LATENCY_MS["DescribeInstances"][0] / 1000
    assert all(t >= low for t in [*took, healed]), (took, healed)


def test_a_latency_rule_is_checked() -> None:
    proxy = FlakyAws("http://127.0.0.1:1")
    with pytest.raises(ValueError):
        proxy.slow("RunInstances", 0.5, 0.1)
    with pytest.raises(ValueError):
        proxy.slow("RunInstances", -1)


def test_a_caller_that_hangs_up_is_no_error_and_its_call_still_counts(
    aws_env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client whose read timeout ends before a slow answer hangs up; the proxy still did the call (as AWS does) and
    prints no traceback for the broken pipe; the next caller is answered."""
    with FlakyAws(aws_env) as proxy:
        proxy.slow("DescribeRegions", 1.0)
        config = Config(retries={"total_max_attempts": 1}, read_timeout=0.2, connect_timeout=2)
        impatient = boto3.client("ec2", region_name="us-east-1", endpoint_url=proxy.url, config=config)
        with pytest.raises(ReadTimeoutError):
            impatient.describe_regions()
        time.sleep(1.5)  # the answer is written to the closed socket
        assert proxy.calls("DescribeRegions") == 1
        assert ec2(proxy.url).describe_regions()["Regions"]
    assert "Traceback" not in capsys.readouterr().err
