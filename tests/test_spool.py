"""The spool: order across restarts, the cap, compaction, and disk errors that must never stop the probe.

Write failures are real ones from the kernel: RLIMIT_FSIZE makes a write that would grow a file past the limit fail
with EFBIG (SIGXFSZ ignored meanwhile). That works as root too, which these tests may run as and which ignores file
permissions. Read-only storage uses chmod, or as root `chattr +i` (skipped where that is not permitted).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from contract.probe import GpuFinding
from node_probe.delivery.spool import FileSpool, MemorySpool

NOW = datetime(2025, 1, 21, 4, 41, 44, tzinfo=UTC)


def numbered(n: int, impairs: bool = False) -> GpuFinding:
    return GpuFinding(
        finding_id=f"i-1/xid/{n:04d}",
        instance_id="i-1",
        group="g",
        kind="xid",
        code=13,
        reason="XID_13",
        impairs=impairs,
        message=f"number {n:04d}",
        observed_at=NOW,
    )


LINE = len(numbered(0).model_dump_json()) + 1  # every numbered finding takes as many bytes


def drain(spool: FileSpool | MemorySpool) -> list[int]:
    numbers = []
    while (head := spool.peek()) is not None:
        numbers.append(int(head.message.split()[1]))
        spool.pop()
    return numbers


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Any write that would make a file larger than nbytes fails with EFBIG, for root too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@contextlib.contextmanager
def no_free_file_descriptors() -> Iterator[None]:
    """open() fails with EMFILE, as when the process's file descriptor table is full."""
    lowest_free = os.dup(0)
    os.close(lowest_free)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """The directory and its files can no longer be written, as after a remount read-only."""
    paths = [directory, *directory.iterdir()]
    if os.geteuid() != 0:
        modes = {path: stat.S_IMODE(path.stat().st_mode) for path in paths}
        for path in paths:
            path.chmod(modes[path] & ~0o222)
        try:
            yield
        finally:
            for path, mode in modes.items():
                path.chmod(mode)
        return
    # Root ignores permissions but not the immutable attribute (needs CAP_LINUX_IMMUTABLE and ext4/xfs/btrfs).
    if shutil.which("chattr") is None:
        pytest.skip("root, and no chattr here")
    done = subprocess.run(["chattr", "+i", *map(str, paths)], capture_output=True, check=False)
    if done.returncode != 0:
        subprocess.run(["chattr", "-i", *map(str, paths)], capture_output=True, check=False)
        pytest.skip(f"root, and chattr +i is not permitted here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", *map(str, paths)], check=True)


def degraded_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "degraded" in r.getMessage()]


