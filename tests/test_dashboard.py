"""The Grafana dashboard (deploy/grafana/) and the alert rules (deploy/prometheus/) against a real Prometheus (Debian's
`prometheus` package) scraping a running `autorepair demo`: the worker's and the ingest's metrics ports, found through
the file_sd file the demo writes (simulator/demo_metrics.py).

Grafana cannot run here, so every panel's query is run as Grafana would send it, its template variables filled in,
and must return data once the events it counts have happened: a repair (the demo's fault) and a refused report (an
unsigned one, sent here). The alert rules are the shipped file, loaded by that Prometheus; one alert is seen not to
fire while its condition is false and to fire once a breaker holds repairs.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from contract.ingest import HEARTBEATS_PATH
from contract.probe import Heartbeat
from simulator.demo import DEMO_GROUP
from simulator.demo_metrics import INGEST_JOB, TARGETS_FILE, WORKER_JOB
from simulator.events import group_events, repaired_instances
from simulator.servers import free_port
from tests.harness import eventually

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy/grafana/dashboards/gpu-autorepair.json"
PROVISIONING = ROOT / "deploy/grafana/provisioning"
RULES = ROOT / "deploy/prometheus/autorepair-alerts.yml"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"

# Grafana's built-in variables, as Grafana fills them for a Prometheus that scrapes every second (as this one does):
# $__rate_interval is max(4 x scrape interval, step + scrape interval); $__range is the time picker's span. The
# dashboard's own variables take their "All" value.
SCRAPE_INTERVAL = "1s"
BUILT_IN = {"__rate_interval": "30s", "__interval": "5s", "__range": "10m"}
# The alert seen firing: AutorepairRepairsHeld waits `for: 1m` in the shipped file; the copy loaded here waits 5s, so
# the test need not wait a minute. Its expression, labels and everything else are the shipped rule's.
HELD_ALERT = "AutorepairRepairsHeld"
HELD_FOR = "5s"
DEMO_INSTANCES = 4


def dashboard() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text())
    assert isinstance(loaded, dict)
    return loaded


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel with queries, those inside collapsed rows included."""
    found = []
    for panel in board["panels"]:
        found += [panel, *panel.get("panels", [])]
    return [p for p in found if p.get("targets")]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`$name`, `${name}` and `[[name]]` replaced as Grafana does; an unknown variable fails the test."""

    def value(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        assert name in variables, f"unknown variable {name!r} in {expr}"
        return variables[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", value, expr)


def variables(board: dict[str, Any]) -> dict[str, str]:
    filled = dict(BUILT_IN)
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            assert variable["includeAll"] and variable.get("allValue"), variable["name"]
            filled[variable["name"]] = variable["allValue"]
    return filled


# --- the dashboard file on its own ------------------------------------------------------------------------------


def test_the_dashboard_is_a_current_grafana_dashboard_on_a_prometheus_datasource_variable() -> None:
    board = dashboard()
    assert board["uid"] == "gpu-autorepair" and board["schemaVersion"] >= 39
    by_name = {v["name"]: v for v in board["templating"]["list"]}
    assert by_name["datasource"]["type"] == "datasource" and by_name["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what it shows and what to do"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    # Each panel is described in the operations guide.
    guide = (ROOT / "docs/operations.md").read_text()
    for panel in panels(board):
        assert f"**{panel['title']}**" in guide, f"{panel['title']} not described in docs/operations.md"


def test_the_provisioning_points_grafana_at_the_dashboard_and_prometheus() -> None:
    (provider,) = yaml.safe_load((PROVISIONING / "dashboards/gpu-autorepair.yml").read_text())["providers"]
    (datasource,) = yaml.safe_load((PROVISIONING / "datasources/prometheus.yml").read_text())["datasources"]
    compose = yaml.safe_load((ROOT / "deploy/compose/compose.yaml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in grafana["volumes"]}
    # The provider's folder is where compose mounts deploy/grafana/dashboards; the datasource is compose's Prometheus.
    assert (ROOT / "deploy/compose" / mounts[provider["options"]["path"]] / DASHBOARD.name).is_file()
    assert (datasource["type"], datasource["url"]) == ("prometheus", "http://prometheus:9090")
    assert "prometheus" in compose["services"] and datasource["isDefault"]


# --- against a real Prometheus scraping a running demo ------------------------------------------------------------


@dataclass
class Running:
    temporal: str
    ingest: str
    prometheus: str
    events: Path
    log: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result, now. Blocking: run it in a thread."""
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        answer = _get(url)
        assert answer["status"] == "success", answer
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = _get(f"{self.prometheus}/api/v1/alerts")["data"]["alerts"]
        return alerts

    def rule(self, name: str) -> dict[str, Any]:
        groups = _get(f"{self.prometheus}/api/v1/rules?type=alert")["data"]["groups"]
        (rule,) = [r for g in groups for r in g["rules"] if r["name"] == name]
        return dict(rule)

    async def repaired(self) -> list[str]:
        """Once the demo's fault is repaired: a repair, its permit and its phases counted by the worker."""
        return await eventually(
            lambda: asyncio.to_thread(repaired_instances, self.events, DEMO_GROUP), bool, within=150, every=1
        )


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        loaded = json.loads(response.read())
        assert isinstance(loaded, dict)
        return loaded


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def rules_with_a_short_wait(path: Path) -> Path:
    """The shipped rules, with HELD_ALERT waiting HELD_FOR instead of its `for:` (stated at the top)."""
    loaded = yaml.safe_load(RULES.read_text())
    (held,) = [r for g in loaded["groups"] for r in g["rules"] if r.get("alert") == HELD_ALERT]
    held["for"] = HELD_FOR
    path.write_text(yaml.safe_dump(loaded, sort_keys=False))
    return path


