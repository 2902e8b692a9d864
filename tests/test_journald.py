"""The journald source against the real journalctl, reading real journal files.

Debian's systemd-journal-remote turns journal export format into journal files (`make test` installs it); the
entries carry what journald itself stores for a kernel record (_TRANSPORT=kernel, this boot's _BOOT_ID, the
kernel's timestamp in _SOURCE_MONOTONIC_TIMESTAMP), and the source runs `journalctl --directory=<that dir>` on them.
With --directory, `-k` means the newest boot in those files rather than the running one, so every entry is
written with this machine's boot id. Appending to the same file while journalctl follows it is how new kernel
records arrive.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import struct
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from contract.health import HealthState
from node_probe import cli
from node_probe.delivery.cursor import CursorStore
from node_probe.probe import Probe, ProbeConfig, build_sources
from node_probe.sources.journald import STARTED_AFTER_S, JournalCursor, JournaldSource
from tests.test_probe import FakeReporter, eventually, following, running
from tests.test_probe_cli import probe_args

JOURNAL_REMOTE = Path("/lib/systemd/systemd-journal-remote")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip().replace("-", "")
OTHER_BOOT = "0123456789abcdef0123456789abcdef"

XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
XID_13 = (
    "NVRM: Xid (PCI:0000:17:00): 13, pid=77, name=train.py, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): "
    "Out Of Range Address"
)
XID_95 = "NVRM: Xid (PCI:0000:c1:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. RST: Yes, D-RST: No"
XID_48 = (
    "NVRM: Xid (PCI:0000:C1:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) "
    "has been detected on GPU in the framebuffer at partition 1, subpartition 0."
)
BANNER = (
    "NVRM: The NVIDIA GPU 0000:B3:00.0",
    "NVRM: (PCI ID: 10de:26b5) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
)
NOISE = "usb 1-1: new high-speed USB device number 2 using xhci_hcd"

POLL = 0.02


@pytest.fixture(scope="module")
def journalctl() -> str:
    found = shutil.which("journalctl")
    if found is None or not os.access(JOURNAL_REMOTE, os.X_OK):
        pytest.fail("journalctl or systemd-journal-remote not found: run the tests through `make test`")
    return found


class Journal:
    """A journal directory that kernel entries are written into, as journald writes what it reads from /dev/kmsg."""

    def __init__(self, directory: Path, create: bool = True) -> None:
        self.directory = directory
        self.file = directory / "kern.journal"
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        self._written = 0

    def write(self, *messages: str | bytes, uptime_us: int = 1_843_308_145, boot: str = BOOT_ID) -> None:
        """One entry per message, the kernel's timestamps `uptime_us`, `uptime_us` + 1, ..."""
        export = bytearray()
        for n, message in enumerate(messages):
            self._written += 1
            body = message.encode() if isinstance(message, str) else message
            export += (
                f"__REALTIME_TIMESTAMP={time.time_ns() // 1000}\n"
                # journald's own receipt time: later than the kernel's, and the same for a batch read at once.
                f"__MONOTONIC_TIMESTAMP={uptime_us + 5_000_000 + self._written}\n"
                f"_BOOT_ID={boot}\n"
                "_TRANSPORT=kernel\n"
                "PRIORITY=4\n"
                "SYSLOG_FACILITY=0\n"
                "SYSLOG_IDENTIFIER=kernel\n"
                "_HOSTNAME=gpu-node\n"
                f"_SOURCE_MONOTONIC_TIMESTAMP={uptime_us + n}\n"
            ).encode()
            if isinstance(message, bytes):
                # Export format's binary field: name, newline, little-endian 64-bit length, the bytes, newline.
                export += b"MESSAGE\n" + struct.pack("<Q", len(body)) + body + b"\n"
            else:
                export += b"MESSAGE=" + body + b"\n"
            export += b"\n"
        result = subprocess.run(
            [str(JOURNAL_REMOTE), f"--output={self.file}", "-"], input=bytes(export), capture_output=True, timeout=30
        )
        assert result.returncode == 0, result.stderr.decode()

    def entries(self, *args: str) -> list[dict[str, Any]]:
        """What journalctl itself says is there: the cursors to expect."""
        out = subprocess.run(
            ["journalctl", f"--directory={self.directory}", "-k", "-o", "json", "--no-pager", "--all", *args],
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout
        return [json.loads(line) for line in out.splitlines()]


def source_for(journal: Journal, journalctl: str, **kwargs: Any) -> JournaldSource:
    return JournaldSource(POLL, journalctl=journalctl, directory=journal.directory, **kwargs)


def journalctl_pid(directory: Path) -> int | None:
    """Our own journalctl child that reads `directory`."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and f"--directory={directory}".encode() in argv:
            return int(proc.name)
    return None


def store(tmp_path: Path, min_interval: float = 0.0) -> CursorStore[JournalCursor]:
    return CursorStore(tmp_path / "spool" / "i-0abc.journald.cursor", JournalCursor, min_interval=min_interval)


# --- records ---------------------------------------------------------------------------------------------------


async def test_xid_entries_become_records_with_code_pci_uptime_and_cursor(tmp_path: Path, journalctl: str) -> None:
    journal = Journal(tmp_path / "journal")
    # More than journalctl's 10-line tail in follow mode: the whole boot's history must be read.
    journal.write(XID_79, *[NOISE] * 12, XID_48, uptime_us=1_843_308_145)
    source = source_for(journal, journalctl)
    assert source.check().is_ok
    async with following(source) as seen:
        await eventually(lambda: len(seen) == 2)
        assert source.status.is_ok
        journal.write(NOISE, XID_13, XID_95, uptime_us=1_900_000_001)  # appended while journalctl follows
        await eventually(lambda: len(seen) == 4)
        await asyncio.sleep(0.1)
    records = [o.record for o in seen]
    assert [(r.kind, r.code, r.pci) for r in records] == [
        ("xid", 79, "0000:3b:00"),
        ("xid", 48, "0000:c1:00"),
        ("xid", 13, "0000:17:00"),
        ("xid", 95, "0000:c1:00"),
    ]
    # The kernel's timestamp (dmesg's uptime), not journald's receipt time.
    assert [r.uptime_s for r in records] == [1843.308145, 1843.308158, 1900.000002, 1900.000003]
    assert records[0].raw == "[1843.308145] " + XID_79
    assert (records[0].pid, records[0].process_name, records[3].rst, records[3].d_rst) == (1234, "python3", True, False)
    cursors = {e["MESSAGE"]: e["__CURSOR"] for e in journal.entries() if e["MESSAGE"] != NOISE}
    assert [o.position for o in seen] == [f"journal:{cursors[m]}" for m in (XID_79, XID_48, XID_13, XID_95)]
    assert {o.source for o in seen} == {f"journald:{journal.directory}"}
    assert source.entries == 17


async def test_the_three_entry_banner_is_one_record(tmp_path: Path, journalctl: str) -> None:
    journal = Journal(tmp_path / "journal")
    journal.write(NOISE, BANNER[0], uptime_us=10_100_000)
    source = source_for(journal, journalctl)
    async with following(source) as seen:
        await eventually(lambda: source.entries == 2)
        journal.write(BANNER[1], BANNER[2], XID_79, uptime_us=10_100_002)
        await eventually(lambda: len(seen) == 2)
    banner, xid = seen
    assert (banner.record.kind, banner.record.pci, banner.record.code) == ("gpu_fallen_off_bus", "0000:b3:00", None)
    assert banner.record.raw.splitlines() == [
        "[10.100001] " + BANNER[0],
        "[10.100002] " + BANNER[1],
        "[10.100003] " + BANNER[2],
    ]
    assert "10de:26b5" in banner.record.message and banner.record.uptime_s == 10.100003
    last = next(e for e in journal.entries() if e["MESSAGE"] == BANNER[2])
    assert banner.position == f"journal:{last['__CURSOR']}"  # the entry that completed it
    assert xid.record.code == 79


async def test_a_message_that_is_not_utf8_is_decoded_with_replacement(tmp_path: Path, journalctl: str) -> None:
    journal = Journal(tmp_path / "journal")
    journal.write(b"NVRM: Xid (PCI:0000:17:00): 13, pid=77, name=\xff\xfe\x01, Graphics Exception", XID_79)
    assert isinstance(journal.entries()[0]["MESSAGE"], list)  # journalctl prints it as byte values
    source = source_for(journal, journalctl)
    async with following(source) as seen:
        await eventually(lambda: len(seen) == 2)
    assert [o.record.code for o in seen] == [13, 79]
    assert seen[0].record.process_name == "\ufffd\ufffd\x01" and source.status.is_ok


async def test_output_that_is_not_a_journal_entry_is_skipped(tmp_path: Path, journalctl: str) -> None:
    journal = Journal(tmp_path / "journal")
    journal.write(XID_79)
    # A stand-in that prints garbage before handing over to the real journalctl with the same arguments.
    wrapper = tmp_path / "journalctl"
    wrapper.write_text(f"#!/bin/sh\necho 'not json {{'\necho '[1, 2]'\nexec {journalctl} \"$@\"\n")
    wrapper.chmod(0o755)
    source = source_for(journal, str(wrapper))
    async with following(source) as seen:
        await eventually(lambda: len(seen) == 1)
    assert seen[0].record.code == 79 and source.entries == 1 and source.status.is_ok


# --- restarts and the durable cursor ---------------------------------------------------------------------------


async def test_restart_with_a_saved_cursor_reads_only_later_entries(tmp_path: Path, journalctl: str) -> None:
    journal = Journal(tmp_path / "journal")
    journal.write(XID_13, NOISE, XID_79, NOISE)
    first = source_for(journal, journalctl, cursor=store(tmp_path))
    async with following(first) as seen:
        await eventually(lambda: len(seen) == 2 and first.entries == 4)
        await eventually(
            lambda: (c := store(tmp_path).load()) is not None and c.cursor == journal.entries()[-1]["__CURSOR"]
        )
    saved = store(tmp_path).load()
    assert saved is not None and saved.boot_id == BOOT_ID

    journal.write(XID_95)
    second = source_for(journal, journalctl, cursor=store(tmp_path))
    async with following(second) as resumed:
        await eventually(lambda: len(resumed) == 1)
        await asyncio.sleep(0.2)
    assert [o.record.code for o in resumed] == [95] and second.entries == 1

    # Positions are the entries' own: a fresh source without a cursor gives the same ones.
    fresh = source_for(journal, journalctl)
    async with following(fresh) as everything:
        await eventually(lambda: len(everything) == 3)
    assert [o.position for o in everything] == [o.position for o in seen + resumed]


async def test_a_cursor_from_another_boot_is_not_used(tmp_path: Path, journalctl: str) -> None:
    journal = Journal(tmp_path / "journal")
    journal.write(XID_13, XID_79)
    cursors = store(tmp_path)
    cursors.update(JournalCursor(cursor=journal.entries()[-1]["__CURSOR"], boot_id=OTHER_BOOT))
    source = source_for(journal, journalctl, cursor=store(tmp_path))
    async with following(source) as seen:
        await eventually(lambda: len(seen) == 2)
    assert [o.record.code for o in seen] == [13, 79]


async def test_a_cursor_journalctl_rejects_is_dropped_and_the_boot_read_again(
    tmp_path: Path, journalctl: str, caplog: pytest.LogCaptureFixture
) -> None:
    journal = Journal(tmp_path / "journal")
    journal.write(XID_13, XID_79)
    store(tmp_path).update(JournalCursor(cursor="not-a-cursor", boot_id=BOOT_ID))
    source = source_for(journal, journalctl, cursor=store(tmp_path))
    async with following(source) as seen:
        await eventually(lambda: len(seen) == 2)
        await eventually(lambda: source.status.is_ok)
    assert [o.record.code for o in seen] == [13, 79]
    assert "journalctl rejected the cursor" in caplog.text and "Failed to seek to cursor" in caplog.text


async def test_a_banner_cut_by_a_probe_restart_is_not_lost(tmp_path: Path, journalctl: str) -> None:
    journal = Journal(tmp_path / "journal")
    journal.write(XID_13, BANNER[0], BANNER[1])
    first = source_for(journal, journalctl, cursor=store(tmp_path))
    async with following(first) as seen:
        await eventually(lambda: first.entries == 3)
        await asyncio.sleep(3 * POLL)  # caught up: the cursor is flushed
    assert [o.record.code for o in seen] == [13]
    saved = store(tmp_path).load()
    # Before the banner's first entry: the parser held the two banner entries in memory only.
    assert saved is not None and saved.cursor == journal.entries()[0]["__CURSOR"]

    journal.write(BANNER[2])
    second = source_for(journal, journalctl, cursor=store(tmp_path))
    async with following(second) as resumed:
        await eventually(lambda: len(resumed) == 1)
    assert resumed[0].record.kind == "gpu_fallen_off_bus" and resumed[0].record.pci == "0000:b3:00"


# --- status ----------------------------------------------------------------------------------------------------


async def test_without_journalctl_the_source_is_down_and_the_probe_says_insufficient_data(tmp_path: Path) -> None:
    missing = str(tmp_path / "bin" / "journalctl")
    source = JournaldSource(POLL, journalctl=missing)
    status = source.check()
    assert status.state == HealthState.INSUFFICIENT_DATA and status.reason == f"journald: {missing} not found"
    assert JournaldSource(POLL, journalctl="no-such-journalctl-here").check().reason == (
        "journald: no-such-journalctl-here not found"
    )
    reporter = FakeReporter()
    config = ProbeConfig(instance_id="i-0abc", group="gpu-a", heartbeat_interval=timedelta(seconds=0.05))
    probe = Probe(config, reporter, sources=[source])
    async with running(probe):
        await eventually(lambda: len(reporter.heartbeats) >= 2)  # the source keeps trying, and keeps running
    assert {h.gpu_health for h in reporter.heartbeats} == {HealthState.INSUFFICIENT_DATA}
    assert reporter.heartbeats[-1].gpu_health_reason == f"journald: {missing} not found"
    assert probe.gpu_health() == (HealthState.INSUFFICIENT_DATA, f"journald: {missing} not found")


async def test_a_journalctl_that_fails_is_down_with_its_error_then_recovers(tmp_path: Path, journalctl: str) -> None:
    journal = Journal(tmp_path / "journal", create=False)
    source = source_for(journal, journalctl)
    assert not source.check().is_ok
    async with following(source) as seen:
        await eventually(lambda: "exited with status 1" in (source.status.reason or ""))
        assert f"Failed to open {journal.directory}" in (source.status.reason or "")
        journal.directory.mkdir()
        journal.write(XID_79)
        await eventually(lambda: len(seen) == 1 and source.status.is_ok)


async def test_a_journalctl_that_finds_no_journal_is_not_ok(tmp_path: Path) -> None:
    # Where no journal is readable (a container without the host's journal mounted), the real journalctl prints
    # this on stderr and keeps waiting; it says it only for the system journal, so a stand-in says it here.
    stand_in = tmp_path / "journalctl"
    stand_in.write_text("#!/bin/sh\necho 'No journal files were found.' >&2\nexec sleep 60\n")
    stand_in.chmod(0o755)
    source = JournaldSource(POLL, journalctl=str(stand_in))
    assert source.check().is_ok
    async with following(source):
        await eventually(lambda: source.status.reason == "journald: No journal files were found.")
        await asyncio.sleep(STARTED_AFTER_S + 0.2)
        assert not source.status.is_ok


async def test_a_journalctl_that_dies_is_restarted_after_the_last_entry(tmp_path: Path, journalctl: str) -> None:
    journal = Journal(tmp_path / "journal")
    journal.write(XID_13, BANNER[0])
    source = source_for(journal, journalctl)
    async with following(source) as seen:
        await eventually(lambda: source.entries == 2 and source.status.is_ok)
        pid = journalctl_pid(journal.directory)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: source.status.reason == "journald: journalctl killed by signal 9")
        await eventually(lambda: source.status.is_ok)
        new_pid = journalctl_pid(journal.directory)
        assert new_pid is not None and new_pid != pid
        # The banner's first entry came from the dead journalctl; one parser for the source joins the rest to it.
        journal.write(BANNER[1], BANNER[2], XID_95)
        await eventually(lambda: len(seen) == 3)
        await asyncio.sleep(0.1)
    assert [(o.record.kind, o.record.code) for o in seen] == [("xid", 13), ("gpu_fallen_off_bus", None), ("xid", 95)]
    assert source.entries == 5  # nothing read twice


# --- the probe -------------------------------------------------------------------------------------------------


async def test_probe_delivers_a_finding_from_the_journal(tmp_path: Path, journalctl: str) -> None:
    journal = Journal(tmp_path / "journal")
    journal.write(NOISE, XID_79)
    reporter = FakeReporter()
    config = ProbeConfig(
        instance_id="i-0abc", group="gpu-a", poll_interval=timedelta(seconds=POLL), task_queue="q-test"
    )
    probe = Probe(config, reporter, sources=[source_for(journal, journalctl)])
    async with running(probe):
        await eventually(lambda: len(reporter.findings) == 1)
        await eventually(lambda: probe.gpu_health() == (HealthState.OK, None))
    finding = reporter.findings[0]
    assert (finding.kind, finding.code, finding.reason, finding.impairs) == ("xid", 79, "XID_79", True)
    assert finding.gpu.pci == "0000:3b:00" and finding.source == f"journald:{journal.directory}"
    assert finding.raw == "[1843.308146] " + XID_79
    assert reporter.heartbeats[0].gpu_health == HealthState.OK  # check(): journalctl is there


def test_build_sources_and_the_cli_flag(tmp_path: Path) -> None:
    config = ProbeConfig(instance_id="i-0abc", group="gpu-a", journald=True, spool_dir=tmp_path)
    (source,) = build_sources(config)
    assert isinstance(source, JournaldSource) and source.name == "journald"
    assert source._cursor is not None and source._cursor.path == tmp_path / "i-0abc.journald.cursor"
    assert source.argv() == ["journalctl", "-k", "-o", "json", "--no-pager", "--follow", "--no-tail", "--all"]
    args = probe_args("--group", "g", "--journald")
    assert args.journald and not args.kmsg
    with pytest.raises(SystemExit):
        probe_args("--group", "g", "--journald", "--kmsg")


async def test_the_probe_command_follows_the_journal_instead_of_kmsg(tmp_path: Path) -> None:
    args = probe_args(
        "--instance-id", "i-1", "--group", "g", "--spool-dir", str(tmp_path), "--journald", "--direct-temporal"
    )  # fmt: skip
    probe = await cli.build_probe(args)
    assert probe.config.journald and not probe.config.kmsg and probe.config.kernel_log is None
