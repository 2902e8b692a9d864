"""The breaker property test's benchmark profile: 1,000 schedules instead of CI's 100, with the same code.

    .venv/bin/python -m benchmarks.breaker_property [--examples N] [--seed S] [--shrink] [--json FILE]

Each schedule runs through tests/test_breaker_property.py's harness (time-skipping test server, the real
DrainSemaphoreWorkflow under the worker's SANDBOX runner, stub activities and stub repairs) and is checked by the
same properties. Unlike the pytest run, a failing schedule does not stop the run: every failure is recorded with
its schedule and the properties it broke, and the next schedule runs (`--shrink` instead lets hypothesis stop at the
first failure and shrink it to a minimal schedule). A markdown summary goes to stdout; benchmarks/BREAKER_PROPERTY.md
records a run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import hypothesis
import temporalio
from hypothesis import HealthCheck, Phase, given, settings
from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter

from benchmarks.probe_throughput import machine
from tests.test_breaker_property import (
    ExampleReport,
    Schedule,
    breaker_harness,
    schedules,
)


@dataclass
class Failure:
    index: int
    schedule: str
    problems: str


@dataclass
class Results:
    started: str
    examples: int = 0
    seconds: float = 0.0
    slowest: list[tuple[float, str]] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    totals: Counter[str] = field(default_factory=Counter)
    sizes: list[int] = field(default_factory=list)
    steps: Counter[str] = field(default_factory=Counter)


def count(results: Results, schedule: Schedule, report: ExampleReport | None) -> None:
    results.sizes.append(schedule.size)
    results.steps.update(type(step).__name__ for step in schedule.steps)
    if report is None:
        return
    totals = results.totals
    totals["grants"] += report.grants
    totals["schedules with grants"] += report.grants > 0
    totals["schedules held"] += bool(report.holds)
    for cause, holds in report.holds.items():
        totals[f"holds: {cause}"] += holds
    totals["resumes"] += report.resumes
    totals["resumes refused (nothing held)"] += report.refused_resumes
    totals["repairs discarded"] += report.discarded
    totals["fleet hold notices"] += report.fleet_holds
    totals["grants with impairments over the rule not yet counted"] += report.late_reports
    totals["worker restarts"] += report.restarts
    totals["replays after a restart"] += report.replays
    totals["semaphore history events"] += report.semaphore_events


def run(examples: int, seed: int | None, shrink: bool) -> Results:
    results = Results(started=datetime.now(UTC).isoformat(timespec="seconds"))
    begun = time.monotonic()
    with breaker_harness() as harness:

        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=seed is None,
            database=None,
            # Without --shrink the property never fails (failures are recorded), so shrinking has nothing to do.
            phases=[Phase.explicit, Phase.generate, Phase.shrink] if shrink else [Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(schedule=schedules())
        def each(schedule: Schedule) -> None:
            results.examples += 1
            started = time.monotonic()
            report: ExampleReport | None = None
            try:
                report = harness.run(schedule)
            except AssertionError as err:
                results.failures.append(Failure(results.examples, repr(schedule), str(err)))
                print(f"schedule {results.examples} FAILED: {schedule!r}\n{err}", file=sys.stderr, flush=True)
                if shrink:
                    raise
            finally:
                took = time.monotonic() - started
                results.slowest = sorted([*results.slowest, (took, repr(schedule))], reverse=True)[:3]
                count(results, schedule, report)
                if results.examples % 50 == 0:
                    print(
                        f"{results.examples} schedules, {time.monotonic() - begun:.0f} s", file=sys.stderr, flush=True
                    )

        if seed is not None:
            each = hypothesis.seed(seed)(each)
        try:
            each()
        except Exception as err:  # --shrink: hypothesis's minimal failing schedule, already printed by it
            results.failures.append(Failure(results.examples, "shrunk, see stderr", f"{type(err).__name__}: {err}"))
    results.seconds = time.monotonic() - begun
    return results


def markdown(results: Results, command: str) -> str:
    host = machine()
    memory = ""
    with open("/proc/meminfo", encoding="utf-8") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                memory = f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    load = " / ".join(f"{value:.1f}" for value in os.getloadavg())
    lines = [
        f"## Run of {results.started}",
        "",
        f"`{command}`",
        "",
        f"Machine: {host['cpus']} CPUs ({host['cpu_model'] or 'model not disclosed'}), {memory} RAM, Linux "
        f"{host['kernel']}, CPython {platform.python_version()}, temporalio {temporalio.__version__}; load average "
        f"at the end {load}.",
        "",
        f"- **{results.examples} schedules** in **{results.seconds:.0f} s** "
        f"({results.seconds / max(results.examples, 1):.2f} s each on average).",
        f"- **Failures: {len(results.failures)}**" + ("" if not results.failures else " (below)."),
        f"- Groups of {min(results.sizes, default=0)} to {max(results.sizes, default=0)} instances; steps drawn: "
        + ", ".join(f"{kind} {n}" for kind, n in results.steps.most_common())
        + ".",
        "- What the schedules exercised: "
        + ", ".join(f"{name} {value}" for name, value in sorted(results.totals.items()))
        + ".",
        "- Slowest: " + "; ".join(f"{took:.1f} s `{schedule}`" for took, schedule in results.slowest) + ".",
    ]
    for failure in results.failures:
        lines += ["", f"Failure at schedule {failure.index}: `{failure.schedule}`", "", "```", failure.problems, "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1000, help="schedules to run (default 1000)")
    parser.add_argument("--seed", type=int, default=None, help="draw at random from this seed (default: derandomized)")
    parser.add_argument("--shrink", action="store_true", help="stop at the first failure and shrink it")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    # Stopped with SIGTERM, the harness still shuts its test server down (on its way out of the with block).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # The semaphore logs every trip and resume at WARNING, and the SDK's core each new worker's view of the test
    # server: thousands of lines that say nothing here (and the core's go to stdout, into the summary).
    logging.getLogger("temporalio").setLevel(logging.ERROR)
    quiet = LoggingConfig(filter=TelemetryFilter(core_level="ERROR", other_level="ERROR"))
    Runtime.set_default(Runtime(telemetry=TelemetryConfig(logging=quiet)), error_if_already_set=False)
    results = run(args.examples, args.seed, args.shrink)
    command = " ".join([".venv/bin/python -m benchmarks.breaker_property", *sys.argv[1:]])
    print(markdown(results, command))
    if args.json:
        data: dict[str, Any] = asdict(results)
        args.json.write_text(json.dumps(data, indent=2, default=str))
    return 1 if results.failures else 0


if __name__ == "__main__":
    sys.exit(main())
