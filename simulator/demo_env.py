"""The demo process's surroundings while it runs: where logs go, which AWS credentials boto3 sees, how loud the
Temporal SDK core is. Each is undone when the demo ends, so a caller's process is left as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from temporalio.runtime import (
    LogForwardingConfig,
    LoggingConfig,
    Runtime,
    TelemetryConfig,
    TelemetryFilter,
)


@contextlib.contextmanager
def logs_to_file(path: Path) -> Iterator[None]:
    """The live summary owns the terminal: worker, probe and SDK logs go to a file instead.

    A plain stdlib formatter on purpose: workflow code logs from inside Temporal's sandbox, where a formatter
    that imports lazily (structlog's JSON fallback, rich tracebacks) fails and hides the original message.
    """
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [handler]
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)
        handler.close()


@contextlib.contextmanager
def moto_credentials() -> Iterator[None]:
    """Throwaway credentials for boto3: whatever real ones the shell has never travel to the moto server."""
    keys = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    dropped = ("AWS_SESSION_TOKEN", "AWS_PROFILE")
    saved = {k: os.environ.get(k) for k in (*keys, *dropped)}
    os.environ.update(keys)
    for key in dropped:
        os.environ.pop(key, None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def quiet_runtime() -> Runtime:
    """The SDK core's own warnings (retries while a server stops) go to the log file, not over the summary."""
    return Runtime(
        telemetry=TelemetryConfig(
            logging=LoggingConfig(
                filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
                forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")),
            )
        )
    )
