"""The ingest's metrics, through prometheus-client, served on a port of their own (`ingest.metrics_bind`,
ingest/cli.py) and never on the port the GPU hosts reach.

One registry per Ingest rather than prometheus-client's global one: a test process runs several ingests, and each
must count only its own reports. Counters end in `_total`, as the worker's and the probe's do.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

REQUESTS = "autorepair_ingest_requests_total"
ACCEPTED = "autorepair_ingest_reports_accepted_total"
RELAYED = "autorepair_ingest_reports_relayed_total"
REFUSED = "autorepair_ingest_reports_refused_total"
IDENTITY_CACHE = "autorepair_ingest_identity_cache_total"
REPORT_DURATION = "autorepair_ingest_report_duration_seconds"
RELAY_DURATION = "autorepair_ingest_relay_duration_seconds"

# A `<name>_created` series beside every counter and histogram doubles the series for a start time that
# process_start_time_seconds already says; the ingest's process serves no other prometheus-client metrics.
prometheus_client.disable_created_metrics()

# From 5 ms (a session token, a cached membership) to 10 s (STS's 5 s timeout, Temporal slow to answer).
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class IngestMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            REQUESTS,
            "Reports answered, by kind (finding, heartbeat) and HTTP status (202 relayed, else refused)",
            ["kind", "code"],
            registry=self.registry,
        )
        self._accepted = Counter(
            ACCEPTED, "Reports that passed every check (identity, membership, rate)", ["kind"], registry=self.registry
        )
        self._relayed = Counter(
            RELAYED, "Reports signalled to the instance's health workflow in Temporal", ["kind"], registry=self.registry
        )
        self._refused = Counter(
            REFUSED,
            "Refused, by HTTP status and reason kind (none reached Temporal)",
            ["status", "reason"],
            registry=self.registry,
        )
        self._identity = Counter(
            IDENTITY_CACHE,
            "Reports by how their sender was known: hit, a session token (no STS call); miss, a proof sent to STS",
            ["result"],
            registry=self.registry,
        )
        self._report_seconds = Histogram(
            REPORT_DURATION,
            "A report's handling, from its request to the answer, by kind and outcome (relayed, refused)",
            ["kind", "outcome"],
            buckets=_SECONDS,
            registry=self.registry,
        )
        self._relay_seconds = Histogram(
            RELAY_DURATION,
            "The relay of an accepted report to Temporal, by kind (failed relays included)",
            ["kind"],
            buckets=_SECONDS,
            registry=self.registry,
        )

    def accepted(self, kind: str) -> None:
        self._accepted.labels(kind=kind).inc()

    def relayed(self, kind: str) -> None:
        self._relayed.labels(kind=kind).inc()

    def refused(self, status: int, reason: str) -> None:
        self._refused.labels(status=str(status), reason=reason).inc()

    def identity(self, *, cached: bool) -> None:
        self._identity.labels(result="hit" if cached else "miss").inc()

    def answered(self, kind: str, status: int, seconds: float) -> None:
        self._requests.labels(kind=kind, code=str(status)).inc()
        outcome = "relayed" if status == 202 else "refused"
        self._report_seconds.labels(kind=kind, outcome=outcome).observe(seconds)

    def relay_took(self, kind: str, seconds: float) -> None:
        self._relay_seconds.labels(kind=kind).observe(seconds)

    def value(self, name: str, **labels: str) -> float:
        """One sample's value as a scrape would read it (0 for a series not there yet): for the tests and the log."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
