"""DCGM health as a fault source: `dcgmi health -c -j`, polled.

Only a "fail" result impairs (reason `DCGM_<SYSTEM>_FAIL`); "warn" is a warning (`DCGM_<SYSTEM>_WARN`). dcgmi not
installed = the source is not configured (it never counts for GPU health); nv-hostengine down, a timeout or a
failing command = INSUFFICIENT_DATA, and the next poll that works makes it OK again.

The JSON shape parsed here is the one dcgmi's own code builds (NVIDIA/DCGM, dcgmi/Health.cpp and
DcgmiOutput.{h,cpp}: DcgmiOutputJson prints jsoncpp's styled string of this tree, tab-indented):

    {"header": ["Health Monitor Report"],
     "body": {"Overall Health": {"value": "Failure"},
              "GPU": {"children": {"0": {"value": "Failure",
                                         "children": {"Errors": {"children": {
                                             "Memory system": {"value": "Failure",
                                                               "overflow": ["<message, cut in chunks>", ...]}}}}}}}}}

Entity groups are DCGM's names ("GPU", "Switch", "ConnectX", "CPU", ...), entity keys their DCGM ids, systems
"PCIe system", "NVLINK system", "Memory system", "SM system", "InfoROM system", "Thermal system", "Power system",
"Driver", "PMU system", "MCU system", "ConnectX system", and "Internal error" for any other (NvSwitch incidents
included); results "Healthy", "Warning", "Failure", "Internal error". The parser is tolerant: "children" wrappers
may be absent, results are matched by word (pass/healthy, warn, fail), and an overall "Failure" whose incidents
cannot be found still yields one impairing finding (`DCGM_OVERALL_FAIL`), so a shape change cannot hide a failure.
Output that is not JSON (dcgmi's text table) is a parse error, never "healthy".

Checked against real output (the samples, and where each came from, are in tests/test_dcgm_source.py): healthy
`dcgmi health -c -j` from two independent runs (tab-indented, as above), and a real `dcgmi health -c` Warning from
DCGM 4.6.1, whose text tree (GPU -> 0 -> Errors -> Power system, message in 54-character chunks) is the tree this
JSON carries. No real JSON with a Warning or Failure was found in public material; that part rests on the source.
dcgmi 2.3 and older keyed each entity by its first incident's health code (0/10/20) instead of its id, and could
drop an entity's systems ("Errors": null): ids from those versions are not GPU ids, but a failure still surfaces.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from node_probe.classify.record import FaultRecord
from node_probe.host import CommandResult, CommandRunner, boot_id, first_line, run_command
from node_probe.sources.base import Observation, SourceStatus, TrackedStatus, polled

log = logging.getLogger(__name__)

SOURCE_NAME = "dcgm"
OVERALL_HEALTH = "Overall Health"
_WATCHES_NOT_ENABLED = "watches not enabled"
Health = Literal["warn", "fail"]
_NON_WORD = re.compile(r"[^A-Z0-9]+")


@dataclass(frozen=True, slots=True)
class DcgmIncident:
    entity_group: str  # "GPU", "NvSwitch", ...
    entity_id: str
    system: str  # as dcgmi names it: "Memory system"
    health: Health
    message: str

    @property
    def reason(self) -> str:
        return f"DCGM_{system_word(self.system)}_{self.health.upper()}"


def system_word(system: str) -> str:
    """ "Memory system" -> MEMORY, "NVLINK system" -> NVLINK, "NvSwitch F" -> NVSWITCH_F."""
    words = _NON_WORD.sub("_", system.upper().removesuffix(" SYSTEM")).strip("_")
    return words or "UNKNOWN"


def _health(value: Any) -> Health | Literal["pass"] | None:
    if not isinstance(value, str):
        return None
    lowered = value.strip().lower()
    if lowered.startswith("fail"):
        return "fail"
    if lowered.startswith("warn"):
        return "warn"
    if lowered in ("healthy", "pass", "passed", "ok"):
        return "pass"
    return None  # "Internal error" and anything new: not evidence of a fault either way


def _value(node: Any) -> Any:
    return node.get("value") if isinstance(node, Mapping) else node


def _children(node: Any) -> Mapping[str, Any]:
    if not isinstance(node, Mapping):
        return {}
    children = node.get("children")
    if isinstance(children, Mapping):
        return children
    return {k: v for k, v in node.items() if k not in ("value", "overflow")}


def _message(node: Any) -> str:
    if not isinstance(node, Mapping):
        return ""
    overflow = node.get("overflow")
    if isinstance(overflow, list):
        return " ".join(str(part).strip() for part in overflow if str(part).strip())
    return str(overflow or "")


@dataclass(frozen=True, slots=True)
class DcgmHealthReport:
    overall: Health | Literal["pass"] | None
    incidents: tuple[DcgmIncident, ...]


class DcgmParseError(ValueError):
    pass


def parse_health_json(text: str) -> DcgmHealthReport:
    """Parse `dcgmi health -c -j` output (see the module docstring for the shape)."""
    start = text.find("{")
    if start < 0:
        raise DcgmParseError("no JSON object in the output")
    try:
        document = json.JSONDecoder().raw_decode(text[start:])[0]
    except json.JSONDecodeError as exc:
        raise DcgmParseError(f"invalid JSON: {exc}") from exc
    if not isinstance(document, Mapping):
        raise DcgmParseError("the JSON is not an object")
    body = document.get("body", document)
    if not isinstance(body, Mapping):
        raise DcgmParseError("'body' is not an object")
    overall = _health(_value(body.get(OVERALL_HEALTH)))
    incidents = list(_incidents(body))
    if overall == "fail" and not any(i.health == "fail" for i in incidents):
        incidents.append(DcgmIncident("", "", "OVERALL", "fail", "overall health: Failure (no failing system found)"))
    return DcgmHealthReport(overall, tuple(incidents))


def _incidents(body: Mapping[str, Any]) -> Iterator[DcgmIncident]:
    for group, group_node in body.items():
        if group == OVERALL_HEALTH or group == "header":
            continue
        for entity_id, entity_node in _children(group_node).items():
            systems = _children(_children(entity_node).get("Errors"))
            seen = False
            for system, system_node in systems.items():
                health = _health(_value(system_node))
                if health in ("warn", "fail"):
                    seen = True
                    yield DcgmIncident(group, str(entity_id), system, health, _message(system_node))
            entity_health = _health(_value(entity_node))
            if not seen and entity_health in ("warn", "fail"):
                yield DcgmIncident(group, str(entity_id), "UNKNOWN", entity_health, "no system named")


GpuLookup = Callable[[int], "tuple[str | None, str | None] | None"]


class DcgmHealthSource(TrackedStatus):
    name = SOURCE_NAME

    def __init__(
        self,
        dcgmi: str = "dcgmi",
        *,
        poll_interval: float = 60.0,
        timeout: float = 30.0,
        runner: CommandRunner = run_command,
        enable_watches: bool = True,
        gpu_lookup: GpuLookup | None = None,
    ) -> None:
        self.dcgmi = dcgmi
        self._poll = poll_interval
        self._timeout = timeout
        self._run = runner
        self._enable_watches = enable_watches
        self._gpu_lookup = gpu_lookup
        self._configured = True
        super().__init__("dcgm: not checked yet")
        # (group, entity, system) -> the health last reported; a finding goes out when one appears or worsens.
        self._open: dict[tuple[str, str, str], Health] = {}
        self._episodes: dict[tuple[str, str, str], int] = {}

    @property
    def configured(self) -> bool:
        """False while dcgmi is not installed: then this source does not count for the heartbeat's GPU health."""
        return self._configured

    def check(self) -> SourceStatus:
        if shutil.which(self.dcgmi) is None:
            self._not_configured()
        return self._status

    def observations(self) -> AsyncIterator[Observation]:
        return polled(self.poll, self._poll)

    async def poll(self) -> list[Observation]:
        """Run dcgmi once; update the status; return the findings that are new since the last poll."""
        result = await self._command("health", "-c", "-j")
        if result is None:
            return []
        if _WATCHES_NOT_ENABLED in result.output.lower() and self._enable_watches:
            # DCGM watches nothing until told to; enable all watches once (they persist in nv-hostengine).
            log.info("dcgm: health watches not enabled; enabling all (dcgmi health -s a)")
            enabled = await self._command("health", "-s", "a")
            if enabled is None:
                return []
            result = await self._command("health", "-c", "-j")
            if result is None:
                return []
        try:
            report = parse_health_json(result.stdout)
        except DcgmParseError as exc:
            detail = first_line(result.output) or str(exc)
            self._set_down(f"dcgm: dcgmi health -c -j exited {result.returncode}: {detail}")
            return []
        self._set_ok()
        return self._diff(report)

    async def _command(self, *args: str) -> CommandResult | None:
        argv = [self.dcgmi, *args]
        try:
            result = await self._run(argv, self._timeout)
        except FileNotFoundError:
            self._not_configured()
            return None
        except TimeoutError:
            self._set_down(f"dcgm: {' '.join(argv)} did not finish within {self._timeout:.0f}s (nv-hostengine hung?)")
            return None
        except OSError as exc:
            self._set_down(f"dcgm: cannot run {self.dcgmi}: {exc.strerror or exc}")
            return None
        self._configured = True
        if result.returncode != 0 and args[:2] != ("health", "-c"):
            self._set_down(f"dcgm: {' '.join(argv)} exited {result.returncode}: {first_line(result.output)}")
            return None
        return result

    def _not_configured(self) -> None:
        self._configured = False
        self._set_down(f"dcgm: {self.dcgmi} not found (source not configured)")

    def _set_ok(self) -> None:
        self._mark_ok("dcgm: health checks work")

    def _diff(self, report: DcgmHealthReport) -> list[Observation]:
        current: dict[tuple[str, str, str], DcgmIncident] = {}
        for incident in report.incidents:
            key = (incident.entity_group, incident.entity_id, incident.system)
            if key not in current or incident.health == "fail":
                current[key] = incident
        for key in [k for k in self._open if k not in current]:
            del self._open[key]
            self._episodes[key] = self._episodes.get(key, 0) + 1
        found: list[Observation] = []
        for key, incident in current.items():
            before = self._open.get(key)
            self._open[key] = incident.health
            if before == incident.health or before == "fail":
                continue  # unchanged, or better than reported: nothing new to say
            found.append(self._observation(incident, self._episodes.get(key, 0)))
        return found

    def _observation(self, incident: DcgmIncident, episode: int) -> Observation:
        pci = uuid = None
        if incident.entity_group == "GPU" and incident.entity_id.isdigit() and self._gpu_lookup is not None:
            # DCGM numbers GPUs in NVML's order, so its GPU id is the NVML index.
            identity = self._gpu_lookup(int(incident.entity_id))
            if identity is not None:
                pci, uuid = identity
        where = f"{incident.entity_group} {incident.entity_id}".strip() or "host"
        verdict = "Failure" if incident.health == "fail" else "Warning"
        record = FaultRecord(
            line=0,
            raw=f"dcgmi health: {where}: {incident.system}: {verdict}: {incident.message}",
            kind="dcgm",
            code=None,
            pci=pci,
            message=f"{where} {incident.system}: {verdict}" + (f": {incident.message}" if incident.message else ""),
            uuid=uuid,
            reason=incident.reason,
            critical=incident.health == "fail",
        )
        position = f"state:{boot_id()}:{where}:{incident.system}:{incident.health}:{episode}"
        return Observation(record, self.name, position)
