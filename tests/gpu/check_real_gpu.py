"""Check the node probe on a host with a real NVIDIA GPU, in one run of about a minute.

    python3 tests/gpu/check_real_gpu.py [--seconds 30] [--fault oob|trap|none] [--out check.json]
    python3 tests/gpu/check_real_gpu.py --import-check

1. Lists the GPUs (index, name, PCI address, UUID, events registered), polls the NVML source once and classifies
   what the poll found under every policy (a healthy GPU gives zero findings).
2. Reads NVIDIA's own verdicts raw, through pynvml, each call on its own: the GPU recovery action (field 230), the
   SRAM ECC status, the repair status, the unrepairable-memory flag, remapped rows, retired pages, clock event
   reasons, PCIe link, ECC counts, the GPU count (and `nvidia-smi -L`'s). Each answer is kept as NVML gave it
   (structs as dicts of all their fields) or as the exception pynvml raised (class and NVML return code), so it
   can become a recorded fixture for the unit tests.
3. Runs the whole probe (NVML plus /dev/kmsg when readable, a reporter that only records) for --seconds at idle and
   measures its CPU time and memory.
4. With the probe still running, runs tests/gpu/user_fault.py in a subprocess: a CUDA kernel that writes far out of
   range (or executes `trap`), which crashes that process. Records the subprocess's exit code and last stderr line,
   the kernel log records of the window, and every finding the probe reported. An application's fault must be seen
   (XID_31, or XID_13/43) and must not impair the instance under the default `ecs` policy.
5. Polls and reads the raw verdicts again: the GPU must still be healthy (no findings, recovery action 0).

Prints one JSON summary (and writes it to --out), its verdict last: `result`, `failed`, `needs_look`, `notes`.
Every step is wrapped, so one failure is recorded and the rest still runs; a global time guard (--deadline) prints
what was gathered and exits 1 if a call hangs.

Exit status: 0 = every check passed, or no NVIDIA driver here (skipped, with a clear message); 2 = the GPU or the
probe showed something that needs a look (`needs_look` says what); 1 = the check itself failed (`failed` says why).
This file is the runbook: the command line, the steps in order, the time guard and the JSON output. The raw
readings of step 2 are recorded by tests/gpu/nvml_readings.py; what every step's record means (failed, needs a look,
a note) is decided by tests/gpu/verdict.py. Not collected by pytest (no test_ prefix): it needs a GPU. Its pure parts
are tested in tests/test_check_real_gpu_helpers.py, which also judges a recorded real run again
(tests/gpu/recorded/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import os
import resource
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # run from anywhere, without installing

# Every module of ours (and its third-party needs) that the GPU path imports: --import-check imports each.
GPU_PATH_MODULES = (
    "tests.gpu.nvml_readings",
    "tests.gpu.verdict",
    "pydantic",
    "pydantic_core",
    "annotated_types",
    "typing_inspection",
    "typing_extensions",
    "pynvml",
    "contract.probe",
    "node_probe.classify.policy",
    "node_probe.probe",
    "node_probe.sources.base",
    "node_probe.sources.kmsg",
    "node_probe.sources.nvml",
)

USER_FAULT_SCRIPT = Path(__file__).resolve().parent / "user_fault.py"
FINDING_FIELDS = {
    "kind", "code", "reason", "impairs", "rule", "source", "sources", "gpu", "immediate_action", "message", "raw",
    "count", "observed_at",
}  # fmt: skip
VERDICT_KEYS = ("result", "exit_status", "failed", "needs_look", "notes")

_IMPORT_ERROR: str | None = None
try:
    from contract.probe import GpuFinding, Heartbeat
    from node_probe.classify.policy import POLICY_NAMES, Policy
    from node_probe.probe import Probe, ProbeConfig
    from node_probe.sources.base import RecordSource
    from node_probe.sources.kmsg import KMSG_PATH, KmsgSource
    from node_probe.sources.nvml import NvmlSource
    from tests.gpu.nvml_readings import describe_error, pynvml_version, read_raw
    from tests.gpu.verdict import after_notes, exit_status, judge_fault, judge_idle, judge_poll, raw_concerns
except ImportError as _exc:  # reported as the check failing, in the same JSON shape (main below)
    _IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"


# --- the probe ---------------------------------------------------------------------------------------------------


class RecordingReporter:
    def __init__(self) -> None:
        self.findings: list[GpuFinding] = []
        self.heartbeats: list[Heartbeat] = []

    async def send_finding(self, finding: GpuFinding, task_queue: str) -> None:
        self.findings.append(finding)

    async def send_heartbeat(self, heartbeat: Heartbeat, task_queue: str) -> None:
        self.heartbeats.append(heartbeat)


def finding_dict(finding: GpuFinding) -> dict[str, Any]:
    return finding.model_dump(mode="json", include=FINDING_FIELDS)


class KmsgTail:
    """New /dev/kmsg records from now on (one record per read), as the kernel wrote them."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self._fd, 0, os.SEEK_END)

    def read(self, limit: int = 400) -> list[str]:
        records: list[str] = []
        while len(records) < limit:
            try:
                data = os.read(self._fd, 16 * 1024)
            except BlockingIOError:
                break
            except BrokenPipeError:
                records.append("<records overwritten before they were read>")
                continue
            if not data:
                break
            records.append(data.decode("utf-8", "replace").rstrip("\n"))
        return records

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def stderr_tail(text: str, lines: int = 15) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-lines:]


