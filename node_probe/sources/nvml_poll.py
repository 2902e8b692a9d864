"""Polling the NVML source's GPUs for state that events do not carry: uncorrectable ECC counts, pending retired
pages, row remapping, the R575+ drivers' flags (SRAM error threshold, unrepairable memory, channel and TPC repair
pending), the recovery action field, "GPU is lost", and the warnings that are never repairs (clocks slowed by
hardware or heat, a PCIe link below its maximum: nvml_warnings.py decides what counts).

A finding goes out when a condition appears, not on every poll, and its id names the condition and how often it
cleared before, so a probe restart within a boot re-sends the same id. NVIDIA's standing verdicts (the recovery
action, the flags, a row-remapping failure) also send a finding when they clear, its action ACTION_NONE, so that the
health workflow lets go of the verdict. Every method here runs on the NVML thread.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from contract.probe import (
    ACTION_NONE,
    ACTION_REPLACE,
    ACTION_RESET_GPU,
    VERDICT_CHANNEL_REPAIR_PENDING,
    VERDICT_RECOVERY_ACTION,
    VERDICT_ROW_REMAP_FAILURE,
    VERDICT_SRAM_THRESHOLD_EXCEEDED,
    VERDICT_TPC_REPAIR_PENDING,
    VERDICT_UNREPAIRABLE_MEMORY,
)
from node_probe.classify.policy import (
    CLEARED_SUFFIX,
    NVML_CHANNEL_REPAIR_PENDING,
    NVML_RECOVERY_ACTION_PREFIX,
    NVML_REMAP_FAILURE,
    NVML_SRAM_THRESHOLD_EXCEEDED,
    NVML_TPC_REPAIR_PENDING,
    NVML_UNREPAIRABLE_MEMORY,
)
from node_probe.classify.record import FaultRecord
from node_probe.classify.verdicts import RECOVERY_ACTIONS, UNKNOWN_ACTION_NAME, RecoveryAction, recovery_action
from node_probe.host import boot_id
from node_probe.sources.nvml_session import NvmlGpu, NvmlSession, NvmlSessionCalls
from node_probe.sources.nvml_warnings import (
    CLOCK_CALLS,
    PCIE_CHECK,
    PCIE_CONDITION,
    ClockBits,
    GpuWarning,
    PcieLink,
    pcie_warning,
)

# One logger for the whole NVML source, whichever of its modules logs, so that one filter catches all its lines.
log = logging.getLogger("node_probe.sources.nvml")

T = TypeVar("T")

NVML_REMAP_PENDING = "NVML_REMAP_PENDING"
NVML_ECC_UNCORRECTED = "NVML_ECC_UNCORRECTED"
NVML_RETIRED_PAGES_PENDING = "NVML_RETIRED_PAGES_PENDING"

# Documented value, used where an older pynvml lacks the constant.
_FI_GPU_RECOVERY_ACTION = 230
# nvmlValueType_t -> the c_nvmlValue_t union member holding it.
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class StandingVerdict(NamedTuple):
    """One of NVIDIA's verdicts that a polled flag states: what its findings say when it appears and when it clears."""

    condition: str  # in the finding ids and NvmlGpu.verdicts
    reason: str
    verdict: str
    action: str
    appeared: str
    cleared: str


_REMAP_FAILURE = StandingVerdict(
    "remap-failure",
    NVML_REMAP_FAILURE,
    VERDICT_ROW_REMAP_FAILURE,
    ACTION_REPLACE,
    "row remapping failure",
    "row remapping failure cleared",
)
_SRAM_THRESHOLD = StandingVerdict(
    "sram-threshold-exceeded",
    NVML_SRAM_THRESHOLD_EXCEEDED,
    VERDICT_SRAM_THRESHOLD_EXCEEDED,
    ACTION_REPLACE,
    "SRAM uncorrectable ECC errors over NVIDIA's threshold: the GPU is to be replaced",
    "SRAM ECC error threshold no longer exceeded",
)
_UNREPAIRABLE = StandingVerdict(
    "unrepairable-memory",
    NVML_UNREPAIRABLE_MEMORY,
    VERDICT_UNREPAIRABLE_MEMORY,
    ACTION_REPLACE,
    "memory NVIDIA cannot repair: the GPU is to be replaced",
    "unrepairable memory flag cleared",
)
# NVIDIA: a GPU reset applies a pending repair.
_CHANNEL_REPAIR = StandingVerdict(
    "channel-repair-pending",
    NVML_CHANNEL_REPAIR_PENDING,
    VERDICT_CHANNEL_REPAIR_PENDING,
    ACTION_RESET_GPU,
    "channel repair pending: a GPU reset applies it",
    "channel repair no longer pending",
)
_TPC_REPAIR = StandingVerdict(
    "tpc-repair-pending",
    NVML_TPC_REPAIR_PENDING,
    VERDICT_TPC_REPAIR_PENDING,
    ACTION_RESET_GPU,
    "TPC repair pending: a GPU reset applies it",
    "TPC repair no longer pending",
)

