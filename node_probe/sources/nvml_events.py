"""The NVML source's event loop: waiting on the event set (nvmlEventSetWait) and turning each event (Xid, double-bit
ECC, GPU unavailable, recovery action) into a record.

A wait that fails at once (a GPU lost, an NVML error) pauses the loop rather than spin. An event that a poll can
say more about (GPU lost, recovery action) asks the GPU through NvmlPolling. Every method here runs on the NVML
thread.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from node_probe.classify.policy import NVML_GPU_UNAVAILABLE
from node_probe.classify.record import FaultRecord
from node_probe.host import boot_id
from node_probe.sources.nvml_poll import Found, NvmlPolling
from node_probe.sources.nvml_session import (
    EVENT_DOUBLE_BIT_ECC,
    EVENT_GPU_UNAVAILABLE,
    EVENT_RECOVERY_ACTION,
    EVENT_XID,
    NvmlGpu,
    NvmlSession,
    handle_key,
    nvml_text,
)

# One logger for the whole NVML source, whichever of its modules logs, so that one filter catches all its lines.
log = logging.getLogger("node_probe.sources.nvml")

NVML_DOUBLE_BIT_ECC = "NVML_DOUBLE_BIT_ECC"

_UNKNOWN_XID = 999
_NO_INSTANCE = 0xFFFFFFFF


class NvmlEvents(NvmlPolling):
    """One wait on the event set at a time, and the records of the events it returns."""

    def __init__(self, nvml: Any) -> None:
        super().__init__(nvml)
        self._event_seq = 0
        self._instance = time.time_ns()  # with _event_seq, a unique position for one-off events

    def _wait(self, session: NvmlSession, timeout_ms: int) -> list[Found]:
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

    def _find_lost(self, session: NvmlSession) -> list[Found]:
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

    def _event_records(self, session: NvmlSession, data: Any) -> list[Found]:
        gpu = self._gpu_for(session, data.device)
        event_type = int(data.eventType)
        found: list[Found] = []
        if event_type & getattr(self.nvml, "nvmlEventTypeXidCriticalError", EVENT_XID):
            found.append(self._xid_record(gpu, data))
        if event_type & getattr(self.nvml, "nvmlEventTypeDoubleBitEccError", EVENT_DOUBLE_BIT_ECC):
            found.append(self._event_record(gpu, NVML_DOUBLE_BIT_ECC, "double-bit ECC error (NVML event)"))
        if event_type & getattr(self.nvml, "nvmlEventTypeGpuUnavailableError", EVENT_GPU_UNAVAILABLE):
            found.append(self._event_record(gpu, NVML_GPU_UNAVAILABLE, "GPU unavailable (NVML event)"))
        if event_type & getattr(self.nvml, "nvmlEventTypeGpuRecoveryAction", EVENT_RECOVERY_ACTION) and gpu:
            # Read the field rather than trust eventData's meaning; fall back to eventData where it is unreadable.
            before = len(found)
            try:
                self._poll_recovery_action(gpu, found)
            except self._errors.gpu_lost:
                found.extend(self._lost(gpu))
            if len(found) == before and "recovery_action" in gpu.unsupported:
                self._recovery_transition(gpu, int(data.eventData), found)
        return found

    def _gpu_for(self, session: NvmlSession, handle: Any) -> NvmlGpu | None:
        gpu = session.by_handle.get(handle_key(handle))
        if gpu is not None:
            return gpu
        try:
            uuid = nvml_text(self.nvml.nvmlDeviceGetUUID(handle))
        except self._errors.base:
            return None
        return next((g for g in session.gpus if g.uuid is not None and g.uuid == uuid), None)

    def _next_event_position(self) -> str:
        self._event_seq += 1
        return f"event:{boot_id()}:{self._instance}:{self._event_seq}"

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
