"""NVIDIA's raw answers, recorded as NVML gave them: the readings half of tests/gpu/check_real_gpu.py.

Every call is made on its own and kept as {"call", "value"} (structs and unions as dicts of all their fields, arrays
as lists) or {"call", "error"} (the exception's class and NVML's return code), so one failing call costs only its own
answer and a whole reading can become a recorded fixture for the unit tests. Nothing here judges an answer
(tests/gpu/verdict.py does); imports nothing of ours, and pynvml only as the module it is handed.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import subprocess
from collections.abc import Callable, Iterable
from typing import Any

# What the raw readings call in pynvml (nvidia-ml-py 13.x has them all).
PYNVML_NAMES = (
    "nvmlDeviceGetFieldValues",
    "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
    "nvmlDeviceGetSramEccErrorStatus",
    "c_nvmlEccSramErrorStatus_v1_t",
    "nvmlDeviceGetRepairStatus",
    "c_nvmlRepairStatus_t",
    "nvmlDeviceGetUnrepairableMemoryFlag_v1",
    "c_nvmlUnrepairableMemory_v1_t",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetRowRemapperHistogram",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetCount",
)
FIELD_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, where an older pynvml lacks the name
# nvmlValueType_t -> the c_nvmlValue_t member that holds it
VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def jsonable(value: Any) -> Any:
    """A pynvml answer as JSON: structs and unions as dicts of all their fields, arrays as lists, ints as ints."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, ctypes.Structure | ctypes.Union):
        return struct_to_dict(value)
    if isinstance(value, ctypes.Array):
        return [jsonable(item) for item in value]
    if isinstance(value, ctypes._Pointer):
        return None if not value else {"pointer": ctypes.cast(value, ctypes.c_void_p).value}
    if isinstance(value, ctypes._SimpleCData):
        return jsonable(value.value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    return repr(value)


def struct_to_dict(struct: ctypes.Structure | ctypes.Union) -> dict[str, Any]:
    """Every field of a ctypes struct, in declaration order; a union also gives its bytes (only one member is real)."""
    out: dict[str, Any] = {}
    for field in struct._fields_:
        name = field[0]
        out[name] = jsonable(getattr(struct, name))
    if isinstance(struct, ctypes.Union):
        out["_bytes"] = bytes(struct).hex()
    return out


def field_value_to_dict(value: Any) -> dict[str, Any]:
    """One c_nvmlFieldValue_t: all its fields, plus `decoded`, the union member its valueType names."""
    out = struct_to_dict(value)
    member = VALUE_MEMBERS.get(out.get("valueType", -1))
    out["decoded"] = jsonable(getattr(value.value, member)) if member is not None else None
    return out


def describe_error(exc: BaseException) -> dict[str, Any]:
    """The exception as a fixture needs it: its class, and NVML's return code for an NVMLError."""
    message = ""
    with contextlib.suppress(Exception):
        message = str(exc)
    code = getattr(exc, "value", None)
    return {
        "class": type(exc).__name__,
        "module": type(exc).__module__,
        "nvml_return": code if isinstance(code, int) else None,
        "message": message,
    }


def record(call: str, fn: Callable[[], Any], convert: Callable[[Any], Any] = jsonable) -> dict[str, Any]:
    """Run one call: {"call", "value"} with its answer, or {"call", "error"} with what it raised."""
    try:
        answer = fn()
    except Exception as exc:
        return {"call": call, "error": describe_error(exc)}
    try:
        return {"call": call, "value": convert(answer)}
    except Exception as exc:
        return {"call": call, "value": repr(answer), "error": describe_error(exc)}


def calling(nvml: Any, function: str, *args: Any) -> Callable[[], Any]:
    """A call of pynvml's `function` for record(): a name this pynvml lacks fails inside it (AttributeError)."""
    return lambda: getattr(nvml, function)(*args)


def bit_names(value: int, nvml: Any, prefixes: Iterable[str]) -> list[str]:
    """The pynvml constant names (single bits) set in a clock event/throttle reason mask."""
    names: set[str] = set()
    for prefix in prefixes:
        for attr in dir(nvml):
            bit = getattr(nvml, attr, None)
            if attr.startswith(prefix) and isinstance(bit, int) and bit > 0 and bit & (bit - 1) == 0 and value & bit:
                names.add(attr.removeprefix(prefix))
    return sorted(names)


def raw_struct_call(nvml: Any, function: str, handle: Any, struct_class: str) -> dict[str, Any]:
    """Call an NVML function that fills a versioned struct, as pynvml does, and return every field of it
    (pynvml's own wrapper returns only some)."""
    struct = getattr(nvml, struct_class)()
    fn = nvml._nvmlGetFunctionPointer(function)
    nvml._nvmlCheckReturn(fn(handle, ctypes.byref(struct)))
    return struct_to_dict(struct)


def pynvml_version(nvml: Any) -> dict[str, Any]:
    from importlib import metadata

    version = None
    with contextlib.suppress(Exception):
        version = metadata.version("nvidia-ml-py")
    return {"nvidia_ml_py": version, "file": getattr(nvml, "__file__", None)}


def nvidia_smi_list() -> dict[str, Any]:
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    except Exception as exc:
        return {"error": describe_error(exc)}
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return {"exit_code": done.returncode, "gpu_lines": sum(1 for line in lines if line.startswith("GPU ")),
            "lines": lines, "stderr": done.stderr.strip()[-500:]}  # fmt: skip


def read_gpu_raw(nvml: Any, index: int) -> dict[str, Any]:
    """Every raw reading of one GPU; each call on its own, so one failing call costs only its own answer."""
    out: dict[str, Any] = {"index": index}
    handle_entry = record(f"nvmlDeviceGetHandleByIndex({index})", lambda: nvml.nvmlDeviceGetHandleByIndex(index),
                          convert=lambda h: "ok")  # fmt: skip
    if "error" in handle_entry:
        out["handle"] = handle_entry
        return out
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    out["name"] = record("nvmlDeviceGetName", lambda: nvml.nvmlDeviceGetName(h))
    out["pci_bus_id"] = record("nvmlDeviceGetPciInfo.busId", lambda: nvml.nvmlDeviceGetPciInfo(h).busId)
    out["uuid"] = record("nvmlDeviceGetUUID", lambda: nvml.nvmlDeviceGetUUID(h))
    field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", FIELD_GPU_RECOVERY_ACTION)
    out["recovery_action"] = record(
        f"nvmlDeviceGetFieldValues(handle, [{field}])",
        lambda: nvml.nvmlDeviceGetFieldValues(h, [field]),
        convert=lambda values: [field_value_to_dict(v) for v in values],
    )
    # Deprecated by the recovery action, still answered by some drivers: 226 reset status, 227 drain-and-reset.
    out["reset_status_fields_deprecated"] = record(
        "nvmlDeviceGetFieldValues(handle, [226, 227])",
        lambda: nvml.nvmlDeviceGetFieldValues(h, [226, 227]),
        convert=lambda values: [field_value_to_dict(v) for v in values],
    )

    def sram() -> dict[str, Any]:
        status = nvml.c_nvmlEccSramErrorStatus_v1_t()
        returned = nvml.nvmlDeviceGetSramEccErrorStatus(h, ctypes.byref(status))
        return {"returned": jsonable(returned), "struct": struct_to_dict(status)}

    out["sram_ecc_error_status"] = record("nvmlDeviceGetSramEccErrorStatus(handle, byref(status_v1))", sram)
    out["repair_status"] = record("nvmlDeviceGetRepairStatus", lambda: nvml.nvmlDeviceGetRepairStatus(h))
    out["repair_status_struct"] = record(
        "nvmlDeviceGetRepairStatus(handle, byref(c_nvmlRepairStatus_t))",
        lambda: raw_struct_call(nvml, "nvmlDeviceGetRepairStatus", h, "c_nvmlRepairStatus_t"),
    )
    out["unrepairable_memory"] = record(
        "nvmlDeviceGetUnrepairableMemoryFlag_v1", lambda: nvml.nvmlDeviceGetUnrepairableMemoryFlag_v1(h)
    )
    out["unrepairable_memory_struct"] = record(
        "nvmlDeviceGetUnrepairableMemoryFlag_v1(handle, byref(c_nvmlUnrepairableMemory_v1_t))",
        lambda: raw_struct_call(nvml, "nvmlDeviceGetUnrepairableMemoryFlag_v1", h, "c_nvmlUnrepairableMemory_v1_t"),
    )
    out["remapped_rows"] = record(
        "nvmlDeviceGetRemappedRows -> (corrRows, uncRows, isPending, failureOccurred)",
        lambda: nvml.nvmlDeviceGetRemappedRows(h),
    )
    out["row_remapper_histogram"] = record(
        "nvmlDeviceGetRowRemapperHistogram", lambda: nvml.nvmlDeviceGetRowRemapperHistogram(h)
    )
    out["retired_pages_pending"] = record(
        "nvmlDeviceGetRetiredPagesPendingStatus", lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(h)
    )
    for cause, label in ((0, "multiple_single_bit"), (1, "double_bit")):
        out[f"retired_pages_{label}"] = record(
            f"nvmlDeviceGetRetiredPages(handle, {cause})", calling(nvml, "nvmlDeviceGetRetiredPages", h, cause)
        )
    reasons = ("nvmlClocksEventReason", "nvmlClocksThrottleReason")
    for key, function in (
        ("clocks_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons"),
        ("clocks_throttle_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
        ("supported_clocks_event_reasons", "nvmlDeviceGetSupportedClocksEventReasons"),
    ):
        entry = record(function, calling(nvml, function, h))
        if isinstance(entry.get("value"), int):
            entry["hex"] = hex(entry["value"])
            entry["names"] = bit_names(entry["value"], nvml, reasons)
        out[key] = entry
    for key, function in (
        ("pcie_link_width_current", "nvmlDeviceGetCurrPcieLinkWidth"),
        ("pcie_link_width_max", "nvmlDeviceGetMaxPcieLinkWidth"),
        ("pcie_link_generation_current", "nvmlDeviceGetCurrPcieLinkGeneration"),
        ("pcie_link_generation_max", "nvmlDeviceGetMaxPcieLinkGeneration"),
        ("pcie_link_generation_gpu_max", "nvmlDeviceGetGpuMaxPcieLinkGeneration"),
    ):
        out[key] = record(function, calling(nvml, function, h))
    out["ecc_mode"] = record("nvmlDeviceGetEccMode -> [current, pending]", lambda: nvml.nvmlDeviceGetEccMode(h))
    for error_type, etype in (("uncorrected", 1), ("corrected", 0)):
        for counter, ctype in (("volatile", 0), ("aggregate", 1)):
            out[f"ecc_{error_type}_{counter}"] = record(
                f"nvmlDeviceGetTotalEccErrors(handle, {etype}, {ctype})",
                calling(nvml, "nvmlDeviceGetTotalEccErrors", h, etype, ctype),
            )
    return out


def read_raw(nvml: Any) -> dict[str, Any]:
    """NVIDIA's newest verdicts for every GPU, read raw through pynvml (initialised here, shut down after)."""
    out: dict[str, Any] = {"pynvml": pynvml_version(nvml)}
    out["nvmlInit"] = record("nvmlInit", calling(nvml, "nvmlInit"))
    if "error" in out["nvmlInit"]:
        return out
    try:
        for key, function in (
            ("driver_version", "nvmlSystemGetDriverVersion"),
            ("nvml_version", "nvmlSystemGetNVMLVersion"),
            ("cuda_driver_version", "nvmlSystemGetCudaDriverVersion_v2"),
            ("device_count", "nvmlDeviceGetCount"),
        ):
            out[key] = record(function, calling(nvml, function))
        out["nvidia_smi_L"] = nvidia_smi_list()
        count = out["device_count"].get("value")
        out["gpus"] = []
        for index in range(count if isinstance(count, int) else 0):
            try:
                out["gpus"].append(read_gpu_raw(nvml, index))
            except Exception as exc:
                out["gpus"].append({"index": index, "error": describe_error(exc)})
    finally:
        out["nvmlShutdown"] = record("nvmlShutdown", calling(nvml, "nvmlShutdown"))
    return out
