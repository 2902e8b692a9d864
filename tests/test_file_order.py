"""The order test files start in when they run side by side (tests/file_order.py): the longest first, files not yet
measured before them, each file's tests in their own order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from tests import conftest
from tests.file_order import SECONDS_FILE, longest_first, measured_seconds, seconds_from_junit

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.test_demo" name="test_a" time="40.5" />
<testcase classname="tests.test_demo" name="test_b" time="19.5" />
<testcase classname="tests.test_breaker.TestHold" name="test_c" time="3.5" />
<testcase classname="tests.test_breaker" name="test_d" time="1.0" />
<testcase classname="benchmarks.scale" name="test_e" time="9.0" />
</testsuite></testsuites>"""


def test_seconds_are_summed_per_test_file_classes_included() -> None:
    assert seconds_from_junit(JUNIT) == {"test_breaker.py": 4.5, "test_demo.py": 60.0}


def test_unmeasured_files_go_first_then_the_longest() -> None:
    seconds = {"test_a.py": 5.0, "test_b.py": 300.0, "test_c.py": 40.0}
    files = ["test_a.py", "test_new.py", "test_b.py", "test_c.py", "test_newer.py"]
    assert longest_first(files, seconds) == ["test_new.py", "test_newer.py", "test_b.py", "test_c.py", "test_a.py"]


@dataclass
class FakeItem:
    path: Path
    name: str


def test_the_collection_is_sorted_by_file_and_keeps_each_file_s_own_order() -> None:
    seconds = measured_seconds()
    short, long = sorted(seconds, key=seconds.__getitem__)[0], max(seconds, key=seconds.__getitem__)
    items = [
        FakeItem(Path("tests") / short, "first"),
        FakeItem(Path("tests") / "test_not_measured_yet.py", "new"),
        FakeItem(Path("tests") / long, "one"),
        FakeItem(Path("tests") / short, "second"),
        FakeItem(Path("tests") / long, "two"),
    ]
    conftest.pytest_collection_modifyitems(cast(list[pytest.Item], cast(Any, items)))
    assert [(item.path.name, item.name) for item in items] == [
        ("test_not_measured_yet.py", "new"),
        (long, "one"),
        (long, "two"),
        (short, "first"),
        (short, "second"),
    ]


def test_the_measurements_name_test_files_of_this_suite() -> None:
    here = {path.name for path in SECONDS_FILE.parent.glob("test_*.py")}
    assert set(measured_seconds()) <= here, (
        "file_seconds.json names a file that is gone: remove it or refresh (file_order.py)"
    )
