"""`autorepair classify` and the argument handling of `autorepair probe`."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from node_probe import cli
from node_probe.imds import ImdsError, imds_instance_id
from operator_cli import classify
from operator_cli.main import main

LOG = "\n".join(
    [
        "[ 1843.308145] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
        "[ 1843.308145] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
        "[ 1843.308200] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
        "Nov 22 15:39:14 host kernel: NVRM: Xid (PCI:0000:17:00): 13, pid=77, name=train.py, Graphics Exception",
        "[ 1900.000001] NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. "
        "RST: Yes, D-RST: No",
        "[ 1900.000002] NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. "
        "RST: Yes, D-RST: No",
        "kernel: nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
        "Nov 22 15:39:14 host python3[99]: NVRM: Xid (PCI:0000:01:00): 79, quoted by an application",
        "NVRM: Xid (PCI:0018:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
    ]
)


def classify_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    classify.add_classify_arguments(parser)
    return parser.parse_args(list(argv))


def json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def test_classify_json_prints_every_record_without_deduplication(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "kern.log"
    log.write_text(LOG)
    assert classify.run_classify(classify_args(str(log), "--format", "json")) == 0
    rows = json_lines(capsys.readouterr().out)
    assert [(r["line"], r["kind"], r["code"], r["pci"], r["impairs"], r["reason"]) for r in rows] == [
        (2, "xid", 79, "0000:3b:00", True, "XID_79"),
        (3, "gpu_fallen_off_bus", None, "0000:3b:00", True, "GPU_FALLEN_OFF_BUS"),
        (4, "xid", 13, "0000:17:00", False, "XID_13"),
        (5, "xid", 95, "0000:c1:00", True, "XID_95"),
        (6, "xid", 95, "0000:c1:00", True, "XID_95"),
        (7, "sxid", 20034, "0000:c5:00.0", False, "SXID_20034"),
        (9, "xid", 154, "0018:01:00", False, "XID_154"),
    ]
    assert rows[0]["message"] == "GPU has fallen off the bus."
    assert rows[0]["rule"] == "ecs:xid-list"
    assert rows[0]["pid"] == 1234 and rows[0]["process_name"] == "python3"
    assert rows[-1]["recovery_action_to"] == "Node Reboot Required"


def test_classify_nvidia_catalog_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "kern.log"
    log.write_text(LOG)
    assert classify.run_classify(classify_args(str(log), "--format", "json", "--policy", "nvidia-catalog")) == 0
    rows = json_lines(capsys.readouterr().out)
    by_line = {r["line"]: r for r in rows}
    assert by_line[9]["impairs"] is True
    assert by_line[9]["rule"] == "nvidia-catalog:xid154-action-node"
    assert by_line[4]["rule"] == "nvidia-catalog:bucket-RESTART_APP"


def test_classify_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(LOG))
    assert classify.run_classify(argparse.Namespace(file=None, policy="ecs", output="jsonl")) == 0
    assert len(json_lines(capsys.readouterr().out)) == 7


def test_classify_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    log = tmp_path / "kern.log"
    log.write_text(LOG)
    assert classify.run_classify(classify_args(str(log))) == 0
    out = capsys.readouterr().out
    assert "XID_79" in out and "SXID_20034" in out and "7 records, 4 impairing" in out


def test_classify_with_policy_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "kern.log"
    log.write_text(LOG)
    overrides = tmp_path / "policy.json"
    overrides.write_text(json.dumps({"add_xids": [13], "remove_xids": [95]}))
    args = classify_args(str(log), "--format", "json", "--policy-config", str(overrides))
    assert classify.run_classify(args) == 0
    rows = {r["line"]: r for r in json_lines(capsys.readouterr().out)}
    assert (rows[4]["impairs"], rows[4]["rule"]) == (True, "override:add xid13")
    assert (rows[5]["impairs"], rows[5]["rule"]) == (False, "override:remove xid95")


def test_classify_missing_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.log"
    assert classify.run_classify(classify_args(str(missing), "--format", "json")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"autorepair classify: {missing}: no such file\n"


def test_classify_bad_policy_config_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "kern.log"
    log.write_text(LOG)
    bad = tmp_path / "policy.json"
    bad.write_text('{"add_xids": "lots"}')
    assert classify.run_classify(classify_args(str(log), "--policy-config", str(bad))) == 2
    assert capsys.readouterr().err.startswith(f"autorepair classify: {bad}: invalid policy config")


def test_classify_tolerates_invalid_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "kern.log"
    log.write_bytes(b"\xff\xfe garbage\nNVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus. \xff\n")
    assert classify.run_classify(classify_args(str(log), "--format", "json")) == 0
    assert [r["code"] for r in json_lines(capsys.readouterr().out)] == [79]


def test_classify_collapse_prints_what_the_probe_would_send(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    storm = [
        f"[{2000 + n / 1000:12.6f}] NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, "
        "Uncontained: FBHUB. RST: Yes, D-RST: No"
        for n in range(1, 1001)
    ]
    log = tmp_path / "kern.log"
    log.write_text(LOG + "\n" + "\n".join(storm) + "\n")
    assert classify.run_classify(classify_args(str(log), "--collapse", "--format", "json")) == 0
    rows = json_lines(capsys.readouterr().out)
    assert [(r["line"], r["kind"], r["code"], r["impairs"], r["count"], r["rollup"]) for r in rows] == [
        (2, "xid", 79, True, 1, False),
        (3, "gpu_fallen_off_bus", None, True, 1, False),
        (4, "xid", 13, False, 1, False),
        (5, "xid", 95, True, 1, False),
        (7, "sxid", 20034, False, 1, False),
        (9, "xid", 154, False, 1, False),
        (1009, "xid", 95, True, 1001, True),  # line 6 and the storm, after line 5 went out on its own
    ]
    rollup = rows[-1]
    assert rollup["first_line"] == 5 and rollup["raw"] == storm[-1] and rollup["reason"] == "XID_95"
    assert rows[0]["raw"] == LOG.splitlines()[1] and rows[0]["pci"] == "0000:3b:00"


def test_classify_collapse_applies_repeat_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The third Xid 13 within the window impairs: it goes out on its own (impairs is part of the burst key)."""
    log = tmp_path / "kern.log"
    log.write_text(
        "".join(f"[{100 + n}.000000] NVRM: Xid (PCI:0000:17:00): 13, pid=1, name=x, Graphics\n" for n in range(6))
    )
    rules = tmp_path / "policy.json"
    rules.write_text(json.dumps({"repeat": [{"code": 13, "count": 3, "within": 600}]}))
    args = classify_args(str(log), "--collapse", "--format", "json", "--policy-config", str(rules))
    assert classify.run_classify(args) == 0
    rows = json_lines(capsys.readouterr().out)
    assert [(r["line"], r["impairs"], r["count"], r["rollup"], r["rule"]) for r in rows] == [
        (1, False, 1, False, "ecs:not-in-xid-list"),
        (3, True, 1, False, "override:repeat xid13 3/600s"),
        (2, False, 1, True, "ecs:not-in-xid-list"),
        (6, True, 3, True, "override:repeat xid13 3/600s"),
    ]


