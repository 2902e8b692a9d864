"""Small host facts and helpers shared by the polled sources (NVML, DCGM, daemons).

Commands run through an injectable async runner so that tests fake them; the real one kills a command that
outlives its timeout, so a hung `dcgmi` or `systemctl` cannot stall the probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
PROC_STAT_PATH = Path("/proc/stat")
# After a kill, wait this long for the child to go; one stuck in the kernel (D state) is left behind.
_REAP_TIMEOUT_S = 5.0


@functools.cache
def boot_id() -> str:
    """This boot's id. Part of the finding id of state conditions (remap failure, DCGM fail, daemon down), so a
    probe restarted within one boot re-sends the same ids (dropped as redeliveries) and a new boot does not."""
    try:
        return BOOT_ID_PATH.read_text(encoding="ascii").strip()
    except OSError:
        return ""


def boot_time(path: Path = PROC_STAT_PATH) -> float | None:
    """When this host booted (POSIX seconds, the kernel's `btime`); None where /proc/stat is not Linux's."""
    try:
        with path.open(encoding="ascii") as stat:
            for line in stat:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass(frozen=True, slots=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str = ""

    @property
    def output(self) -> str:
        """stdout and stderr together: dcgmi prints its errors on stdout, systemctl on stderr."""
        return "\n".join(part for part in (self.stdout.strip(), self.stderr.strip()) if part)


# argv, timeout in seconds -> result. Raises FileNotFoundError when the program is missing, TimeoutError when
# it did not finish in time.
CommandRunner = Callable[[Sequence[str], float], Awaitable[CommandResult]]


async def run_command(argv: Sequence[str], timeout: float) -> CommandResult:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow the probe's own cancellation (gh-86296).
        async with asyncio.timeout(timeout):
            stdout, stderr = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_REAP_TIMEOUT_S):
                await proc.wait()
        raise
    return CommandResult(
        returncode=proc.returncode if proc.returncode is not None else -1,
        stdout=stdout.decode("utf-8", "replace"),
        stderr=stderr.decode("utf-8", "replace"),
    )


def first_line(text: str, limit: int = 200) -> str:
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 1] + "…"
