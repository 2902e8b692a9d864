"""One fault, one finding: the same fault seen by several sources (the kernel log, NVML, DCGM) is one finding that
names them all (`GpuFinding.sources`), so the health workflow counts faults, not copies.

A double-bit ECC error on one GPU is an Xid 48 line in the kernel log, NVML's DoubleBitEccError event (and a rise
of its uncorrectable ECC count at the next poll), and a DCGM memory failure (a DBE policy violation with the
bindings); an Xid is a kernel line and NVML's (or DCGM's) Xid event. Each source turns its copy into a record with
its own reason; `fault_key` maps the records of one fault to one key: the GPU, its MIG instance and the fault's
class. Records that no other source can see have no key and are never held.

The first copy of a fault is held for the correlation window (a few seconds: events and the kernel log arrive
within it); every copy from another view (another source, or another reason of the same class) within it joins
it, and when the window ends one finding goes out: the first impairing copy's (else the first copy's) finding,
naming every source, impairing if any copy impairs, observed when the first copy was. A copy that arrives after the
window but within the memory (the probe's dedupe window: polled sources answer a minute later) is the same fault
told already and is only counted, unless it impairs where what went out did not: then it goes out on its own.
A repeat of a view already seen (the same source and reason) is not a copy: burst collapse counts it as before.

A copy may state one of NVIDIA's standing verdicts on the GPU (NVML's row-remapping failure, Xid 154's recovery
action; classify/verdicts.py), which the health workflow keeps apart from any count. What a held copy states goes out
with the fault, in its finding, whichever copy that finding is made of (`Release.stating`). A copy stating what the
fault's copies have not stated (a verdict, or another action) is never folded into it: it goes out on its own, as an
impairing one does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Generic, NamedTuple, TypeVar

from node_probe.classify.record import FaultRecord

T = TypeVar("T")

DEFAULT_MAX_KEYS = 1024
# A double-bit (uncorrectable) ECC error, whoever reports it.
DBE = "DBE"
ROW_REMAP_FAILURE = "ROW_REMAP_FAILURE"
# Xid 48 is the driver's double-bit ECC error; Xid 64 a failure to record a row remapping (or page retirement).
_XID_CLASSES = {48: DBE, 64: ROW_REMAP_FAILURE}
# The other sources' reasons for those faults: NVML's event and polled count (sources/nvml_events.py,
# nvml_poll.py), dcgmi's memory-system failure and the bindings' DBE policy violation (sources/dcgm*.py).
_REASON_CLASSES = {
    "NVML_DOUBLE_BIT_ECC": DBE,
    "NVML_ECC_UNCORRECTED": DBE,
    "DCGM_MEMORY_FAIL": DBE,
    "DCGM_POLICY_DBE": DBE,
    "NVML_REMAP_FAILURE": ROW_REMAP_FAILURE,
}


class FaultKey(NamedTuple):
    gpu: str
    mig_gpu_instance: int | None
    mig_compute_instance: int | None
    fault: str


def fault_key(record: FaultRecord, reason: str) -> FaultKey | None:
    """The key every copy of this record's fault shares, or None when no other source could report it (or the GPU
    is not known: records of unknown GPUs could be about different ones)."""
    gpu = record.pci or record.uuid
    if gpu is None:
        return None
    if record.kind == "xid" and record.code is not None:
        fault: str | None = _XID_CLASSES.get(record.code, f"XID_{record.code}")
    else:
        fault = _REASON_CLASSES.get(reason)
    if fault is None:
        return None
    return FaultKey(gpu, record.mig_gpu_instance, record.mig_compute_instance, fault)


@dataclass(slots=True)
class Copies(Generic[T]):
    """The copies of one fault: held until `held_until`, then released (held_until None) and remembered."""

    first_at: datetime
    held_until: datetime | None
    items: list[T] = field(default_factory=list)  # the held copies, each with what impairs, in arrival order
    impairing: list[bool] = field(default_factory=list)
    views: set[tuple[str, str]] = field(default_factory=set)  # (source, reason) of every copy seen
    sources: list[str] = field(default_factory=list)  # every source, in the order first seen
    impairs: bool = False  # whether any copy impairs (of what went out, once released)
    statement: str = ""  # what a copy stated of NVIDIA's verdicts (of what went out, once released)
    stating: T | None = None  # the held copy that stated it

    def add(self, item: T, source: str, reason: str, impairs: bool, states: str = "") -> None:
        if self.held_until is not None:
            self.items.append(item)
            self.impairing.append(impairs)
            if states and not self.statement:
                self.stating = item
        if states:
            self.statement = states
        self.views.add((source, reason))
        if source not in self.sources:
            self.sources.append(source)
        self.impairs = self.impairs or impairs

    def release(self) -> Release[T]:
        """What goes out: the first copy that impairs, else the first, naming every source, and stating what a copy
        stated. The copies are let go of; the views and the statement are kept, to know later copies for what they
        are."""
        primary = next((item for item, bad in zip(self.items, self.impairing, strict=True) if bad), self.items[0])
        stating = self.stating if self.stating is not primary else None
        self.held_until = None
        self.items, self.impairing, self.stating = [], [], None
        return Release(primary, tuple(self.sources), self.first_at, self.impairs, stating)


class Release(NamedTuple, Generic[T]):
    """One fault to send: the copy to make the finding of, every source that saw it, when the first did, and the
    copy whose statement of NVIDIA's verdict the finding must carry (None: the primary's own, if any)."""

    primary: T
    sources: tuple[str, ...]
    first_at: datetime
    impairs: bool
    stating: T | None = None


class Correlator(Generic[T]):
    """Holds first copies for `hold`, folds later copies for `memory` after the first. Call `due` regularly."""

    def __init__(self, hold: timedelta, memory: timedelta, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if hold < timedelta(0) or memory < hold:
            raise ValueError("the hold must not be negative, nor longer than the memory")
        self._hold = hold
        self._memory = memory
        self._max_keys = max_keys
        self._faults: OrderedDict[FaultKey, Copies[T]] = OrderedDict()  # oldest first
        self.copies = 0  # copies folded into a fault seen already
        self.held = 0  # faults held now, not yet sent

    @property
    def holding(self) -> bool:
        """Whether some fault waits here: what a log source read is not all in the spool yet."""
        return self.held > 0

    def __len__(self) -> int:
        return len(self._faults)

    def copy_of(
        self, key: FaultKey, item: T, source: str, reason: str, impairs: bool, now: datetime, states: str = ""
    ) -> bool:
        """True when `item` is another view of a fault seen within the memory: held with it, or folded into what
        went out. False for a new fault, a repeat of a view seen already, a copy that impairs where what went out did
        not, and one that states (`states`, classify/verdicts.statement) what the fault's copies have not: those go
        on to burst collapse and `hold`. A held fault whose copies stated nothing takes a statement with it."""
        copies = self._live(key, now)
        if copies is None or (source, reason) in copies.views:
            return False
        if copies.held_until is None and impairs and not copies.impairs:
            return False
        if states and states != copies.statement and (copies.held_until is None or copies.statement):
            return False
        copies.add(item, source, reason, impairs, states)
        self.copies += 1
        return True

    def hold(
        self, key: FaultKey, item: T, source: str, reason: str, impairs: bool, now: datetime, states: str = ""
    ) -> list[Release[T]]:
        """Hold the first copy of a fault; the faults to send now (an earlier one under the key still held, the
        oldest held one when there is no room for another key)."""
        release: list[Release[T]] = []
        before = self._live(key, now)
        if before is not None and before.held_until is not None:
            release.append(self._release(before))
        copies: Copies[T] = Copies(first_at=now, held_until=now + self._hold)
        if before is not None:
            # What was told of the fault before stays told: its sources are named again, its views are not copies,
            # and a copy stating again what it stated is folded.
            copies.views |= before.views
            copies.sources = list(before.sources)
            copies.statement = before.statement
        copies.add(item, source, reason, impairs, states)
        if source in copies.sources:  # the copy that goes out names its own source first
            copies.sources.remove(source)
            copies.sources.insert(0, source)
        self._faults.pop(key, None)
        self._faults[key] = copies
        self.held += 1
        while len(self._faults) > self._max_keys:
            _, oldest = self._faults.popitem(last=False)
            if oldest.held_until is not None:
                release.append(self._release(oldest))
        return release

    def due(self, now: datetime) -> list[Release[T]]:
        """The faults whose hold ended (send them now); forgets faults past the memory."""
        released = []
        for key in list(self._faults):
            copies = self._faults[key]
            if copies.held_until is not None and now >= copies.held_until:
                released.append(self._release(copies))
            if now - copies.first_at >= self._memory:
                del self._faults[key]
        return released

    def flush(self) -> list[Release[T]]:
        """Release everything held, e.g. at shutdown."""
        return [self._release(copies) for copies in self._faults.values() if copies.held_until is not None]

    def _release(self, copies: Copies[T]) -> Release[T]:
        self.held -= 1
        return copies.release()

    def _live(self, key: FaultKey, now: datetime) -> Copies[T] | None:
        copies = self._faults.get(key)
        if copies is not None and now - copies.first_at >= self._memory:
            del self._faults[key]
            return None
        return copies
