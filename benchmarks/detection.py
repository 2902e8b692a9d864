"""Detection: is the repair decision right, are faults raised while the probe was down delivered, and how fast.

    .venv/bin/python -m benchmarks.detection [--quick] [--skip-e2e] [--json FILE]   (repository root)

Measures, on the project's real code paths:
  A. the repair decision for every Xid in NVIDIA's catalog: a real-format kernel line per code (under six log
     prefixes), parsed by node_probe.classify.kernel_log and classified by node_probe.classify.policy.Policy ('ecs' and
     'nvidia-catalog'), next to the decision rules peers apply (ECS's list, the EKS node monitoring agent's fatal
     list, "any Xid replaces", "no Xid action"), scored against NVIDIA's immediate resolution bucket; then the
     records that need more than the code (Xid 45's cause, Xid 154's recovery action, Xid 94/95's RST flags,
     NVLink5 severity, the fallen-off-the-bus banner, RmInitAdapter, SXid, a quoted line in an application log);
  B. faults written while the probe is stopped: the real Probe with a kernel-log file (and a file in /dev/kmsg's
     format), with and without a spool dir, stopped and restarted, against a reader that only follows new lines;
     also stopped mid-delivery, killed with SIGKILL (in a child process), and with the log rotated while stopped;
  C. end-to-end latency on the real stack (Temporal dev server, moto, the simulated fleet running the real probe,
     an in-process worker): kernel line -> IMPAIRED -> RepairStarted -> ReplacementReady -> RepairCompleted, and
     heartbeat silence -> AGENT_CONNECTIVITY IMPAIRED. Timings are the end-to-end tests' compressed ones.
A markdown summary goes to stdout; --json writes every number and list; benchmarks/DETECTION.md records a run.
Each part is its own module (detection_decision, detection_downtime, detection_latency; the summary is
detection_report, the shared helpers benchmarks.support); this one runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.detection_decision import REFERENCE_CATALOG, part_a
from benchmarks.detection_downtime import child_probe, part_b
from benchmarks.detection_report import markdown
from benchmarks.probe_throughput import machine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer faults in B and C (a smoke test, ~1 min)")
    parser.add_argument("--skip-e2e", action="store_true", help="skip part C (needs the temporal CLI and moto_server)")
    parser.add_argument("--faults", type=int, default=None, help="part C: faults to inject (default 5, quick 2)")
    parser.add_argument("--losses", type=int, default=None, help="part C: heartbeat losses (default 2, quick 1)")
    parser.add_argument("--catalog", type=Path, default=REFERENCE_CATALOG, help="the reference Xid catalog (TSV)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--child-probe", nargs=2, type=Path, help=argparse.SUPPRESS)  # used by part B itself
    args = parser.parse_args()
    if args.child_probe:
        asyncio.run(child_probe(*args.child_probe))
        return 0
    # The probe logs each restart's resume point and the servers their start; the tables are the output here.
    logging.basicConfig(level=logging.WARNING)

    results: dict[str, Any] = {"machine": machine(), "at": datetime.now(UTC).isoformat(timespec="seconds")}
    results["part_a"] = part_a(args.catalog)
    results["part_b"] = asyncio.run(part_b(args.quick))
    if not args.skip_e2e:
        faults = args.faults if args.faults is not None else (2 if args.quick else 5)
        losses = args.losses if args.losses is not None else (1 if args.quick else 2)
        # Imported here: parts A and B need neither Temporal nor moto.
        from benchmarks.detection_latency import part_c

        results["part_c"] = asyncio.run(part_c(faults, losses))
    print(markdown(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