def recovered_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Recovery is logged at INFO: the fixture below captures it."""
    return [r.getMessage() for r in caplog.records if "recovered" in r.getMessage()]


@pytest.fixture(autouse=True)
def _spool_info_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="node_probe.delivery.spool")


# --- the file ------------------------------------------------------------------------------------------------


def test_file_spool_keeps_order_across_reopen(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path, "i-1")
    for n in range(5):
        assert spool.append(numbered(n))
    assert spool.peek() == numbered(0)
    spool.pop()
    spool.pop()
    reopened = FileSpool(tmp_path, "i-1")
    assert len(reopened) == 3
    assert drain(reopened) == [2, 3, 4]
    assert reopened.path.stat().st_size == 0  # emptied once everything was delivered
    assert not reopened.degraded


def test_file_spool_cuts_a_partial_last_line(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path, "i-1")
    spool.append(numbered(1))
    with open(spool.path, "ab") as handle:
        handle.write(b'{"finding_id": "half-writ')
    reopened = FileSpool(tmp_path, "i-1")
    assert len(reopened) == 1
    reopened.append(numbered(2))
    assert drain(reopened) == [1, 2]


def test_an_offset_file_from_before_the_inode_was_recorded_is_still_read(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path, "i-1")
    for n in range(4):
        spool.append(numbered(n))
    (tmp_path / "i-1.offset").write_text(str(2 * LINE))
    assert drain(FileSpool(tmp_path, "i-1")) == [2, 3]


# --- the cap -------------------------------------------------------------------------------------------------


def test_full_spool_drops_warnings_but_keeps_impairing_findings(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path, "i-1", max_bytes=LINE * 3)
    assert all(spool.append(numbered(n)) for n in range(3))
    assert not spool.append(numbered(3))
    assert spool.append(numbered(4, impairs=True))
    assert len(spool) == 4
    memory = MemorySpool(max_items=2)
    assert memory.append(numbered(0)) and memory.append(numbered(1))
    assert not memory.append(numbered(2))
    assert memory.append(numbered(3, impairs=True))
    assert len(memory) == 3


def test_the_cap_counts_only_what_is_undelivered(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path, "i-1", max_bytes=LINE * 4)
    assert all(spool.append(numbered(n)) for n in range(4))
    assert not spool.append(numbered(99))
    spool.peek()
    spool.pop()
    spool.peek()
    spool.pop()
    # The delivered prefix is still in the file (no compaction below half the cap), but no longer counts.
    assert spool.path.stat().st_size == 4 * LINE
    assert spool.append(numbered(4)) and spool.append(numbered(5))
    assert not spool.append(numbered(99))
    assert drain(spool) == [2, 3, 4, 5]


def test_steady_traffic_that_never_drains_drops_nothing_and_the_file_stays_small(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path, "i-1", max_bytes=LINE * 10)
    delivered: list[int] = []
    assert spool.append(numbered(0)) and spool.append(numbered(1))
    largest = 0
    for n in range(2, 200):
        assert spool.append(numbered(n))  # the backlog is never above three
        largest = max(largest, spool.path.stat().st_size)
        delivered.extend(drain_one(spool))
    assert len(spool) == 2
    delivered.extend(drain(spool))
    assert delivered == list(range(200))
    assert largest <= LINE * 10 // 2 + 3 * LINE  # cut once the delivered prefix passes half the cap


def drain_one(spool: FileSpool) -> list[int]:
    head = spool.peek()
    assert head is not None
    spool.pop()
    return [int(head.message.split()[1])]


# --- compaction ----------------------------------------------------------------------------------------------


def compacted_spool(tmp_path: Path) -> tuple[FileSpool, str]:
    """Five findings, three delivered: the third delivery passed half the cap and compacted the file.
    Returns the spool and what the offset file said just before the compaction."""
    spool = FileSpool(tmp_path, "i-1", max_bytes=LINE * 5)
    for n in range(5):
        assert spool.append(numbered(n))
    drain_one(spool)
    drain_one(spool)
    before = (tmp_path / "i-1.offset").read_text()
    inode = spool.path.stat().st_ino
    drain_one(spool)
    assert spool.path.stat().st_size == 2 * LINE and spool.path.stat().st_ino != inode
    return spool, before


def test_compaction_keeps_every_undelivered_entry_across_a_reopen(tmp_path: Path) -> None:
    spool, _ = compacted_spool(tmp_path)
    assert spool.append(numbered(5))
    assert drain(FileSpool(tmp_path, "i-1", max_bytes=LINE * 5)) == [3, 4, 5]


def test_a_crash_between_compaction_and_the_new_offset_loses_and_repeats_nothing(tmp_path: Path) -> None:
    _, before = compacted_spool(tmp_path)
    (tmp_path / "i-1.offset").write_text(before)  # as if the probe died before recording the new file's offset
    assert drain(FileSpool(tmp_path, "i-1", max_bytes=LINE * 5)) == [3, 4]


def test_a_crash_while_writing_the_compacted_copy_keeps_the_old_file(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path, "i-1", max_bytes=LINE * 5)
    for n in range(5):
        spool.append(numbered(n))
    drain_one(spool)
    drain_one(spool)
    (tmp_path / "i-1.findings.jsonl.tmp").write_bytes(spool.path.read_bytes()[2 * LINE : 3 * LINE + 7])
    assert drain(FileSpool(tmp_path, "i-1", max_bytes=LINE * 5)) == [2, 3, 4]
    assert not (tmp_path / "i-1.findings.jsonl.tmp").exists()


# --- disk errors ---------------------------------------------------------------------------------------------


def test_a_failed_write_waits_in_memory_in_order_and_the_file_is_used_again_once_it_drains(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = FileSpool(tmp_path, "i-1")
    spool.append(numbered(0))
    spool.append(numbered(1))
    with file_size_limit(2 * LINE + LINE // 2):  # the next line can be written only in part
        for n in range(2, 22):
            assert spool.append(numbered(n))
        assert spool.degraded and not spool.on_disk
        assert drain_one(spool) == [0]  # the file's entries come first
    assert spool.path.stat().st_size == 2 * LINE  # the partial line was cut
    assert len(degraded_lines(caplog)) == 1  # one line, not one per finding
    assert "File too large" in degraded_lines(caplog)[0]
    assert spool.append(numbered(22))  # the disk works again, but 2-21 wait in memory: 22 goes behind them
    assert spool.path.stat().st_size == 2 * LINE
    assert FileSpool(tmp_path, "i-1").peek() == numbered(1)  # what a restart now would find: only the file's
    assert drain(spool) == list(range(1, 23))
    assert spool.on_disk  # nothing left that only memory holds
    assert spool.degraded and not recovered_lines(caplog)  # until the file has taken a finding again
    assert spool.append(numbered(23))
    assert not spool.degraded
    assert len(recovered_lines(caplog)) == 1
    assert drain(FileSpool(tmp_path, "i-1")) == [23]  # durable again


def test_impairing_findings_are_never_dropped_from_memory(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path, "i-1", max_items=2)
    with file_size_limit(0):
        assert spool.append(numbered(0)) and spool.append(numbered(1))
        assert not spool.append(numbered(2))
        assert spool.append(numbered(3, impairs=True)) and spool.append(numbered(4, impairs=True))
        assert not spool.append(numbered(5))
    assert len(spool) == 4
    assert drain(spool) == [0, 1, 3, 4]


def test_the_offset_file_failing_neither_stops_nor_repeats_delivery(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = FileSpool(tmp_path, "i-1")
    for n in range(3):
        spool.append(numbered(n))
    with file_size_limit(1):
        assert drain_one(spool) == [0]
        assert spool.degraded and "i-1.offset" in degraded_lines(caplog)[0]
        assert drain_one(spool) == [1]
        assert spool.peek() == numbered(2)  # not 0 or 1 again: this process knows they were delivered
    # A restart now would send 0 and 1 again, with their finding ids, which the health workflow drops; none is lost.
    restarted = FileSpool(tmp_path, "i-1")
    assert len(restarted) == 3 and restarted.peek() == numbered(0)
    assert drain(spool) == [2]  # records the offset again, then starts the file over
    assert not spool.degraded and len(recovered_lines(caplog)) == 1
    assert len(degraded_lines(caplog)) == 1
    assert len(FileSpool(tmp_path, "i-1")) == 0
    assert spool.path.stat().st_size == 0


def test_an_unusable_spool_dir_falls_back_to_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "not-a-dir").write_text("")
    spool = FileSpool(tmp_path / "not-a-dir" / "spool", "i-1")
    assert spool.degraded and len(degraded_lines(caplog)) == 1
    for n in range(3):
        assert spool.append(numbered(n, impairs=n == 1))
    assert drain(spool) == [0, 1, 2]
    assert spool.append(numbered(3))
    assert drain(spool) == [3]
    assert len(degraded_lines(caplog)) == 1


def test_read_only_storage_still_delivers_its_backlog_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool = FileSpool(tmp_path, "i-1")
    for n in range(3):
        spool.append(numbered(n))
    drain_one(spool)
    with read_only(tmp_path):
        restarted = FileSpool(tmp_path, "i-1")  # e.g. after the filesystem was remounted read-only
        assert drain_one(restarted) == [1]
        assert restarted.append(numbered(3))
        assert restarted.degraded
        assert drain(restarted) == [2, 3]
    assert restarted.append(numbered(4))  # written to the file: nothing waits in memory any more
    assert restarted.degraded  # the delivery progress is not recorded yet
    assert drain(restarted) == [4]
    assert not restarted.degraded and len(recovered_lines(caplog)) == 1
    assert len(FileSpool(tmp_path, "i-1")) == 0


def test_a_spool_file_deleted_under_the_probe(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spool = FileSpool(tmp_path, "i-1")
    spool.append(numbered(0))
    spool.append(numbered(1))
    assert spool.peek() == numbered(0)
    spool.path.unlink()
    spool.pop()  # 0 was delivered; 1 went with the file
    assert spool.peek() is None
    assert any("1 undelivered findings in it are lost" in r.getMessage() for r in caplog.records)
    assert spool.append(numbered(2))
    assert not spool.degraded  # a new file was started
    assert drain(FileSpool(tmp_path, "i-1")) == [2]


def test_a_pop_after_the_file_was_replaced_does_not_remove_an_undelivered_finding(tmp_path: Path) -> None:
    spool = FileSpool(tmp_path, "i-1")
    spool.append(numbered(0))
    assert spool.peek() == numbered(0)  # being delivered
    spool.path.unlink()
    spool.append(numbered(1))  # starts a new file
    spool.pop()  # 0, delivered meanwhile
    assert drain(spool) == [1]


def test_a_drained_spool_starts_its_file_over_even_when_the_offset_cannot_be_recorded(tmp_path: Path) -> None:
    """On a full disk the offset file cannot be written and only starting the file over frees space: the offset
    file is removed instead (absent reads as 0, right for any file), so the spool does not stay stuck full."""
    spool = FileSpool(tmp_path, "i-1")
    for n in range(3):
        spool.append(numbered(n))
    with file_size_limit(1):
        assert drain(spool) == [0, 1, 2]
        assert spool.path.stat().st_size == 0
    assert not (tmp_path / "i-1.offset").exists()
    assert len(FileSpool(tmp_path, "i-1")) == 0  # nothing sent again, nothing lost
    assert spool.degraded
    assert spool.append(numbered(3))
    assert drain(FileSpool(tmp_path, "i-1")) == [3]


@pytest.fixture
def tiny_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 16 KiB tmpfs, to fill up for real (needs root with CAP_SYS_ADMIN: skipped elsewhere)."""
    mountpoint = tmp_path / "tiny"
    mountpoint.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mountpoint)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def test_a_full_disk(tiny_filesystem: Path, caplog: pytest.LogCaptureFixture) -> None:
    spool = FileSpool(tiny_filesystem, "i-1")
    big = [numbered(n).model_copy(update={"raw": "x" * 300, "impairs": n % 10 == 0}) for n in range(100)]
    assert all(spool.append(finding) for finding in big)
    assert spool.degraded and len(spool) == 100
    assert "No space left on device" in degraded_lines(caplog)[0]
    assert drain(spool) == list(range(100))
    assert spool.append(numbered(100))  # the drained file was started over, which freed the disk
    assert not spool.degraded and len(recovered_lines(caplog)) == 1
    assert drain(FileSpool(tiny_filesystem, "i-1")) == [100]


