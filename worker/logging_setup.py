"""structlog for everything: JSON lines for machines, key=value on a terminal.

Workflow and activity code log through the SDK's replay-aware `workflow.logger` / `activity.logger` (stdlib
loggers); routing stdlib through structlog's ProcessorFormatter gives one format without logging twice on replay.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(fmt: str = "auto", level: int = logging.INFO) -> None:
    json_output = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json_output else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    # botocore and the HTTP stack are chatty at INFO; their warnings still come through.
    for noisy in ("botocore", "urllib3", "werkzeug"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
