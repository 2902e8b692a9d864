"""Read cursors: a restarted probe continues its kernel log or /dev/kmsg where it stopped, with the ids an
uninterrupted probe would give, and reads from the start whenever the cursor does not fit what it finds."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest

from node_probe import host
from node_probe.classify.policy import PolicyConfig, RepeatRule
from node_probe.delivery.cursor import CursorStore, FileCursor, KmsgCursor, cursor_path
from node_probe.probe import Probe
from node_probe.sources.base import Observation
from node_probe.sources.kmsg import KmsgSource
from node_probe.sources.log_file import KernelLogFileSource
from tests.test_probe import NOISE, XID_13, XID_79, XID_95, FakeReporter, append, config, eventually, following, running

BANNER = (
    "[ 10.1] NVRM: The NVIDIA GPU 0000:b3:00.0\n",
    "[ 10.1] NVRM: (PCI ID: 10de:26b5) installed in this system has\n",
    "[ 10.1] NVRM: fallen off the bus and is not responding to commands.\n",
)
KMSG_48 = "6,1000,1843308145,-;NVRM: Xid (PCI:0000:3b:00): 48, pid=1, name=x, An uncorrectable double bit error\n"
KMSG_CONT = " SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n"
KMSG_NOISE = "6,1001,1843308146,-;usb 1-1: new high-speed USB device\n"
KMSG_79 = "4,1002,1843308200,-;NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.\n"
KMSG_13 = "4,1003,1843308300,-;NVRM: Xid (PCI:0000:17:00): 13, pid=77, name=train.py, Graphics SM Warp Exception\n"


def file_store(tmp_path: Path) -> CursorStore[FileCursor]:
    return CursorStore(tmp_path / "spool" / "i-0abc.kernel_log.cursor", FileCursor)


def saved(store: CursorStore[FileCursor]) -> FileCursor | None:
    # A fresh store reads the file as a restarted probe would, without touching the live one's state.
    return CursorStore(store.path, FileCursor).load()


async def read_file(log: Path, store: CursorStore[FileCursor] | None, count: int, line: int) -> list[Observation]:
    """One probe run: follow until `count` records came and the cursor reached `line`, then stop."""
    source = KernelLogFileSource(log, poll_interval=0.02, cursor=store)
    async with following(source) as seen:
        await eventually(lambda: len(seen) >= count)
        if store is not None:
            await eventually(lambda: (c := saved(store)) is not None and c.line == line)
        await asyncio.sleep(0.1)  # time to (wrongly) send more
    return seen


def described(seen: list[Observation]) -> list[tuple[int | None, str]]:
    return [(o.record.code, o.position) for o in seen]


async def test_a_restarted_file_follower_reads_only_new_lines_with_unchanged_ids(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(NOISE + XID_79 + NOISE + XID_13)
    store = file_store(tmp_path)
    first = await read_file(log, store, count=2, line=4)
    append(log, NOISE + XID_95 + XID_79)
    second = await read_file(log, file_store(tmp_path), count=2, line=7)
    uninterrupted = await read_file(log, None, count=4, line=7)
    assert [o.record.code for o in first] == [79, 13]
    assert [o.record.code for o in second] == [95, 79]
    assert described(first + second) == described(uninterrupted)
    inode = os.stat(log).st_ino
    assert [o.position for o in second] == [f"ino:{inode}:line:{n}" for n in (6, 7)]
    assert [o.record.line for o in second] == [6, 7]


async def test_a_restart_while_the_file_is_unchanged_sends_nothing(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79 + XID_13)
    await read_file(log, file_store(tmp_path), count=2, line=2)
    assert await read_file(log, file_store(tmp_path), count=0, line=2) == []


async def test_a_rotated_file_is_read_from_the_start(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79 + NOISE)
    await read_file(log, file_store(tmp_path), count=1, line=2)
    log.rename(tmp_path / "kern.log.1")  # the old file keeps its inode, so the new one gets another
    log.write_text(XID_13 + XID_95)
    seen = await read_file(log, file_store(tmp_path), count=2, line=2)
    inode = os.stat(log).st_ino
    assert described(seen) == [(13, f"ino:{inode}:line:1"), (95, f"ino:{inode}:line:2")]


@pytest.mark.parametrize(
    ("how", "rotated_name"),
    [("rename", "kern.log.1"), ("rename", "kern.log-20261130"), ("copytruncate", "kern.log.1")],
)
async def test_lines_the_probe_missed_before_a_rotation_while_it_was_down_are_read_once(
    tmp_path: Path, how: str, rotated_name: str
) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79 + NOISE)
    await read_file(log, file_store(tmp_path), count=1, line=2)
    inode = os.stat(log).st_ino
    # While the probe is down: two faults land in the log, then logrotate runs.
    append(log, XID_13 + XID_95)
    rotated = tmp_path / rotated_name
    if how == "rename":
        log.rename(rotated)
    else:
        shutil.copyfile(log, rotated)
        with open(log, "r+b") as handle:
            handle.truncate(0)
    (tmp_path / "kern.log.2.gz").write_bytes(b"\x1f\x8b older, compressed: never followed")
    append(log, NOISE + XID_95)
    seen = await read_file(log, file_store(tmp_path), count=3, line=2)
    now = os.stat(log).st_ino
    # The missed two with their generation's ids (as an uninterrupted probe would have sent them), then the new file.
    assert described(seen) == [(13, f"ino:{inode}:line:3"), (95, f"ino:{inode}:line:4"), (95, f"ino:{now}:line:2")]


async def test_a_rotation_whose_rotated_file_is_gone_reads_the_new_file_and_says_what_was_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79 + NOISE)
    await read_file(log, file_store(tmp_path), count=1, line=2)
    append(log, XID_13)
    log.unlink()
    log.write_text(XID_95)
    with caplog.at_level(logging.WARNING):
        seen = await read_file(log, file_store(tmp_path), count=1, line=1)
    assert [o.record.code for o in seen] == [95]
    assert "no rotated file continues where it stopped (line 2)" in caplog.text


@pytest.mark.parametrize(
    "rewrite",
    [
        pytest.param(XID_13, id="shorter"),
        # Grown past the old offset while the probe was down: same inode, larger size, other content.
        pytest.param(XID_13 + XID_95 + XID_79 + NOISE, id="grown-again"),
    ],
)
async def test_a_truncated_file_is_read_from_the_start(tmp_path: Path, rewrite: str) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79 + NOISE + NOISE)
    await read_file(log, file_store(tmp_path), count=1, line=3)
    inode = os.stat(log).st_ino
    with open(log, "r+", encoding="utf-8") as handle:  # copytruncate: same file, new content
        handle.truncate(0)
        handle.write(rewrite)
    assert os.stat(log).st_ino == inode
    expected = [o.record.code for o in await read_file(log, None, count=1, line=0)]
    seen = await read_file(log, file_store(tmp_path), count=len(expected), line=rewrite.count("\n"))
    assert [o.record.code for o in seen] == expected
    assert seen[0].position == f"ino:{inode}:line:1"


@pytest.mark.parametrize("content", [b"{not json", b'{"path": "x", "inode": 1}', b"\xff\xfe"])
async def test_a_corrupt_cursor_is_a_warning_and_a_read_from_the_start(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79 + XID_13)
    store = file_store(tmp_path)
    store.path.parent.mkdir(parents=True)
    store.path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="node_probe.delivery.cursor"):
        seen = await read_file(log, store, count=2, line=2)
    assert [o.record.code for o in seen] == [79, 13]
    assert any("corrupt cursor" in r.getMessage() for r in caplog.records)
    assert saved(store) is not None  # replaced by a good one


async def test_an_unreadable_cursor_is_a_warning_and_a_read_from_the_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79)
    store = CursorStore(tmp_path / "a-directory.cursor", FileCursor)
    store.path.mkdir()
    source = KernelLogFileSource(log, poll_interval=0.02, cursor=store)
    with caplog.at_level(logging.WARNING, logger="node_probe.delivery.cursor"):
        async with following(source) as seen:
            await eventually(lambda: len(seen) == 1)
            await asyncio.sleep(0.1)
    messages = [r.getMessage() for r in caplog.records]
    assert any("cannot read cursor" in m for m in messages)
    assert len([m for m in messages if "cannot write cursor" in m]) == 1  # once, not once per read


async def test_a_partial_last_line_is_not_consumed_until_its_newline_comes(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_79 + XID_13[:40])
    first = await read_file(log, file_store(tmp_path), count=1, line=1)
    cursor = saved(file_store(tmp_path))
    assert cursor is not None and cursor.offset == len(XID_79.encode())
    append(log, XID_13[40:])
    second = await read_file(log, file_store(tmp_path), count=1, line=2)
    uninterrupted = await read_file(log, None, count=2, line=2)
    assert [(o.record.code, o.record.raw) for o in second] == [(13, XID_13.rstrip("\n"))]
    assert described(first + second) == described(uninterrupted)


async def test_a_banner_cut_by_a_restart_is_still_one_record(tmp_path: Path) -> None:
    """The parser holds a banner's first lines in memory: the cursor must not pass them before the record."""
    log = tmp_path / "kern.log"
    log.write_text(XID_79 + NOISE + BANNER[0] + BANNER[1])
    first = await read_file(log, file_store(tmp_path), count=1, line=2)
    append(log, BANNER[2] + XID_13)
    second = await read_file(log, file_store(tmp_path), count=2, line=6)
    uninterrupted = await read_file(log, None, count=3, line=6)
    assert [(o.record.kind, o.record.line) for o in second] == [("gpu_fallen_off_bus", 3), ("xid", 6)]
    assert described(first + second) == described(uninterrupted)


