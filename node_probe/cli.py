"""`autorepair probe` and `probe-report`, and the rows of `classify` (operator_cli/classify.py prints them);
operator_cli/main.py wires them into the `autorepair` command."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO
from urllib.parse import urlsplit

from pydantic import Field, ValidationError
from pydantic_settings import SettingsConfigDict

from contract.config import ConfigError, ConfigSources, IngestSettings, TemporalSettings
from contract.groups import HEARTBEATS_PER_THRESHOLD, MAX_HEARTBEAT_LOSS_THRESHOLD
from contract.ingest import FINDINGS_PATH
from contract.probe import GpuFinding
from contract.temporal_options import add_temporal_arguments, load_settings
from node_probe.classify.collapse import SentFinding, sent_findings
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.manual import DEFAULT_PCI, manual_findings, pci_address, records_from_text, xid_line
from node_probe.classify.policy import POLICY_ECS, POLICY_NAMES, Policy, PolicyConfig, Verdict
from node_probe.classify.record import FaultRecord
from node_probe.health import add_health_arguments, run_with_health
from node_probe.imds import ImdsError, imds_instance_id
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources import dcgm_bindings as dcgm
from node_probe.sources.container_runtime import RuntimeSpec, default_runtimes
from node_probe.sources.daemons import DaemonSpec, default_daemons
from node_probe.sources.nvml import nvml_available

if TYPE_CHECKING:
    # Imported where each delivery is set up: the ingest's brings botocore and boto3, the direct one temporalio.
    from node_probe.delivery.ingest_reporter import IngestReporter
    from node_probe.delivery.reporter import ReporterProtocol

log = logging.getLogger(__name__)
DEFAULT_INGEST_ID: str = IngestSettings.model_fields["id"].default  # ingest_reporter's, without loading boto3

DEFAULT_SPOOL_DIR = Path("/var/lib/gpu-autorepair/spool")
# Columns every JSON line starts with; other record fields follow when set.
_LEADING = ("line", "kind", "code", "pci", "impairs", "reason", "rule", "message")


class ProbeSettings(ConfigSources):
    """The part of the shared settings the probe reads (AUTOREPAIR_TEMPORAL__* or the TOML file); the other top-level
    sections of that file are the worker's, so they are left to it. Within [temporal] an unknown key is an error."""

    model_config = SettingsConfigDict(extra="ignore")

    temporal: TemporalSettings = Field(default_factory=TemporalSettings)
    log_format: str = Field(default="auto", pattern="^(auto|json|console)$")


class CliError(Exception):
    """A problem the user can fix: printed as one line on stderr, exit status 2."""


def _fail(command: str, error: CliError) -> int:
    print(f"autorepair {command}: {error}", file=sys.stderr)
    return 2


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """`--policy` and `--policy-config`, defined once for classify, probe and the operator's inject."""
    parser.add_argument("--policy", choices=POLICY_NAMES, default=POLICY_ECS, help="base policy (default: ecs)")
    parser.add_argument(
        "--policy-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSON file with operator overrides: add_xids, remove_xids, add_sxids, repeat",
    )


def load_policy_config(path: Path | None) -> PolicyConfig:
    """The operator overrides in `--policy-config` (none: the base policy as is); a bad file is a CliError."""
    if path is None:
        return PolicyConfig()
    try:
        return PolicyConfig.model_validate_json(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror or exc}") from exc
    except ValidationError as exc:
        raise CliError(f"{path}: invalid policy config: {exc.errors()[0]['msg']}") from exc


