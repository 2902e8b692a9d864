"""A probe started with a --group the ingest's settings do not have (issue 13): the ingest refuses its reports and
says which group and that it is not in the settings; the probe keeps every finding in its spool, says why once and
loudly, backs off, and loses nothing: restarted with the right group, it delivers what it kept. Against the real
ingest over HTTP, moto's STS and the real Temporal dev server (tests/test_ingest.py's stack)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from contract.ingest import FINDINGS_PATH, REFUSED_UNKNOWN_GROUP
from ingest.server import Ingest
from node_probe.delivery.ingest_reporter import IngestRefused
from node_probe.probe import Probe, ProbeConfig
from tests import test_ingest
from tests.harness import eventually
from tests.test_ingest import Host, Stack, finding_about, post, running_ingest
from tests.test_probe import eventually as soon

stack = test_ingest.stack  # the module-scoped fixture: a worker, moto's IAM role for the hosts, the group

XID_79 = "[ 1843.308145] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n"
WRONG = "gpu-trainnig"  # the typo an operator makes


def probe_config(host: Host, group: str, log: Path, spool: Path) -> ProbeConfig:
    return ProbeConfig(
        instance_id=host.instance_id,
        group=group,
        kernel_log=log,
        spool_dir=spool,
        poll_interval=timedelta(seconds=0.05),
        heartbeat_interval=timedelta(seconds=0.5),
        retry_max_backoff=timedelta(seconds=0.5),
    )


def refused_unknown(ingest: Ingest) -> float:
    return ingest.metrics.value("autorepair_ingest_reports_refused_total", status="403", reason=REFUSED_UNKNOWN_GROUP)


@contextlib.asynccontextmanager
async def running(probe: Probe) -> AsyncIterator[Probe]:
    task = asyncio.create_task(probe.run())
    try:
        yield probe
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_ingest_names_the_unknown_group_and_its_own(stack: Stack) -> None:
    host = stack.launch(group=stack.group)
    body = finding_about(host.instance_id, WRONG).model_dump_json().encode()
    async with running_ingest(stack) as (url, ingest):
        status, _, refusal = await post(url, FINDINGS_PATH, body, signer=host, stack=stack)
        assert (status, refusal["kind"]) == (403, REFUSED_UNKNOWN_GROUP)
        assert refusal["reason"].startswith(f"unknown group {WRONG!r}: not in settings (this ingest's groups: ")
        assert stack.group in refusal["reason"] and "--group" in refusal["reason"]
        async with stack.reporter(url, host) as reporter:
            with pytest.raises(IngestRefused) as refused:
                await reporter.send_finding(finding_about(host.instance_id, WRONG), "q")
        assert refused.value.unknown_group and refused.value.status == 403 and reporter.dropped == 0
        assert refused_unknown(ingest) == 2
        assert ingest.membership.lookups == 0  # a group not in the settings costs no AWS call
    assert not await stack.health_exists(host.instance_id)


async def test_a_probe_with_a_wrong_group_loses_nothing_and_says_why(
    stack: Stack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    host = stack.launch(group=stack.group)
    log, spool = tmp_path / "kern.log", tmp_path / "spool"
    log.write_text(XID_79)
    caplog.set_level(logging.INFO, logger="node_probe.probe")
    async with running_ingest(stack) as (url, ingest):
        async with stack.reporter(url, host) as reporter:
            wrong = Probe(probe_config(host, WRONG, log, spool), reporter)
            async with running(wrong):
                await soon(lambda: wrong.stats.delivery_failures >= 3, timeout=30)
                assert wrong.pending == 1 and wrong.stats.delivered == 0
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        # Said once, however often it was tried: which group, why, and that nothing is dropped.
        (said,) = errors
        assert said.startswith(f"the ingest refuses this probe's group {WRONG!r}: unknown group {WRONG!r}")
        assert "not in settings" in said and "kept in the spool (1 now), none is dropped" in said
        assert reporter.dropped == 0 and not await stack.health_exists(host.instance_id)

        # Restarted with the right group on the same spool: the finding kept goes out, under the right group.
        async with stack.reporter(url, host) as reporter:
            right = Probe(probe_config(host, stack.group, log, spool), reporter)
            assert right.pending == 1
            async with running(right):
                await soon(lambda: right.stats.delivered == 1, timeout=30)
        assert right.stats.records == 0  # not read again (the cursor kept its place): the spool had it
    view = await eventually(lambda: stack.health(host.instance_id), lambda v: bool(v.recent_findings), within=60)
    (finding,) = view.recent_findings
    assert (finding.reason, finding.group) == ("XID_79", stack.group)
    assert refused_unknown(ingest) >= 3
