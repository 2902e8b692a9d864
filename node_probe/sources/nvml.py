"""NVML as a fault source: Xid / ECC / GPU-unavailable / recovery-action events, and a slower poll of state that
events do not carry (uncorrectable ECC counts, pending retired pages, row remapping, the R575+ drivers' flags, the
recovery action field, "GPU is lost"), NVIDIA's standing verdicts among them (classify/verdicts.py), and warnings
that are never repairs (clocks slowed, a PCIe link below its maximum: nvml_warnings.py).

The pynvml module is a constructor argument, so tests pass a stand-in with pynvml's own function names, return
types and exception classes, and the real module drops in unchanged.

Every NVML call runs on one daemon thread (`NvmlWorker`): nvmlEventSetWait blocks, and a driver in trouble can hang
any call. A call that outlives its timeout makes the source INSUFFICIENT_DATA; no second call is started behind
it, and once it returns the source re-initialises by itself. Nothing latches.

This module is the source's async side: scheduling, timeouts, status. What runs on the NVML thread is in layers
NvmlSource inherits: the session (nvml_session.py), polling (nvml_poll.py) and the event loop (nvml_events.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from node_probe.classify.record import FaultRecord
from node_probe.sources.base import Observation, SourceStatus, TrackedStatus
from node_probe.sources.nvml_events import NvmlEvents
from node_probe.sources.nvml_session import NoGpus, NvmlGpu, NvmlSession, NvmlWorker

log = logging.getLogger(__name__)

T = TypeVar("T")

SOURCE_NAME = "nvml"


class _Unavailable(Exception):
    """NVML cannot be used right now; the message is the status reason."""


class NvmlSource(NvmlEvents, TrackedStatus):
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
        NvmlEvents.__init__(self, nvml)
        TrackedStatus.__init__(self, "nvml: not initialised yet")
        self._poll_interval = poll_interval
        self._event_timeout = event_timeout
        self._call_timeout = call_timeout
        self._check_timeout = min(check_timeout, call_timeout)
        self._retry_initial = retry_initial
        self._retry_max = retry_max
        self._worker = NvmlWorker("nvml")
        self._session: NvmlSession | None = None
        self._hung: concurrent.futures.Future[Any] | None = None
        self._hung_call = ""
        self._hung_since = 0.0

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

    def gpu_readings(self) -> dict[str, Any]:
        """Per GPU (by PCI address), its clock event reasons and PCIe link as the last poll read them and the warnings
        that hold, for /healthz: what the poll kept, so answering never waits on NVML."""
        return {gpu.label: {"uuid": gpu.uuid, **gpu.warnings.view} for gpu in self.gpus}

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

    async def _watch(self, session: NvmlSession) -> AsyncIterator[Observation]:
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
            if not isinstance(exc, (self._errors.base, NoGpus)):
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
        if isinstance(result, NvmlSession) and self._session is None:
            self._session = result  # a late nvmlInit: its session is as good as a new one

    async def _close(self, session: NvmlSession) -> None:
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
        if isinstance(exc, _Unavailable | NoGpus):
            return str(exc)
        if isinstance(exc, self._errors.base):
            return f"nvml: {what}: {exc}"
        return f"nvml: {what} failed: {exc!r}"

    def _observation(self, record: FaultRecord, position: str) -> Observation:
        return Observation(record, self.name, position)


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
        NvmlWorker("nvml-check").submit(init_and_shutdown).result(timeout=timeout)
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