# --- classify -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _open_input(file: str | os.PathLike[str] | None) -> Iterator[TextIO]:
    if file is None or str(file) == "-":
        yield sys.stdin
        return
    try:
        # Kernel logs can hold bytes that are not UTF-8 (firmware strings); never fail on them.
        handle = open(file, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed below
    except FileNotFoundError as exc:
        raise CliError(f"{file}: no such file") from exc
    except OSError as exc:
        raise CliError(f"{file}: {exc.strerror or exc}") from exc
    with handle:
        yield handle


def classification_row(record: FaultRecord, verdict: Verdict) -> dict[str, Any]:
    fields = record.to_dict()
    row: dict[str, Any] = {
        "line": record.line,
        "kind": record.kind,
        "code": record.code,
        "pci": record.pci,
        "impairs": verdict.impairs,
        "reason": verdict.reason,
        "rule": verdict.rule,
        "message": record.message,
    }
    row.update({k: v for k, v in fields.items() if k not in _LEADING and v is not None})
    return row


def sent_row(sent: SentFinding) -> dict[str, Any]:
    finding = sent.finding
    row: dict[str, Any] = {
        "line": sent.line,
        "kind": finding.kind,
        "code": finding.code,
        "pci": finding.gpu.pci,
        "impairs": finding.impairs,
        "reason": finding.reason,
        "rule": finding.rule,
        "count": finding.count,
        "rollup": sent.first_line is not None,
        "message": finding.message,
    }
    if sent.first_line is not None:
        row["first_line"] = sent.first_line
    if finding.verdict:
        row["verdict"] = finding.verdict
        row["immediate_action"] = finding.immediate_action
    gpu = finding.gpu.model_dump(exclude={"pci"}, exclude_none=True)
    row.update(gpu)
    row["raw"] = finding.raw
    return row


def classified_rows(file: str | None, policy: Policy, *, collapse: bool) -> Iterator[dict[str, Any]]:
    """`autorepair classify`'s rows (operator_cli/classify.py prints them), read as they are asked for: one per fault
    record in input order, without de-duplication (a burst shows in full); with `collapse`, the findings the probe
    would send instead. CliError when the input cannot be read."""
    with _open_input(file) as handle:
        now = datetime.now(UTC)
        if collapse:
            # The probe's default window; with one `now` for the whole log, no burst closes before the end.
            window: timedelta = ProbeConfig.model_fields["dedupe_window"].default
            yield from (sent_row(s) for s in sent_findings(handle, policy, now, window))
        else:
            yield from (classification_row(r, policy.classify(r, now)) for r in parse_lines(handle))


# --- probe --------------------------------------------------------------------------------------------------

# Heartbeats: at least one a second (a faster one is load on Temporal, not liveness), and at most a third of the
# longest heartbeat-loss threshold the worker accepts, since that threshold must span 3 heartbeat intervals.
MIN_HEARTBEAT_INTERVAL_S = 1.0
MAX_HEARTBEAT_INTERVAL_S = MAX_HEARTBEAT_LOSS_THRESHOLD.total_seconds() / HEARTBEATS_PER_THRESHOLD
MAX_DEDUPE_WINDOW_S = 86_400.0


def number_in_range(
    low: float, high: float, unit: str = "seconds", *, whole: bool = False, low_inclusive: bool = True
) -> Callable[[str], float]:
    """An argparse `type=`: a finite number (`whole`: an integer) of `unit` within [low, high] (or (low, high]);
    anything else is an argparse error, one line and exit status 2."""

    def number(text: str) -> float:
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if whole else ''}number of {unit}") from None
        above_low = value >= low if low_inclusive else value > low
        if not (math.isfinite(value) and above_low and value <= high):
            lower = f"at least {low:g}" if low_inclusive else f"more than {low:g}"
            raise argparse.ArgumentTypeError(f"must be {lower} and at most {high:g} {unit}, not {text}")
        return value

    return number


