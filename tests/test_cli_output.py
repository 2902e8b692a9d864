"""The operator's output conventions (issue 26): `-o text|json|jsonl|wide` on every command that prints results (the
older `--json` and classify's `--format` kept), describe-instances answered like `aws ecs
describe-container-instances`, the exit codes as README.md lists them, shell completion, a progress bar only on a
terminal's stderr, and `--profile` choosing the temporal CLI's profile. Against the real dev server and a simulated
fleet, as tests/test_ops_cli.py runs the commands."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from operator_cli import exit_codes, output
from operator_cli.main import main
from simulator.servers import free_port
from tests.fleet import simulated_fleet
from tests.harness import eventually
from tests.test_ops_cli import assert_one_clear_line, autorepair, cli_env, described_instances
from tests.test_probe_cli import LOG
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
UNKNOWN = "i-0000000000000000f"


def wide_env(settings: Settings) -> dict[str, str]:
    # Wider than cli_env: the wide tables' headers stay on one line each.
    return cli_env(settings) | {"COLUMNS": "1000"}


def json_lines(text: str) -> list[Any]:
    lines = text.splitlines()
    assert lines and all(line.strip() for line in lines), text
    return [json.loads(line) for line in lines]


def header_cells(out: str, title: str) -> list[str]:
    """The column headers of the table titled `title` in rich's output (its header row is drawn with ┃)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if title in line)
    header = next(line for line in lines[start:] if "┃" in line)
    return [cell.strip() for cell in header.strip().strip("┃").split("┃")]


async def answers(settings: Settings, *args: str) -> dict[str, str]:
    """The command's stdout under each -o (and under the older --json), every one exiting 0."""
    said: dict[str, str] = {}
    for mode in (*output.Output, "--json"):
        flags = ["--json"] if mode == "--json" else ["-o", str(mode)]
        code, out, err = await autorepair(wide_env(settings), *args, *flags)
        assert code == exit_codes.OK, (args, mode, err)
        said[str(mode)] = out
    # --json is -o json (times like lastHeard move between two calls: the shape is compared).
    document, older = json.loads(said["json"]), json.loads(said["--json"])
    assert type(document) is type(older)
    assert set(document) == set(older) if isinstance(document, dict) else len(document) == len(older)
    return said