def prometheus_config(state: Path, rules: Path) -> dict[str, Any]:
    """The compose stack's worker and ingest jobs, their targets from the demo's file_sd file."""
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [str(rules)],
        "scrape_configs": [{"job_name": "gpu-autorepair", "file_sd_configs": [{"files": [str(state / TARGETS_FILE)]}]}],
    }


async def _stop(proc: asyncio.subprocess.Process, within: float) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)  # the demo ends in order: sim, worker, ingest, servers
        try:
            await asyncio.wait_for(proc.wait(), timeout=within)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@pytest.fixture(scope="module")
async def running(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    """`autorepair demo` (four instances, one Xid fault) left running, and a Prometheus scraping it from before the
    fault: a counter first seen at 1 would read as no increase."""
    assert Path(PROMETHEUS).is_file(), "prometheus is missing: `make test` installs Debian's prometheus package"
    tmp = tmp_path_factory.mktemp("dashboard")
    state, temporal_port, ingest_port = tmp / "state", free_port(), free_port()
    demo_log, prometheus_log = tmp / "demo.log", tmp / "prometheus.log"
    with demo_log.open("wb") as demo_out, prometheus_log.open("wb") as prometheus_out:
        demo = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "operator_cli.main", "demo", "--state-dir", str(state), "--events", str(tmp / "events.jsonl")),
            *("--instances", str(DEMO_INSTANCES), "--faults", "1", "--seed", "3", "--time-limit", "280"),
            *("--temporal-port", str(temporal_port), "--ui-port", str(free_port())),
            *("--moto-port", str(free_port()), "--ingest-port", str(ingest_port), "--sim-port", str(free_port())),
            stdout=demo_out,
            stderr=asyncio.subprocess.STDOUT,
        )
        prometheus: asyncio.subprocess.Process | None = None
        try:
            targets = state / TARGETS_FILE
            await eventually(lambda: asyncio.to_thread(targets.is_file), bool, within=90, every=0.5)
            rules = rules_with_a_short_wait(tmp / "rules.yml")
            (tmp / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(state, rules)))
            port = free_port()
            prometheus = await asyncio.create_subprocess_exec(
                PROMETHEUS,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                stdout=prometheus_out,
                stderr=asyncio.subprocess.STDOUT,
            )
            url = f"http://127.0.0.1:{port}"
            await eventually(lambda: asyncio.to_thread(_ready, f"{url}/-/ready"), bool, within=30)
            yield Running(
                temporal=f"127.0.0.1:{temporal_port}",
                ingest=f"http://127.0.0.1:{ingest_port}",
                prometheus=url,
                events=tmp / "events.jsonl",
                log=demo_log,
            )
        finally:
            if prometheus is not None:
                await _stop(prometheus, 10)
            await _stop(demo, 60)


async def send_unsigned_heartbeat(ingest: str, instance_id: str) -> int:
    """A heartbeat without the signed proof of its instance, as from a host without credentials: refused."""
    body = Heartbeat(instance_id=instance_id, group=DEMO_GROUP, sent_at=datetime.now(UTC)).model_dump_json()
    request = urllib.request.Request(
        f"{ingest}{HEARTBEATS_PATH}", data=body.encode(), headers={"Content-Type": "application/json"}, method="POST"
    )

    def send() -> int:
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return int(response.status)
        except urllib.error.HTTPError as err:
            return err.code

    return await asyncio.to_thread(send)


