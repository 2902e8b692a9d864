"""NVML as a fault source: Xid / ECC / GPU-unavailable / recovery-action events, and a slower poll of state that
events do not carry (uncorrectable ECC counts, pending retired pages, row remapping, the recovery action field,
"GPU is lost").

The pynvml module is a constructor argument, so tests pass a stand-in with pynvml's own function names, return
types and exception classes, and the real module drops in unchanged.

Every NVML call runs on one daemon thread (`_Worker`): nvmlEventSetWait blocks, and a driver in trouble can hang
any call. A call that outlives its timeout makes the source INSUFFICIENT_DATA; no second call is started behind
it, and once it returns the source re-initialises by itself. Nothing latches.

GPUs are named by PCI address in the kernel log's shape (`dddd:bb:dd`, lower case, no function) and by UUID, so
NVML and kernel-log findings about one GPU match (and collapse into one burst).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import logging
import queue
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from node_probe.classify.policy import NVML_GPU_UNAVAILABLE, NVML_RECOVERY_ACTION_PREFIX, NVML_REMAP_FAILURE
from node_probe.classify.record import FaultRecord
from node_probe.host import boot_id
from node_probe.sources.base import Observation, SourceStatus, TrackedStatus

log = logging.getLogger(__name__)

T = TypeVar("T")

SOURCE_NAME = "nvml"
NVML_REMAP_PENDING = "NVML_REMAP_PENDING"
NVML_ECC_UNCORRECTED = "NVML_ECC_UNCORRECTED"
NVML_DOUBLE_BIT_ECC = "NVML_DOUBLE_BIT_ECC"
NVML_RETIRED_PAGES_PENDING = "NVML_RETIRED_PAGES_PENDING"

# Documented values, used where an older pynvml lacks the constant.
_EVENT_DOUBLE_BIT_ECC = 0x2
_EVENT_XID = 0x8
_EVENT_GPU_UNAVAILABLE = 0x4000
_EVENT_RECOVERY_ACTION = 0x8000
_FI_GPU_RECOVERY_ACTION = 230
_UNKNOWN_XID = 999
_NO_INSTANCE = 0xFFFFFFFF
# Code -> (reason suffix, the name the driver prints in Xid 154, which the nvidia-catalog policy reads).
_RECOVERY_ACTIONS: dict[int, tuple[str, str]] = {
    0: ("NONE", "None"),
    1: ("GPU_RESET", "GPU Reset Required"),
    2: ("NODE_REBOOT", "Node Reboot Required"),
    3: ("DRAIN_P2P", "Drain P2P"),
    4: ("DRAIN_AND_RESET", "Drain and Reset"),
    5: ("RECOVER_IMEX_DOMAIN", "Recover IMEX Domain"),
    6: ("BUS_RESET", "Bus Reset Required"),
    7: ("SYSTEM_REBOOT", "System Reboot Required"),
}
# nvmlValueType_t -> the c_nvmlValue_t union member holding it.
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
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


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class _Errors:
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


class _Worker:
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
    remap_failure: bool = False
    recovery_action: int = 0
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)  # checks this GPU/driver answered "not supported"
    episodes: dict[str, int] = field(default_factory=dict)  # how often each condition cleared, for finding ids
    errors_logged: set[tuple[str, int]] = field(default_factory=set)

    @property
    def label(self) -> str:
        return self.pci or self.uuid or f"index {self.index}"


@dataclass(slots=True)
class _Session:
    gpus: list[NvmlGpu]
    event_set: Any | None
    started: float
    by_handle: dict[int, NvmlGpu] = field(default_factory=dict)
    # Set by a wait that failed at once (GPU lost, an NVML error): waiting again at once would spin.
    pause_events: bool = False
    lost_unidentified: bool = False


class _Unavailable(Exception):
    """NVML cannot be used right now; the message is the status reason."""


Found = tuple[FaultRecord, str]  # a record and its position (for the finding id)


def _handle_key(handle: Any) -> int:
    """Event data carries a new pointer object to the same device: compare addresses, not objects."""
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
    return address if address is not None else id(handle)


class NvmlSource(TrackedStatus):
    name = SOURCE_NAME

    def __init__(
        self,
        nvml: Any = None,
        *,
        poll_interval: float = 60.0,
        event_timeout: float = 1.0,
        call_timeout: float = 30.0,
        check_timeout: float = 5.0,
        retry_initial: float = 1.0,
        retry_max: float = 60.0,
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self.nvml = nvml
        self._errors = _Errors(nvml)
        self._poll_interval = poll_interval
        self._event_timeout = event_timeout
        self._call_timeout = call_timeout
        self._check_timeout = min(check_timeout, call_timeout)
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        super().__init__("nvml: not initialised yet")
        self._worker = _Worker("nvml")
        self._session: _Session | None = None
        self._hung: concurrent.futures.Future[Any] | None = None
        self._hung_call = ""
        self._hung_since = 0.0
        self._event_seq = 0
        # Kept across NVML sessions: a kernel-log finding about a GPU that NVML no longer answers for (the usual
        # case when it fell off the bus) still names its UUID.
        self._uuid_by_pci: dict[str, str] = {}
        self._instance = time.time_ns()  # with _event_seq, a unique position for one-off events
        self._wanted_events = (
            getattr(nvml, "nvmlEventTypeXidCriticalError", _EVENT_XID)
            | getattr(nvml, "nvmlEventTypeDoubleBitEccError", _EVENT_DOUBLE_BIT_ECC)
            | getattr(nvml, "nvmlEventTypeGpuUnavailableError", _EVENT_GPU_UNAVAILABLE)
            | getattr(nvml, "nvmlEventTypeGpuRecoveryAction", _EVENT_RECOVERY_ACTION)
        )
        self._recovery_actions = dict(_RECOVERY_ACTIONS)
        for attr in dir(nvml):
            # Newer drivers' actions come with newer pynvml constants: name them from there.
            if attr.startswith("NVML_GPU_RECOVERY_ACTION_"):
                code = getattr(nvml, attr)
                if isinstance(code, int) and code not in self._recovery_actions:
                    suffix = attr.removeprefix("NVML_GPU_RECOVERY_ACTION_")
                    self._recovery_actions[code] = (suffix, suffix.replace("_", " ").title())

    # --- the RecordSource protocol -------------------------------------------------------------------------

    @property
    def gpus(self) -> list[NvmlGpu]:
        session = self._session
        return list(session.gpus) if session is not None else []

    def uuid_of(self, pci: str) -> str | None:
        """The UUID of the GPU at this PCI address (`dddd:bb:dd`), as NVML last named it."""
        return self._uuid_by_pci.get(pci)

    def gpu_identity(self, index: int) -> tuple[str | None, str | None] | None:
        """(pci, uuid) of the GPU at this NVML index, for sources that name GPUs by index (DCGM)."""
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu.pci, gpu.uuid
        return None

    def check(self) -> SourceStatus:
        """Initialise NVML now (bounded by check_timeout: this blocks the caller) so the first heartbeat knows."""
        if self._session is None and self._hung is None:
            future = self._worker.submit(self._start)
            try:
                self._session = future.result(timeout=self._check_timeout)
            except concurrent.futures.TimeoutError:
                self._mark_hung(future, "nvmlInit")
                self._set_down(f"nvml: nvmlInit did not return within {self._check_timeout:.0f}s (driver hung?)")
            except Exception as exc:
                self._set_down(self._describe(exc, "nvmlInit"))
            else:
                self._set_ok()
        return self._status

    def poll_once(self) -> list[Observation]:
        """One poll of every GPU, now (blocking; for `tests/gpu/check_real_gpu.py`). Needs a started source."""
        session = self._session
        if session is None:
            return []
        return [self._observation(r, p) for r, p in self._worker.submit(lambda: self._poll(session)).result()]

    async def observations(self) -> AsyncIterator[Observation]:
        backoff = self._retry_initial
        while True:
            if self._session is None:
                try:
                    self._settle_hung()  # a hung nvmlInit that came back leaves its session here
                    if self._session is None:
                        self._session = await self._call(self._start, self._call_timeout, "nvmlInit")
                except _Unavailable as exc:
                    self._set_down(str(exc))
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self._retry_max)
                    continue
                self._set_ok()
            session = self._session
            try:
                async for observation in self._watch(session):
                    yield observation
            except _Unavailable as exc:
                self._set_down(str(exc))
            await self._close(session)
            if time.monotonic() - session.started > self._retry_max:
                backoff = self._retry_initial  # a long-lived session earns a fresh start
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._retry_max)

    # --- the async side: scheduling, timeouts ---------------------------------------------------------------

    async def _watch(self, session: _Session) -> AsyncIterator[Observation]:
        loop = asyncio.get_running_loop()
        next_poll = loop.time()
        while True:
            if loop.time() >= next_poll:
                found = await self._call(lambda: self._poll(session), self._call_timeout, "poll")
                next_poll = loop.time() + self._poll_interval
                for record, position in found:
                    yield self._observation(record, position)
            if session.event_set is None:
                await asyncio.sleep(max(0.0, next_poll - loop.time()))
                continue
            wait = functools.partial(self._wait, session, int(self._event_timeout * 1000))
            found = await self._call(wait, self._event_timeout + self._call_timeout, "nvmlEventSetWait")
            for record, position in found:
                yield self._observation(record, position)
            if session.pause_events:
                await asyncio.sleep(self._event_timeout)

    async def _call(self, fn: Callable[[], T], timeout: float, what: str) -> T:
        """Run fn on the NVML thread. Raises _Unavailable when NVML is broken, hung, or fn failed unexpectedly."""
        self._settle_hung()
        future = self._worker.submit(fn)
        try:
            # Not asyncio.wait_for: on 3.11 it swallows a cancellation that races with the result (gh-86296),
            # and a result arrives every event_timeout here, so the probe could not be stopped.
            async with asyncio.timeout(timeout):
                return await asyncio.wrap_future(future)
        except TimeoutError:
            self._mark_hung(future, what)
            raise _Unavailable(f"nvml: {what} did not return within {timeout:.0f}s (driver hung?)") from None
        except Exception as exc:
            if not isinstance(exc, (self._errors.base, _NoGpus)):
                # A bug or an unexpected return shape must not kill the probe: report and start over.
                log.exception("nvml: %s failed unexpectedly", what)
            raise _Unavailable(self._describe(exc, what)) from exc

    def _mark_hung(self, future: concurrent.futures.Future[Any], what: str) -> None:
        self._hung = future
        self._hung_call = what
        self._hung_since = time.monotonic()

    def _settle_hung(self) -> None:
        """Raises _Unavailable while a timed-out call still blocks the NVML thread; forgets it once it returned."""
        future = self._hung
        if future is None:
            return
        if not future.done():
            age = time.monotonic() - self._hung_since
            raise _Unavailable(f"nvml: {self._hung_call} has not returned for {age:.0f}s (driver hung?)")
        self._hung = None
        log.info("nvml: the hung %s returned after %.0fs", self._hung_call, time.monotonic() - self._hung_since)
        if future.cancelled() or future.exception() is not None:
            return
        result = future.result()
        if isinstance(result, _Session) and self._session is None:
            self._session = result  # a late nvmlInit: its session is as good as a new one

    async def _close(self, session: _Session) -> None:
        if self._session is session:
            self._session = None
        if self._hung is not None:
            return  # the NVML thread is stuck: nothing can be freed now
        try:
            await self._call(lambda: self._shutdown(session), self._call_timeout, "nvmlShutdown")
        except _Unavailable as exc:
            log.debug("nvml: shutdown: %s", exc)

    def _set_ok(self) -> None:
        if self._status.is_ok:  # called on every successful NVML round trip: build the message only on recovery
            return
        gpus = ", ".join(f"{g.label} ({g.uuid})" for g in self.gpus)
        self._mark_ok(f"nvml: watching {len(self.gpus)} GPU(s): {gpus}")

    def _describe(self, exc: BaseException, what: str) -> str:
        if isinstance(exc, _Unavailable | _NoGpus):
            return str(exc)
        if isinstance(exc, self._errors.base):
            return f"nvml: {what}: {exc}"
        return f"nvml: {what} failed: {exc!r}"

    def _observation(self, record: FaultRecord, position: str) -> Observation:
        return Observation(record, self.name, position)

    # --- the NVML thread: every function below runs there --------------------------------------------------

    def _start(self) -> _Session:
        nvml = self.nvml
        nvml.nvmlInit()
        try:
            count = int(nvml.nvmlDeviceGetCount())
            if count == 0:
                raise _NoGpus("nvml: no GPUs found")
            gpus = [self._describe_gpu(index) for index in range(count)]
            session = _Session(gpus=gpus, event_set=None, started=time.monotonic())
            session.by_handle = {_handle_key(g.handle): g for g in gpus if g.handle is not None}
            session.event_set = self._register_events(gpus)
        except BaseException:
            try:
                nvml.nvmlShutdown()
            except Exception as exc:  # already failing; the first error is the one to report
                log.debug("nvml: shutdown after a failed start: %s", exc)
            raise
        return session

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
            gpu.pci = normalise_bus_id(_text(nvml.nvmlDeviceGetPciInfo(gpu.handle).busId))
            gpu.uuid = _text(nvml.nvmlDeviceGetUUID(gpu.handle))
        except (self._errors.gpu_lost, *self._errors.unsupported) as exc:
            log.warning("nvml: GPU %d: cannot read its identity: %s", gpu.index, exc)
        if gpu.pci is not None and gpu.uuid is not None:
            self._uuid_by_pci[gpu.pci] = gpu.uuid
        try:
            gpu.name = _text(nvml.nvmlDeviceGetName(gpu.handle))
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

    def _shutdown(self, session: _Session) -> None:
        if session.event_set is not None:
            self._free_event_set(session.event_set)
            session.event_set = None
        try:
            self.nvml.nvmlShutdown()
        except self._errors.base as exc:
            log.debug("nvml: nvmlShutdown: %s", exc)

    def _wait(self, session: _Session, timeout_ms: int) -> list[Found]:
        session.pause_events = False
        try:
            data = self.nvml.nvmlEventSetWait(session.event_set, timeout_ms)
        except self._errors.timeout:
            return []  # no event within the timeout: the normal idle case
        except self._errors.gpu_lost:
            session.pause_events = True
            return self._find_lost(session)
        except self._errors.unsupported:
            log.info("nvml: nvmlEventSetWait not supported; polling only")
            session.event_set = None
            return []
        except self._errors.session_broken:
            raise
        except self._errors.base as exc:
            log.warning("nvml: nvmlEventSetWait: %s", exc)
            session.pause_events = True
            return []
        return self._event_records(session, data)

    def _find_lost(self, session: _Session) -> list[Found]:
        """The event set said a GPU is lost but not which: a poll asks each GPU."""
        found = self._poll(session)
        if any(gpu.lost for gpu in session.gpus) or session.lost_unidentified:
            return found
        session.lost_unidentified = True
        record = FaultRecord(
            line=0,
            raw="nvmlEventSetWait: NVML_ERROR_GPU_IS_LOST",
            kind="gpu_fallen_off_bus",
            code=None,
            pci=None,
            message="NVML: a GPU is lost (nvmlEventSetWait); no GPU answered as lost when asked one by one",
        )
        return [*found, (record, self._state_position("unknown-gpu", "gpu-lost", 0))]

    def _event_records(self, session: _Session, data: Any) -> list[Found]:
        gpu = self._gpu_for(session, data.device)
        event_type = int(data.eventType)
        found: list[Found] = []
        if event_type & getattr(self.nvml, "nvmlEventTypeXidCriticalError", _EVENT_XID):
            found.append(self._xid_record(gpu, data))
        if event_type & getattr(self.nvml, "nvmlEventTypeDoubleBitEccError", _EVENT_DOUBLE_BIT_ECC):
            found.append(self._event_record(gpu, NVML_DOUBLE_BIT_ECC, "double-bit ECC error (NVML event)"))
        if event_type & getattr(self.nvml, "nvmlEventTypeGpuUnavailableError", _EVENT_GPU_UNAVAILABLE):
            found.append(self._event_record(gpu, NVML_GPU_UNAVAILABLE, "GPU unavailable (NVML event)"))
        if event_type & getattr(self.nvml, "nvmlEventTypeGpuRecoveryAction", _EVENT_RECOVERY_ACTION) and gpu:
            # Read the field rather than trust eventData's meaning; fall back to eventData where it is unreadable.
            before = len(found)
            try:
                self._poll_recovery_action(gpu, found)
            except self._errors.gpu_lost:
                found.extend(self._lost(gpu))
            if len(found) == before and "recovery_action" in gpu.unsupported:
                self._recovery_transition(gpu, int(data.eventData), found)
        return found

    def _gpu_for(self, session: _Session, handle: Any) -> NvmlGpu | None:
        gpu = session.by_handle.get(_handle_key(handle))
        if gpu is not None:
            return gpu
        try:
            uuid = _text(self.nvml.nvmlDeviceGetUUID(handle))
        except self._errors.base:
            return None
        return next((g for g in session.gpus if g.uuid is not None and g.uuid == uuid), None)

    def _next_event_position(self) -> str:
        self._event_seq += 1
        return f"event:{boot_id()}:{self._instance}:{self._event_seq}"

    def _state_position(self, gpu_id: str, condition: str, episode: int) -> str:
        # Stable across probe restarts within a boot: a re-sent state finding has the same id and is dropped.
        return f"state:{boot_id()}:{gpu_id}:{condition}:{episode}"

    def _xid_record(self, gpu: NvmlGpu | None, data: Any) -> Found:
        code = int(data.eventData)
        gi = int(data.gpuInstanceId)
        ci = int(data.computeInstanceId)
        mig_gi = None if gi == _NO_INSTANCE else gi
        mig_ci = None if ci == _NO_INSTANCE else ci
        what = "unknown Xid" if code == _UNKNOWN_XID else f"Xid {code}"
        mig = "" if mig_gi is None else f" GPU-I:{mig_gi}" + ("" if mig_ci is None else f" GPU-CI:{mig_ci}")
        pci = gpu.pci if gpu else None
        uuid = gpu.uuid if gpu else None
        record = FaultRecord(
            line=0,
            raw=f"NVML event XidCriticalError (PCI:{pci or '?'}{mig} {uuid or '?'}): {code}",
            kind="xid",
            code=code,
            pci=pci,
            message=f"{what} (NVML event)",
            uuid=uuid,
            mig_gpu_instance=mig_gi,
            mig_compute_instance=mig_ci,
        )
        return record, self._next_event_position()

    def _event_record(self, gpu: NvmlGpu | None, reason: str, message: str) -> Found:
        pci = gpu.pci if gpu else None
        uuid = gpu.uuid if gpu else None
        record = FaultRecord(
            line=0,
            raw=f"NVML event {reason} (PCI:{pci or '?'} {uuid or '?'})",
            kind="nvml",
            code=None,
            pci=pci,
            message=message,
            uuid=uuid,
            reason=reason,
        )
        return record, self._next_event_position()

    def _state_record(self, gpu: NvmlGpu, reason: str, condition: str, message: str, **extra: Any) -> Found:
        record = FaultRecord(
            line=0,
            raw=f"NVML {reason} (PCI:{gpu.pci or '?'} {gpu.uuid or '?'}): {message}",
            kind="nvml",
            code=None,
            pci=gpu.pci,
            message=message,
            uuid=gpu.uuid,
            reason=reason,
            **extra,
        )
        episode = gpu.episodes.get(condition, 0)
        return record, self._state_position(gpu.uuid or gpu.label, condition, episode)

    def _cleared(self, gpu: NvmlGpu, condition: str) -> None:
        gpu.episodes[condition] = gpu.episodes.get(condition, 0) + 1

    # --- polling ---

    def _poll(self, session: _Session) -> list[Found]:
        found: list[Found] = []
        for gpu in session.gpus:
            found.extend(self._poll_gpu(gpu))
        return found

    def _poll_gpu(self, gpu: NvmlGpu) -> list[Found]:
        if gpu.handle is None:
            return self._lost(gpu)
        found: list[Found] = []
        try:
            self._poll_ecc(gpu, found)
            self._poll_retired_pages(gpu, found)
            self._poll_remapped_rows(gpu, found)
            self._poll_recovery_action(gpu, found)
        except self._errors.gpu_lost:
            found.extend(self._lost(gpu))
            return found
        if gpu.lost:
            log.warning("nvml: GPU %s answers again", gpu.label)
            gpu.lost = False
            self._cleared(gpu, "gpu-lost")
            if gpu.pci is None or gpu.uuid is None:
                self._read_identity(gpu)
        return found

    def _lost(self, gpu: NvmlGpu) -> list[Found]:
        if gpu.lost:
            return []
        gpu.lost = True
        record = FaultRecord(
            line=0,
            raw=f"NVML (PCI:{gpu.pci or '?'} {gpu.uuid or '?'}): NVML_ERROR_GPU_IS_LOST",
            kind="gpu_fallen_off_bus",
            code=None,
            pci=gpu.pci,
            message="NVML: GPU is lost (fell off the bus or is otherwise inaccessible)",
            uuid=gpu.uuid,
        )
        episode = gpu.episodes.get("gpu-lost", 0)
        return [(record, self._state_position(gpu.uuid or gpu.label, "gpu-lost", episode))]

    def _query(self, gpu: NvmlGpu, check: str, fn: Callable[..., T], *args: Any) -> T | None:
        """fn(*args), or None when this GPU cannot answer; "GPU is lost" and a broken NVML propagate."""
        if check in gpu.unsupported:
            return None
        try:
            return fn(*args)
        except self._errors.unsupported as exc:
            log.info("nvml: GPU %s: %s not supported (%s)", gpu.label, check, exc)
            gpu.unsupported.add(check)
            return None
        except (self._errors.gpu_lost, *self._errors.session_broken):
            raise
        except self._errors.base as exc:
            key = (check, int(getattr(exc, "value", -1)))
            if key not in gpu.errors_logged:  # once per kind of error: a poll every minute must not flood logs
                gpu.errors_logged.add(key)
                log.warning("nvml: GPU %s: %s failed: %s", gpu.label, check, exc)
            return None

    def _poll_ecc(self, gpu: NvmlGpu, found: list[Found]) -> None:
        nvml = self.nvml
        count = self._query(
            gpu,
            "ecc",
            nvml.nvmlDeviceGetTotalEccErrors,
            gpu.handle,
            getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
            getattr(nvml, "NVML_VOLATILE_ECC", 0),
        )
        if count is None:
            return
        count = int(count)
        previous = gpu.ecc_uncorrected
        gpu.ecc_uncorrected = count
        # The volatile counter starts at driver load: a count already there at start happened during this boot.
        if count > (previous or 0):
            message = f"volatile uncorrectable ECC errors: {count} (+{count - (previous or 0)})"
            found.append(self._state_record(gpu, NVML_ECC_UNCORRECTED, f"ecc-uncorrected-{count}", message))

    def _poll_retired_pages(self, gpu: NvmlGpu, found: list[Found]) -> None:
        pending = self._query(gpu, "retired_pages", self.nvml.nvmlDeviceGetRetiredPagesPendingStatus, gpu.handle)
        if pending is None:
            return
        now = bool(int(pending))
        if now and not gpu.retired_pending:
            message = "retired pages pending: a GPU reset or reboot is needed to retire them"
            found.append(self._state_record(gpu, NVML_RETIRED_PAGES_PENDING, "retired-pending", message))
        elif gpu.retired_pending and not now:
            self._cleared(gpu, "retired-pending")
        gpu.retired_pending = now

    def _poll_remapped_rows(self, gpu: NvmlGpu, found: list[Found]) -> None:
        rows = self._query(gpu, "remapped_rows", self.nvml.nvmlDeviceGetRemappedRows, gpu.handle)
        if rows is None:
            return
        corrected, uncorrected, is_pending, failure = (int(value) for value in rows)
        counts = f"(rows remapped: {corrected} correctable, {uncorrected} uncorrectable)"
        if failure and not gpu.remap_failure:
            message = f"row remapping failure {counts}"
            found.append(self._state_record(gpu, NVML_REMAP_FAILURE, "remap-failure", message))
        elif gpu.remap_failure and not failure:
            self._cleared(gpu, "remap-failure")
        if is_pending and not gpu.remap_pending:
            message = f"row remapping pending: a GPU reset is needed to apply it {counts}"
            found.append(self._state_record(gpu, NVML_REMAP_PENDING, "remap-pending", message))
        elif gpu.remap_pending and not is_pending:
            self._cleared(gpu, "remap-pending")
        gpu.remap_failure = bool(failure)
        gpu.remap_pending = bool(is_pending)

    def _poll_recovery_action(self, gpu: NvmlGpu, found: list[Found]) -> None:
        nvml = self.nvml
        field_id = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", _FI_GPU_RECOVERY_ACTION)
        values = self._query(gpu, "recovery_action", nvml.nvmlDeviceGetFieldValues, gpu.handle, [field_id])
        if values is None:
            return
        value = values[0]
        ret = int(value.nvmlReturn)
        if ret != getattr(nvml, "NVML_SUCCESS", 0):
            # Each field value carries its own status; the call as a whole succeeded.
            if ret == getattr(nvml, "NVML_ERROR_GPU_IS_LOST", 15):
                raise self._errors.gpu_lost()
            unsupported = (
                getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3),
                getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13),
            )
            if ret in unsupported:
                log.info("nvml: GPU %s: recovery action field not supported", gpu.label)
                gpu.unsupported.add("recovery_action")
            return
        member = _VALUE_MEMBERS.get(int(value.valueType), "uiVal")
        self._recovery_transition(gpu, int(getattr(value.value, member)), found)

    def _recovery_transition(self, gpu: NvmlGpu, action: int, found: list[Found]) -> None:
        previous = gpu.recovery_action
        if action == previous:
            return
        gpu.recovery_action = action
        if previous != 0:
            self._cleared(gpu, f"recovery-{previous}")
        if action == 0:
            log.info("nvml: GPU %s: recovery action cleared", gpu.label)
            return
        suffix, name = self._recovery_actions.get(action, (str(action), "Unknown"))
        previous_name = self._recovery_actions.get(previous, (str(previous), "Unknown"))[1]
        found.append(
            self._state_record(
                gpu,
                f"{NVML_RECOVERY_ACTION_PREFIX}{suffix}",
                f"recovery-{action}",
                f"GPU recovery action: {name} ({action})",
                recovery_action_from=previous_name,
                recovery_action_to=name,
                recovery_action_from_code=previous,
                recovery_action_to_code=action,
            )
        )


def nvml_available(nvml: Any = None, timeout: float = 10.0) -> bool:
    """Whether this host has NVIDIA's driver library (the CLI's default for --nvml). Only a missing libnvidia-ml
    turns the source off: a driver not loaded yet at boot, or an nvmlInit that hangs, means the GPUs are there,
    and the source reports INSUFFICIENT_DATA until NVML answers, then recovers by itself."""
    try:
        if nvml is None:
            import pynvml

            nvml = pynvml
        base = getattr(nvml, "NVMLError", Exception)
    except ImportError:
        return False
    library_not_found = getattr(nvml, "NVMLError_LibraryNotFound", None)

    def init_and_shutdown() -> None:
        nvml.nvmlInit()
        nvml.nvmlShutdown()

    try:
        _Worker("nvml-check").submit(init_and_shutdown).result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        log.warning("nvml: nvmlInit did not return within %.0fs; watching NVML anyway", timeout)
        return True
    except base as exc:
        if library_not_found is not None and isinstance(exc, library_not_found):
            log.info("nvml: not available (%s); NVML source off", exc)
            return False
        log.warning("nvml: nvmlInit failed (%s); watching NVML anyway (INSUFFICIENT_DATA until it works)", exc)
        return True
    return True


class _NoGpus(Exception):
    """nvmlInit worked but there is no GPU to watch: as good as no NVML for this probe."""
