"""An Xid storm through `autorepair classify --collapse`, the mixed-log rate, and the probe's memory in the storm,
each beside the previous implementation, in one run.

    .venv/bin/python -m benchmarks.classify_storm [--quick] [--repeat 3] [--json FILE]   (repository root)

The previous implementation is HEAD's node_probe/classify/{kernel_log,policy,dedupe}.py (or --previous REV's), read
with `git show` at run time: loaded under other names in this process, or in place of the real modules in a child
process. New and previous runs alternate, so load on the machine hits both alike. Measures:
  1. the storm, 800,000 identical Xid 95 lines but for dmesg's uptime stamp (NVIDIA/NVSentinel#1120), as a file:
     `autorepair classify --collapse --format json FILE`, wall clock of the whole command, CLI start-up included,
     and its peak RSS. The previous `classify` had no --collapse; its equivalent is a process that imports the same
     `autorepair` command (the same start-up) and runs the previous parser, policy and burst collapse per record
     over the file (the probe's per-record step, as in probe_throughput.pipeline), printing the same findings;
  2. `autorepair classify` start-up alone, on an empty input;
  3. in-process lines/s for the storm and the mixed log (probe_throughput.mixed_lines: 3 % GPU fault records)
     through the probe's per-record pipeline (parse in 1 MiB chunks as the file source reads, policy, collapse,
     findings), new and previous, and through classify --collapse's path (collapse.sent_findings);
  4. the real Probe following the storm file (file source -> parse -> policy -> collapse -> spool -> a recording
     reporter), each run in a process of its own: seconds until every record was handled, and the peak RSS (VmHWM)
     of that process (the highest of the runs). Three import sets with the new code: the probe's modules alone (and
     the previous modules in their place, in the same set); `autorepair probe --ingest URL` as it starts
     (operator_cli/main.py's parser on those arguments, the probe's settings and logging, its ingest reporter built
     and one identity proof signed with stand-in credentials, nothing sent); and the same with every command's
     modules imported, as operator_cli/main.py imported them at start-up up to 819f1e7. Each set also without the
     storm (its imports alone).
Timings are the best of --repeat runs, with every run's seconds and their median. Results go to stdout as JSON;
benchmarks/RESULTS.md records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PREVIOUS_MODULES = ("kernel_log", "policy", "dedupe")
WINDOW = timedelta(minutes=5)  # the probe's default dedupe window


def previous_sources(rev: str) -> dict[str, str]:
    """The previous implementation's source of each module this work changed (read-only git)."""
    return {
        name: subprocess.run(
            ["git", "show", f"{rev}:node_probe/classify/{name}.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for name in PREVIOUS_MODULES
    }


def load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def load_previous(folder: Path, *, in_place: bool) -> dict[str, ModuleType]:
    """The previous modules from `folder`: under private names, or in place of node_probe.classify's own (before
    anything imports those)."""
    import node_probe.classify  # noqa: F401 - the package the in-place modules belong to

    prefix = "node_probe.classify." if in_place else "_previous_"
    return {name: load_module(prefix + name, folder / f"{name}.py") for name in PREVIOUS_MODULES}


# --- the per-record pipeline, with whichever modules -------------------------------------------------------------


def pipeline(data: Iterator[bytes], parser: Any, policy: Any, collapser: Any) -> dict[str, int]:
    """What Probe._consume_once does per record, minus the event loop, fed as the file source feeds
    (LineAssembler's split): parse, classify, collapse, build the findings that go out."""
    from node_probe.classify.findings import burst_rollup, dedupe_key, make_finding

    now = datetime.now(UTC)

    def finding(kept: Any) -> Any:
        return make_finding(kept[0], kept[1], instance_id="i-1", group="g", source="bench", observed_at=now)

    feed, classify, offer = parser.feed, policy.classify, collapser.offer
    partial = b""
    records = findings = 0
    for chunk in data:
        lines = (partial + chunk).split(b"\n")
        partial = lines.pop()
        for line in lines:
            for record in feed(line.decode("utf-8", "replace")):
                records += 1
                verdict = classify(record, now)
                if offer(dedupe_key(record, verdict), (record, verdict), now):
                    finding((record, verdict))
                    findings += 1
    rollups = [burst_rollup(finding(b.first), finding(b.last), b.suppressed, now) for b in collapser.flush()]
    return {"lines": parser.lines_seen, "records": records, "findings": findings, "rollups": len(rollups)}


def per_record(modules: dict[str, ModuleType]) -> Callable[[Iterator[bytes]], dict[str, int]]:
    def run(data: Iterator[bytes]) -> dict[str, int]:
        return pipeline(
            data,
            modules["kernel_log"].KernelLogParser(),
            modules["policy"].Policy("ecs"),
            modules["dedupe"].BurstCollapser(WINDOW),
        )

    return run


def collapse_path(lines: list[str]) -> dict[str, int]:
    """classify --collapse's path over the same log, as lines of a text file."""
    from node_probe.classify.collapse import sent_findings
    from node_probe.classify.policy import Policy

    sent = list(sent_findings(lines, Policy("ecs"), datetime.now(UTC), WINDOW))
    rollups = [s for s in sent if s.first_line is not None]
    return {
        "records": len(sent) - len(rollups) + sum(s.finding.count for s in rollups),
        "findings": len(sent) - len(rollups),
        "rollups": len(rollups),
    }


def rate(run: Callable[[Any], dict[str, int]], data: list[Any], lines: int) -> dict[str, Any]:
    """One timed run over data made before the clock starts: only the work is measured."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    counts = run(iter(data))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {**counts, "seconds": round(wall, 3), "cpu_seconds": round(cpu, 3), "lines_per_second": round(lines / wall)}


def best(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest run, with every run's seconds and their median: load on a shared machine swings single runs."""
    top = min(results, key=lambda r: r["seconds"])
    seconds = [r["seconds"] for r in results]
    return {**top, "all_seconds": seconds, "median_seconds": statistics.median(seconds)}


# --- child processes ------------------------------------------------------------------------------------------


def timed_child(argv: list[str], timeout: float | None = None) -> dict[str, Any]:
    """Run a command; its wall clock, CPU and peak RSS (from wait4: this child only), and its output. Past `timeout`
    seconds it is killed and this raises: a probe whose source keeps failing would otherwise wait for ever."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=err)
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG if timeout is not None else 0)
            if pid:
                break
            if timeout is not None and time.perf_counter() - started > timeout:
                proc.kill()
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{argv} failed ({proc.returncode}) after {wall:.0f}s: {stderr[-2000:]}")
        out.seek(0)
        output = out.read().decode()
    return {
        "seconds": round(wall, 3),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 3),
        "max_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "output": output,
    }


def findings_of(output: str) -> list[tuple[Any, ...]]:
    return [
        (r["kind"], r["code"], r["pci"], r["impairs"], r["reason"], r["count"])
        for r in map(json.loads, output.splitlines())
    ]


def child_previous_collapse(path: Path, folder: Path) -> None:
    """The previous implementation's equivalent of `classify --collapse`: the autorepair command's start-up, then
    the per-record pipeline of the previous modules, printing the findings as classify --collapse prints them."""
    from operator_cli.main import build_parser

    build_parser().parse_args(["classify", "--collapse", str(path)])  # the same start-up as `autorepair classify`
    from node_probe.classify.findings import burst_rollup, dedupe_key, make_finding

    old = load_previous(folder, in_place=False)
    parser, policy = old["kernel_log"].KernelLogParser(), old["policy"].Policy("ecs")
    bursts = old["dedupe"].BurstCollapser(WINDOW)
    now = datetime.now(UTC)

    def finding(kept: Any) -> Any:
        return make_finding(kept[0], kept[1], instance_id="-", group="-", source="classify", observed_at=now)

    rows = []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            for record in parser.feed(line):
                verdict = policy.classify(record, now)
                if bursts.offer(dedupe_key(record, verdict), (record, verdict), now):
                    rows.append(finding((record, verdict)))
    rows += [burst_rollup(finding(b.first), finding(b.last), b.suppressed, now) for b in bursts.flush()]
    for f in rows:
        row = {"kind": f.kind, "code": f.code, "pci": f.gpu.pci, "impairs": f.impairs, "reason": f.reason}
        sys.stdout.write(json.dumps({**row, "count": f.count}) + "\n")


# What operator_cli/main.py imported at start-up, whichever command ran, up to 819f1e7.
EVERY_COMMAND = (
    "ingest.cli",
    "node_probe.cli",
    "operator_cli.client",
    "operator_cli.describe",
    "operator_cli.fleet",
    "operator_cli.group",
    "operator_cli.history",
    "operator_cli.inject",
    "operator_cli.instance",
    "simulator.demo",
    "worker.commands",
    "worker.logging_setup",
    "worker.settings",
)
IMPORT_SETS = ("probe", "command", "every-command")
PROBE_TIMEOUT_S = 180.0  # the storm takes the probe seconds; a child past this is stuck, not slow


def start_as_autorepair_probe(every_command: bool) -> None:
    """What `autorepair probe --ingest URL` does before it reads a line, but connect: its arguments parsed by the
    command's own parser, its settings and logging, its ingest reporter, and one proof signed as for the first
    report (stand-in credentials: the credential chain's modules load, nothing is sent). `every_command`: first
    import every command's modules, as the command did at start-up up to 819f1e7."""
    if every_command:
        for name in EVERY_COMMAND:
            importlib.import_module(name)
    from node_probe import cli
    from node_probe.delivery.proof import ambient_credentials, sign_proof
    from operator_cli.main import build_parser
    from worker.logging_setup import configure_logging

    args = build_parser().parse_args(["probe", "--group", "bench", "--ingest", "https://ingest.invalid"])
    configure_logging(cli.ProbeSettings.load().log_format)
    reporter = cli.ingest_reporter(args)
    os.environ.update(AWS_ACCESS_KEY_ID="AKIDBENCH", AWS_SECRET_ACCESS_KEY="bench", AWS_EC2_METADATA_DISABLED="true")
    proof = sign_proof(
        b"{}",
        ingest_id=reporter.ingest_id,
        sts_endpoint=reporter.sts_endpoint,
        region=reporter.region,
        credentials=ambient_credentials(reporter.region),
    )
    assert proof


def child_probe(path: Path, lines: int, folder: Path | None, imports: str) -> None:
    """The real Probe following the storm file, with the new modules or the previous ones in their place, in a
    process with one of IMPORT_SETS. Nothing of node_probe may be imported before the swap: this module imports
    probe_throughput (which imports the probe) only in functions, for that reason."""
    if folder is not None:
        load_previous(folder, in_place=True)
    if imports != "probe":
        start_as_autorepair_probe(every_command=imports == "every-command")
    from benchmarks.probe_throughput import probe_end_to_end
    from node_probe.sources import base

    before = _vm("VmHWM")
    result = asyncio.run(probe_end_to_end(path, lines)) if lines else {}
    # Which parser the probe's sources ran: the previous one has no runs.
    parser = "new" if hasattr(sys.modules[base.KernelLogParser.__module__], "parse_runs") else "previous"
    heavy = {name: name in sys.modules for name in ("temporalio", "boto3", "botocore", "aiohttp", "grpc")}
    json.dump(
        {**result, "parser": parser, "rss_before_storm_mib": before, "peak_rss_mib": _vm("VmHWM"), "loaded": heavy},
        sys.stdout,
    )


def _vm(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


# --- the run --------------------------------------------------------------------------------------------------


def memory_and_load() -> dict[str, Any]:
    info: dict[str, Any] = {"load_average": [round(x, 2) for x in os.getloadavg()]}
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tenth of the lines, one repeat (a smoke test)")
    parser.add_argument("--repeat", type=int, default=3, help="best of N for each timing (default 3)")
    parser.add_argument("--previous", default="HEAD", metavar="REV", help="git revision of the previous code")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, *rest = args.child
        if mode == "previous-collapse":
            child_previous_collapse(Path(rest[0]), Path(rest[1]))
        else:  # probe FILE LINES FOLDER|- IMPORT_SET
            folder = None if rest[2] == "-" else Path(rest[2])
            child_probe(Path(rest[0]), int(rest[1]), folder, rest[3])
        return 0

    from benchmarks.probe_throughput import FLOOD_LINES, MIXED_LINES, chunks, flood_lines, machine, mixed_lines

    flood = FLOOD_LINES // 10 if args.quick else FLOOD_LINES
    mixed = MIXED_LINES // 10 if args.quick else MIXED_LINES
    repeat = 1 if args.quick else args.repeat
    results: dict[str, Any] = {
        "machine": {**machine(), "nproc": os.cpu_count(), **memory_and_load()},
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "previous": args.previous,
    }
    sources = previous_sources(args.previous)
    me = [sys.executable, "-m", "benchmarks.classify_storm", "--child"]
    cli = [str(Path(sys.executable).with_name("autorepair")), "classify"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "previous"
        folder.mkdir()
        for name, text in sources.items():
            (folder / f"{name}.py").write_text(text)
        storm, empty = Path(tmp) / "storm.log", Path(tmp) / "empty.log"
        with storm.open("w") as out:
            out.writelines(flood_lines(flood))
        empty.write_text("")

        new_cli, old_cli, startup = [], [], []
        for _ in range(repeat):
            startup.append(timed_child([*cli, "--format", "json", str(empty)]))
            new_cli.append(timed_child([*cli, "--collapse", "--format", "json", str(storm)]))
            old_cli.append(timed_child([*me, "previous-collapse", str(storm), str(folder)]))
        new_findings, old_findings = findings_of(new_cli[0]["output"]), findings_of(old_cli[0]["output"])
        for run in (*new_cli, *old_cli, *startup):
            del run["output"]
        results["storm_classify_collapse"] = {
            "lines": flood,
            "new": {**best(new_cli), "findings": new_findings},
            "previous": {**best(old_cli), "findings": old_findings},
            "same_findings": new_findings == old_findings,
        }
        results["cli_startup"] = best(startup)

        old = load_previous(folder, in_place=False)
        new = {name: importlib.import_module(f"node_probe.classify.{name}") for name in PREVIOUS_MODULES}
        for label, make, count in (("storm", flood_lines, flood), ("mixed_log", mixed_lines, mixed)):
            data, log_lines = list(chunks(make(count))), list(make(count))
            runs: dict[str, list[dict[str, Any]]] = {
                "new_per_record": [],
                "previous_per_record": [],
                "new_collapse": [],
            }
            for _ in range(repeat):
                runs["new_per_record"].append(rate(per_record(new), data, count))
                runs["previous_per_record"].append(rate(per_record(old), data, count))
                runs["new_collapse"].append(rate(collapse_path, log_lines, count))
            results[label] = {"lines": count, **{key: best(value) for key, value in runs.items()}}

        probe: dict[str, Any] = {"lines": flood}
        # The previous modules stand in only with the probe's own imports: the command imports classify's new path.
        kinds = {"new": ("-", "probe"), "previous": (str(folder), "probe")}
        kinds |= {"new_as_autorepair_probe": ("-", "command"), "new_with_every_command": ("-", "every-command")}
        probe_runs: dict[str, list[dict[str, Any]]] = {label: [] for label in kinds}
        for _ in range(repeat):
            for label, (previous, imports) in list(kinds.items()):
                try:
                    run = timed_child([*me, "probe", str(storm), str(flood), previous, imports], PROBE_TIMEOUT_S)
                except RuntimeError as exc:
                    if label != "previous":
                        raise
                    # The previous modules in place of the working tree's may no longer fit its sources.
                    probe["previous_failed"] = str(exc)[-600:]
                    del kinds[label]
                    continue
                probe_runs[label].append(json.loads(run["output"]))
        for label, probe_results in probe_runs.items():
            if probe_results:
                peak = max(r["peak_rss_mib"] for r in probe_results)
                probe[label] = {**best(probe_results), "peak_rss_mib": peak}
        for imports in IMPORT_SETS:
            probe[f"imports_only_{imports}"] = json.loads(
                timed_child([*me, "probe", str(storm), "0", "-", imports])["output"]
            )
        results["probe_storm"] = probe
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(results, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
