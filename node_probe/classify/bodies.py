"""What one kernel log body says on its own: an Xid, an SXid, a GPU fallen off the bus, a failed initialisation.

Stateless: kernel_log.py keeps what earlier lines said (the banner being read, the GPUs' UUIDs) and calls
`parse_body` once per distinct body text. Formats follow the open driver (kernel_rc.c, gpu.c, osinit.c, osapi.c,
error_nvswitch.h) and what older drivers printed; see the shared reference `gpu-fault-signals.md`.
"""

from __future__ import annotations

import re
from typing import Any, Final

from contract.probe import VERDICT_RECOVERY_ACTION
from node_probe.classify.record import FaultRecord
from node_probe.classify.verdicts import recovery_action

PCI = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}"
FUNC = r"(?:\.[0-9a-fA-F])?"

_XID: Final = re.compile(r"NVRM: Xid \((?P<loc>[^)]*)\): (?P<code>\d+)(?:,\s?(?P<rest>.*))?$")
# Inside the parentheses: `PCI:dddd:bb:dd`, old drivers' bare `dddd:bb:dd`, then MIG instance ids; an elided
# address (`PCI:...`) simply does not match and leaves pci unset.
_XID_LOC: Final = re.compile(r"(?:PCI:)?(?P<pci>" + PCI + r")" + FUNC + r"(?=$|\s)")
_MIG_GI: Final = re.compile(r"GPU-I:(\d+)")
_MIG_CI: Final = re.compile(r"GPU-CI:(\d+)")
# `pid=1234, name=python, msg`, older drivers' `pid='<unknown>', name=<unknown>, msg`, and `pid=1234, msg` with no
# name (an H100 cluster's Xid 64, in the MENTHOS root-cause data set).
_PROC: Final = re.compile(r"pid=(?P<pid>[^,]*)(?:, name=(?P<name>[^,]*))?(?:,\s?(?P<msg>.*))?$")
_CAUSED_BY: Final = re.compile(r"caused by previous Xid (\d+)")
_RECOVERY: Final = re.compile(
    r"GPU recovery action changed from (?P<from_code>0x[0-9a-fA-F]+) \((?P<from>[^)]*)\) "
    r"to (?P<to_code>0x[0-9a-fA-F]+) \((?P<to>[^)]*)\)"
)
_RST: Final = re.compile(r"RST: (?P<rst>Yes|No), D-RST: (?P<drst>Yes|No)")
_NVLINK5: Final = re.compile(
    r"(?P<unit>[A-Z][A-Z0-9_]*(?:/[A-Z0-9_]+)?)\s+(?P<sev>Fatal|Nonfatal)\s+XC\d+\s+i\d+\s+Link\s+(?P<link>-?\d+)"
)
_FALLEN: Final = re.compile(
    r"NVRM: GPU (?:at )?(?:PCI:)?(?P<pci>"
    + PCI
    + r")"
    + FUNC
    + r":? (?:GPU )?has fallen off the bus\.?\s*(?P<rest>.*)$"
)
_INIT_FAILED: Final = re.compile(
    r"NVRM: (?:GPU (?:at )?(?:PCI:)?(?P<pci>" + PCI + r")" + FUNC + r":? )?RmInitAdapter failed!\s*(?P<rest>.*)$"
)
_SXID: Final = re.compile(
    r"nvidia-nvswitch(?P<switch>\d+): SXid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): "
    r"(?P<code>\d+),?\s?(?P<rest>.*)$"
)
_SXID_PCI: Final = re.compile(PCI + r"\.[0-9a-fA-F]")  # the whole address, function included; `...` is elided
_UNKNOWN_VALUES = frozenset({"", "<unknown>", "'<unknown>'", "...", "'...'"})


def _optional_int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip().strip("'")
    return int(text) if text.isdigit() else None


def _optional_name(text: str | None) -> str | None:
    if text is None:
        return None
    text = text.strip()
    return None if text in _UNKNOWN_VALUES else text