async def test_every_command_that_prints_results_answers_in_each_output(
    client: Client, aws_env: str, tmp_path: Path
) -> None:
    async with simulated_fleet(client, aws_env, tmp_path, instances=2) as fleet:
        await fleet.all_healthy(2)
        settings, group = fleet.settings, fleet.group
        warned, faulty = fleet.sim.live_instances()
        await eventually(lambda: described_instances(settings, "--group", group), lambda e: len(e) == 2)

        # inject: a finding's table, and its document.
        said = await answers(settings, "inject", "--instance", warned, "--group", group, "--xid", "13")
        assert json.loads(said["json"])["findings"][0]["reason"] == "XID_13"
        [line] = json_lines(said["jsonl"])
        assert line["workflowId"] == f"health/{warned}"
        assert len(header_cells(said["wide"], "Injected into")) > len(header_cells(said["text"], "Injected into"))
        code, _, err = await autorepair(
            wide_env(settings), "inject", "--instance", faulty, "--group", group, "--xid", "79"
        )
        assert code == exit_codes.OK, err
        await fleet.repairs_finished(1)

        # describe-instances: ECS's shape; a line per instance; wide has the columns text leaves out.
        said = await answers(settings, "describe-instances", "--group", group)
        document = json.loads(said["json"])
        assert set(document) == {"containerInstances", "failures"} and document["failures"] == []
        ids = sorted(e["ec2InstanceId"] for e in document["containerInstances"])
        assert sorted(line["ec2InstanceId"] for line in json_lines(said["jsonl"])) == ids
        text, wide = header_cells(said["text"], "Instance health"), header_cells(said["wide"], "Instance health")
        assert wide[: len(text)] == text and len(wide) > len(text) and "Web UI" in wide

        # history: the repair, a line per repair, and its record's other fields in the wide table.
        said = await eventually(
            lambda: answers(settings, "history", "--group", group),
            lambda s: '"Completed"' in s["json"],
        )
        [record] = json.loads(said["json"])
        assert record["instanceId"] == faulty
        [line] = json_lines(said["jsonl"])
        assert line["workflowId"] == record["workflowId"] and set(line) == set(record)
        text, wide = header_cells(said["text"], "Repairs"), header_cells(said["wide"], "Repairs")
        assert wide[: len(text)] == text and {"workflow id", "run id", "error"} <= set(wide) - set(text)

        # group describe and update, fleet describe, an instance control: one document each, a line in jsonl.
        said = await answers(settings, "group", "describe", "--name", group)
        assert json.loads(said["json"])["name"] == group and json_lines(said["jsonl"])[0]["name"] == group
        text, wide = header_cells(said["text"], "Capacity group"), header_cells(said["wide"], "Capacity group")
        assert len(wide) > len(text) and "default" in wide
        code, out, err = await autorepair(
            wide_env(settings), "group", "update", "--name", group, "--max-draining-percent", "40", "-o", "jsonl"
        )
        assert code == exit_codes.OK, err
        [line] = json_lines(out)
        assert line["overrides"] == {"max_draining_percent": 40}
        said = await answers(settings, "fleet", "describe")
        assert json_lines(said["jsonl"]) == [json.loads(said["json"])]
        code, out, err = await autorepair(
            wide_env(settings), "instance", "exclude", "--instance", warned, "--reason", "maintenance", "-o", "jsonl"
        )
        assert code == exit_codes.OK, err
        [line] = json_lines(out)
        assert line["ec2InstanceId"] == warned and line["action"] == "exclude"

        # Unknown instances are failures in ECS's shape, not an error: exit 0, as the aws CLI does.
        code, out, err = await autorepair(
            wide_env(settings), "describe-instances", "--instance", warned, "--instance", UNKNOWN, "-o", "json"
        )
        assert code == exit_codes.OK, err
        answer = json.loads(out)
        assert [e["ec2InstanceId"] for e in answer["containerInstances"]] == [warned]
        [failure] = answer["failures"]
        assert set(failure) == {"arn", "reason", "detail"}
        assert (failure["arn"], failure["reason"]) == (UNKNOWN, "MISSING") and "no such workflow" in failure["detail"]
        code, out, err = await autorepair(wide_env(settings), "describe-instances", "--instance", UNKNOWN)
        assert code == exit_codes.OK, err
        assert f"{UNKNOWN}: MISSING: no such workflow" in out
        code, out, err = await autorepair(
            wide_env(settings), "describe-instances", "--instance", UNKNOWN, "-o", "jsonl"
        )
        assert code == exit_codes.OK and json_lines(out) == [failure], (out, err)


def test_classify_in_each_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")
    log = tmp_path / "kern.log"
    log.write_text(LOG)
    said: dict[str, str] = {}
    for flags in (["-o", "json"], ["-o", "jsonl"], ["-o", "text"], ["-o", "wide"], ["--format", "json"], []):
        assert main(["classify", str(log), *flags]) == exit_codes.OK
        said[" ".join(flags)] = capsys.readouterr().out
    rows = json.loads(said["-o json"])
    assert isinstance(rows, list) and len(rows) == 7
    # The older --format json was a line per record, and stays so: the same as -o jsonl.
    assert json_lines(said["-o jsonl"]) == json_lines(said["--format json"]) == rows
    assert said["-o text"] == said[""]
    text, wide = header_cells(said["-o text"], "GPU fault records"), header_cells(said["-o wide"], "GPU fault records")
    assert wide[: len(text)] == text and len(wide) > len(text)
    # A collapsed log too: the findings' GPU fields and raw lines are what wide adds.
    assert main(["classify", str(log), "--collapse", "-o", "jsonl"]) == exit_codes.OK
    assert len(json_lines(capsys.readouterr().out)) == 7


@contextlib.contextmanager
def endpoint(status: int) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"status": "ok" if status == 200 else "unhealthy", "reason": "told to"}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/healthz"
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_is_silent_as_text_and_says_its_verdict_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    with endpoint(200) as url:
        assert main(["healthcheck", url]) == exit_codes.OK
        assert capsys.readouterr().out == ""
        assert main(["healthcheck", url, "-o", "json"]) == exit_codes.OK
        assert json.loads(capsys.readouterr().out) == {"url": url, "healthy": True, "detail": f"{url}: ok"}
    with endpoint(503) as url:
        assert main(["healthcheck", url, "-o", "jsonl"]) == exit_codes.FAILED
        captured = capsys.readouterr()
        [line] = json_lines(captured.out)
        assert line == {"url": url, "healthy": False, "detail": f"{url} answered 503: told to"}
        assert captured.err == f"autorepair healthcheck: {url} answered 503: told to\n"


