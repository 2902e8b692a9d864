"""Size limits on everything a signal, update or workflow input carries (docs/operations.md lists them).

A workflow keeps what it is sent in its state and carries that state across continue-as-new, so an unbounded
string or list from one bad (or hostile) sender would grow every later history. Identifiers over their limit are
refused (the signal is counted and dropped); free text over its limit is cut, since a long kernel line is still a
real fault.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Final

from pydantic import AfterValidator, BeforeValidator, StringConstraints

MAX_ID: Final = 256  # instance ids, group names, workflow ids, finding ids
MAX_NAME: Final = 128  # kinds, reasons, rules, source names, requesters
MAX_TOKEN: Final = 64  # the tokens that authenticate internal signals
MAX_TEXT: Final = 4096  # messages, raw log lines, errors, status reasons (cut, not refused)
MAX_PROBE_SOURCES: Final = 32  # sources one heartbeat reports
MAX_COUNT: Final = 1_000_000_000  # a burst's count
MAX_HEARTBEAT_LOSS_INJECTION: Final = timedelta(days=1)

TEXT_CUT_MARK: Final = "…[cut]"


def _cut(value: object) -> object:
    if isinstance(value, str) and len(value) > MAX_TEXT:
        return value[: MAX_TEXT - len(TEXT_CUT_MARK)] + TEXT_CUT_MARK
    return value


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


# A time without an offset is read as UTC: compared with the workflow's own (aware) clock it would fail the workflow
# task, and an event must say its offset.
Timestamp = Annotated[datetime, AfterValidator(_aware)]
Id = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID)]
OptionalId = Annotated[str, StringConstraints(max_length=MAX_ID)]
Name = Annotated[str, StringConstraints(max_length=MAX_NAME)]
Token = Annotated[str, StringConstraints(max_length=MAX_TOKEN)]
Text = Annotated[str, BeforeValidator(_cut)]
