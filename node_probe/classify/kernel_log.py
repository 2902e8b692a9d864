"""Parse NVIDIA fault records out of kernel log text (dmesg, journald, syslog, /dev/kmsg).

The kernel log is the one GPU signal that survives a hung NVML, and it keeps history that NVML events lose, so
the parser must accept every shape the driver and the log tools have produced. Formats follow the open driver
(kernel_rc.c, gpu.c, osinit.c, osapi.c); see docs in the shared reference `gpu-fault-signals.md`.

Where the record sits on the line does not matter: the parser finds its body (`NVRM: ...`, `nvidia-nvswitchN: ...`)
wherever it is, then accepts the line only when everything before the body is a stack of prefixes that log tools
write (log_prefix.py), so an application quoting an NVRM message is not a record.

Speed matters (an Xid storm is hundreds of thousands of lines): a substring prefilter rejects almost every other
line, and a repeated body (a storm repeats a handful behind changing timestamps) is looked up in a bounded cache
before any regex runs; only a new body is parsed. A reader that needs only what a storm adds up to (`classify
--collapse`) takes records as runs (`parse_runs`): a line that repeats the latest record but for where it is costs a
text compare and its prefix, and no record is built for it.

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

from node_probe.classify.bodies import FUNC, PCI, parse_body
from node_probe.classify.context import RecentLines
from node_probe.classify.log_prefix import NO_PREFIX, Prefix, PrefixReader, unwrap_docker_json, wall_time
from node_probe.classify.record import FaultRecord
from node_probe.classify.wall_clock import WallClock

_KERNEL_BODIES = ("NVRM: ", "nvidia-nvswitch")
# A body holding several lines of one printk: /dev/kmsg's escapes (`\x0a` a newline, `\x5c` a backslash) or
# rsyslog's escaped newline.
_KMSG_ESCAPE: Final = re.compile(r"\\x([0-9a-fA-F]{2})")
_SYSLOG_NEWLINE = "#012"

_BANNER_1: Final = re.compile(r"NVRM: The NVIDIA GPU (?P<pci>" + PCI + r")" + FUNC + r"\s*$")
_BANNER_2: Final = re.compile(r"NVRM: (?:\(PCI ID: [0-9a-fA-F]{4}:[0-9a-fA-F]{4}\) )?installed in this system has\s*$")
_BANNER_3: Final = re.compile(r"NVRM: fallen off the bus and is not responding to commands\.?\s*$")
# Printed once per GPU before its first Xid (kernel_rc.c); then `NVRM: GPU Board Serial Number: ...`.
_GPU_UUID: Final = re.compile(
    r"NVRM: GPU at (?:PCI:)?(?P<pci>"
    + PCI
    + r")"
    + FUNC
    + r": (?P<uuid>GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})\s*$"
)

# A banner whose later lines never come (the log was cut) must not capture an unrelated line much later.
BANNER_MAX_GAP = 8
# GPUs whose UUID the parser remembers (a host has at most 16); the oldest is forgotten first.
UUID_MEMORY = 64


_new_tuple: Final = tuple.__new__
# The parts of a cached template that _place copies around each line's own values: the fields after (line, raw),
# those after (kmsg_seq, uptime_s, wall_s) up to uuid, and those after uuid.
_BODY_FIELDS = slice(2, FaultRecord._fields.index("kmsg_seq"))
_UUID_FIELD = FaultRecord._fields.index("uuid")
_DETAIL_FIELDS = slice(FaultRecord._fields.index("wall_s") + 1, _UUID_FIELD)
_AFTER_UUID_FIELDS = slice(_UUID_FIELD + 1, None)


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

    def add(self, line: int, raw: str, body: str, prefix: Prefix) -> None:
        if line != self.last_line:  # the pieces of one escaped record share its line and raw text
            self.raws.append(raw)
            self.last_line = line
        self.bodies.append(body[6:])
        kmsg_seq, uptime_s, clock = prefix
        if kmsg_seq is not None:
            self.kmsg_seq = kmsg_seq
        if uptime_s is not None:
            self.uptime_s = uptime_s
        if clock is not None:
            self.clock = clock


def _place(
    template: FaultRecord,
    line: int,
    raw: str,
    kmsg_seq: int | None,
    uptime_s: float | None,
    wall: float | None,
    uuid: str | None,
) -> FaultRecord:
    fields: tuple[Any, ...] = template
    # tuple.__new__ rather than _make: the same record without a Python-level call and length check, for every line
    # of a storm (test_template_field_slices_match_the_record_fields holds the field count).
    return _new_tuple(
        FaultRecord,
        (
            line,
            raw,
            *fields[_BODY_FIELDS],
            kmsg_seq,
            uptime_s,
            wall,
            *fields[_DETAIL_FIELDS],
            uuid,
            *fields[_AFTER_UUID_FIELDS],
        ),
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
    record = parse_body(body)
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

    def __init__(self, now: Callable[[], float] = time.time, recent: RecentLines | None = None) -> None:
        self._line_no = 0
        # The source's ring of latest lines, every line fed, for the context of an impairing fault.
        self._recent = recent
        self._banner: _Banner | None = None
        self._templates: dict[str, FaultRecord | None] = {}
        self._uuids: dict[str, str] = {}  # PCI address (dddd:bb:dd, lower case) -> GPU UUID, oldest first
        self._prefixes = PrefixReader()
        self._clock = WallClock(now)
        # The latest record, when a line may repeat it (see `take_repeats`): its body, template and GPU UUID; and the
        # latest line that did repeat one: its number, raw text, prefix and template.
        self._last: tuple[str, FaultRecord, str | None] | None = None
        self._repeat: tuple[int, str, Prefix, FaultRecord, str | None] | None = None

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
        if self._recent is not None:
            self._recent.append(line)
        if "NVRM" not in line and "SXid" not in line:
            return []
        line = line.rstrip("\r\n")
        text = line
        outer: re.Match[str] | None = None
        if line[0] == "{":  # not empty: it holds "NVRM" or "SXid"
            unwrapped = unwrap_docker_json(line)
            if unwrapped is None:
                return []
            text, outer = unwrapped
        start = text.find("NVRM: ")
        if "SXid" in text:
            switch = text.find("nvidia-nvswitch")
            if switch >= 0 and (start < 0 or switch < start):
                start = switch
        if start < 0:
            return []
        body = text[start:] if start else text
        template = self._templates.get(body, _MISS)
        if template is _MISS:
            template = _ESCAPED if "\\x" in body or _SYSLOG_NEWLINE in body else _template(body)
            self._remember(body, template)
        if template is None and self._banner is None:
            return []  # most NVRM lines that are no record: whatever their prefix, nothing changes
        prefix = self._prefix(text, start, body)
        if prefix is None:
            return []
        if outer is not None:
            prefix = (prefix[0], prefix[1], outer)  # the outermost time wins, as in a stack of prefixes
        if template is None or template is _DRIVER_LOAD:
            if self._banner is not None:
                return self._forget_last(self._feed_other(line, body, prefix, template))
            if template is not None:
                self._forget_gpus()
            return []
        if template is _ESCAPED:
            return self._forget_last(self._feed_pieces(line, body, prefix))
        if template is _STATEFUL or self._banner is not None:
            return self._forget_last(self._feed_other(line, body, prefix, template))
        # self._record, inlined: this is the path of every line of a storm that is read record by record.
        kmsg_seq, uptime_s, clock = prefix
        uuids = self._uuids
        uuid = uuids.get(template[4] or "") if uuids else None
        wall = None if clock is None else wall_time(clock, self._clock)
        self._last = (body, template, uuid)
        return [_place(template, self._line_no, line, kmsg_seq, uptime_s, wall, uuid)]

    def take_repeats(self, lines: Iterator[str]) -> tuple[int, str | None]:
        """Read lines from `lines` while each is a record just like the latest one but for where it is (line
        number, raw text, prefix values): they count as read (`lines_seen`), the last of them as the latest repeat
        (`last_repeat`), and no record is built for them. Returns how many it took and the first line it did not
        take (None: `lines` ran out); the parser did nothing with that line: `feed` it. A storm's lines take this
        path: a text compare and the prefix, no cache lookup and no record."""
        last = self._last
        if last is None or self._banner is not None or self._uuid_of(last[1]) != last[2]:
            return 0, next(lines, None)  # nothing a line could repeat (a pending banner takes every NVRM line)
        body, template, uuid = last
        size, prefix_of, read = len(body), self._prefix, self._prefixes.read
        taken, text, prefix = 0, "", NO_PREFIX
        for line in lines:
            candidate = line.rstrip("\r\n")
            at = len(candidate) - size
            if at < 0 or not candidate.endswith(body) or candidate[0] == "{":
                break
            first = candidate.find("NVRM: ")  # where feed would find the body
            if "SXid" in candidate:
                switch = candidate.find("nvidia-nvswitch")
                if switch >= 0 and (first < 0 or switch < first):
                    first = switch
            if first != at:
                break
            # What _prefix does, with one call fewer for the common case: a prefix that is no indentation.
            found = read(candidate[:at]) if at and candidate[0] not in " \t" else prefix_of(candidate, at, body)
            if found is None:
                break
            taken, text, prefix = taken + 1, candidate, found
        else:
            line = None
        if taken:
            self._line_no += taken
            self._repeat = (self._line_no, text, prefix, template, uuid)
        return taken, line

    def last_repeat(self) -> FaultRecord | None:
        """The record of the latest line that `take_repeats` took, as `feed` would have returned it; lines fed since
        do not change it."""
        repeat = self._repeat
        if repeat is None:
            return None
        line_no, raw, prefix, template, uuid = repeat
        return self._place(template, raw, prefix, line_no, uuid)

    def _forget_last(self, records: list[FaultRecord]) -> list[FaultRecord]:
        if records:
            self._last = None  # a banner's or a piece's record: no line repeats it
        return records

    def _prefix(self, text: str, start: int, body: str) -> Prefix | None:
        """What the text before the body says; None when it is no log tool's prefix (the line is not the kernel's)."""
        if not start:
            return NO_PREFIX
        first = text[0]
        if first == " " or first == "\t":
            # dmesg and journalctl indent the later lines of a multi-line record, with no prefix: those that are
            # NVIDIA's are bodies. /dev/kmsg's continuation lines (` SUBSYSTEM=pci`) carry metadata of the record
            # above, never a fault.
            return NO_PREFIX if body.startswith("NVRM: ") and text[:start].isspace() else None
        return self._prefixes.read(text[:start])

    def _remember(self, body: str, template: FaultRecord | None) -> None:
        if len(self._templates) >= _TEMPLATE_CACHE_SIZE:
            self._templates.clear()
        self._templates[body] = template

    def _record(self, template: FaultRecord, raw: str, prefix: Prefix, line_no: int) -> FaultRecord:
        """The record of a line: the template with the line's own values, its wall time and its GPU's UUID."""
        return self._place(template, raw, prefix, line_no, self._uuid_of(template))

    def _uuid_of(self, template: FaultRecord) -> str | None:
        uuids = self._uuids
        return uuids.get(template[4] or "") if uuids else None  # never an SXid's: the switch's address has a function

    def _place(self, template: FaultRecord, raw: str, prefix: Prefix, line_no: int, uuid: str | None) -> FaultRecord:
        kmsg_seq, uptime_s, clock = prefix
        wall = None if clock is None else wall_time(clock, self._clock)
        return _place(template, line_no, raw, kmsg_seq, uptime_s, wall, uuid)

    def _feed_pieces(self, raw: str, body: str, prefix: Prefix) -> list[FaultRecord]:
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
                template = parse_body(piece)
            else:
                template = self._templates.get(piece, _MISS)
                if template is _MISS:
                    template = _template(piece)
                    self._remember(piece, template)
            records.extend(self._feed_other(raw, piece, prefix, template))
        return records

    def _feed_other(self, raw: str, body: str, prefix: Prefix, template: FaultRecord | None) -> list[FaultRecord]:
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
            return [self._record(template, raw, prefix, self._line_no)]
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

    def _continue_banner(self, banner: _Banner, raw: str, body: str, prefix: Prefix) -> FaultRecord | None:
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
            wall_s=wall_time(banner.clock, self._clock) if banner.clock is not None else None,
            uuid=self._uuids.get(banner.pci),
        )


def parse_lines(lines: Iterable[str], now: Callable[[], float] = time.time) -> Iterator[FaultRecord]:
    """Parse a whole log (any iterable of lines, e.g. an open file) lazily."""
    parser = KernelLogParser(now)
    for line in lines:
        yield from parser.feed(line)


class RecordRun(NamedTuple):
    """Records in a row that differ only in where they are (line number, raw text, prefix values)."""

    first: FaultRecord
    size: int  # how many records, the first included
    last: FaultRecord  # the first itself when size is 1


def _never(record: FaultRecord) -> bool:
    return False


def parse_runs(
    lines: Iterable[str],
    now: Callable[[], float] = time.time,
    one_by_one: Callable[[FaultRecord], bool] = _never,
) -> Iterator[RecordRun]:
    """What parse_lines yields, as runs: a storm's records come as one run each, built twice (its first and last),
    not once per line. Records for which `one_by_one` is true never form a run (each is a run of one), e.g. those a
    policy's repeat rule must count one by one."""
    parser = KernelLogParser(now)
    feed, take_repeats = parser.feed, parser.take_repeats
    remaining = iter(lines)
    first: FaultRecord | None = None
    count = 0
    while True:
        if first is not None:
            taken, line = take_repeats(remaining)
            count += taken
        else:
            line = next(remaining, None)
        if line is None:
            break
        records = feed(line)
        if not records:
            continue  # another line between a storm's: the run goes on
        if first is not None:
            yield RecordRun(first, count, _last_of(parser, first, count))
            first = None
        for record in records[:-1]:
            yield RecordRun(record, 1, record)
        record = records[-1]
        if one_by_one(record):
            yield RecordRun(record, 1, record)
        else:
            first, count = record, 1
    if first is not None:
        yield RecordRun(first, count, _last_of(parser, first, count))


def _last_of(parser: KernelLogParser, first: FaultRecord, count: int) -> FaultRecord:
    last = parser.last_repeat() if count > 1 else None
    return first if last is None else last
