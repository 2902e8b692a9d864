"""The one thing a plain model asks of a workflow's logger: replay-aware in the workflow, a list in a test."""

from __future__ import annotations

from typing import Protocol


class Log(Protocol):
    def info(self, msg: str, *args: object) -> None: ...

    def warning(self, msg: str, *args: object) -> None: ...
