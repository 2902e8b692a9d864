"""The prefixes log tools put before the kernel's own text, and the wrappers container runtimes put around a line.

The parser (kernel_log.py) finds a fault record by its body wherever it sits on a line, then asks this module
whether everything before the body is a stack of prefixes some log tool writes. Only then is the line the
kernel's: an application that merely quotes an NVRM message (`host app[12]: ... NVRM: Xid ...`) has a prefix no
log tool writes, and is not a record.

Prefixes stack (syslog's header, then dmesg's uptime stamp; a container runtime's wrapper, then dmesg's), so they
are read in layers, each anchored where the previous one ended:
  * none, or only indentation (the later lines of a multi-line record, as dmesg and journalctl print them);
  * /dev/kmsg's record header `<prio>,<seq>,<usec>,<flags>;` and `dmesg -r`'s priority `<4>`;
  * a bracket: dmesg's uptime `[ 1843.308145]` (also integer, and with `dmesg -d`'s `<delta>`), `dmesg -T`'s
    `[Fri Aug 30 11:43:09 2024]`, `dmesg -e`'s `[Aug30 11:43]` and `[  +0.000123]`, and NVIDIA's own elided `[...]`;
  * syslog and journalctl headers ending in `host kernel: ` with a BSD time (`Nov 22 15:39:14`, `short-precise`'s
    fraction), an ISO time (`short-iso`, rsyslog's file format) or a POSIX time (`short-unix`);
  * RFC 5424 syslog (`<4>1 2024-01-15T10:31:00Z host kernel - - - `);
  * `dmesg -x`'s `kern  :warn  : ` with an optional ISO time, `dmesg --time-format=iso`'s bare ISO time, `kernel: `;
  * a bare uptime (`1843.308145 `, or an integer);
  * a CRI container log's `2024-01-01T00:00:00.000000000Z stdout F `.
Docker's json-file lines (`{"log":"...","stream":"stderr","time":"..."}`) are unwrapped before any of that.

Speed: a storm's lines share their body and differ in the prefix, so the common prefixes (dmesg's uptime, the kmsg
header) are read without a regex, and other prefixes are cached by their text (a syslog second repeats across a
burst). A prefix's wall-clock time stays a regex match until a record needs it (see `wall_time`).
"""

from __future__ import annotations

import json
import re
from typing import Final

from node_probe.classify.wall_clock import WallClock

# What a prefix says: the kmsg sequence number, the uptime in seconds, and the outermost match that holds a
# wall-clock time (its groups are read only for a line that is a fault record). A plain tuple: one is built for
# every line of a storm, and a NamedTuple costs several times more to build.
Prefix = tuple[int | None, float | None, re.Match[str] | None]
NO_PREFIX: Final[Prefix] = (None, None, None)

_ISO = r"(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}):(\d{2}(?:[.,]\d+)?)(Z|[+-]\d{2}:?\d{2})?"
# Regexes whose groups are exactly an ISO time's (minute, seconds, offset): wall_time reads them alike.
_ISO_ONLY: Final = re.compile(_ISO + r"$")  # Docker's "time" field
_ISO_BARE: Final = re.compile(_ISO + r" ")  # dmesg --time-format=iso
_CRI: Final = re.compile(_ISO + r" (?:stdout|stderr) [FP] ")
_RFC5424: Final = re.compile(r"<\d{1,3}>1 " + _ISO + r" \S+ kernel \S+ \S+ (?:-|(?:\[[^\]]*\])+) ")
_WORD: Final = re.compile(r"kernel: |[a-z]+ *:[a-z]+ *: (?:" + _ISO + r" ?)?")  # kernel: , dmesg -x

_KMSG: Final = re.compile(r"<?\d+>?,(\d+),(\d+),[^;]*;")  # prio,seq,usec,flags;
_RAW_PRIORITY: Final = re.compile(r"<\d{1,3}>")  # dmesg -r
_BRACKET: Final = re.compile(
    r"\[\s*(?:"
    r"(\d+(?:\.\d+)?)(?:\s*<\s*[\d.]+>)?"  # uptime, with dmesg -d's delta
    r"|([A-Z][a-z]{2} [A-Z][a-z]{2} {1,2}\d{1,2} \d{2}:\d{2}):(\d{2}) (\d{4})"  # dmesg -T
    r"|[+-]\s*\d+(?:\.\d+)?|[A-Z][a-z]{2} {0,2}\d{1,2} \d{2}:\d{2}"  # dmesg -e: a delta, or a minute without a year
    r"|\.\.\."  # elided, as NVIDIA's own documentation prints it
    r")\s*\] ?"
)
_SYSLOG: Final = re.compile(  # Nov 22 15:39:14 host kernel: (or an ISO time: journalctl -o short-iso, rsyslog)
    r"(?:([A-Z][a-z]{2} {1,2}\d{1,2} \d{2}:\d{2}):(\d{2}(?:\.\d+)?)|" + _ISO + r") \S+ kernel: "
)
_UNIX: Final = re.compile(r"(\d+(?:\.\d+)?) \S+ kernel: ")  # journalctl -o short-unix: POSIX time
_BARE_UPTIME: Final = re.compile(r"(\d+(?:\.\d+)?) ")
_HOST_KERNEL: Final = re.compile(r"\S+ kernel: ")  # journalctl -o short-monotonic: after the uptime bracket

