"""Parse NVIDIA fault records out of kernel log text (dmesg, journald, syslog, /dev/kmsg).

The kernel log is the one GPU signal that survives a hung NVML, and it keeps history that NVML events lose, so
the parser must accept every shape the driver and the log tools have produced. Formats follow the open driver
(kernel_rc.c, gpu.c, osinit.c, osapi.c); see docs in the shared reference `gpu-fault-signals.md`.

Speed matters (an Xid storm is hundreds of thousands of lines): regexes are compiled once and a substring
prefilter rejects almost every line before any regex runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NamedTuple

RecordKind = Literal[
    "xid", "sxid", "gpu_fallen_off_bus", "gpu_init_failed", "nvml", "dcgm", "daemon", "daemon_recovered"
]

# Prefixes that log tools put before the kernel's own text. They can stack (syslog's header, then dmesg's
# uptime stamp), so they are stripped in a loop. Each alternative is anchored so that an application line
# that merely quotes an NVRM message is not mistaken for a kernel record.
_ISO_TIME = r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?"
# One regex per leading character: trying a single big alternation on every line costs several times more.
_PREFIX_KMSG: Final = re.compile(r"<?\d+>?,(?P<seq>\d+),(?P<usec>\d+),[^;]*;")  # prio,seq,usec,flags;message
_PREFIX_BRACKET: Final = re.compile(  # dmesg's [ 1843.308145], dmesg -T's [Fri Aug 30 11:43:09 2024]
    r"\[\s*(?:(?P<uptime>\d+\.\d+)|[A-Z][a-z]{2} [A-Z][a-z]{2} {1,2}\d{1,2} \d{2}:\d{2}:\d{2} \d{4})\]\s?"
)
_PREFIX_SYSLOG: Final = re.compile(  # Nov 22 15:39:14 host kernel: (or an ISO time, as journalctl -o short-iso)
    r"(?:[A-Z][a-z]{2} {1,2}\d{1,2} \d{2}:\d{2}:\d{2}(?:\.\d+)?|" + _ISO_TIME + r") \S+ kernel: "
)
_PREFIX_WORD: Final = re.compile(  # kernel: , or dmesg -x's "kern  :warn  : " with an optional ISO time
    r"kernel: |[a-z]+ *:[a-z]+ *: (?:" + _ISO_TIME + r" ?)?"
)
# journalctl -o short-monotonic: "[ 1843.308145] host kernel: ", the host after the uptime stamp.
_PREFIX_HOST_KERNEL: Final = re.compile(r"\S+ kernel: ")
_BODY_STARTS = ("NVRM", "nvidia-nvswitch")

_PCI = r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}"
_FUNC = r"(?:\.[0-9a-fA-F])?"

_XID: Final = re.compile(r"NVRM: Xid \((?P<loc>[^)]*)\): (?P<code>\d+)(?:,\s?(?P<rest>.*))?$")
# Inside the parentheses: `PCI:dddd:bb:dd`, old drivers' bare `dddd:bb:dd`, then MIG instance ids; an elided
# address (`PCI:...`) simply does not match and leaves pci unset.
_XID_LOC: Final = re.compile(r"(?:PCI:)?(?P<pci>" + _PCI + r")" + _FUNC + r"(?=$|\s)")
_MIG_GI: Final = re.compile(r"GPU-I:(\d+)")
_MIG_CI: Final = re.compile(r"GPU-CI:(\d+)")
# `pid=1234, name=python, msg`, or older drivers' `pid='<unknown>', name=<unknown>, msg`.
_PROC: Final = re.compile(r"pid=(?P<pid>[^,]*), name=(?P<name>[^,]*)(?:,\s?(?P<msg>.*))?$")
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
    + _PCI
    + r")"
    + _FUNC
    + r":? (?:GPU )?has fallen off the bus\.?\s*(?P<rest>.*)$"
)
_INIT_FAILED: Final = re.compile(
    r"NVRM: (?:GPU (?:at )?(?:PCI:)?(?P<pci>" + _PCI + r")" + _FUNC + r":? )?RmInitAdapter failed!\s*(?P<rest>.*)$"
)
_BANNER_1: Final = re.compile(r"NVRM: The NVIDIA GPU (?P<pci>" + _PCI + r")" + _FUNC + r"\s*$")
_BANNER_2: Final = re.compile(r"NVRM: \(PCI ID: [0-9a-fA-F]{4}:[0-9a-fA-F]{4}\) installed in this system has\s*$")
_BANNER_3: Final = re.compile(r"NVRM: fallen off the bus and is not responding to commands\.?\s*$")
_SXID: Final = re.compile(
    r"nvidia-nvswitch(?P<switch>\d+): SXid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): "
    r"(?P<code>\d+),?\s?(?P<rest>.*)$"
)

# A banner whose later lines never come (the log was cut) must not capture an unrelated line much later.
BANNER_MAX_GAP = 8
_UNKNOWN_VALUES = frozenset({"", "<unknown>", "'<unknown>'", "...", "'...'"})


class KernelRecord(NamedTuple):
    """One GPU fault record. `line` is the 1-based number of its first input line.

    A NamedTuple rather than a frozen dataclass: as immutable, and several times cheaper to build, which
    counts when a storm logs hundreds of thousands of records."""

    line: int
    raw: str
    kind: RecordKind
    code: int | None
    pci: str | None
    message: str
    kmsg_seq: int | None = None
    # Seconds since boot, when the line carries it (kmsg, dmesg): lets repeat rules measure real spacing even
    # when a restarted probe re-reads old history in one go.
    uptime_s: float | None = None
    mig_gpu_instance: int | None = None
    mig_compute_instance: int | None = None
    pid: int | None = None
    process_name: str | None = None
    caused_by_xid: int | None = None
    recovery_action_from: str | None = None
    recovery_action_to: str | None = None
    recovery_action_from_code: int | None = None
    recovery_action_to_code: int | None = None
    rst: bool | None = None
    d_rst: bool | None = None
    nvlink_unit: str | None = None
    nvlink_fatal: bool | None = None
    nvlink_link: int | None = None
    nvswitch: int | None = None
    # Set by the NVML, DCGM and daemon sources (never by the kernel-log parser): the GPU's UUID, the condition's
    # name (the finding's reason, e.g. NVML_REMAP_FAILURE), and the source's own "hard failure" verdict (a DCGM
    # "fail", a daemon marked critical) that the policy turns into impairs.
    uuid: str | None = None
    reason: str | None = None
    critical: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return self._asdict()


# Index of the first field after (line, raw) and of the first after (kmsg_seq, uptime_s): see _place.
_BODY_FIELDS = slice(2, 6)
_DETAIL_FIELDS = slice(8, None)


class _Prefix(NamedTuple):
    end: int
    kmsg_seq: int | None
    uptime_s: float | None


@dataclass(slots=True)
class _Banner:
    line: int
    pci: str
    raws: list[str] = field(default_factory=list)
    bodies: list[str] = field(default_factory=list)


def _strip_prefixes(line: str) -> _Prefix:
    pos = 0
    kmsg_seq: int | None = None
    uptime_s: float | None = None
    # Bounded: at most one of each stacked prefix kind appears in practice.
    for _ in range(4):
        if pos >= len(line) or line.startswith(_BODY_STARTS, pos):
            break
        first = line[pos]
        match: re.Match[str] | None
        if first == "[":
            match = _PREFIX_BRACKET.match(line, pos)
            if match is not None and match.group("uptime") is not None:
                uptime_s = float(match.group("uptime"))
        elif first == "<" or first.isdigit():
            match = _PREFIX_KMSG.match(line, pos)
            if match is not None:
                kmsg_seq = int(match.group("seq"))
                uptime_s = int(match.group("usec")) / 1_000_000
            else:
                match = _PREFIX_SYSLOG.match(line, pos)
        elif first.isupper():
            match = _PREFIX_SYSLOG.match(line, pos)
        else:
            match = _PREFIX_WORD.match(line, pos)
        if match is None:
            match = _PREFIX_HOST_KERNEL.match(line, pos)
        if match is None or match.end() == pos:
            break
        pos = match.end()
    return _Prefix(pos, kmsg_seq, uptime_s)


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


def _parse_xid(body: str) -> KernelRecord | None:
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
            extras.update(
                recovery_action_from=recovery.group("from"),
                recovery_action_to=recovery.group("to"),
                recovery_action_from_code=int(recovery.group("from_code"), 16),
                recovery_action_to_code=int(recovery.group("to_code"), 16),
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
    return KernelRecord(
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


def _parse_sxid(body: str) -> KernelRecord | None:
    match = _SXID.match(body)
    if match is None:
        return None
    return KernelRecord(
        line=0,
        raw="",
        kind="sxid",
        code=int(match.group("code")),
        pci=match.group("pci"),
        message=match.group("rest").strip(),
        nvswitch=int(match.group("switch")),
    )


def _parse_other_nvrm(body: str) -> KernelRecord | None:
    if "fallen off the bus" in body:
        match = _FALLEN.match(body)
        if match is not None:
            return KernelRecord(
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
            return KernelRecord(
                line=0,
                raw="",
                kind="gpu_init_failed",
                code=None,
                pci=pci.lower() if pci else None,
                message=("RmInitAdapter failed! " + match.group("rest")).strip(),
            )
    return None


def _parse_body(body: str) -> KernelRecord | None:
    """The stateless part: what one line's text (after the prefixes) says, at line 0 with no raw text."""
    if body.startswith("NVRM: Xid"):
        return _parse_xid(body)
    if body.startswith("NVRM: "):
        return _parse_other_nvrm(body)
    return _parse_sxid(body)


