"""Where a running demo serves its Prometheus metrics: the worker's (Temporal's and ours) and the ingest's, each on a
port of its own, written to <state>/prometheus-targets.json in Prometheus' file_sd format.

A Prometheus given that file (`file_sd_configs`) scrapes the demo under the job names the shipped compose stack uses
(deploy/compose/prometheus.yml), so the Grafana dashboard (deploy/grafana/) and the alert rules read it as they read
a real deployment; tests/test_dashboard.py does exactly that.
"""

from __future__ import annotations

import json
from pathlib import Path

from contract.ingest import METRICS_PATH

TARGETS_FILE = "prometheus-targets.json"
# The compose stack's scrape jobs (deploy/compose/prometheus.yml).
WORKER_JOB = "gpu-autorepair-worker"
INGEST_JOB = "gpu-autorepair-ingest"


def metrics_url(address: str) -> str:
    return f"http://{address}{METRICS_PATH}"


def write_targets(state_dir: Path, *, worker: str, ingest: str) -> Path:
    """The file_sd file for the worker's and the ingest's HOST:PORT; replaced whole, so Prometheus never reads half."""
    path = state_dir / TARGETS_FILE
    groups = [
        {"targets": [worker], "labels": {"job": WORKER_JOB}},
        {"targets": [ingest], "labels": {"job": INGEST_JOB}},
    ]
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(groups, indent=2) + "\n")
    partial.replace(path)
    return path