def add_ingest_client_arguments(parser: argparse.ArgumentParser) -> None:
    """How the host proves who it is to the ingest (contract/ingest.py): for `probe --ingest` and `probe-report`."""
    parser.add_argument(
        "--ingest-id", default=DEFAULT_INGEST_ID, help=f"the ingest's ingest.id (default: {DEFAULT_INGEST_ID})"
    )
    parser.add_argument(
        "--sts-endpoint",
        default=None,
        metavar="URL",
        help="the STS endpoint the proof is signed for, the ingest's ingest.sts_endpoint (default: "
        "https://sts.REGION.amazonaws.com)",
    )
    parser.add_argument(
        "--region",
        default=None,
        help="AWS region of the proof (default: AWS_REGION or AWS_DEFAULT_REGION, else us-east-1)",
    )


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instance-id", default=None, help="default: this EC2 instance's id, from IMDSv2")
    parser.add_argument("--group", required=True, help="capacity group of this instance")
    delivery = parser.add_mutually_exclusive_group()
    delivery.add_argument(
        "--ingest",
        default=None,
        metavar="URL",
        help="report through the ingest at this https:// URL (`autorepair ingest`), proving this host's identity "
        "with its own AWS credentials",
    )
    delivery.add_argument(
        "--direct-temporal",
        action="store_true",
        help="signal Temporal directly with the [temporal] settings: trusted lab only (any host could then speak "
        "for any instance)",
    )
    add_ingest_client_arguments(parser)
    sources = parser.add_mutually_exclusive_group()
    sources.add_argument("--kernel-log", type=Path, default=None, metavar="FILE", help="follow this file (tail -F)")
    sources.add_argument("--kmsg", action="store_true", help="follow /dev/kmsg (the default)")
    sources.add_argument("--journald", action="store_true", help="follow the journal's kernel entries (journalctl -k)")
    parser.add_argument(
        "--nvml",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="NVML events and polled state (default: on where NVIDIA's driver library is installed)",
    )
    parser.add_argument(
        "--dcgm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="DCGM health via `dcgmi health -c -j` (default: on; it counts once dcgmi is installed)",
    )
    parser.add_argument(
        "--dcgm-thermal-limit",
        type=number_in_range(dcgm.MIN_THERMAL_LIMIT_C, dcgm.MAX_THERMAL_LIMIT_C, "degrees C", whole=True),
        default=dcgm.DEFAULT_THERMAL_LIMIT_C,
        metavar="CELSIUS",
        help=f"with DCGM's bindings, a GPU hotter than this is a warning, {dcgm.MIN_THERMAL_LIMIT_C} to "
        f"{dcgm.MAX_THERMAL_LIMIT_C} (default: {dcgm.DEFAULT_THERMAL_LIMIT_C})",
    )
    parser.add_argument(
        "--dcgm-power-limit",
        type=number_in_range(dcgm.MIN_POWER_LIMIT_W, dcgm.MAX_POWER_LIMIT_W, "watts", whole=True),
        default=None,
        metavar="WATTS",
        help=f"with DCGM's bindings, a GPU drawing more than this is a warning, {dcgm.MIN_POWER_LIMIT_W} to "
        f"{dcgm.MAX_POWER_LIMIT_W} (default: the lowest enforced power limit NVML reads on this host's GPUs; "
        "without NVML, power is not watched)",
    )
    parser.add_argument(
        "--daemon",
        action="append",
        default=None,
        metavar="UNIT[:critical]",
        help="a systemd unit that must stay up; repeat for more (default: the fabric manager where NVSwitches "
        "exist (critical), nvidia-persistenced and the DCGM host engine when installed)",
    )
    parser.add_argument("--no-daemons", action="store_true", help="watch no systemd units")
    parser.add_argument(
        "--container-runtime",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="docker and containerd, where installed: unit active and API answering (default: on where systemd is)",
    )
    # With --direct-temporal (contract/temporal_options.py says what each falls back to).
    add_temporal_arguments(parser)
    parser.add_argument("--task-queue", default=None)
    parser.add_argument(
        "--heartbeat-interval",
        type=number_in_range(MIN_HEARTBEAT_INTERVAL_S, MAX_HEARTBEAT_INTERVAL_S),
        default=60.0,
        metavar="SECONDS",
        help=f"between heartbeats, {MIN_HEARTBEAT_INTERVAL_S:g} to {MAX_HEARTBEAT_INTERVAL_S:g} (default: 60); set "
        "the group's heartbeat_interval in the worker's settings to the same value",
    )
    parser.add_argument(
        "--dedupe-window",
        type=number_in_range(0, MAX_DEDUPE_WINDOW_S, low_inclusive=False),
        default=300.0,
        metavar="SECONDS",
        help=f"repeats of a finding within this window are folded into one, more than 0 and at most "
        f"{MAX_DEDUPE_WINDOW_S:g} (default: 300)",
    )
    parser.add_argument(
        "--spool-dir",
        type=Path,
        default=None,
        help=f"where undelivered findings wait (default: {DEFAULT_SPOOL_DIR}, or memory if not writable)",
    )
    add_policy_arguments(parser)
    add_health_arguments(parser)


async def _resolve_instance_id(given: str | None) -> str:
    if given:
        return given
    try:
        return await asyncio.to_thread(imds_instance_id)
    except ImdsError as exc:
        raise CliError(f"no --instance-id given and none found: {exc}") from exc


def _resolve_spool_dir(given: Path | None) -> Path | None:
    if given is not None:
        try:
            given.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CliError(f"--spool-dir {given}: {exc.strerror or exc}") from exc
        return given
    try:
        DEFAULT_SPOOL_DIR.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("%s not usable (%s): undelivered findings will wait in memory only", DEFAULT_SPOOL_DIR, exc)
        return None
    return DEFAULT_SPOOL_DIR if os.access(DEFAULT_SPOOL_DIR, os.W_OK) else None