def test_completion_scripts_name_every_command_subcommand_and_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["completion", "bash"]) == exit_codes.OK
    script = capsys.readouterr().out
    subcommands = re.search(r"^_shtab_autorepair_subparsers=\((.*)\)$", script, re.MULTILINE)
    assert subcommands is not None, script[:2000]
    assert {"describe-instances", "history", "group", "instance", "classify", "completion"} <= set(
        subcommands.group(1).split()
    )
    # Arguments every command adds only when it is parsed (CommandParser): completion sees them all.
    describe = re.search(r"^_shtab_autorepair_describe_instances_option_strings=\((.*)\)$", script, re.MULTILINE)
    assert describe is not None
    assert {"--group", "--status", "-o", "--output", "--json", "--profile", "--address"} <= set(
        describe.group(1).split()
    )
    assert re.search(r"^_shtab_autorepair_group_subparsers=\(describe update\)$", script, re.MULTILINE)
    assert "--max-draining-percent" in script and "--collapse" in script
    for shell in ("zsh", "tcsh"):
        assert main(["completion", shell]) == exit_codes.OK
        other = capsys.readouterr().out
        # tcsh lists the long flags without their leading dashes.
        assert "describe-instances" in other and "max-draining-percent" in other and "profile" in other
    with pytest.raises(SystemExit) as exited:
        main(["completion", "fish"])
    assert exited.value.code == exit_codes.USAGE


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal_s_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    stdout, piped, terminal = io.StringIO(), io.StringIO(), _Terminal()
    monkeypatch.setattr("sys.stdout", stdout)
    for stderr in (piped, terminal):
        monkeypatch.setattr("sys.stderr", stderr)
        with output.progress("describing instances", 3) as advance:
            for _ in range(3):
                advance()
    assert piped.getvalue() == "" and stdout.getvalue() == ""
    assert "describing instances" in terminal.getvalue() and "3/3" in terminal.getvalue()


def test_readme_lists_every_exit_code() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    listed = {int(code) for code in re.findall(r"^\| `(\d+)` \|", section, re.MULTILINE)}
    named = {value for name, value in vars(exit_codes).items() if name.isupper() and isinstance(value, int)}
    assert listed == named


async def test_profile_picks_the_temporal_toml_profile_flag_first(client: Client, tmp_path: Path) -> None:
    config = tmp_path / "temporal.toml"
    nowhere = f"127.0.0.1:{free_port()}"
    config.write_text(
        f'[profile.dev]\naddress = "{client.service_client.config.target_host}"\nnamespace = "{client.namespace}"\n'
        f'[profile.elsewhere]\naddress = "{nowhere}"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOREPAIR_TEMPORAL__", "TEMPORAL_"))}
    env.pop("AUTOREPAIR_CONFIG", None)
    env |= {"TEMPORAL_CONFIG_FILE": str(config), "TEMPORAL_PROFILE": "elsewhere"}
    # TEMPORAL_PROFILE alone: the elsewhere profile, where nothing listens.
    code, _, err = await autorepair(env, "history", "-o", "json")
    assert code == exit_codes.UNREACHABLE and f"cannot reach Temporal at {nowhere}" in err, err
    # --profile wins over TEMPORAL_PROFILE: that server's repairs (none), not a failure to connect.
    code, out, err = await autorepair(env, "history", "--profile", "dev", "-o", "json")
    assert code == exit_codes.OK, err
    assert isinstance(json.loads(out), list)
    # ... and --address over the profile.
    code, _, err = await autorepair(env, "history", "--profile", "dev", "--address", nowhere, "-o", "json")
    assert code == exit_codes.UNREACHABLE and f"cannot reach Temporal at {nowhere}" in err, err
    # The flag is read in place of the variable, never after it: a TEMPORAL_PROFILE that names no profile is not read.
    code, out, err = await autorepair(env | {"TEMPORAL_PROFILE": "gone"}, "history", "--profile", "dev", "-o", "json")
    assert code == exit_codes.OK and isinstance(json.loads(out), list), err
    # A profile that is not there: one line, and fix the command.
    code, _, err = await autorepair(env, "history", "--profile", "nope")
    assert code == exit_codes.USAGE, err
    assert_one_clear_line(err)
    assert "Profile 'nope' not found" in err
