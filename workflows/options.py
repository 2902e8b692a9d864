"""Activity options shared by the workflows."""

from datetime import timedelta

from temporalio.common import RetryPolicy

# AWS and Temporal calls answer in seconds; a slow or throttled API is retried with backoff, never given up on.
CALL_TIMEOUT = timedelta(seconds=60)
CALL_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), maximum_interval=timedelta(minutes=1))
# The longest heartbeat timeout of any activity. The SDK sends an activity's heartbeats at most every 80 % of its
# timeout and at most every max_heartbeat_throttle_interval (its default: a minute); the worker sets that to this, so a
# long wait's own timeout decides how often it heartbeats, each heartbeat being a billed action.
HEARTBEAT_TIMEOUT_MAX = timedelta(minutes=5)
# The SDK's default_heartbeat_throttle_interval: how often an activity without a heartbeat timeout heartbeats.
HEARTBEAT_WITHOUT_TIMEOUT = timedelta(seconds=30)


def heartbeat_every(timeout: timedelta | None) -> timedelta:
    """How often the SDK sends an activity's heartbeats to the server on our worker (for the cost models)."""
    if not timeout:
        return HEARTBEAT_WITHOUT_TIMEOUT
    return min(timeout * 0.8, HEARTBEAT_TIMEOUT_MAX)
