"""Parse NVIDIA fault records out of kernel log text (dmesg, journald, syslog, /dev/kmsg).

The kernel log is the one GPU signal that survives a hung NVML, and it keeps history that NVML events lose, so
the parser must accept every shape the driver and the log tools have produced. Formats follow the open driver
(kernel_rc.c, gpu.c, osinit.c, osapi.c); see docs in the shared reference `gpu-fault-signals.md`.

Speed matters (an Xid storm is hundreds of thousands of lines): regexes are compiled once and a substring
prefilter rejects almost every line before any regex runs.

One printk can hold several lines (the "fallen off the bus" banner is one). Each log tool shows that its own way:
/dev/kmsg escapes the newlines (`\x0a`, kept by rsyslog's imkmsg), rsyslog writes a real newline as `#012`, dmesg
and journalctl indent the later lines with no prefix, journald's MESSAGE keeps them (its source splits it). The
parser takes each of those lines as a body of its own, at the input line it came in.

Records also carry what earlier lines and the prefix said: the GPU's UUID (`NVRM: GPU at PCI:...: GPU-...`, printed
before a GPU's first Xid) and the wall-clock time of the line, when its prefix has one (the parser finds the
stamp; wall_clock.py turns it into POSIX time).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from node_probe.classify.record import FaultRecord
from node_probe.classify.wall_clock import WallClock

# Prefixes that log tools put before the kernel's own text. They can stack (syslog's header, then dmesg's
# uptime stamp), so they are stripped in a loop. Each alternative is anchored so that an application line
# that merely quotes an NVRM message is not mistaken for a kernel record.
_ISO_TIME = r"(?P<isom>\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}):(?P<isos>\d{2}(?:[.,]\d+)?)(?P<isoz>Z|[+-]\d{2}:?\d{2})?"
# One regex per leading character: trying a single big alternation on every line costs several times more.
_PREFIX_KMSG: Final = re.compile(r"<?\d+>?,(?P<seq>\d+),(?P<usec>\d+),[^;]*;")  # prio,seq,usec,flags;message
# The groups that hold a wall-clock time (the minute, the seconds, the year or the UTC offset) are read only for a
# line that is a fault record, and in order (Match.groups() is several times cheaper than named groups).
_PREFIX_BRACKET: Final = re.compile(  # dmesg's [ 1843.308145], dmesg -T's [Fri Aug 30 11:43:09 2024]
    r"\[\s*(?:(?P<uptime>\d+\.\d+)|"
    r"(?P<ctm>[A-Z][a-z]{2} [A-Z][a-z]{2} {1,2}\d{1,2} \d{2}:\d{2}):(?P<cts>\d{2}) (?P<cty>\d{4}))\]\s?"
)
_PREFIX_SYSLOG: Final = re.compile(  # Nov 22 15:39:14 host kernel: (or an ISO time, as journalctl -o short-iso)
    r"(?:(?P<bsdm>[A-Z][a-z]{2} {1,2}\d{1,2} \d{2}:\d{2}):(?P<bsds>\d{2}(?:\.\d+)?)|" + _ISO_TIME + r") \S+ kernel: "
)
_PREFIX_WORD: Final = re.compile(  # kernel: , or dmesg -x's "kern  :warn  : " with an optional ISO time
    r"kernel: |[a-z]+ *:[a-z]+ *: (?:" + _ISO_TIME + r" ?)?"
)
# journalctl -o short-monotonic: "[ 1843.308145] host kernel: ", the host after the uptime stamp.
_PREFIX_HOST_KERNEL: Final = re.compile(r"\S+ kernel: ")
_BODY_STARTS = ("NVRM", "nvidia-nvswitch")
_KERNEL_BODIES = ("NVRM: ", "nvidia-nvswitch")
# A body holding several lines of one printk: /dev/kmsg's escapes (`\x0a` a newline, `\x5c` a backslash) or
# rsyslog's escaped newline.
_KMSG_ESCAPE: Final = re.compile(r"\\x([0-9a-fA-F]{2})")
_SYSLOG_NEWLINE = "#012"

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
_BANNER_2: Final = re.compile(r"NVRM: (?:\(PCI ID: [0-9a-fA-F]{4}:[0-9a-fA-F]{4}\) )?installed in this system has\s*$")
_BANNER_3: Final = re.compile(r"NVRM: fallen off the bus and is not responding to commands\.?\s*$")
_SXID: Final = re.compile(
    r"nvidia-nvswitch(?P<switch>\d+): SXid \((?:PCI:)?(?P<pci>[0-9a-fA-F:.]+)\): "
    r"(?P<code>\d+),?\s?(?P<rest>.*)$"
)
_SXID_PCI: Final = re.compile(_PCI + r"\.[0-9a-fA-F]")  # the whole address, function included; `...` is elided
# Printed once per GPU before its first Xid (kernel_rc.c); then `NVRM: GPU Board Serial Number: ...`.
_GPU_UUID: Final = re.compile(
    r"NVRM: GPU at (?:PCI:)?(?P<pci>"
    + _PCI
    + r")"
    + _FUNC
    + r": (?P<uuid>GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})\s*$"
)

# A banner whose later lines never come (the log was cut) must not capture an unrelated line much later.
BANNER_MAX_GAP = 8
# GPUs whose UUID the parser remembers (a host has at most 16); the oldest is forgotten first.
UUID_MEMORY = 64
_UNKNOWN_VALUES = frozenset({"", "<unknown>", "'<unknown>'", "...", "'...'"})


# The parts of a cached template that _place copies around each line's own values: the fields after (line, raw),
# those after (kmsg_seq, uptime_s, wall_s) up to uuid, and those after uuid.
_BODY_FIELDS = slice(2, FaultRecord._fields.index("kmsg_seq"))
_UUID_FIELD = FaultRecord._fields.index("uuid")
_DETAIL_FIELDS = slice(FaultRecord._fields.index("wall_s") + 1, _UUID_FIELD)
_AFTER_UUID_FIELDS = slice(_UUID_FIELD + 1, None)


class _Prefix(NamedTuple):
    end: int
    kmsg_seq: int | None
    uptime_s: float | None
    # The outermost prefix match that holds a wall-clock time, parsed only when the line is a record.
    clock: re.Match[str] | None = None


_NO_PREFIX: Final = _Prefix(0, None, None)


@dataclass(slots=True)
class _Banner:
    line: int
    pci: str
    raws: list[str] = field(default_factory=list)
    bodies: list[str] = field(default_factory=list)
    last_line: int = 0
    # The latest of each that the banner's lines carried: an indented continuation line carries none.
    kmsg_seq: int | None = None
    uptime_s: float | None = None
    clock: re.Match[str] | None = None

    def add(self, line: int, raw: str, body: str, prefix: _Prefix) -> None:
        if line != self.last_line:  # the pieces of one escaped record share its line and raw text
            self.raws.append(raw)
            self.last_line = line
        self.bodies.append(body[6:])
        if prefix.kmsg_seq is not None:
            self.kmsg_seq = prefix.kmsg_seq
        if prefix.uptime_s is not None:
            self.uptime_s = prefix.uptime_s
        if prefix.clock is not None:
            self.clock = prefix.clock


def _strip_prefixes(line: str) -> _Prefix:
    pos = 0
    kmsg_seq: int | None = None
    uptime_s: float | None = None
    clock: re.Match[str] | None = None
    # Bounded: at most one of each stacked prefix kind appears in practice.
    for _ in range(4):
        if pos >= len(line) or line.startswith(_BODY_STARTS, pos):
            break
        first = line[pos]
        match: re.Match[str] | None
        if first == "[":
            match = _PREFIX_BRACKET.match(line, pos)
            if match is not None:
                if match.group("uptime") is not None:
                    uptime_s = float(match.group("uptime"))
                elif clock is None:
                    clock = match
        elif first == "<" or first.isdigit():
            match = _PREFIX_KMSG.match(line, pos)
            if match is not None:
                kmsg_seq = int(match.group("seq"))
                uptime_s = int(match.group("usec")) / 1_000_000
            else:
                match = _PREFIX_SYSLOG.match(line, pos)
                if clock is None:
                    clock = match
        elif first.isupper():
            match = _PREFIX_SYSLOG.match(line, pos)
            if clock is None:
                clock = match
        else:
            match = _PREFIX_WORD.match(line, pos)
            if clock is None and match is not None and match.lastindex is not None:  # its ISO time matched
                clock = match
        if match is None:
            match = _PREFIX_HOST_KERNEL.match(line, pos)
        if match is None or match.end() == pos:
            break
        pos = match.end()
    return _Prefix(pos, kmsg_seq, uptime_s, clock)


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


def _parse_body(body: str) -> FaultRecord | None:
    """The stateless part: what one line's text (after the prefixes) says, at line 0 with no raw text."""
    if body.startswith("NVRM: Xid"):
        return _parse_xid(body)
    if body.startswith("NVRM: "):
        return _parse_other_nvrm(body)
    return _parse_sxid(body)


