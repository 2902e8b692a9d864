"""The plain models the worker passes through the workflow sandbox (worker/main.py PLAIN_MODELS) are the workflows/
modules without Temporal in them, and everything of ours they import is passed through too: a class loaded both
inside and outside the sandbox would be two classes (a Rejected raised outside, not caught inside)."""

from __future__ import annotations

import ast
from pathlib import Path

from worker.main import PLAIN_MODELS

ROOT = Path(__file__).resolve().parent.parent
PASSED_THROUGH_PACKAGES = ("contract", "activities")
# Decodes signals for the models and logs through the workflow logger: Temporal, and passed through with them.
SIGNAL_DECODING = "workflows.signal_input"


def imports_of(module: str) -> set[str]:
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            # `from workflows import health_checks`: the submodule is what is imported.
            found |= {f"{node.module}.{alias.name}" for alias in node.names if node.module == "workflows"}
    return found


def test_the_plain_models_are_the_workflows_modules_without_temporal() -> None:
    plain = {
        f"workflows.{path.stem}"
        for path in (ROOT / "workflows").glob("*.py")
        if path.stem != "__init__" and not any(i.startswith("temporalio") for i in imports_of(f"workflows.{path.stem}"))
    }
    assert set(PLAIN_MODELS) == plain | {SIGNAL_DECODING}


def test_what_a_passed_through_model_imports_of_ours_is_passed_through() -> None:
    for module in PLAIN_MODELS:
        ours = {i for i in imports_of(module) if i.split(".")[0] in ("workflows", *PASSED_THROUGH_PACKAGES)}
        stray = {i for i in ours if i != "workflows" and i.split(".")[0] == "workflows" and i not in PLAIN_MODELS}
        assert not stray, f"{module} imports {sorted(stray)}, which the sandbox would load a second time"
