"""The NVML session behind the NVML source: the thread every NVML call runs on, the module's error classes, the GPUs
it found, and opening and closing a session.

These are the pieces that polling (nvml_poll.py) and the event loop (nvml_events.py) share. NvmlSource is built in
layers, each a class of its own module: NvmlSessionCalls here, then NvmlPolling, then NvmlEvents, then the source's
async side in nvml.py. Every method of the first three runs on the NVML thread.

GPUs are named by PCI address in the kernel log's shape (`dddd:bb:dd`, lower case, no function) and by UUID, so
NVML and kernel-log findings about one GPU match (and collapse into one burst).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from node_probe.sources.nvml_warnings import GpuWarnings

# One logger for the whole NVML source, whichever of its modules logs, so that one filter catches all its lines.
log = logging.getLogger("node_probe.sources.nvml")

T = TypeVar("T")

# Documented values, used where an older pynvml lacks the constant.
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_XID = 0x8
EVENT_GPU_UNAVAILABLE = 0x4000
EVENT_RECOVERY_ACTION = 0x8000
_BUS_ID = re.compile(r"^\s*([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.[0-9a-fA-F])?\s*$")


def normalise_bus_id(bus_id: str | bytes | None) -> str | None:
    """NVML's `00000000:3B:00.0` (8-digit domain, upper case, function) -> the kernel log's `0000:3b:00`."""
    if bus_id is None:
        return None
    text = bus_id.decode("ascii", "replace") if isinstance(bus_id, bytes) else str(bus_id)
    match = _BUS_ID.match(text)
    if match is None:
        return None
    domain, bus, device = (int(part, 16) for part in match.groups())
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def nvml_text(value: Any) -> str | None:
    """A string NVML returned: bytes from older pynvml versions, str from newer ones."""
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlErrors:
    """The module's NVMLError classes, looked up once. A class the module lacks matches nothing."""

    def __init__(self, nvml: Any) -> None:
        self.base: type[BaseException] = getattr(nvml, "NVMLError", Exception)

        def cls(name: str) -> type[BaseException]:
            found = getattr(nvml, name, None)
            return found if isinstance(found, type) else type(name, (Exception,), {})

        self.timeout = cls("NVMLError_Timeout")
        self.gpu_lost = cls("NVMLError_GpuIsLost")
        # "Not supported" in both its forms: never a fault (old drivers lack symbols, MIG disables remapping).
        self.unsupported = (cls("NVMLError_NotSupported"), cls("NVMLError_FunctionNotFound"))
        # NVML as a whole is gone or unusable: end the session and re-initialise with backoff.
        self.session_broken = (
            cls("NVMLError_Uninitialized"),
            cls("NVMLError_DriverNotLoaded"),
            cls("NVMLError_LibraryNotFound"),
            cls("NVMLError_LibRmVersionMismatch"),
        )