def test_a_read_cursor_stays_behind_findings_that_only_memory_holds(tmp_path: Path) -> None:
    """The log sources' cursors skip what was spooled; a finding the disk could not take must be read again after a
    restart, so the cursor waits until it has been delivered."""
    from node_probe.delivery.cursor import CursorStore, KmsgCursor

    spool = FileSpool(tmp_path, "i-1")
    cursor = CursorStore(tmp_path / "i-1.kmsg.cursor", KmsgCursor, min_interval=0, spooled=lambda: spool.on_disk)
    cursor.update(KmsgCursor(path="/dev/kmsg", boot_id="b", seq=1))
    with file_size_limit(LINE // 2):  # the spool's first line cannot be written; the cursor's small file still can
        assert spool.append(numbered(0, impairs=True))
        cursor.update(KmsgCursor(path="/dev/kmsg", boot_id="b", seq=2))
        cursor.flush()
    assert CursorStore(cursor.path, KmsgCursor).load() == KmsgCursor(path="/dev/kmsg", boot_id="b", seq=1)
    assert drain(spool) == [0]
    cursor.flush()
    assert CursorStore(cursor.path, KmsgCursor).load() == KmsgCursor(path="/dev/kmsg", boot_id="b", seq=2)


def test_a_read_that_fails_for_a_moment_keeps_every_finding_for_the_next_try(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Findings pile up in the file while Temporal is down; one failed read then must not cost them (the read
    cursors are already past them, so nothing else could deliver them)."""
    spool = FileSpool(tmp_path, "i-1")
    for n in range(5):
        spool.append(numbered(n, impairs=True))
    with no_free_file_descriptors():
        assert spool.peek() is None
    assert len(spool) == 5 and spool.degraded and spool.on_disk
    assert "Too many open files" in degraded_lines(caplog)[0]
    assert drain(spool) == [0, 1, 2, 3, 4]
    assert not spool.degraded and len(recovered_lines(caplog)) == 1
    assert drain(FileSpool(tmp_path, "i-1")) == []
