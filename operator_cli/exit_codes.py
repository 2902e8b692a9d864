"""The exit statuses of `autorepair`, named once (README.md, "Exit codes", lists them; a test keeps the two agreed).

The probe's commands (`node_probe/cli.py`: `classify`, `probe-report`) and the demo give the same numbers the same
meaning without importing these: a GPU host's code imports only the contract."""

from __future__ import annotations

from typing import Final

# Done; for describe-instances also when some instances are unknown (listed in `failures`, as `aws ecs
# describe-container-instances` does).
OK: Final = 0
# The command ran and the answer is no: an endpoint unhealthy (healthcheck), a finding refused (probe-report), a demo
# that did not heal in time, a check that failed (doctor).
FAILED: Final = 1
# Fix the command: a bad argument, invalid configuration, an unknown profile, a refused request, a missing extra.
USAGE: Final = 2
# Temporal (or the ingest, for probe-report) unreachable, refusing the call, or not answering in time.
UNREACHABLE: Final = 3
# Interrupted (Ctrl-C): 128 + SIGINT, as shells report it.
INTERRUPTED: Final = 130
