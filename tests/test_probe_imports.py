"""`autorepair probe` carries only the probe's modules: not temporalio (the worker's and the operator's Temporal
client, and the direct lab path) nor boto3/botocore (the ingest's client), which cost a GPU host tens of MiB it
needs during an Xid storm (benchmarks/RESULTS.md). Each check runs in a fresh interpreter, since this one has
imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("temporalio", "boto3", "botocore")


def loaded_after(code: str, modules: tuple[str, ...] = HEAVY) -> dict[str, bool]:
    """Which of `modules` a fresh interpreter has loaded after running `code`."""
    script = f"{code}\nimport json, sys\nprint(json.dumps({{m: m in sys.modules for m in {modules!r}}}))\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    loaded: dict[str, bool] = json.loads(result.stdout.splitlines()[-1])
    return loaded


NONE_LOADED = dict.fromkeys(HEAVY, False)


@pytest.mark.parametrize(
    "argv",
    [
        ["probe", "--group", "g", "--ingest", "https://ingest.example"],
        ["probe", "--group", "g", "--direct-temporal"],
        ["probe-report", "--ingest", "https://ingest.example", "--group", "g", "--xid", "79"],
        ["classify", "--collapse"],
        ["probe", "--group", "g", "--ingest", "https://ingest.example", "--health-bind", "127.0.0.1:8482"],
        # What a container's health check runs every few seconds, on a GPU host too.
        ["healthcheck", "http://127.0.0.1:8482/healthz"],
    ],
)
def test_parsing_a_probe_side_command_loads_no_temporal_or_aws_client(argv: list[str]) -> None:
    code = f"from operator_cli.main import build_parser\nargs = build_parser().parse_args({argv!r})\nassert args.run"
    assert loaded_after(code) == NONE_LOADED


def test_the_probe_help_loads_no_temporal_or_aws_client() -> None:
    code = (
        "import contextlib, io\n"
        "from operator_cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
        "    main(['probe', '--help'])\n"
        "assert '--dcgm-power-limit' in out.getvalue(), out.getvalue()\n"
    )
    assert loaded_after(code) == NONE_LOADED


def test_the_probe_and_its_sources_load_no_temporal_or_aws_client() -> None:
    assert loaded_after("import node_probe.probe, node_probe.cli, node_probe.health") == NONE_LOADED


def test_prometheus_client_is_loaded_only_by_a_probe_that_serves_metrics() -> None:
    """--metrics-bind is off by default: a probe that serves no metrics does not carry prometheus_client."""
    prometheus = ("prometheus_client",)
    assert loaded_after("import node_probe.probe, node_probe.cli, node_probe.health", prometheus) == {
        "prometheus_client": False
    }
    assert loaded_after("import node_probe.metrics", prometheus) == {"prometheus_client": True}


def test_an_operator_command_still_gets_its_temporal_client() -> None:
    """The other side of laziness: a command's modules do load when it is the one parsed."""
    code = "from operator_cli.main import build_parser\nbuild_parser().parse_args(['describe-instances'])"
    assert loaded_after(code)["temporalio"]


def test_the_probe_flags_default_ingest_id_is_the_ingest_reporters() -> None:
    from node_probe import cli
    from node_probe.delivery.ingest_reporter import DEFAULT_INGEST_ID

    assert cli.DEFAULT_INGEST_ID == DEFAULT_INGEST_ID