def test_classify_collapse_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    log = tmp_path / "kern.log"
    log.write_text(LOG)
    assert classify.run_classify(classify_args(str(log), "--collapse")) == 0
    out = capsys.readouterr().out
    assert "5..6" in out and "+1 (roll-up)" in out
    assert "7 findings for 7 records: 6 first of a burst (3 impairing), 1 roll-up" in out


def test_classify_collapse_through_the_autorepair_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "kern.log"
    log.write_text(LOG)
    assert main(["classify", "--collapse", "--format", "json", str(log)]) == 0
    assert len(json_lines(capsys.readouterr().out)) == 7


# --- probe arguments --------------------------------------------------------------------------------


def probe_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_probe_arguments(parser)
    return parser.parse_args(list(argv))


async def test_build_probe_from_arguments(tmp_path: Path) -> None:
    args = probe_args(
        "--instance-id", "i-0abc", "--group", "gpu-a", "--kernel-log", str(tmp_path / "kern.log"),
        "--temporal-address", "127.0.0.1:1", "--task-queue", "q2", "--heartbeat-interval", "5",
        "--spool-dir", str(tmp_path / "spool"), "--policy", "nvidia-catalog", "--direct-temporal",
    )  # fmt: skip
    probe = await cli.build_probe(args)
    config = probe.config
    assert (config.instance_id, config.group, config.task_queue, config.policy) == (
        "i-0abc",
        "gpu-a",
        "q2",
        "nvidia-catalog",
    )
    assert config.kernel_log == tmp_path / "kern.log" and not config.kmsg
    assert config.heartbeat_interval == timedelta(seconds=5)
    assert config.spool_dir == tmp_path / "spool"