def _place(
    template: FaultRecord, line: int, raw: str, prefix: _Prefix, wall: float | None, uuid: str | None
) -> FaultRecord:
    fields: tuple[Any, ...] = template
    return FaultRecord._make(
        (
            line,
            raw,
            *fields[_BODY_FIELDS],
            prefix[1],
            prefix[2],
            wall,
            *fields[_DETAIL_FIELDS],
            uuid,
            *fields[_AFTER_UUID_FIELDS],
        )
    )


def _unescape_kmsg(text: str) -> str:
    """/dev/kmsg's text: the kernel writes a control byte, a backslash (and on old kernels any byte >= 0x7f) as
    `\\xNN`; the bytes of a UTF-8 character come back as one character."""
    parts = _KMSG_ESCAPE.split(text)
    data = bytearray()
    for index, part in enumerate(parts):
        data += bytes((int(part, 16),)) if index % 2 else part.encode("utf-8", "surrogateescape")
    return data.decode("utf-8", "replace")


# Storms repeat a handful of distinct texts (NVSentinel#1120: 800K lines, 29 distinct) behind changing
# timestamps, so parsing each distinct text once makes a storm cheap. Bounded: cleared when full.
_TEMPLATE_CACHE_SIZE = 512
_MISS: Final = FaultRecord(line=-1, raw="", kind="xid", code=None, pci=None, message="")
# Markers in the cache: a body that holds escapes (several lines of one printk, or a kmsg `\xNN`); one that is no
# record but may change the parser's state (a banner's first line, a GPU's identity); the driver loading (its own
# marker, checked inline: the benchmark's mixed log has it often).
_ESCAPED: Final = FaultRecord(line=-2, raw="", kind="xid", code=None, pci=None, message="")
_STATEFUL: Final = FaultRecord(line=-3, raw="", kind="xid", code=None, pci=None, message="")
_DRIVER_LOAD: Final = FaultRecord(line=-4, raw="", kind="xid", code=None, pci=None, message="")


