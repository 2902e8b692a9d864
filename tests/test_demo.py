"""`autorepair demo` as an operator runs it: its own Temporal dev server and moto server, the flags as documented."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path

from simulator.events import read_events
from simulator.servers import free_port


async def run_demo(tmp_path: Path, *flags: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "operator_cli.main",
        "demo",
        "--state-dir",
        str(tmp_path / "state"),
        "--events",
        str(tmp_path / "events.jsonl"),
        "--temporal-port",
        str(free_port()),
        "--ui-port",
        str(free_port()),
        "--moto-port",
        str(free_port()),
        # Not the default 8480: tests run side by side, and another may hold it.
        "--ingest-port",
        str(free_port()),
        "--time-limit",
        "240",
        "--exit",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_demo_until_repaired_heals_faults_and_heartbeat_loss_but_not_blips(tmp_path: Path) -> None:
    code, output = await run_demo(
        tmp_path,
        "--instances",
        "6",
        "--faults",
        "2",
        "--heartbeat-loss",
        "1",
        "--blips",
        "1",
        "--seed",
        "5",
        "--until-repaired",
    )
    assert code == 0, output[-3000:]
    # Six instances: one repair at a time (below 9 instances the cap is 1), three in turn.
    assert "drain cap: at most 1 draining at once, cap 1" in output, output[-3000:]
    events = read_events(tmp_path / "events.jsonl")
    counts = Counter(e["type"] for e in events)
    assert counts["RepairStarted"] == 3 and counts["RepairCompleted"] == 3 and counts["Terminated"] == 3
    # Each repair kept its evidence first, the host's kernel log and bug report included.
    stored = [e for e in events if e["type"] == "EvidenceStored"]
    assert len(stored) == 3 and all(e["complete"] and e["evidence"].startswith("s3://") for e in stored)
    reasons = sorted(e["reason"].split(" ")[0] for e in events if e["type"] == "RepairStarted")
    assert reasons[0] == "Agent" and all(r.startswith("XID_") for r in reasons[1:])
    for event in events:
        assert event["time"].endswith("Z") and event["group"] and event["instance_id"].startswith("i-")


async def test_demo_disabled_impairs_and_replaces_nothing(tmp_path: Path) -> None:
    code, output = await run_demo(
        tmp_path, "--instances", "4", "--faults", "2", "--auto-repair", "DISABLED", "--until-repaired"
    )
    assert code == 0, output[-3000:]
    events = read_events(tmp_path / "events.jsonl")
    assert {e["type"] for e in events} == {"HealthChanged"}
    assert len({e["instance_id"] for e in events if e["overall_status"] == "IMPAIRED"}) == 2


async def test_demo_rejects_bad_flags_with_one_clear_line(tmp_path: Path) -> None:
    code, output = await run_demo(tmp_path, "--instances", "3", "--faults", "5")
    assert code == 2
    assert "Traceback" not in output
    assert "--faults" in output