def _yes_no(text: str) -> bool:
    return text == "Yes"


def _parse_xid(body: str) -> FaultRecord | None:
    match = _XID.match(body)
    if match is None:
        return None
    loc = match.group("loc")
    loc_match = _XID_LOC.match(loc)
    gi = _MIG_GI.search(loc) if "GPU-I" in loc else None
    ci = _MIG_CI.search(loc) if "GPU-CI" in loc else None
    code = int(match.group("code"))
    message = match.group("rest") or ""
    pid: int | None = None
    name: str | None = None
    if message.startswith("pid="):
        proc = _PROC.match(message)
        if proc is not None:
            pid = _optional_int(proc.group("pid"))
            name = _optional_name(proc.group("name"))
            message = proc.group("msg") or ""
    extras: dict[str, Any] = {}
    if code == 45:
        caused = _CAUSED_BY.search(message)
        if caused is not None:
            extras["caused_by_xid"] = int(caused.group(1))
    elif code == 154:
        recovery = _RECOVERY.search(message)
        if recovery is not None:
            to_code = int(recovery.group("to_code"), 16)
            extras.update(
                recovery_action_from=recovery.group("from"),
                recovery_action_to=recovery.group("to"),
                recovery_action_from_code=int(recovery.group("from_code"), 16),
                recovery_action_to_code=to_code,
                nvidia_verdict=VERDICT_RECOVERY_ACTION,
                nvidia_action=recovery_action(to_code, recovery.group("to")),
            )
    elif code in (94, 95):
        rst = _RST.search(message)
        if rst is not None:
            extras.update(rst=_yes_no(rst.group("rst")), d_rst=_yes_no(rst.group("drst")))
    elif 144 <= code <= 150:
        nvlink = _NVLINK5.match(message)
        if nvlink is not None:
            extras.update(
                nvlink_unit=nvlink.group("unit"),
                nvlink_fatal=nvlink.group("sev") == "Fatal",
                nvlink_link=int(nvlink.group("link")),
            )
    return FaultRecord(
        line=0,
        raw="",
        kind="xid",
        code=code,
        pci=loc_match.group("pci").lower() if loc_match is not None else None,
        message=message.strip(),
        mig_gpu_instance=int(gi.group(1)) if gi is not None else None,
        mig_compute_instance=int(ci.group(1)) if ci is not None else None,
        pid=pid,
        process_name=name,
        **extras,
    )


def _parse_sxid(body: str) -> FaultRecord | None:
    match = _SXID.match(body)
    if match is None:
        return None
    pci = match.group("pci")
    return FaultRecord(
        line=0,
        raw="",
        kind="sxid",
        code=int(match.group("code")),
        pci=pci if _SXID_PCI.fullmatch(pci) is not None else None,
        message=match.group("rest").strip(),
        nvswitch=int(match.group("switch")),
    )


def _parse_other_nvrm(body: str) -> FaultRecord | None:
    if "fallen off the bus" in body:
        match = _FALLEN.match(body)
        if match is not None:
            return FaultRecord(
                line=0,
                raw="",
                kind="gpu_fallen_off_bus",
                code=None,
                pci=match.group("pci").lower(),
                message=("GPU has fallen off the bus. " + match.group("rest")).strip(),
            )
    if "RmInitAdapter" in body:
        match = _INIT_FAILED.match(body)
        if match is not None:
            pci = match.group("pci")
            return FaultRecord(
                line=0,
                raw="",
                kind="gpu_init_failed",
                code=None,
                pci=pci.lower() if pci else None,
                message=("RmInitAdapter failed! " + match.group("rest")).strip(),
            )
    return None


def parse_body(body: str) -> FaultRecord | None:
    """The stateless part: what one line's text (after the prefixes) says, at line 0 with no raw text."""
    if body.startswith("NVRM: Xid"):
        return _parse_xid(body)
    if body.startswith("NVRM: "):
        return _parse_other_nvrm(body)
    return _parse_sxid(body)