def _template(body: str) -> FaultRecord | None:
    """What the cache keeps for a body without escapes: its record at line 0, a marker, or None."""
    record = _parse_body(body)
    if record is None:
        if body.startswith("NVRM: loading NVIDIA "):
            return _DRIVER_LOAD
        if body.startswith(("NVRM: The NVIDIA GPU ", "NVRM: GPU at ")):
            return _STATEFUL
    return record


class KernelLogParser:
    """Streaming parser: feed lines in order. Its state (line number, a pending banner, the cache of parsed
    texts, the UUIDs the log gave the GPUs) lives in the instance. `now` is the clock a syslog time without a
    year is placed by."""

    def __init__(self, now: Callable[[], float] = time.time) -> None:
        self._line_no = 0
        self._banner: _Banner | None = None
        self._templates: dict[str, FaultRecord | None] = {}
        self._uuids: dict[str, str] = {}  # PCI address (dddd:bb:dd, lower case) -> GPU UUID, oldest first
        self._clock = WallClock(now)

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

    def feed(self, line: str) -> list[FaultRecord]:
        self._line_no += 1
        if "NVRM" not in line and "SXid" not in line:
            return []
        line = line.rstrip("\r\n")
        first = line[0]  # not empty: it holds "NVRM" or "SXid"
        if first == " " or first == "\t":
            # dmesg and journalctl indent the later lines of a multi-line record, with no prefix: those that
            # are NVIDIA's are bodies. /dev/kmsg's continuation lines (` SUBSYSTEM=pci`) carry metadata of the
            # record above, never a fault.
            body = line.lstrip()
            if not body.startswith("NVRM: "):
                return []
            prefix = _NO_PREFIX
        else:
            prefix = _strip_prefixes(line)
            body = line[prefix.end :]
            if not body.startswith(_KERNEL_BODIES):
                return []
        template = self._templates.get(body, _MISS)
        if template is _MISS:
            template = _ESCAPED if "\\x" in body or _SYSLOG_NEWLINE in body else _template(body)
            self._remember(body, template)
        if template is None or template is _DRIVER_LOAD:  # most NVRM lines that are no record
            if self._banner is not None:
                return self._feed_other(line, body, prefix, template)
            if template is not None:
                self._forget_gpus()
            return []
        if template is _ESCAPED:
            return self._feed_pieces(line, body, prefix)
        if template is _STATEFUL or self._banner is not None:
            return self._feed_other(line, body, prefix, template)
        # self._record, inlined: this is the path of every line of a storm.
        clock = prefix[3]
        uuids = self._uuids
        return [
            _place(
                template,
                self._line_no,
                line,
                prefix,
                None if clock is None else self._wall(clock),
                uuids.get(template[4] or "") if uuids else None,
            )
        ]

    def _remember(self, body: str, template: FaultRecord | None) -> None:
        if len(self._templates) >= _TEMPLATE_CACHE_SIZE:
            self._templates.clear()
        self._templates[body] = template

    def _record(self, template: FaultRecord, raw: str, prefix: _Prefix) -> FaultRecord:
        """The record of this line: the template with the line's own values, its wall time and its GPU's UUID."""
        clock = prefix[3]
        uuids = self._uuids
        return _place(
            template,
            self._line_no,
            raw,
            prefix,
            self._wall(clock) if clock is not None else None,
            uuids.get(template[4] or "") if uuids else None,  # never an SXid's: the switch's address has a function
        )

    def _feed_pieces(self, raw: str, body: str, prefix: _Prefix) -> list[FaultRecord]:
        """A body holding several lines of one printk: each line is a body with the record's prefix, at its input
        line. /dev/kmsg's `\\xNN` escapes come undone: rsyslog's imkmsg passes them on too, and dmesg, journald
        and imklog show text unescaped, where a literal `\\x` is too rare in NVIDIA's messages to matter."""
        text = _unescape_kmsg(body) if "\\x" in body else body
        pieces = text.replace(_SYSLOG_NEWLINE, "\n").split("\n")
        records: list[FaultRecord] = []
        for piece in pieces:
            if not piece.startswith(_KERNEL_BODIES):
                continue
            if "\\x" in piece:  # a literal one (kmsg's `\\x5c`): not cached, the cache would take it for an escape
                template = _parse_body(piece)
            else:
                template = self._templates.get(piece, _MISS)
                if template is _MISS:
                    template = _template(piece)
                    self._remember(piece, template)
            records.extend(self._feed_other(raw, piece, prefix, template))
        return records

    def _feed_other(self, raw: str, body: str, prefix: _Prefix, template: FaultRecord | None) -> list[FaultRecord]:
        """A body while a banner is pending, or one that is no record by itself (banner lines, GPU identity)."""
        banner = self._banner
        if banner is not None:
            if body.startswith("NVRM: "):
                record = self._continue_banner(banner, raw, body, prefix)
                if record is not None:
                    return [record]
                if self._banner is not None:
                    return []
            else:
                self._banner = None
        if template is _DRIVER_LOAD:
            self._forget_gpus()
        elif template is not None and template is not _STATEFUL:
            return [self._record(template, raw, prefix)]
        if body.startswith("NVRM: The NVIDIA GPU "):
            match = _BANNER_1.match(body)
            if match is not None:
                self._banner = _Banner(self._line_no, match.group("pci").lower())
                self._banner.add(self._line_no, raw, body, prefix)
        elif body.startswith("NVRM: GPU at "):
            identity = _GPU_UUID.match(body)
            if identity is not None:
                self._remember_uuid(identity.group("pci").lower(), identity.group("uuid"))
        elif body.startswith("NVRM: loading NVIDIA "):  # in a piece, where _parse_body, not _template, ran
            self._forget_gpus()
        return []

    def _forget_gpus(self) -> None:
        """The driver (re)loads: its GPUs print their identity again before their first Xid, and a GPU at a known
        address may be another one now (a kern.log spans reboots, and a stopped instance moves host)."""
        self._uuids.clear()

    def _remember_uuid(self, pci: str, uuid: str) -> None:
        uuids = self._uuids
        uuids.pop(pci, None)
        if len(uuids) >= UUID_MEMORY:
            del uuids[next(iter(uuids))]
        uuids[pci] = uuid

    def _continue_banner(self, banner: _Banner, raw: str, body: str, prefix: _Prefix) -> FaultRecord | None:
        """Advance the three-line banner; a line that does not continue it drops it (self._banner = None)."""
        expected = _BANNER_2 if len(banner.bodies) == 1 else _BANNER_3
        if self._line_no - banner.line > BANNER_MAX_GAP or expected.match(body) is None:
            self._banner = None
            return None
        banner.add(self._line_no, raw, body, prefix)
        if expected is _BANNER_2:
            return None
        self._banner = None
        return FaultRecord(
            line=banner.line,
            raw="\n".join(banner.raws),
            kind="gpu_fallen_off_bus",
            code=None,
            pci=banner.pci,
            message=" ".join(b.strip() for b in banner.bodies),
            kmsg_seq=banner.kmsg_seq,
            uptime_s=banner.uptime_s,
            wall_s=self._wall(banner.clock) if banner.clock is not None else None,
            uuid=self._uuids.get(banner.pci),
        )

    def _wall(self, clock: re.Match[str]) -> float | None:
        """POSIX time of a prefix's wall-clock time: this module's regexes say which group holds what, the clock
        does the calendar work."""
        groups = clock.groups()
        if clock.re is _PREFIX_BRACKET:  # uptime, minute, second, year
            _, minute, second, year = groups
            return self._clock.ctime(minute, second, year)
        if clock.re is _PREFIX_SYSLOG:  # BSD minute, seconds, then the ISO groups
            if groups[0] is not None:
                return self._clock.syslog(groups[0], float(groups[1]))
            groups = groups[2:]
        minute, second, offset = groups  # ISO
        return self._clock.iso(minute, second, offset)


def parse_lines(lines: Iterable[str], now: Callable[[], float] = time.time) -> Iterator[FaultRecord]:
    """Parse a whole log (any iterable of lines, e.g. an open file) lazily."""
    parser = KernelLogParser(now)
    for line in lines:
        yield from parser.feed(line)