async def test_probe_defaults_to_kmsg(tmp_path: Path) -> None:
    args = probe_args("--instance-id", "i-1", "--group", "g", "--spool-dir", str(tmp_path), "--direct-temporal")
    probe = await cli.build_probe(args)
    assert probe.config.kmsg and probe.config.kernel_log is None
    # DCGM is on by default: without dcgmi it is "not configured" and counts once DCGM is installed, no restart.
    assert probe.config.dcgm is True


async def test_probe_without_instance_id_uses_imds_or_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_imds() -> str:
        raise ImdsError("EC2 instance metadata (IMDSv2) at http://169.254.169.254 unavailable: timed out")

    monkeypatch.setattr(cli, "imds_instance_id", no_imds)
    assert await cli.run_probe_command(probe_args("--group", "g", "--direct-temporal")) == 2
    err = capsys.readouterr().err
    assert err.startswith("autorepair probe: no --instance-id given") and "IMDSv2" in err
    assert err.count("\n") == 1

    monkeypatch.setattr(cli, "imds_instance_id", lambda: "i-from-imds")
    probe = await cli.build_probe(probe_args("--group", "g", "--spool-dir", str(tmp_path), "--direct-temporal"))
    assert probe.config.instance_id == "i-from-imds"


def test_imds_lookup_fails_fast_without_a_metadata_service() -> None:
    with pytest.raises(ImdsError, match="IMDSv2"):
        imds_instance_id(endpoint="http://127.0.0.1:9", timeout=0.5)


# --- probe flags and settings: one line, exit status 2 ------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [
        ("--heartbeat-interval", "0", "must be at least 1 and at most 28800 seconds, not 0"),
        ("--heartbeat-interval", "-1", "must be at least 1 and at most 28800 seconds, not -1"),
        ("--heartbeat-interval", "0.001", "must be at least 1 and at most 28800 seconds, not 0.001"),
        ("--heartbeat-interval", "inf", "must be at least 1 and at most 28800 seconds, not inf"),
        ("--heartbeat-interval", "28801", "must be at least 1 and at most 28800 seconds, not 28801"),
        ("--heartbeat-interval", "soon", "'soon' is not a number of seconds"),
        ("--dedupe-window", "0", "must be more than 0 and at most 86400 seconds, not 0"),
        ("--dedupe-window", "-1", "must be more than 0 and at most 86400 seconds, not -1"),
        ("--dedupe-window", "nan", "must be more than 0 and at most 86400 seconds, not nan"),
    ],
)
def test_bad_probe_flag_is_one_line_and_exit_2(
    flag: str, value: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["probe", "--group", "g", "--instance-id", "i-1", flag, value])
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"autorepair probe: error: argument {flag}: {problem} (see autorepair probe --help)\n")