def _place(template: KernelRecord, line: int, raw: str, prefix: _Prefix) -> KernelRecord:
    fields: tuple[Any, ...] = template
    return KernelRecord._make((line, raw, *fields[_BODY_FIELDS], prefix[1], prefix[2], *fields[_DETAIL_FIELDS]))


# Storms repeat a handful of distinct texts (NVSentinel#1120: 800K lines, 29 distinct) behind changing
# timestamps, so parsing each distinct text once makes a storm cheap. Bounded: cleared when full.
_TEMPLATE_CACHE_SIZE = 512
_MISS: Final = KernelRecord(line=-1, raw="", kind="xid", code=None, pci=None, message="")


class KernelLogParser:
    """Streaming parser: feed lines in order. Its state (line number, a pending banner, the cache of parsed
    texts) lives in the instance."""

    def __init__(self) -> None:
        self._line_no = 0
        self._banner: _Banner | None = None
        self._templates: dict[str, KernelRecord | None] = {}

    @property
    def lines_seen(self) -> int:
        return self._line_no

    @property
    def pending_banner_line(self) -> int | None:
        """The line number of a banner's first line while its record can still complete. The parser holds those
        lines in memory only: a source's saved read position must stay before it, or a restart loses the banner."""
        banner = self._banner
        if banner is None or self._line_no - banner.line >= BANNER_MAX_GAP:
            return None
        return banner.line

    def feed(self, line: str) -> list[KernelRecord]:
        self._line_no += 1
        if "NVRM" not in line and "SXid" not in line:
            return []
        line = line.rstrip("\r\n")
        # /dev/kmsg continuation lines (` SUBSYSTEM=pci`) carry metadata of the record above, never a fault.
        if line.startswith(" ") and "=" in line and "NVRM:" not in line:
            return []
        prefix = _strip_prefixes(line)
        body = line[prefix.end :]
        if body.startswith("NVRM: "):
            if self._banner is not None:
                record = self._continue_banner(self._banner, line, body, prefix)
                if record is not None or self._banner is not None:
                    return [record] if record is not None else []
            if body.startswith("NVRM: The NVIDIA GPU "):
                match = _BANNER_1.match(body)
                if match is not None:
                    self._banner = _Banner(self._line_no, match.group("pci").lower(), [line], [body[6:]])
                    return []
        elif body.startswith("nvidia-nvswitch"):
            self._banner = None
        else:
            return []
        template = self._templates.get(body, _MISS)
        if template is _MISS:
            template = _parse_body(body)
            if len(self._templates) >= _TEMPLATE_CACHE_SIZE:
                self._templates.clear()
            self._templates[body] = template
        if template is None:
            return []
        return [_place(template, self._line_no, line, prefix)]

    def _continue_banner(self, banner: _Banner, raw: str, body: str, prefix: _Prefix) -> KernelRecord | None:
        """Advance the three-line banner; a line that does not continue it drops it (self._banner = None)."""
        expected = _BANNER_2 if len(banner.raws) == 1 else _BANNER_3
        if self._line_no - banner.line > BANNER_MAX_GAP or expected.match(body) is None:
            self._banner = None
            return None
        banner.raws.append(raw)
        banner.bodies.append(body[6:])
        if expected is _BANNER_2:
            return None
        self._banner = None
        return KernelRecord(
            line=banner.line,
            raw="\n".join(banner.raws),
            kind="gpu_fallen_off_bus",
            code=None,
            pci=banner.pci,
            message=" ".join(b.strip() for b in banner.bodies),
            kmsg_seq=prefix.kmsg_seq,
            uptime_s=prefix.uptime_s,
        )


def parse_lines(lines: Iterable[str]) -> Iterator[KernelRecord]:
    """Parse a whole log (any iterable of lines, e.g. an open file) lazily."""
    parser = KernelLogParser()
    for line in lines:
        yield from parser.feed(line)
