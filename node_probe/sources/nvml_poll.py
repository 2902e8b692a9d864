"""Polling the NVML source's GPUs for state that events do not carry: uncorrectable ECC counts, pending retired
pages, row remapping, the recovery action field, "GPU is lost".

A finding goes out when a condition appears, not on every poll, and its id names the condition and how often it
cleared before, so a probe restart within a boot re-sends the same id. Every method here runs on the NVML thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from node_probe.classify.policy import NVML_RECOVERY_ACTION_PREFIX, NVML_REMAP_FAILURE
from node_probe.classify.record import FaultRecord
from node_probe.host import boot_id
from node_probe.sources.nvml_session import NvmlGpu, NvmlSession, NvmlSessionCalls

# One logger for the whole NVML source, whichever of its modules logs, so that one filter catches all its lines.
log = logging.getLogger("node_probe.sources.nvml")

T = TypeVar("T")

NVML_REMAP_PENDING = "NVML_REMAP_PENDING"
NVML_ECC_UNCORRECTED = "NVML_ECC_UNCORRECTED"
NVML_RETIRED_PAGES_PENDING = "NVML_RETIRED_PAGES_PENDING"

# Documented value, used where an older pynvml lacks the constant.
_FI_GPU_RECOVERY_ACTION = 230
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

Found = tuple[FaultRecord, str]  # a record and its position (for the finding id)


class NvmlPolling(NvmlSessionCalls):
    """The poll of every GPU, and the records of the conditions it finds."""

    def __init__(self, nvml: Any) -> None:
        super().__init__(nvml)
        self._recovery_actions = dict(_RECOVERY_ACTIONS)
        for attr in dir(nvml):
            # Newer drivers' actions come with newer pynvml constants: name them from there.
            if attr.startswith("NVML_GPU_RECOVERY_ACTION_"):
                code = getattr(nvml, attr)
                if isinstance(code, int) and code not in self._recovery_actions:
                    suffix = attr.removeprefix("NVML_GPU_RECOVERY_ACTION_")
                    self._recovery_actions[code] = (suffix, suffix.replace("_", " ").title())

    def _poll(self, session: NvmlSession) -> list[Found]:
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

    def _state_position(self, gpu_id: str, condition: str, episode: int) -> str:
        # Stable across probe restarts within a boot: a re-sent state finding has the same id and is dropped.
        return f"state:{boot_id()}:{gpu_id}:{condition}:{episode}"
