"""The rooms stay one role each: imports point down, the product never imports tests/, files stay readable.

Read from the source with ast, so a lazy import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A guard against god files, not a splitter: a module is split where a seam is, long before it reaches this.
MAX_LINES = 800

# What each product folder may import of ours. Everything sits on the contract; the worker, the ingest, the operator
# CLI and the simulator sit on top; workflows may call activities by their typed methods, never the reverse. The
# ingest relays the probe's own signals (node_probe.delivery.reporter) and reads the worker's settings.
ALLOWED: dict[str, set[str]] = {
    "contract": set(),
    "activities": {"contract"},
    "workflows": {"contract", "activities"},
    "node_probe": {"contract"},
    "worker": {"contract", "activities", "workflows"},
    "ingest": {"contract", "worker", "node_probe"},
    "simulator": {"contract", "activities", "workflows", "worker", "node_probe", "ingest"},
    "operator_cli": {"contract", "activities", "workflows", "worker", "node_probe", "simulator", "ingest"},
}
OURS = {*ALLOWED, "tests", "benchmarks"}


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _imported_tops(path: Path) -> set[str]:
    tops: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            tops |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            tops.add(node.module.split(".")[0])
    return tops & OURS


def test_every_product_folder_is_known() -> None:
    folders = {
        d.name
        for d in ROOT.iterdir()
        if d.is_dir() and (d / "__init__.py").exists() and d.name not in {"tests", "benchmarks"}
    }
    assert folders == set(ALLOWED), "a new product folder needs its place in ALLOWED (and in README's layout)"


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_down(folder: str) -> None:
    wrong = {
        f"{path.relative_to(ROOT)} imports {top}"
        for path in _sources(folder)
        for top in _imported_tops(path) - ALLOWED[folder] - {folder}
    }
    assert not wrong, sorted(wrong)


def test_benchmarks_import_only_the_product() -> None:
    wrong = [str(p.relative_to(ROOT)) for p in _sources("benchmarks") if "tests" in _imported_tops(p)]
    assert not wrong


def test_no_product_file_is_over_the_limit() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for folder in ALLOWED
        for path in _sources(folder)
        if (lines := path.read_text(encoding="utf-8").count("\n")) > MAX_LINES
    }
    assert not long, long


def test_no_test_file_is_over_the_limit() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for path in _sources("tests")
        if (lines := path.read_text(encoding="utf-8").count("\n")) > MAX_LINES
    }
    assert not long, long


def test_the_autorepair_command_runs_without_the_simulator() -> None:
    """A privileged probe image need not ship the demo's simulated fleet: with `simulator` unimportable, every
    other command is still there."""
    code = (
        'import sys; sys.modules["simulator"] = None\n'
        "from operator_cli.main import build_parser\n"
        "parser = build_parser()\n"
        "print(parser.format_usage().replace('\\n', ' '))\n"
        'parser.parse_args(["probe", "--help"])\n'
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
    usage = result.stdout.splitlines()[0]
    assert "probe" in usage and "worker" in usage and "demo" not in usage
    assert "usage: autorepair probe" in result.stdout


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, modules: set[str]) -> set[str]:
    """Our modules `path` imports, under TYPE_CHECKING and inside functions too: a cycle is a cycle to a reader."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                if child in modules:
                    found.add(child)
                elif node.module in modules:
                    found.add(node.module)
    return found


def test_no_import_cycle_among_product_files() -> None:
    paths = {_module_name(p): p for folder in ALLOWED for p in _sources(folder)}
    graph = {name: _imported_modules(path, set(paths)) - {name} for name, path in paths.items()}
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycles.append([*trail[trail.index(name) :], name])
            return
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, [" -> ".join(cycle) for cycle in cycles]


# Public despite the underscore: the namedtuple API, and os._exit (a process's exit without cleanup).
PUBLIC_UNDERSCORED = {"_replace", "_fields", "_asdict", "_make", "_exit"}


def _reaches(path: Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in PUBLIC_UNDERSCORED
        and not (isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"})
        and not (isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super")
    ]


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_no_code_reaches_into_another_objects_private_members(folder: str) -> None:
    """`other._member` couples a module to another's insides, which a rename breaks silently: steps take what they
    need (a context object, a plain model's public methods). Only its own `self._member` is its own business."""
    reaches = [reach for path in _sources(folder) for reach in _reaches(path)]
    assert not reaches, reaches
