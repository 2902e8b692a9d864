"""NVIDIA's standing verdicts on a GPU as the probe states them: which verdict a record states, and the action it
asks for (contract.probe's NVIDIA_VERDICTS and ACTION_*).

The GPU recovery action comes two ways, NVML's field 230 (sources/nvml_poll.py) and Xid 154 in the kernel log
(classify/bodies.py); both name their action through `recovery_action`, so the two can never disagree on what one
value asks for. The R575+ drivers' flags and a row-remapping failure are NVML's alone.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from contract.probe import (
    ACTION_DRAIN_AND_RESET,
    ACTION_DRAIN_P2P,
    ACTION_NONE,
    ACTION_RESET_GPU,
    ACTION_RESTART_BM,
)
from node_probe.classify.record import FaultRecord

# What the driver prints in Xid 154 for a value it has no name for.
UNKNOWN_ACTION_NAME: Final = "Unknown"


class RecoveryAction(NamedTuple):
    suffix: str  # of the NVML record's reason, NVML_RECOVERY_ACTION_<suffix> (pynvml's constant names it so)
    name: str  # as the driver prints it in Xid 154
    action: str  # what it asks of us; "": nothing we do, the fault's own catalog action applies


RECOVERY_ACTIONS: Final[dict[int, RecoveryAction]] = {
    0: RecoveryAction("NONE", "None", ACTION_NONE),
    1: RecoveryAction("GPU_RESET", "GPU Reset Required", ACTION_RESET_GPU),
    2: RecoveryAction("NODE_REBOOT", "Node Reboot Required", ACTION_RESTART_BM),
    3: RecoveryAction("DRAIN_P2P", "Drain P2P", ACTION_DRAIN_P2P),
    4: RecoveryAction("DRAIN_AND_RESET", "Drain and Reset", ACTION_DRAIN_AND_RESET),
    # IMEX is the NVLink domain's memory export service, not this GPU: recovering it is nothing a reset or a reboot
    # of this instance is known to do.
    5: RecoveryAction("RECOVER_IMEX_DOMAIN", "Recover IMEX Domain", ""),
    # No rung resets the PCIe bus alone, and a reboot surely does (the whole node comes up again, bus included).
    6: RecoveryAction("BUS_RESET", "Bus Reset Required", ACTION_RESTART_BM),
    7: RecoveryAction("SYSTEM_REBOOT", "System Reboot Required", ACTION_RESTART_BM),
}
_BY_NAME: Final = {row.name.lower(): row for row in RECOVERY_ACTIONS.values()}


def recovery_action(code: int | None, name: str | None = None) -> str:
    """The action a GPU recovery action asks for: by its value (NVML's field, the `0x..` of Xid 154), else by the
    name Xid 154 prints. A driver that prints "Unknown" disowns the value, and a value or name this table does not
    know (a newer driver's) asks for nothing we take: both give "", and the fault's catalog action applies."""
    if name is not None and name.strip().lower() == UNKNOWN_ACTION_NAME.lower():
        return ""
    row = RECOVERY_ACTIONS.get(code) if code is not None else None
    if row is None and name is not None:
        row = _BY_NAME.get(name.strip().lower())
    return row.action if row is not None else ""


def statement(record: FaultRecord) -> str:
    """What the record states of NVIDIA's verdicts, as one comparable value: "" when it states none. Two records
    stating different things (a verdict set, then withdrawn) must never be taken for repeats of one another."""
    if record.nvidia_verdict is None:
        return ""
    return f"{record.nvidia_verdict}={record.nvidia_action or ''}"
