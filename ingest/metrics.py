"""The ingest's counters, served on GET /metrics in Prometheus' text format (written by hand: the probe-side image
carries no prometheus_client, and three counter families need no library)."""

from __future__ import annotations

import threading
from collections import Counter

_FAMILIES = {
    "autorepair_ingest_reports_accepted_total": "Reports that passed every check (identity, membership, rate).",
    "autorepair_ingest_reports_relayed_total": "Reports signalled to the instance's health workflow in Temporal.",
    "autorepair_ingest_reports_refused_total": "Refused, by HTTP status and reason kind (none reached Temporal).",
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class IngestMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()

    def _inc(self, family: str, **labels: str) -> None:
        with self._lock:
            self._counts[(family, tuple(sorted(labels.items())))] += 1

    def accepted(self, kind: str) -> None:
        self._inc("autorepair_ingest_reports_accepted_total", kind=kind)

    def relayed(self, kind: str) -> None:
        self._inc("autorepair_ingest_reports_relayed_total", kind=kind)

    def refused(self, status: int, reason: str) -> None:
        self._inc("autorepair_ingest_reports_refused_total", status=str(status), reason=reason)

    def value(self, family: str, **labels: str) -> int:
        with self._lock:
            return self._counts[(family, tuple(sorted(labels.items())))]

    def render(self) -> str:
        with self._lock:
            counts = dict(self._counts)
        lines: list[str] = []
        for family, help_text in _FAMILIES.items():
            lines.append(f"# HELP {family} {help_text}")
            lines.append(f"# TYPE {family} counter")
            for (name, labels), count in sorted(counts.items()):
                if name != family:
                    continue
                rendered = ",".join(f'{key}="{_escape(value)}"' for key, value in labels)
                lines.append(f"{family}{{{rendered}}} {count}")
        return "\n".join(lines) + "\n"