class NvmlWorker:
    """One daemon thread that makes every NVML call, in order.

    Daemon, so that a call stuck in the driver cannot keep the process from exiting (the threads of
    asyncio.to_thread's executor are joined at exit); one thread, so that a hung call never piles up threads."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((fn, future))
        return future

    def _loop(self) -> None:
        while True:
            fn, future = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting side, which decides
                future.set_exception(exc)
            else:
                future.set_result(result)


# An NvmlGpu's polled state that a new session takes over from the last (NvmlSessionCalls._carry_over).
CARRIED_ACROSS_SESSIONS = (
    "ecc_uncorrected",
    "retired_pending",
    "remap_pending",
    "recovery_action",
    "verdicts",
    "warnings",
    "episodes",
    "errors_logged",
)


@dataclass(slots=True)
class NvmlGpu:
    index: int
    pci: str | None
    uuid: str | None
    name: str | None
    handle: Any = field(repr=False)
    events: int = 0  # the event types registered for this GPU
    # Last polled state: a finding goes out when a condition appears, not on every poll.
    ecc_uncorrected: int | None = None
    retired_pending: bool = False
    remap_pending: bool = False
    recovery_action: int = 0
    # NVIDIA's verdicts on this GPU that hold now (a row-remapping failure, the R575+ flags), by condition name.
    verdicts: set[str] = field(default_factory=set)
    # The warnings that are never repairs (clocks slowed, a PCIe link below its maximum), and their last readings.
    warnings: GpuWarnings = field(default_factory=GpuWarnings)
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)  # checks this GPU/driver answered "not supported"
    episodes: dict[str, int] = field(default_factory=dict)  # how often each condition cleared, for finding ids
    errors_logged: set[tuple[str, int]] = field(default_factory=set)

    @property
    def label(self) -> str:
        return self.pci or self.uuid or f"index {self.index}"


@dataclass(slots=True)
class NvmlSession:
    gpus: list[NvmlGpu]
    event_set: Any | None
    started: float
    by_handle: dict[int, NvmlGpu] = field(default_factory=dict)
    # Set by a wait that failed at once (GPU lost, an NVML error): waiting again at once would spin.
    pause_events: bool = False
    lost_unidentified: bool = False


class NoGpus(Exception):
    """nvmlInit worked but there is no GPU to watch: as good as no NVML for this probe."""


def handle_key(handle: Any) -> int:
    """Event data carries a new pointer object to the same device: compare addresses, not objects."""
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
    return address if address is not None else id(handle)


class NvmlSessionCalls:
    """Opening a session (nvmlInit, the GPUs and their identity, event registration) and closing it."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self._errors = NvmlErrors(nvml)
        # Kept across NVML sessions: a kernel-log finding about a GPU that NVML no longer answers for (the usual
        # case when it fell off the bus) still names its UUID.
        self._uuid_by_pci: dict[str, str] = {}
        # Each GPU's last polled state, by UUID, for the next session to start from (_carry_over).
        self._polled: dict[str, NvmlGpu] = {}
        self._wanted_events = (
            getattr(nvml, "nvmlEventTypeXidCriticalError", EVENT_XID)
            | getattr(nvml, "nvmlEventTypeDoubleBitEccError", EVENT_DOUBLE_BIT_ECC)
            | getattr(nvml, "nvmlEventTypeGpuUnavailableError", EVENT_GPU_UNAVAILABLE)
            | getattr(nvml, "nvmlEventTypeGpuRecoveryAction", EVENT_RECOVERY_ACTION)
        )

    def _start(self) -> NvmlSession:
        nvml = self.nvml
        nvml.nvmlInit()
        try:
            count = int(nvml.nvmlDeviceGetCount())
            if count == 0:
                raise NoGpus("nvml: no GPUs found")
            gpus = [self._describe_gpu(index) for index in range(count)]
            for gpu in gpus:
                self._carry_over(gpu)
            session = NvmlSession(gpus=gpus, event_set=None, started=time.monotonic())
            session.by_handle = {handle_key(g.handle): g for g in gpus if g.handle is not None}
            session.event_set = self._register_events(gpus)
        except BaseException:
            try:
                nvml.nvmlShutdown()
            except Exception as exc:  # already failing; the first error is the one to report
                log.debug("nvml: shutdown after a failed start: %s", exc)
            raise
        return session

    def _carry_over(self, gpu: NvmlGpu) -> None:
        """A new session's GPU starts from what the last session last polled of it. NVML started again (after a hung
        call or a broken session) is not a new boot: a volatile ECC count or a standing flag it had read was told
        already, and read again as new it went out again, as a fault of its own when it had gone out as another
        source's copy. A restarted probe tells them again, with the same ids (the health workflow drops those)."""
        if gpu.uuid is None:
            return
        before = self._polled.get(gpu.uuid)
        if before is not None:
            for name in CARRIED_ACROSS_SESSIONS:
                setattr(gpu, name, getattr(before, name))
        self._polled[gpu.uuid] = gpu

    def _describe_gpu(self, index: int) -> NvmlGpu:
        nvml = self.nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except self._errors.gpu_lost:
            # Enumerated but not answering: the first poll reports it lost.
            return NvmlGpu(index=index, pci=None, uuid=None, name=None, handle=None)
        gpu = NvmlGpu(index=index, pci=None, uuid=None, name=None, handle=handle)
        self._read_identity(gpu)
        return gpu

    def _read_identity(self, gpu: NvmlGpu) -> None:
        """PCI address, UUID, name. A GPU lost at start has none yet: read again once it answers."""
        nvml = self.nvml
        try:
            gpu.pci = normalise_bus_id(nvml_text(nvml.nvmlDeviceGetPciInfo(gpu.handle).busId))
            gpu.uuid = nvml_text(nvml.nvmlDeviceGetUUID(gpu.handle))
        except (self._errors.gpu_lost, *self._errors.unsupported) as exc:
            log.warning("nvml: GPU %d: cannot read its identity: %s", gpu.index, exc)
        if gpu.pci is not None and gpu.uuid is not None:
            self._uuid_by_pci[gpu.pci] = gpu.uuid
        try:
            gpu.name = nvml_text(nvml.nvmlDeviceGetName(gpu.handle))
        except self._errors.base:
            gpu.name = None

    def _register_events(self, gpus: list[NvmlGpu]) -> Any | None:
        nvml = self.nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except self._errors.unsupported:
            log.info("nvml: events not supported; polling only")
            return None
        for gpu in gpus:
            if gpu.handle is None:
                continue
            try:
                mask = self._wanted_events & int(nvml.nvmlDeviceGetSupportedEventTypes(gpu.handle))
                if mask:
                    nvml.nvmlDeviceRegisterEvents(gpu.handle, mask, event_set)
                    gpu.events = mask
            except (self._errors.gpu_lost, *self._errors.unsupported) as exc:
                log.info("nvml: GPU %s: no events (%s); polling only", gpu.label, exc)
        if not any(gpu.events for gpu in gpus):
            self._free_event_set(event_set)
            return None
        return event_set

    def _free_event_set(self, event_set: Any) -> None:
        try:
            self.nvml.nvmlEventSetFree(event_set)
        except self._errors.base as exc:
            log.debug("nvml: nvmlEventSetFree: %s", exc)

    def _shutdown(self, session: NvmlSession) -> None:
        if session.event_set is not None:
            self._free_event_set(session.event_set)
            session.event_set = None
        try:
            self.nvml.nvmlShutdown()
        except self._errors.base as exc:
            log.debug("nvml: nvmlShutdown: %s", exc)
