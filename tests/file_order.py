"""The order `make test` starts test files in when they run side by side: the longest first.

pytest-xdist's `--dist loadfile` hands each worker one file at a time, in the collection's order, and by default
first reorders the files by how many tests each holds: the unit-test files with hundreds of quick cases went first
and the end-to-end files (a few tests, minutes each) last, where they ran alone while the other workers idled. With
`--no-loadscope-reorder` the collection's order is kept, and conftest sorts it by each file's measured seconds
(`file_seconds.json`), longest first: the greedy order that leaves the shortest tail. A file not yet measured goes
first (it may be long; if not, it is over quickly).

Refresh the measurements from a full run's JUnit XML (the seconds each file's tests took, as `make test` runs them):

    make test PYTEST_ARGS="-n 5 --dist loadfile --no-loadscope-reorder --junitxml=/tmp/junit.xml"
    .venv/bin/python -m tests.file_order /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

SECONDS_FILE = Path(__file__).with_name("file_seconds.json")


def measured_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """Each test file's name and the seconds its tests took in the run measured last."""
    return {str(name): float(seconds) for name, seconds in json.loads(path.read_text()).items()}


def longest_first(files: Sequence[str], seconds: dict[str, float]) -> list[str]:
    """`files` (names), those not measured first in their given order, then the measured ones longest first."""
    unmeasured = [name for name in files if name not in seconds]
    measured = sorted((name for name in files if name in seconds), key=lambda name: -seconds[name])
    return unmeasured + measured


def seconds_from_junit(xml: str) -> dict[str, float]:
    """Seconds per test file from JUnit XML whose test cases are named `tests.<module>[.<class>]`."""
    totals: defaultdict[str, float] = defaultdict(float)
    for case in ET.fromstring(xml).iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        if len(parts) >= 2 and parts[0] == "tests":
            totals[f"{parts[1]}.py"] += float(case.get("time") or 0)
    return {name: round(totals[name], 1) for name in sorted(totals)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.file_order JUNIT_XML", file=sys.stderr)
        return 2
    seconds = seconds_from_junit(Path(argv[0]).read_text())
    if not seconds:
        print(f"{argv[0]}: no test cases named tests.<module>", file=sys.stderr)
        return 1
    SECONDS_FILE.write_text(json.dumps(seconds, indent=1) + "\n")
    print(f"{SECONDS_FILE}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