def test_probe_flags_at_their_bounds_are_accepted() -> None:
    args = probe_args("--group", "g", "--heartbeat-interval", "1", "--dedupe-window", "0.5")
    assert (args.heartbeat_interval, args.dedupe_window) == (1.0, 0.5)
    args = probe_args("--group", "g", "--heartbeat-interval", "28800", "--dedupe-window", "86400")
    assert (args.heartbeat_interval, args.dedupe_window) == (28800.0, 86400.0)
    assert (probe_args("--group", "g").heartbeat_interval, probe_args("--group", "g").dedupe_window) == (60.0, 300.0)


def test_the_real_probe_refuses_a_zero_heartbeat_interval_at_once() -> None:
    """It used to make thousands of attempts a second against a refusing server; now it never starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOREPAIR_")}
    result = subprocess.run(
        [sys.executable, "-m", "operator_cli.main", "probe", "--group", "g", "--instance-id", "i-1",
         "--temporal-address", "127.0.0.1:1", "--heartbeat-interval", "0"],
        cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "argument --heartbeat-interval: must be at least 1" in result.stderr


async def test_probe_with_a_bad_settings_file_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "autorepair.toml"
    # The worker's tables are not the probe's to judge; a typo inside [temporal] is.
    config.write_text('[temporal]\nadress = "t:7233"\n\n[[groups]]\nname = "g"\ncluster = "c"\nnewer_key = 1\n')
    monkeypatch.setenv("AUTOREPAIR_CONFIG", str(config))
    args = probe_args(
        "--instance-id", "i-1", "--group", "g", "--spool-dir", str(tmp_path / "spool"), "--direct-temporal"
    )  # fmt: skip
    assert await cli.run_probe_command(args) == 2
    assert capsys.readouterr().err == (
        f"autorepair probe: invalid configuration: {config}: temporal.adress: unknown key: did you mean address?\n"
    )
    config.write_text('[temporal]\naddress = "127.0.0.1:1"\n\n[[groups]]\nname = "g"\ncluster = "c"\nnewer_key = 1\n')
    assert (await cli.build_probe(args)).config.group == "g"


# --- where the probe reports: the ingest, or Temporal directly in a trusted lab -------------------------------------


async def test_the_probe_refuses_to_start_without_saying_where_it_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = probe_args("--instance-id", "i-1", "--group", "g", "--spool-dir", str(tmp_path))
    assert await cli.run_probe_command(args) == 2
    assert capsys.readouterr().err == (
        "autorepair probe: say where findings go: --ingest URL, or --direct-temporal (trusted lab only)\n"
    )
    with pytest.raises(SystemExit):
        probe_args("--group", "g", "--ingest", "https://ingest.example", "--direct-temporal")


async def test_the_probe_reports_through_the_ingest_when_told(tmp_path: Path) -> None:
    from node_probe.delivery.ingest_reporter import IngestReporter

    args = probe_args(
        "--instance-id", "i-1", "--group", "g", "--spool-dir", str(tmp_path), "--ingest", "https://ingest.example:8480",
        "--region", "eu-west-1",
    )  # fmt: skip
    probe = await cli.build_probe(args)
    reporter = probe._reporter
    assert isinstance(reporter, IngestReporter)
    assert (reporter.url, reporter.region, reporter.sts_endpoint) == (
        "https://ingest.example:8480",
        "eu-west-1",
        "https://sts.eu-west-1.amazonaws.com",
    )
    # Plain HTTP would carry the proofs readable across the network: only to a loopback address.
    args = probe_args("--instance-id", "i-1", "--group", "g", "--ingest", "http://ingest.example")
    with pytest.raises(cli.CliError, match="plain http only to a loopback address"):
        await cli.build_probe(args)


def test_direct_temporal_is_labelled_trusted_lab_only() -> None:
    parser = argparse.ArgumentParser()
    cli.add_probe_arguments(parser)
    assert "trusted lab only" in " ".join(parser.format_help().split())
