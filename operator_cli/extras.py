"""Which extra of gpu-autorepair a command needs, for when its modules are not installed.

Each part installs only what it uses (pyproject.toml): `pip install 'gpu-autorepair[probe]'` on a GPU host has no
Temporal SDK, so `autorepair worker` there must say which extra to install, not end in an ImportError's traceback.
"""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "gpu-autorepair"

# Our own top-level packages: one of these missing is a broken install or a bug, never an extra left out.
OURS = frozenset({"contract", "workflows", "activities", "worker", "node_probe", "ingest", "operator_cli", "simulator"})
PROBE_SIDE = frozenset({"probe", "probe-report", "classify"})
# Modules that only the ops extra brings, whichever command reached them (`autorepair probe --direct-temporal`
# speaks to Temporal itself, so it needs the ops extra even on a GPU host).
OPS_ONLY = frozenset({"temporalio", "cachetools", "opentelemetry", "shtab"})
DEMO_ONLY = frozenset({"moto"})


def version() -> str:
    """The installed distribution's version, as pip and the images know it."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def extra_for(command: str | None, module: str) -> str:
    """The extra that brings `module` (a top-level import name) for `command`."""
    if module in DEMO_ONLY or command == "demo":
        return "demo"
    if module in OPS_ONLY:
        return "ops"
    if command in PROBE_SIDE:
        return "probe"
    return "ops"


def command_of(argv: list[str]) -> str | None:
    """The subcommand named in argv, without parsing it (parsing is what failed)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def missing_extra(err: ModuleNotFoundError, argv: list[str]) -> str | None:
    """One line naming the extra to install, or None when the missing module is ours (not an extra's to bring)."""
    if not err.name:
        return None
    module = err.name.split(".")[0]
    if module in OURS:
        return None
    command = command_of(argv)
    extra = extra_for(command, module)
    what = f"autorepair {command}" if command else "autorepair"
    if command in PROBE_SIDE and "--direct-temporal" in argv:
        what += " --direct-temporal"  # the probe's one path to Temporal itself: the rest of it runs without ops
    return f"{what} needs {module}, which is not installed: pip install '{DISTRIBUTION}[{extra}]'"
