"""Activity options shared by the workflows."""

from datetime import timedelta

from temporalio.common import RetryPolicy

# AWS and Temporal calls answer in seconds; a slow or throttled API is retried with backoff, never given up on.
CALL_TIMEOUT = timedelta(seconds=60)
CALL_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), maximum_interval=timedelta(minutes=1))