def _daemon_specs(args: argparse.Namespace) -> list[DaemonSpec]:
    if getattr(args, "no_daemons", False):
        return []
    given = getattr(args, "daemon", None)
    if not given:
        if shutil.which("systemctl") is None:
            # A container (the Kubernetes DaemonSet) has no systemd to ask: the defaults could never be checked.
            log.info("daemons: no systemctl here; no units watched (name them with --daemon to insist)")
            return []
        return default_daemons()
    try:
        return [DaemonSpec.parse(text) for text in given]
    except ValueError as exc:
        raise CliError(f"--daemon {exc}") from exc


def _runtime_specs(args: argparse.Namespace) -> list[RuntimeSpec]:
    wanted = getattr(args, "container_runtime", None)
    if wanted is False or (wanted is None and shutil.which("systemctl") is None):
        return []
    return default_runtimes()


def _ingest_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"--ingest {url!r} is not an https:// URL")
    if parts.scheme == "http" and parts.hostname not in ("localhost", "127.0.0.1", "::1"):  # loopback only
        raise CliError(f"--ingest {url}: plain http only to a loopback address; use https://")
    return url


def ingest_reporter(args: argparse.Namespace) -> IngestReporter:
    from node_probe.delivery.ingest_reporter import IngestReporter, default_sts_endpoint

    region = args.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    return IngestReporter(
        _ingest_url(args.ingest),
        ingest_id=args.ingest_id,
        sts_endpoint=args.sts_endpoint or default_sts_endpoint(region),
        region=region,
    )


def direct_temporal_settings() -> ProbeSettings:
    """With --direct-temporal, the [temporal] settings over the `temporal` CLI's own (TEMPORAL_*, temporal.toml's
    profile), as the worker reads them; the ingest's delivery has no Temporal SDK to read them with, nor a need."""
    settings = ProbeSettings.load()
    try:
        temporal = settings.temporal.beneath_environment()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return settings.model_copy(update={"temporal": temporal})


async def build_probe(args: argparse.Namespace) -> Probe:
    ingest = getattr(args, "ingest", None)
    if not ingest and not getattr(args, "direct_temporal", False):
        raise CliError("say where findings go: --ingest URL, or --direct-temporal (trusted lab only)")
    try:
        temporal = load_settings(ProbeSettings.load if ingest else direct_temporal_settings, args).temporal
    except ConfigError as exc:
        raise CliError(f"invalid configuration: {exc}") from exc
    try:
        config = ProbeConfig(
            instance_id=await _resolve_instance_id(args.instance_id),
            group=args.group,
            kernel_log=args.kernel_log,
            kmsg=args.kernel_log is None and not getattr(args, "journald", False),
            journald=getattr(args, "journald", False),
            nvml=args.nvml if getattr(args, "nvml", None) is not None else await asyncio.to_thread(nvml_available),
            # On by default: without dcgmi the source is "not configured" and does not count, and it starts
            # counting when DCGM is installed later, without a probe restart.
            dcgm=args.dcgm if getattr(args, "dcgm", None) is not None else True,
            dcgm_thermal_limit_c=getattr(args, "dcgm_thermal_limit", dcgm.DEFAULT_THERMAL_LIMIT_C),
            dcgm_power_limit_w=getattr(args, "dcgm_power_limit", None),
            daemons=_daemon_specs(args),
            container_runtimes=_runtime_specs(args),
            policy=args.policy,
            policy_config=load_policy_config(args.policy_config),
            heartbeat_interval=timedelta(seconds=args.heartbeat_interval),
            dedupe_window=timedelta(seconds=args.dedupe_window),
            task_queue=temporal.task_queue,
            spool_dir=_resolve_spool_dir(args.spool_dir),
        )
    except ValidationError as exc:
        raise CliError(f"invalid arguments: {exc.errors()[0]['msg']}") from exc
    # Direct: lazy, so the probe starts (and spools) even while Temporal is down; calls connect when they can.
    reporter: ReporterProtocol
    if ingest:
        reporter = ingest_reporter(args)
    else:
        from contract.temporal_client import connect
        from node_probe.delivery.liveness_relay import LivenessRelay, LivenessRoute
        from node_probe.delivery.reporter import Reporter

        route = LivenessRoute.for_probe(config.heartbeat_interval)
        direct = Reporter(await connect(temporal, lazy=True))
        reporter = LivenessRelay(direct, lambda group: route, temporal.task_queue, relay=False)
    return Probe(config, reporter)