# More layers than any real stack (a CRI wrapper, a syslog header, an uptime stamp) but bounded.
_MAX_LAYERS = 6
_CACHE_SIZE = 256


def parse_prefix(text: str) -> Prefix | None:
    """What the prefix `text` (everything before a body) says; None when it is not wholly a stack of prefixes that
    log tools write, i.e. the line is not the kernel's."""
    pos, end = 0, len(text)
    kmsg_seq: int | None = None
    uptime_s: float | None = None
    clock: re.Match[str] | None = None
    for _ in range(_MAX_LAYERS):
        if pos == end:
            break
        first = text[pos]
        match: re.Match[str] | None = None
        # One regex at a time, chosen by the first character: one big alternation costs several times more.
        if first == "[":
            match = _BRACKET.match(text, pos)
            if match is not None:
                if match.group(1) is not None:
                    uptime_s = float(match.group(1))
                elif match.group(2) is not None and clock is None:
                    clock = match
        elif first == "<":
            match = _KMSG.match(text, pos)
            if match is not None:
                kmsg_seq, uptime_s = int(match.group(1)), int(match.group(2)) / 1_000_000
            else:
                match = _RFC5424.match(text, pos)
                if match is not None:
                    clock = clock or match
                else:
                    match = _RAW_PRIORITY.match(text, pos)
        elif first.isdigit():
            match = _KMSG.match(text, pos)
            if match is not None:
                kmsg_seq, uptime_s = int(match.group(1)), int(match.group(2)) / 1_000_000
            else:
                for regex in (_SYSLOG, _CRI, _ISO_BARE, _UNIX):
                    match = regex.match(text, pos)
                    if match is not None:
                        clock = clock or match
                        break
                else:
                    match = _BARE_UPTIME.match(text, pos)
                    if match is not None and "." in match.group(1):  # an integer's unit is not known
                        uptime_s = float(match.group(1))
        elif first.isupper():
            match = _SYSLOG.match(text, pos)
            if match is not None:
                clock = clock or match
        else:
            match = _WORD.match(text, pos)
            if match is not None and match.lastindex is not None:  # its ISO time matched
                clock = clock or match
        if match is None:
            match = _HOST_KERNEL.match(text, pos)
        if match is None or match.end() == pos:
            return None
        pos = match.end()
    return (kmsg_seq, uptime_s, clock) if pos == end else None


def _kmsg_header(text: str) -> Prefix | None:
    """/dev/kmsg's `6,1234,1843308145,-;`, read without a regex: every kmsg record has a new one."""
    if text[-1] != ";":
        return None
    fields = text[:-1].split(",", 3)
    if len(fields) != 4:
        return None
    priority, seq, usec = fields[0].strip("<>"), fields[1], fields[2]
    if priority.isdecimal() and seq.isdecimal() and usec.isdecimal() and text.isascii() and ";" not in fields[3]:
        return (int(seq), int(usec) / 1_000_000, None)
    return None


class PrefixReader:
    """One parser's prefixes: the fast forms read directly, the rest parsed once per distinct text (bounded)."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[str, Prefix | None] = {}

    def read(self, text: str) -> Prefix | None:
        """`text` is not empty; see parse_prefix."""
        first = text[0]
        if first == "[" and text[-2:] == "] ":
            # dmesg's `[ 1843.308145] `, read without a regex (or a call: this runs for every line of a storm).
            inner = text[1:-2].lstrip(" ")
            whole, dot, fraction = inner.partition(".")
            if dot and whole.isdecimal() and fraction.isdecimal() and inner.isascii():
                return (None, float(inner), None)
        elif first.isdigit():
            header = _kmsg_header(text)
            if header is not None:
                return header
        cache = self._cache
        if text in cache:
            return cache[text]
        if text.isspace():
            prefix: Prefix | None = NO_PREFIX  # indentation: the caller decides whether it continues a record
        else:
            prefix = parse_prefix(text)
        if len(cache) >= _CACHE_SIZE:
            cache.clear()
        cache[text] = prefix
        return prefix


def unwrap_docker_json(line: str) -> tuple[str, re.Match[str] | None] | None:
    """A Docker json-file line's text (without its newline) and its "time" as a clock; None for anything else."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not isinstance(entry, dict):
        return None
    text = entry.get("log")
    if not isinstance(text, str):
        return None
    stamp = entry.get("time")
    clock = _ISO_ONLY.match(stamp) if isinstance(stamp, str) else None
    return text.rstrip("\r\n"), clock


def wall_time(clock: re.Match[str], wall: WallClock) -> float | None:
    """POSIX time of a prefix's wall-clock time: this module's regexes say which group holds what, the clock does
    the calendar work."""
    regex = clock.re
    groups = clock.groups()
    if regex is _BRACKET:  # uptime, minute, second, year
        return wall.ctime(groups[1], groups[2], groups[3])
    if regex is _UNIX:
        return float(groups[0])
    if regex is _SYSLOG:  # BSD minute, seconds, then the ISO groups
        if groups[0] is not None:
            return wall.syslog(groups[0], float(groups[1]))
        groups = groups[2:]
    minute, second, offset = groups  # the ISO regexes
    return wall.iso(minute, second, offset)