Found = tuple[FaultRecord, str]  # a record and its position (for the finding id)


class NvmlPolling(NvmlSessionCalls):
    """The poll of every GPU, and the records of the conditions it finds."""

    def __init__(self, nvml: Any) -> None:
        super().__init__(nvml)
        self._clock_bits = ClockBits(nvml)
        self._recovery_actions = dict(RECOVERY_ACTIONS)
        for attr in dir(nvml):
            # Newer drivers' actions come with newer pynvml constants: name them from there.
            if attr.startswith("NVML_GPU_RECOVERY_ACTION_"):
                code = getattr(nvml, attr)
                if isinstance(code, int) and code not in self._recovery_actions:
                    suffix = attr.removeprefix("NVML_GPU_RECOVERY_ACTION_")
                    name = suffix.replace("_", " ").title()
                    self._recovery_actions[code] = RecoveryAction(suffix, name, recovery_action(code, name))

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
            self._poll_sram_threshold(gpu, found)
            self._poll_unrepairable_memory(gpu, found)
            self._poll_repair_status(gpu, found)
            self._poll_recovery_action(gpu, found)
            self._poll_warnings(gpu, found)
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

    def _bindings(self, gpu: NvmlGpu, check: str, *names: str) -> list[Any] | None:
        """pynvml's functions and structs `names`, or None where this pynvml is older than them: the check is not
        supported on this GPU then, as where the driver lacks it, and said once."""
        if check in gpu.unsupported:
            return None
        bound = [getattr(self.nvml, name, None) for name in names]
        missing = [name for name, value in zip(names, bound, strict=True) if value is None]
        if missing:
            log.info("nvml: GPU %s: %s not supported (pynvml lacks %s)", gpu.label, check, ", ".join(missing))
            gpu.unsupported.add(check)
            return None
        return bound

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
        self._standing(gpu, _REMAP_FAILURE, bool(failure), found, f" {counts}")
        if is_pending and not gpu.remap_pending:
            message = f"row remapping pending: a GPU reset is needed to apply it {counts}"
            found.append(self._state_record(gpu, NVML_REMAP_PENDING, "remap-pending", message))
        elif gpu.remap_pending and not is_pending:
            self._cleared(gpu, "remap-pending")
        gpu.remap_pending = bool(is_pending)

    def _poll_sram_threshold(self, gpu: NvmlGpu, found: list[Found]) -> None:
        bound = self._bindings(gpu, "sram_ecc", "nvmlDeviceGetSramEccErrorStatus", "c_nvmlEccSramErrorStatus_v1_t")
        if bound is None:
            return
        get_status, status_type = bound

        def exceeded() -> bool:
            status = status_type()  # its constructor sets the version NVML checks
            # A pointer, not the struct: pynvml hands this argument to the C function as it is, and a ctypes
            # structure alone would be passed by value where NVML writes through a pointer.
            get_status(gpu.handle, ctypes.pointer(status))
            return bool(int(status.bThresholdExceeded))

        holds = self._query(gpu, "sram_ecc", exceeded)
        if holds is not None:
            self._standing(gpu, _SRAM_THRESHOLD, holds, found)

    def _poll_unrepairable_memory(self, gpu: NvmlGpu, found: list[Found]) -> None:
        bound = self._bindings(gpu, "unrepairable_memory", "nvmlDeviceGetUnrepairableMemoryFlag_v1")
        if bound is None:
            return
        flag = self._query(gpu, "unrepairable_memory", bound[0], gpu.handle)
        if flag is not None:
            self._standing(gpu, _UNREPAIRABLE, bool(int(flag)), found)

    def _poll_repair_status(self, gpu: NvmlGpu, found: list[Found]) -> None:
        bound = self._bindings(gpu, "repair_status", "nvmlDeviceGetRepairStatus")
        if bound is None:
            return
        status = self._query(gpu, "repair_status", bound[0], gpu.handle)
        if status is None:
            return
        channel, tpc = (bool(int(value)) for value in status)
        self._standing(gpu, _CHANNEL_REPAIR, channel, found)
        self._standing(gpu, _TPC_REPAIR, tpc, found)

    def _standing(
        self, gpu: NvmlGpu, verdict: StandingVerdict, holds: bool, found: list[Found], detail: str = ""
    ) -> None:
        """A finding when the verdict appears, and one withdrawing it (ACTION_NONE, its own reason) when it clears."""
        held = verdict.condition in gpu.verdicts
        if holds == held:
            return
        if holds:
            gpu.verdicts.add(verdict.condition)
            record = self._state_record(
                gpu,
                verdict.reason,
                verdict.condition,
                verdict.appeared + detail,
                nvidia_verdict=verdict.verdict,
                nvidia_action=verdict.action,
            )
            found.append(record)
            return
        gpu.verdicts.discard(verdict.condition)
        # Its own condition, counted in step with the verdict's: episode n of the one withdraws episode n of the other.
        withdrawn = f"{verdict.condition}-cleared"
        found.append(
            self._state_record(
                gpu,
                verdict.reason + CLEARED_SUFFIX,
                withdrawn,
                verdict.cleared + detail,
                nvidia_verdict=verdict.verdict,
                nvidia_action=ACTION_NONE,
            )
        )
        self._cleared(gpu, verdict.condition)
        self._cleared(gpu, withdrawn)

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
        """A finding for each change of the recovery action, back to None (0) included: that one withdraws the
        verdict. Each value counts its own episodes, so 0 -> 1 -> 0 -> 1 is recovery-1:0, recovery-0:1, recovery-1:1."""
        previous = gpu.recovery_action
        if action == previous:
            return
        gpu.recovery_action = action
        self._cleared(gpu, f"recovery-{previous}")
        now, before = self._recovery_named(action), self._recovery_named(previous)
        if action == 0:
            log.info("nvml: GPU %s: recovery action cleared (was %s)", gpu.label, before.name)
        found.append(
            self._state_record(
                gpu,
                f"{NVML_RECOVERY_ACTION_PREFIX}{now.suffix}",
                f"recovery-{action}",
                f"GPU recovery action: {now.name} ({action}), was {before.name} ({previous})",
                recovery_action_from=before.name,
                recovery_action_to=now.name,
                recovery_action_from_code=previous,
                recovery_action_to_code=action,
                nvidia_verdict=VERDICT_RECOVERY_ACTION,
                nvidia_action=recovery_action(action, now.name),
            )
        )

    def _poll_warnings(self, gpu: NvmlGpu, found: list[Found]) -> None:
        """The clock event reasons and the PCIe link: three NVML calls a GPU, once its link's maximum is known."""
        mask = self._clock_reasons(gpu)
        if mask is not None:
            for condition, warning in self._clock_bits.warnings(mask).items():
                self._warning(gpu, condition, warning, found)
        link = self._pcie_link(gpu)
        if link is not None:
            idle = None if mask is None else self._clock_bits.idle(mask)
            held = PCIE_CONDITION in gpu.warnings.holding
            self._warning(gpu, PCIE_CONDITION, pcie_warning(link, idle, held), found)
        gpu.warnings.publish(mask, link, self._clock_bits, gpu.unsupported)

    def _clock_reasons(self, gpu: NvmlGpu) -> int | None:
        for check, name in CLOCK_CALLS:
            if check in gpu.unsupported:
                continue
            call = getattr(self.nvml, name, None)
            if call is None:
                # Said only when neither name is there: a pynvml before 12.535 lacks the newer one and reads the older.
                gpu.unsupported.add(check)
                if all(known in gpu.unsupported for known, _ in CLOCK_CALLS):
                    lacks = " and ".join(called for _, called in CLOCK_CALLS)
                    log.info("nvml: GPU %s: clock event reasons not supported (pynvml lacks %s)", gpu.label, lacks)
                continue
            mask = self._query(gpu, check, call, gpu.handle)
            # Only "not supported" moves on: a driver before R535 lacks the newer call, and the older one answers.
            if mask is not None or check not in gpu.unsupported:
                return None if mask is None else int(mask)
        return None

    def _pcie_link(self, gpu: NvmlGpu) -> PcieLink | None:
        bound = self._bindings(
            gpu,
            PCIE_CHECK,
            "nvmlDeviceGetCurrPcieLinkWidth",
            "nvmlDeviceGetCurrPcieLinkGeneration",
            "nvmlDeviceGetMaxPcieLinkWidth",
            # The most the GPU and the host's slot can both do, not the GPU's own maximum
            # (nvmlDeviceGetGpuMaxPcieLinkGeneration): a gen 5 GPU in a gen 4 slot at gen 4 has all the link it can get.
            "nvmlDeviceGetMaxPcieLinkGeneration",
        )
        if bound is None:
            return None
        width_now, generation_now, width_max, generation_max = bound
        warnings = gpu.warnings

        def read() -> PcieLink:
            if warnings.link_max is None:
                warnings.link_max = (int(width_max(gpu.handle)), int(generation_max(gpu.handle)))
            width, generation = warnings.link_max
            return PcieLink(int(width_now(gpu.handle)), width, int(generation_now(gpu.handle)), generation)

        return self._query(gpu, PCIE_CHECK, read)

    def _warning(self, gpu: NvmlGpu, condition: str, warning: GpuWarning | None, found: list[Found]) -> None:
        """A finding when the warning appears; when it clears, only a new episode: a warning withdraws no verdict."""
        held = gpu.warnings.holding.get(condition)
        if warning is not None and held is None:
            gpu.warnings.holding[condition] = warning.reason
            found.append(self._state_record(gpu, warning.reason, condition, warning.message))
        elif warning is None and held is not None:
            del gpu.warnings.holding[condition]
            log.info("nvml: GPU %s: %s cleared", gpu.label, held)
            self._cleared(gpu, condition)

    def _recovery_named(self, code: int) -> RecoveryAction:
        return self._recovery_actions.get(code) or RecoveryAction(str(code), UNKNOWN_ACTION_NAME, "")

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
