"""The alert rules that ship (deploy/prometheus/autorepair-alerts.yml): promtool accepts them, their unit tests pass
(each alert fires when it should and not otherwise), the Kubernetes PrometheusRule carries the same groups, the compose
Prometheus loads them, and every series they read is one something of ours exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy/prometheus/autorepair-alerts.yml"
RULE_TESTS = ROOT / "deploy/prometheus/autorepair-alerts.test.yml"
PROMTOOL = shutil.which("promtool")
# Where the series come from: our code names them, the Temporal SDK's are documented in docs/operations.md §5.
SOURCES = ("workflows", "activities", "worker", "ingest", "node_probe")


def rules() -> dict[str, Any]:
    loaded = yaml.safe_load(RULES.read_text())
    assert isinstance(loaded, dict)
    return loaded


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None, "promtool is missing: `make test` installs Debian's prometheus package"
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120, cwd=RULES.parent)


def test_promtool_accepts_the_rules() -> None:
    checked = promtool("check", "rules", RULES.name)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rules()['groups'])} rules found" in checked.stdout


def test_each_alert_fires_when_it_should_and_not_otherwise() -> None:
    tested = promtool("test", "rules", RULE_TESTS.name)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # Every alert has a case that sees it fire.
    cases = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {t["alertname"] for case in cases for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert fired == {r["alert"] for g in rules()["groups"] for r in g["rules"]}


def test_a_broken_rule_is_caught(tmp_path: Path) -> None:
    broken = RULES.read_text().replace("max by (group) (autorepair_repairs_held) > 0", "max by (group (", 1)
    (tmp_path / RULES.name).write_text(broken)
    checked = subprocess.run([str(PROMTOOL), "check", "rules", RULES.name], capture_output=True, cwd=tmp_path)
    assert checked.returncode != 0


def test_the_prometheus_rule_carries_the_same_groups() -> None:
    resource = yaml.safe_load((ROOT / "deploy/kubernetes/prometheusrule.yaml").read_text())
    assert (resource["apiVersion"], resource["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert resource["spec"] == rules()


def test_the_compose_prometheus_loads_the_rules() -> None:
    config = yaml.safe_load((ROOT / "deploy/compose/prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "deploy/compose/compose.yaml").read_text())
    [loaded] = config["rule_files"]
    mounts = compose["services"]["prometheus"]["volumes"]
    assert f"../prometheus/{RULES.name}:{loaded}:ro" in mounts


@pytest.mark.parametrize("rule", [r for g in rules()["groups"] for r in g["rules"]], ids=lambda r: r["alert"])
def test_every_series_a_rule_reads_is_exported(rule: dict[str, Any]) -> None:
    code = "\n".join(p.read_text() for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))
    docs = (ROOT / "docs/operations.md").read_text()
    for name in set(re.findall(r"\b((?:autorepair|temporal)_[a-z_]+)\b", rule["expr"])):
        where = docs if name.startswith("temporal_") else code
        # The worker's counters are named without the _total its exporter appends (worker/telemetry.py); the
        # ingest's and the probe's are named with it.
        named = name in where or (name.endswith("_total") and f'"{name.removesuffix("_total")}"' in where)
        assert named, f"{rule['alert']} reads {name}: nothing exports it"
    assert rule["labels"]["severity"] in ("page", "ticket") and rule["annotations"]["summary"]