async def test_every_panel_query_returns_data_from_a_running_demo(running: Running) -> None:
    [repaired] = await running.repaired()
    assert await send_unsigned_heartbeat(running.ingest, repaired) == 401
    board = dashboard()
    filled = variables(board)
    # Scraped under the compose stack's job names, so a query or rule written for the stack reads the demo alike.
    jobs = {s["metric"]["job"] for s in await asyncio.to_thread(running.query, "up == 1")}
    assert jobs == {WORKER_JOB, INGEST_JOB}

    queries = [
        (panel["title"], substitute(target["expr"], filled)) for panel in panels(board) for target in panel["targets"]
    ]
    assert len(queries) >= 20
    empty: dict[str, str] = {}
    deadline = time.monotonic() + 60
    for title, expr in queries:
        while not await asyncio.to_thread(running.query, expr):
            if time.monotonic() > deadline:
                empty[title] = expr
                break
            await asyncio.sleep(1)
    assert not empty, f"panels without data: {json.dumps(empty, indent=2)}"

    # A few whose value is known: every instance counted once (the repaired one gone, its replacement there), the
    # permit handed back (a repair the alert test holds has none), the refusal counted.
    def value(expr: str) -> float:
        (sample,) = running.query(substitute(expr, filled))
        return float(sample["value"][1])

    instances = 'sum(max by (group) (sum without (health_status) (autorepair_instances{group=~"$group"})))'
    assert await eventually(lambda: asyncio.to_thread(value, instances), lambda v: v == DEMO_INSTANCES, within=60)
    assert await asyncio.to_thread(value, "sum(autorepair_ingest_reports_refused_total)") >= 1
    assert await asyncio.to_thread(value, 'sum(max by (group) (autorepair_drain_permits_in_use{group=~"$group"}))') == 0


async def test_a_breaker_holding_repairs_fires_its_alert_and_nothing_fires_it_before(running: Running) -> None:
    [repaired] = await running.repaired()
    # The breaker's gauge is there at 0 (the semaphore granted the demo's permit), and the rule has read it.
    await eventually(
        lambda: asyncio.to_thread(running.query, f'autorepair_repairs_held{{group="{DEMO_GROUP}"}} == 0'), bool
    )
    evaluated = await eventually(
        lambda: asyncio.to_thread(running.rule, HELD_ALERT), lambda r: r["health"] == "ok" and r["lastEvaluation"]
    )
    await asyncio.sleep(2 * _seconds(HELD_FOR))  # longer than its `for:`: a pending alert would be firing by now
    assert running.rule(HELD_ALERT)["state"] == "inactive", evaluated
    assert not [a for a in running.alerts() if a["labels"]["alertname"] == HELD_ALERT]

    # Hold repairs: a budget of one repair a day (the demo's used it), then a second instance faults.
    healthy = sorted(
        {e["instance_id"] for e in group_events(running.events, DEMO_GROUP, "HealthChanged")}
        - {e["instance_id"] for e in group_events(running.events, DEMO_GROUP, "RepairStarted")}
    )
    for command in (
        ["group", "update", "--name", DEMO_GROUP, "--max-repairs-per-day", "1"],
        ["inject", "--instance", healthy[0], "--group", DEMO_GROUP, "--xid", "79"],
    ):
        await autorepair(*command, "--address", running.temporal)
    await eventually(
        lambda: asyncio.to_thread(group_events, running.events, DEMO_GROUP, "RepairsHeld"), bool, within=60
    )

    firing = await eventually(
        lambda: asyncio.to_thread(running.alerts),
        lambda alerts: any(a["labels"]["alertname"] == HELD_ALERT and a["state"] == "firing" for a in alerts),
        within=60,
    )
    (alert,) = [a for a in firing if a["labels"]["alertname"] == HELD_ALERT]
    assert alert["labels"]["group"] == DEMO_GROUP and alert["labels"]["severity"] == "page"
    assert DEMO_GROUP in alert["annotations"]["summary"]
    assert repaired not in healthy


def _seconds(duration: str) -> float:
    assert duration.endswith("s")
    return float(duration[:-1])


async def autorepair(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "operator_cli.main",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, out.decode()
    return out.decode()
