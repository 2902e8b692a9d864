"""The kernel-log lines around a fault: what a support case asks for beside the fault's own line.

Each kernel-log source keeps its latest lines, every line it reads (not only NVIDIA's: a PCIe AER error or a
thermal event before an Xid is often the cause), in a bounded ring. When a fault becomes an impairing finding the
probe takes the lines before it (and the few after it already read) from the ring; they travel with the finding and
end in the incident's evidence (docs/operations.md §15). Only references are kept: the ring costs one append per line.
"""

from __future__ import annotations

from collections import deque
from typing import Final

from contract.probe import MAX_CONTEXT_LINES

RING_LINES: Final = 1024
AFTER: Final = 4  # lines after the fault, when already read
BEFORE: Final = MAX_CONTEXT_LINES - AFTER - 1
LINE_CHARS: Final = 512


class RecentLines:
    """The latest RING_LINES lines a source read, oldest first."""

    def __init__(self, size: int = RING_LINES) -> None:
        self._lines: deque[str] = deque(maxlen=size)
        self.append = self._lines.append

    def around(self, raw: str) -> list[str]:
        """The lines around the latest line that is (or starts) `raw`: up to BEFORE before it, it, up to AFTER after;
        none when it has left the ring (a storm read past it) or `raw` is no line of this source."""
        first = raw.split("\n", 1)[0].rstrip("\r")
        if not first:
            return []
        lines = list(self._lines)
        for index in range(len(lines) - 1, -1, -1):
            if lines[index].rstrip("\r\n") == first:
                window = lines[max(0, index - BEFORE) : index + AFTER + 1]
                return [line.rstrip("\r\n")[:LINE_CHARS] for line in window]
        return []
