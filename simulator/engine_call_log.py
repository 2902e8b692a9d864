"""The engine's AWS calls that change the world, as a file: from the AWS proxy in one process to the simulated fleet
in another (`autorepair sim --engine-calls FILE`).

The proxy stays with the engine's side (the demo's process): a simulator killed and started again must not take the
engine's AWS endpoint down with it. `EngineCallLog` is the proxy's listener there; it appends one JSON line per
changing call, `{"action": "TerminateInstances", "instances": ["i-..."], ...}` (simulator.fleet_aws.changes_heard
decides which calls change what). `FollowedCallLog` is the fleet's `EngineCalls` in the simulator's process: each
take() first reads the lines added since the last, whole lines only. A simulator started again reads from the end
of the file: its first look at the world is a full one (simulator.fleet: adopt and the first reconcile).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from simulator.aws_proxy import Answered
from simulator.fleet_aws import Changes, EngineCalls, changes_heard

log = logging.getLogger(__name__)


class EngineCallLog:
    """A FlakyAws listener (`proxy.listen(EngineCallLog(path))`) writing each changing call to `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # the proxy's threads answer side by side; one line is one write
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()

    def __call__(self, answered: Answered) -> None:
        heard = changes_heard(answered)
        if heard is None:
            return
        action, changes = heard
        line = json.dumps(
            {
                "action": action,
                "instances": sorted(changes.instances),
                "container_instances": sorted(changes.container_instances),
                "commands": sorted(changes.commands),
                "runs": sorted(changes.runs),
                "reconcile": changes.reconcile,
            }
        )
        with self._lock, self.path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")


class FollowedCallLog(EngineCalls):
    """The fleet's EngineCalls, fed from an EngineCallLog's file as it grows, from its end at the time of making."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        try:
            self._offset = path.stat().st_size
        except FileNotFoundError:
            self._offset = 0

    def take(self) -> Changes:
        self._read_new()
        return super().take()

    def not_run(self, instance_id: str, command_id: str) -> bool:
        self._read_new()  # the engine may ask after a command sent since the fleet's last tick
        return super().not_run(instance_id, command_id)

    def _read_new(self) -> None:
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next take
        self._offset += end
        for raw in data[:end].splitlines():
            try:
                entry = json.loads(raw)
                changes = Changes(
                    instances=set(entry.get("instances", [])),
                    container_instances=set(entry.get("container_instances", [])),
                    commands=set(entry.get("commands", [])),
                    runs={(str(i), str(c)) for i, c in entry.get("runs", [])},
                    reconcile=bool(entry.get("reconcile", False)),
                )
                self.add(str(entry["action"]), changes)
            except (ValueError, KeyError, TypeError):
                log.warning("fleet-sim: unreadable line in %s: %r", self.path, raw[:200])