async def run_user_fault(mode: str, timeout: float) -> dict[str, Any]:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(USER_FAULT_SCRIPT), mode,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=str(REPO_ROOT),
    )  # fmt: skip
    timed_out = False
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except TimeoutError:
        timed_out = True
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        out, err = await proc.communicate()
    stderr = err.decode("utf-8", "replace")
    tail = stderr_tail(stderr)
    return {
        "command": f"{sys.executable} {USER_FAULT_SCRIPT.relative_to(REPO_ROOT)} {mode}",
        "mode": mode,
        "pid": proc.pid,
        "exit_code": proc.returncode,
        "timed_out": timed_out,
        "timeout_s": timeout,
        "seconds": round(time.monotonic() - started, 2),
        "launched": "LAUNCHED " in stderr,
        "faulted": "FAULT " in stderr,
        "last_stderr_line": tail[-1] if tail else "",
        "stderr_tail": tail,
        "stdout_tail": stderr_tail(out.decode("utf-8", "replace"), 5),
    }


async def fault_window(reporter: RecordingReporter, mode: str, settle: float, timeout: float) -> dict[str, Any]:
    tail: KmsgTail | None = None
    result: dict[str, Any] = {}
    try:
        tail = KmsgTail(KMSG_PATH)
    except OSError as exc:
        result["kmsg_tail_error"] = describe_error(exc)
    first = len(reporter.findings)
    result["started_at"] = datetime.now(UTC).isoformat()
    try:
        result["subprocess"] = await run_user_fault(mode, timeout)
    except Exception as exc:
        result["subprocess"] = {"error": describe_error(exc), "launched": False}
    await asyncio.sleep(settle)  # the NVML event and the kernel line reach the probe within seconds
    result["settle_s"] = settle
    records = tail.read() if tail is not None else []
    if tail is not None:
        tail.close()
    result["kernel_lines_nvrm"] = [r for r in records if "NVRM" in r or "Xid" in r]
    result["kernel_lines"] = records[:200]
    result["findings"] = [finding_dict(f) for f in reporter.findings[first:]]
    return result


