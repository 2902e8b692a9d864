"""Debian's Chromium, headless, on the Temporal Web UI: a page's DOM once the single-page app has rendered it, or a
screenshot of it. Used by tests/test_web_ui.py and by the capture script (docs/pictures/capture.py).

Every external program runs as an asyncio subprocess: a worker may share the caller's event loop, and a blocking
`subprocess.run` would stall it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import struct
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
# One Chromium run may not finish rendering the single-page app in time; each run is bounded, and retried.
CHROMIUM_RUN_TIMEOUT_S = 60.0
VIRTUAL_TIME_BUDGET_MS = 10_000
WINDOW = (1400, 1000)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def find_chromium() -> str | None:
    """Debian's chromium (`make test` and `make browser` install it), else one on PATH."""
    return CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")


async def run_command(*argv: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run a program without blocking the event loop; kill its whole process group if it overruns."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        env=env,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise AssertionError(f"{argv[0]} did not finish within {timeout}s") from None
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


def chromium_args(chromium: str, profile: Path, window: tuple[int, int] = WINDOW) -> list[str]:
    return [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        # Virtual time runs ahead only while no request is pending: the app's API calls complete before the dump.
        f"--virtual-time-budget={VIRTUAL_TIME_BUDGET_MS}",
        f"--window-size={window[0]},{window[1]}",
    ]


async def run_chromium(chromium: str, profile: Path, action: str, url: str, window: tuple[int, int] = WINDOW) -> str:
    code, out, err = await run_command(
        *chromium_args(chromium, profile, window), action, url, timeout=CHROMIUM_RUN_TIMEOUT_S
    )
    assert code == 0, f"chromium {action} failed ({code}): {err[-2000:]}"
    return out


def png_size(data: bytes) -> tuple[int, int]:
    """A PNG's width and height, from its header (the IHDR chunk comes first); ValueError when it is no PNG."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)