async def run_probe_command(args: argparse.Namespace) -> int:
    """Run the probe until SIGTERM/SIGINT; 0 on a clean stop, 2 on a usage error."""
    try:
        probe = await build_probe(args)
    except CliError as exc:
        return _fail("probe", exc)
    loop = asyncio.get_running_loop()
    binds = getattr(args, "health_bind", None), getattr(args, "metrics_bind", None)
    task = asyncio.create_task(run_with_health(probe, *binds))
    handled: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, task.cancel)
            handled.append(sig)
    via = f"through the ingest at {args.ingest}" if args.ingest else "directly to Temporal (trusted lab only)"
    log.info("probe for %s (%s) running, reporting %s", probe.config.instance_id, probe.config.group, via)
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # our caller cancelled us, not a signal
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await probe.close()
    return 0


# --- probe-report ---------------------------------------------------------------------------------------------

PROBE_REPORT_SOURCE = "autorepair-probe-report"


def add_probe_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ingest", required=True, metavar="URL", help="the ingest's https:// URL")
    parser.add_argument("--group", required=True, help="capacity group of this instance")
    parser.add_argument("--instance-id", default=None, help="default: this EC2 instance's id, from IMDSv2")
    fault = parser.add_mutually_exclusive_group(required=True)
    fault.add_argument("--xid", type=int, help="an NVIDIA Xid code, written as the driver logs it")
    fault.add_argument("--kernel-line", metavar="TEXT", help="a kernel log line (NVRM: ...), as the probe reads it")
    parser.add_argument(
        "--pci", type=pci_address, default=DEFAULT_PCI, help=f"GPU PCI address for --xid ({DEFAULT_PCI})"
    )
    add_policy_arguments(parser)
    add_ingest_client_arguments(parser)


async def run_probe_report(args: argparse.Namespace) -> int:
    """Send one finding, built as the probe would, through the ingest once: 0 when accepted (202); 1 with the
    ingest's reason when refused, 2 for a usage problem, 3 when the ingest cannot be reached."""
    import aiohttp

    from node_probe.delivery.proof import MissingCredentials

    try:
        if args.xid is not None and args.xid < 0:
            raise CliError(f"--xid must be a non-negative Xid code, not {args.xid}")
        text = xid_line(args.xid, args.pci, by="autorepair probe-report") if args.xid is not None else args.kernel_line
        try:
            records = records_from_text(text)
        except ValueError as err:
            raise CliError(str(err)) from None
        policy = Policy(args.policy, load_policy_config(args.policy_config))
        instance_id = await _resolve_instance_id(args.instance_id)
        reporter = ingest_reporter(args)
    except CliError as exc:
        return _fail("probe-report", exc)
    findings = manual_findings(
        records, policy, instance_id=instance_id, group=args.group, source=PROBE_REPORT_SOURCE, now=datetime.now(UTC)
    )
    answers: list[dict[str, object]] = []
    code = 0
    async with reporter:
        for finding in findings:
            try:
                status, reason = await reporter.send_once(FINDINGS_PATH, finding)
            except (MissingCredentials, ValueError) as err:
                return _fail("probe-report", CliError(str(err)))
            except (aiohttp.ClientError, TimeoutError) as err:
                print(
                    f"autorepair probe-report: ingest {args.ingest} unreachable: {err or type(err).__name__}",
                    file=sys.stderr,
                )
                return 3
            answers.append(_report_answer(finding, status, reason))
            if status != 202:
                print(f"autorepair probe-report: refused ({status}): {reason}", file=sys.stderr)
                code = 1
                break
    _print_answers(answers, getattr(args, "output", "text"))
    return code


def _report_answer(finding: GpuFinding, status: int, reason: str) -> dict[str, object]:
    accepted = status == 202
    return {
        "accepted": accepted,
        "status": status,
        "refusal": None if accepted else reason,
        "reason": finding.reason,
        "impairs": finding.impairs,
        "instanceId": finding.instance_id,
        "group": finding.group,
        "findingId": finding.finding_id,
    }


def _print_answers(answers: list[dict[str, object]], output: str) -> None:
    """-o json: one document; jsonl: a line per finding; text and wide: a line per accepted finding (a refusal is
    stderr's one line)."""
    if output == "json":
        print(json.dumps({"findings": answers}, indent=2))
    elif output == "jsonl":
        for answer in answers:
            print(json.dumps(answer))
    else:
        for answer in (a for a in answers if a["accepted"]):
            effect = "impairs ACCELERATED_COMPUTE" if answer["impairs"] else "a warning"
            print(
                f"accepted: {answer['reason']} ({effect}) for {answer['instanceId']} in {answer['group']}, "
                f"finding {answer['findingId']}"
            )