async def probe_session(source: NvmlSource, args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """One probe, idle for --seconds (measured), then through the user-fault window."""
    sources: list[RecordSource] = [source]
    if os.access(KMSG_PATH, os.R_OK):
        sources.append(KmsgSource())
    config = ProbeConfig(instance_id="check-real-gpu", group="check", heartbeat_interval=timedelta(seconds=60))
    reporter = RecordingReporter()
    probe = Probe(config, reporter, sources=sources)
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    cpu_before, wall_before = time.process_time(), time.monotonic()
    task = asyncio.create_task(probe.run())
    try:
        await asyncio.sleep(args.seconds)
        cpu = time.process_time() - cpu_before
        wall = time.monotonic() - wall_before
        usage_after = resource.getrusage(resource.RUSAGE_SELF)
        summary["idle"] = {
            "policy": config.policy,
            "sources": [s.name for s in sources],
            "seconds": round(wall, 2),
            "cpu_seconds": round(cpu, 4),
            "cpu_percent_of_one_core": round(100 * cpu / wall, 3),
            "user_s": round(usage_after.ru_utime - usage_before.ru_utime, 4),
            "system_s": round(usage_after.ru_stime - usage_before.ru_stime, 4),
            "max_rss_mib": round(usage_after.ru_maxrss / 1024, 1),
            "heartbeat_gpu_health": [str(h.gpu_health) for h in reporter.heartbeats],
            "probe_task": "running" if not task.done() else f"ended: {task.exception()!r}",
            # The kmsg history read at start can hold old faults: they are listed, not counted against NVML.
            "findings": [finding_dict(f) for f in reporter.findings],
        }
        if args.fault != "none" and not task.done():
            step_started(summary, "fault_window")
            try:
                summary["fault"] = await fault_window(reporter, args.fault, args.fault_wait, args.fault_timeout)
                summary["fault"]["probe_task"] = "running" if not task.done() else f"ended: {task.exception()!r}"
                step_done(summary, "fault_window")
            except Exception as exc:
                step_failed(summary, "fault_window", exc)
        summary["heartbeats"] = [h.model_dump(mode="json") for h in reporter.heartbeats][-3:]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def poll_findings(source: NvmlSource) -> list[dict[str, Any]]:
    now = datetime.now(UTC)
    return [
        {
            "kind": o.record.kind,
            "pci": o.record.pci,
            "message": o.record.message,
            **{name: Policy(name).classify(o.record, now)._asdict() for name in POLICY_NAMES},
        }
        for o in source.poll_once()
    ]


# --- the run ------------------------------------------------------------------------------------------------------

_T0 = time.monotonic()
_EMIT_LOCK = threading.Lock()
_EMITTED = False


def step_started(summary: dict[str, Any], name: str) -> None:
    summary["step"] = name
    summary.setdefault("steps", {})[name] = {"state": "running", "at_s": round(time.monotonic() - _T0, 1)}
    print(f"[{time.monotonic() - _T0:6.1f}s] {name} ...", file=sys.stderr, flush=True)


def step_done(summary: dict[str, Any], name: str) -> None:
    entry = summary.setdefault("steps", {}).setdefault(name, {"at_s": 0.0})
    entry.update(state="ok", seconds=round(time.monotonic() - _T0 - entry["at_s"], 1))
    print(f"[{time.monotonic() - _T0:6.1f}s] {name} ok", file=sys.stderr, flush=True)


def step_failed(summary: dict[str, Any], name: str, exc: BaseException) -> None:
    entry = summary.setdefault("steps", {}).setdefault(name, {"at_s": 0.0})
    entry.update(state="failed", seconds=round(time.monotonic() - _T0 - entry["at_s"], 1),
                 error=describe_error(exc), traceback=traceback.format_exc().splitlines()[-6:])  # fmt: skip
    summary.setdefault("failed", []).append(f"step {name}: {type(exc).__name__}: {exc}")
    print(f"[{time.monotonic() - _T0:6.1f}s] {name} FAILED: {exc!r}", file=sys.stderr, flush=True)


def run_step(summary: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    step_started(summary, name)
    try:
        result = fn()
    except Exception as exc:
        step_failed(summary, name, exc)
        return None
    step_done(summary, name)
    return result


def ordered(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with its verdict last, where a truncated output's tail still shows it."""
    body = {k: v for k, v in summary.items() if k not in VERDICT_KEYS}
    return {**body, **{k: summary[k] for k in VERDICT_KEYS if k in summary}}


def emit(summary: dict[str, Any], out: str | None) -> None:
    global _EMITTED
    with _EMIT_LOCK:
        if _EMITTED:
            return
        _EMITTED = True
        text = ""
        for _ in range(5):  # the time guard's thread reads what the main thread may still be changing
            try:
                text = json.dumps(ordered(summary), indent=2, default=str)
                break
            except (RuntimeError, ValueError):
                time.sleep(0.05)
        else:
            text = json.dumps({k: summary.get(k) for k in ("step", *VERDICT_KEYS)}, indent=2, default=str)
        print(text, flush=True)
        if out:
            try:
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(text + "\n")
            except OSError as exc:
                print(f"could not write {out}: {exc}", file=sys.stderr, flush=True)


def start_time_guard(summary: dict[str, Any], seconds: float, out: str | None) -> None:
    def fire() -> None:
        snapshot = dict(summary)
        failed = [*list(snapshot.get("failed") or []), f"time guard: still at step {snapshot.get('step')!r} "
                  f"after {seconds:.0f} s (an NVML call or the GPU hung?)"]  # fmt: skip
        snapshot.update(result="failed", exit_status=1, failed=failed)
        emit(snapshot, out)
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def import_check() -> int:
    """Import every module the GPU path uses, and look up the pynvml names it calls; exit 0 when all are there."""
    from importlib import metadata

    report: dict[str, Any] = {"result": "import-check", "python": sys.version.split()[0], "modules": {}}
    ok = True
    for name in GPU_PATH_MODULES:
        try:
            module = importlib.import_module(name)
            report["modules"][name] = {"file": getattr(module, "__file__", None)}
        except Exception as exc:
            ok = False
            report["modules"][name] = {"error": f"{type(exc).__name__}: {exc}"}
    for dist in ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
                 "nvidia-ml-py"):  # fmt: skip
        with contextlib.suppress(Exception):
            report.setdefault("versions", {})[dist] = metadata.version(dist)
    with contextlib.suppress(Exception):  # a module missing above has already made this check fail
        import pynvml

        readings = importlib.import_module("tests.gpu.nvml_readings")
        missing = [name for name in readings.PYNVML_NAMES if not hasattr(pynvml, name)]
        report["pynvml_missing"] = missing
        ok = ok and not missing
    report["fault_backends"] = {
        name: importlib.util.find_spec(name) is not None for name in ("cupy", "numba")
    }  # informational: the GPU host has both
    report["ok"] = ok
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="idle run length (default 30)")
    parser.add_argument("--fault", choices=("oob", "trap", "none"), default="oob",
                        help="the user fault: oob = out-of-range write (Xid 31), trap (Xid 43), none")  # fmt: skip
    parser.add_argument("--fault-wait", type=float, default=10.0, help="seconds to watch after the fault (10)")
    parser.add_argument("--fault-timeout", type=float, default=60.0, help="limit for the faulting subprocess (60)")
    parser.add_argument("--deadline", type=float, default=200.0, help="global time guard in seconds (200)")
    parser.add_argument("--out", help="also write the JSON summary to this file")
    parser.add_argument("--import-check", action="store_true",
                        help="import every module the GPU path uses, then exit (0 = all there)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.import_check:
        return import_check()
    summary: dict[str, Any] = {"result": "running", "at": datetime.now(UTC).isoformat(), "args": vars(args),
                               "python": sys.version.split()[0]}  # fmt: skip
    if _IMPORT_ERROR is not None:
        summary.update(result="failed", exit_status=1, failed=[f"import: {_IMPORT_ERROR}"])
        emit(summary, args.out)
        return 1
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        message = f"no NVIDIA driver on this host (nvmlInit: {exc}); nothing to check"
        print(message, file=sys.stderr)
        emit({"result": "skipped", "reason": message}, args.out)
        return 0
    with contextlib.suppress(Exception):
        summary["driver_version"] = pynvml.nvmlSystemGetDriverVersion()
        summary["nvml_version"] = pynvml.nvmlSystemGetNVMLVersion()
    with contextlib.suppress(Exception):
        pynvml.nvmlShutdown()
    summary["pynvml"] = pynvml_version(pynvml)
    summary.update(failed=[], needs_look=[], notes=[])
    start_time_guard(summary, args.deadline, args.out)
    failed: list[str] = summary["failed"]
    needs_look: list[str] = summary["needs_look"]
    notes: list[str] = summary["notes"]

    source = NvmlSource(pynvml, poll_interval=60.0)

    def start() -> bool:
        status = source.check()
        summary["nvml_source"] = {"ok": status.is_ok, "reason": status.reason}
        summary["gpus"] = [
            {"index": g.index, "name": g.name, "pci": g.pci, "uuid": g.uuid, "events_registered": hex(g.events)}
            for g in source.gpus
        ]
        return bool(status.is_ok)

    started = run_step(summary, "nvml_source", start)
    if not started:
        failed.append(f"the NVML source did not start: {summary.get('nvml_source')}")
    else:
        summary["poll_findings"] = run_step(summary, "poll", lambda: poll_findings(source))
        needs_look.extend(judge_poll(summary["poll_findings"], "before"))

    summary["raw_before"] = run_step(summary, "raw_before", lambda: read_raw(pynvml))
    if summary["raw_before"] is not None:
        concerns, raw_notes = raw_concerns(summary["raw_before"], "before")
        needs_look.extend(concerns)
        notes.extend(raw_notes)

    if started:
        run_step(summary, "probe", lambda: asyncio.run(probe_session(source, args, summary)))
        idle = summary.get("idle")
        if idle is None:
            failed.append("the idle run recorded nothing")
        else:
            idle_look, idle_notes = judge_idle(idle)
            needs_look.extend(idle_look)
            notes.extend(idle_notes)
        if args.fault != "none":
            fault = summary.get("fault")
            if fault is None:
                failed.append("the user-fault window recorded nothing")
            else:
                f_failed, f_look, f_notes = judge_fault(fault)
                failed.extend(f_failed)
                needs_look.extend(f_look)
                notes.extend(f_notes)

        def after() -> list[dict[str, Any]]:
            if not source.gpus:  # the session went away during the run: start it again, do not poll nothing
                status = source.check()
                if not status.is_ok:
                    raise RuntimeError(f"the NVML source did not restart: {status.reason}")
            return poll_findings(source)

        summary["poll_after"] = run_step(summary, "poll_after", after)
        needs_look.extend(judge_poll(summary["poll_after"], "after"))

        def gate() -> dict[str, Any]:
            # Imported here: the gate reads workflow and activity modules (Temporal, boto3), which the rest of the
            # check does without; a host lacking them fails this step alone.
            from tests.gpu.gate import gate_here

            return gate_here([o.record for o in source.poll_once()], len(source.gpus))

        summary["gate"] = run_step(summary, "gate", gate)
        passed = summary["gate"] is not None and summary["gate"]["passed"]
        if summary["gate"] is not None and not passed:
            why = summary["gate"]["failed"] or summary["gate"].get("host")
            needs_look.append(f"the fix's gate did not pass on this healthy host: {why}")
    summary["raw_after"] = run_step(summary, "raw_after", lambda: read_raw(pynvml))
    if summary["raw_after"] is not None:
        concerns, raw_notes = raw_concerns(summary["raw_after"], "after")
        needs_look.extend(concerns)
        notes.extend(after_notes(raw_notes, notes))

    summary["step"] = "done"
    summary["seconds"] = round(time.monotonic() - _T0, 1)
    result, status_code = exit_status(failed, needs_look)
    summary.update(result=result, exit_status=status_code)
    emit(summary, args.out)
    return status_code


if __name__ == "__main__":
    sys.exit(main())