async def test_the_cursor_moves_on_once_a_banner_can_no_longer_complete(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(NOISE + BANNER[0] + NOISE * 7)
    await read_file(log, file_store(tmp_path), count=0, line=1)  # line 10 could still complete the banner
    append(log, NOISE)
    await read_file(log, file_store(tmp_path), count=0, line=10)


# --- /dev/kmsg -----------------------------------------------------------------


async def read_kmsg(
    kmsg: Path, store: CursorStore[KmsgCursor], boot: str, count: int, seq: int | None = None
) -> list[Observation]:
    source = KmsgSource(kmsg, poll_interval=0.02, cursor=store, boot_id=boot)
    async with following(source) as seen:
        await eventually(lambda: len(seen) >= count)
        if seq is not None:
            await eventually(lambda: (c := CursorStore(store.path, KmsgCursor).load()) is not None and c.seq == seq)
        await asyncio.sleep(0.1)
    return seen


async def test_a_restarted_kmsg_follower_skips_records_it_handled_in_this_boot(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(KMSG_48 + KMSG_CONT + KMSG_NOISE + KMSG_79)
    path = cursor_path(tmp_path / "spool", "i-0abc", "kmsg")
    first = await read_kmsg(kmsg, CursorStore(path, KmsgCursor), "boot-a", count=2, seq=1002)
    assert CursorStore(path, KmsgCursor).load() == KmsgCursor(path=str(kmsg), boot_id="boot-a", seq=1002)
    append(kmsg, KMSG_13)
    same_boot = await read_kmsg(kmsg, CursorStore(path, KmsgCursor), "boot-a", count=1, seq=1003)
    other_boot = await read_kmsg(kmsg, CursorStore(path, KmsgCursor), "boot-b", count=3, seq=1003)
    assert [o.position for o in first] == ["seq:1000", "seq:1002"]
    assert [o.position for o in same_boot] == ["seq:1003"]
    assert [o.position for o in other_boot] == ["seq:1000", "seq:1002", "seq:1003"]


# The "fallen off the bus" banner is one printk: /dev/kmsg gives it as one record, its newlines escaped.
KMSG_BANNER = (
    "3,1002,1843308145,-;NVRM: The NVIDIA GPU 0000:b3:00.0\\x0aNVRM: (PCI ID: 10de:26b5) installed in this system "
    "has\\x0aNVRM: fallen off the bus and is not responding to commands.\n"
)


async def test_kmsg_delivers_the_banner_printed_as_one_record_and_its_cursor_skips_it(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(KMSG_48 + KMSG_CONT + KMSG_NOISE + KMSG_BANNER + " SUBSYSTEM=pci\n DEVICE=+pci:0000:b3:00.0\n")
    path = cursor_path(tmp_path / "spool", "i-0abc", "kmsg")
    first = await read_kmsg(kmsg, CursorStore(path, KmsgCursor), "boot-a", count=2, seq=1002)
    assert [(o.record.kind, o.record.pci, o.position) for o in first] == [
        ("xid", "0000:3b:00", "seq:1000"),
        ("gpu_fallen_off_bus", "0000:b3:00", "seq:1002"),
    ]
    banner = first[1].record
    assert (banner.line, banner.code, banner.kmsg_seq, banner.uptime_s) == (5, None, 1002, 1843.308145)
    assert banner.raw == KMSG_BANNER.rstrip("\n")
    assert banner.message == (
        "The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has fallen off the bus and is "
        "not responding to commands."
    )
    append(kmsg, KMSG_13)
    again = await read_kmsg(kmsg, CursorStore(path, KmsgCursor), "boot-a", count=1, seq=1003)
    assert [o.position for o in again] == ["seq:1003"]


async def test_kmsg_without_a_boot_id_keeps_no_cursor(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(KMSG_48)
    store = CursorStore(tmp_path / "kmsg.cursor", KmsgCursor)
    with caplog.at_level(logging.WARNING, logger="node_probe.sources.kmsg"):
        seen = await read_kmsg(kmsg, store, "", count=1)
    assert len(seen) == 1
    assert not store.path.exists()
    assert any("no boot id" in r.getMessage() for r in caplog.records)


# --- the store -------------------------------------------------------------------


def test_the_store_writes_changes_at_most_once_per_interval_and_flushes_the_rest(tmp_path: Path) -> None:
    now = [0.0]
    store = CursorStore(tmp_path / "c.cursor", KmsgCursor, min_interval=1.0, clock=lambda: now[0])
    cursors = [KmsgCursor(path="k", boot_id="b", seq=n) for n in range(5)]
    store.update(cursors[0])
    assert store.writes == 1  # the first at once
    store.update(cursors[1])
    store.update(cursors[2])
    assert store.writes == 1
    assert CursorStore(store.path, KmsgCursor).load() == cursors[0]
    now[0] = 1.0
    store.update(cursors[3])
    assert store.writes == 2
    store.flush()
    assert store.writes == 2  # nothing newer
    store.update(cursors[4])
    store.flush()
    store.flush()
    store.update(cursors[4])
    now[0] = 5.0
    store.update(cursors[4])
    assert store.writes == 3
    assert CursorStore(store.path, KmsgCursor).load() == cursors[4]
    assert [p.name for p in tmp_path.iterdir()] == ["c.cursor"]  # no temporary file left behind


def test_cursor_files_are_named_per_instance_and_source(tmp_path: Path) -> None:
    assert cursor_path(tmp_path, "i-0abc", "kmsg") == tmp_path / "i-0abc.kmsg.cursor"
    assert cursor_path(tmp_path, "node/1 x", "kernel_log") == tmp_path / "node_1_x.kernel_log.cursor"


# --- the probe -------------------------------------------------------------------


async def test_a_restarted_probe_with_a_spool_dir_does_not_deliver_old_findings_again(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(XID_13 + NOISE + XID_79)
    spool = tmp_path / "spool"
    cursor = cursor_path(spool, "i-0abc", "kernel_log")
    before = FakeReporter()
    async with running(Probe(config(tmp_path, spool_dir=spool), before)):
        await eventually(lambda: len(before.findings) == 2)
        await eventually(lambda: (c := CursorStore(cursor, FileCursor).load()) is not None and c.line == 3)
    append(log, XID_95)
    after = FakeReporter()
    async with running(Probe(config(tmp_path, spool_dir=spool), after)):
        await eventually(lambda: len(after.findings) == 1)
        await asyncio.sleep(0.2)
    uninterrupted = FakeReporter()
    async with running(Probe(config(tmp_path), uninterrupted)):
        await eventually(lambda: len(uninterrupted.findings) == 3)
    assert [f.reason for f in after.findings] == ["XID_95"]
    assert [f.finding_id for f in before.findings + after.findings] == [f.finding_id for f in uninterrupted.findings]


@pytest.mark.skipif(not host.boot_id(), reason="this host has no boot id")
async def test_a_restarted_probe_following_kmsg_does_not_deliver_old_findings_again(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(KMSG_48 + KMSG_CONT + KMSG_79)
    spool = tmp_path / "spool"
    settings = config(tmp_path, kernel_log=None, kmsg=True, kmsg_path=kmsg, spool_dir=spool)
    cursor = cursor_path(spool, "i-0abc", "kmsg")
    before = FakeReporter()
    async with running(Probe(settings, before)):
        await eventually(lambda: len(before.findings) == 2)
        await eventually(lambda: (c := CursorStore(cursor, KmsgCursor).load()) is not None and c.seq == 1002)
    append(kmsg, KMSG_13)
    after = FakeReporter()
    async with running(Probe(settings, after)):
        await eventually(lambda: len(after.findings) == 1)
        await asyncio.sleep(0.2)
    assert [f.reason for f in after.findings] == ["XID_13"]


async def test_a_repeat_rule_counts_across_a_probe_restart(tmp_path: Path) -> None:
    """Two Xid 13s, a restart, a third: the cursor keeps the first two from being read again, and the repeat
    rules' memory beside the spool keeps them counted, so the third impairs as it would without the restart."""
    log = tmp_path / "kern.log"
    log.write_text(XID_13 + NOISE + XID_13)
    rule = RepeatRule(code=13, count=3, within=timedelta(minutes=10))
    settings = config(tmp_path, spool_dir=tmp_path / "spool", policy_config=PolicyConfig(repeat=[rule]))
    before = FakeReporter()
    async with running(Probe(settings, before)):
        await eventually(lambda: len(before.findings) == 1 and before.findings[0].count == 1)
        await eventually(lambda: (c := saved(file_store(tmp_path))) is not None and c.line == 3)
    assert not before.findings[0].impairs
    append(log, XID_13)
    after = FakeReporter()
    async with running(Probe(settings, after)):
        await eventually(lambda: any(f.impairs for f in after.findings))
    # First the roll-up of the first run's burst (the second Xid 13, spooled at shutdown), then the impairing third.
    assert [(f.impairs, f.rule, f.count) for f in after.findings] == [
        (False, "ecs:not-in-xid-list", 1),
        (True, "override:repeat xid13 3/600s", 1),
    ]
