"""DCGM health via `dcgmi health -c -j`, with a fake command runner (no DCGM on this machine).

The built JSON below has the shape dcgmi's own code builds (NVIDIA/DCGM dcgmi/Health.cpp + DcgmiOutput.{h,cpp}:
"header", then "body" -> section -> "children" -> ..., leaves with "value" and "overflow"). The "real dcgmi output"
section holds output captured from real runs, each with where it was published.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from contract.health import HealthState
from node_probe.classify.policy import Policy
from node_probe.host import CommandResult
from node_probe.probe import Probe, ProbeConfig
from node_probe.sources.dcgm import DcgmHealthSource, DcgmParseError, parse_health_json, system_word
from tests.test_probe import FakeReporter

NOW = datetime(2025, 1, 1, tzinfo=UTC)

HEALTHY = """{
   "body" : {
      "Overall Health" : {
         "value" : "Healthy"
      }
   },
   "header" : [ "Health Monitor Report" ]
}
"""


def report(overall: str, entities: dict[str, dict[str, dict[str, tuple[str, list[str]]]]]) -> str:
    """entities: group -> entity id -> system -> (result, message chunks)."""
    body: dict[str, Any] = {"Overall Health": {"value": overall}}
    for group, by_id in entities.items():
        children: dict[str, Any] = {}
        for entity_id, systems in by_id.items():
            results = [result for result, _ in systems.values()]
            worst = next((r for r in ("Failure", "Warning") if r in results), results[0])
            errors = {name: {"value": result, "overflow": chunks} for name, (result, chunks) in systems.items()}
            children[entity_id] = {"value": worst, "children": {"Errors": {"children": errors}}}
        body[group] = {"children": children}
    return json.dumps({"body": body, "header": ["Health Monitor Report"]}, indent=3)


MEMORY_FAIL_GPU1 = report(
    "Failure",
    {
        "GPU": {
            "0": {"PCIe system": ("Warning", ["Detected more than 8 PCIe replays per minute for GPU 0 : 12"])},
            "1": {
                "Memory system": (
                    "Failure",
                    ["A volatile double-bit ECC error has occurred on GPU 1. Drain the GPU and reset it or", "reboot."],
                )
            },
        }
    },
)


class FakeRunner:
    """Answers each argv from a table of canned results (or exceptions); records the calls."""

    def __init__(self, answers: dict[tuple[str, ...], Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, ...]] = []

    async def __call__(self, argv: Sequence[str], timeout: float) -> CommandResult:
        key = tuple(argv)
        self.calls.append(key)
        answer = self.answers[key]
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, CommandResult):
            return answer
        return CommandResult(0, answer)


CHECK = ("dcgmi", "health", "-c", "-j")
ENABLE = ("dcgmi", "health", "-s", "a")


def source_with(answers: dict[tuple[str, ...], Any], **kwargs: Any) -> tuple[DcgmHealthSource, FakeRunner]:
    runner = FakeRunner(answers)
    return DcgmHealthSource(runner=runner, **kwargs), runner


# --- the parser -------------------------------------------------------------------------------------------


def test_parse_healthy() -> None:
    parsed = parse_health_json(HEALTHY)
    assert parsed.overall == "pass" and parsed.incidents == ()


def test_parse_incidents_per_entity_and_system_with_the_message_joined() -> None:
    parsed = parse_health_json(MEMORY_FAIL_GPU1)
    assert parsed.overall == "fail"
    assert [(i.entity_group, i.entity_id, i.system, i.health) for i in parsed.incidents] == [
        ("GPU", "0", "PCIe system", "warn"),
        ("GPU", "1", "Memory system", "fail"),
    ]
    assert parsed.incidents[1].message.endswith("Drain the GPU and reset it or reboot.")
    assert [i.reason for i in parsed.incidents] == ["DCGM_PCIE_WARN", "DCGM_MEMORY_FAIL"]


@pytest.mark.parametrize(
    ("system", "word"),
    [("Memory system", "MEMORY"), ("NVLINK system", "NVLINK"), ("Driver", "DRIVER"), ("NvSwitch F", "NVSWITCH_F")],
)
def test_system_words(system: str, word: str) -> None:
    assert system_word(system) == word


def test_parse_tolerates_a_flat_shape_and_leading_text() -> None:
    flat = {"Overall Health": "Failure", "GPU": {"3": {"value": "Failure", "Errors": {"Thermal system": "Failure"}}}}
    parsed = parse_health_json("Health Monitor Report\n" + json.dumps(flat))
    assert [(i.entity_id, i.system, i.health) for i in parsed.incidents] == [("3", "Thermal system", "fail")]


def test_an_overall_failure_without_a_readable_incident_still_fails() -> None:
    parsed = parse_health_json(json.dumps({"body": {"Overall Health": {"value": "Failure"}, "GPU": 42}}))
    assert [(i.reason, i.health) for i in parsed.incidents] == [("DCGM_OVERALL_FAIL", "fail")]


def test_internal_error_is_not_a_fault() -> None:
    parsed = parse_health_json(report("Internal error", {"GPU": {"0": {"SM system": ("Internal error", [])}}}))
    assert parsed.incidents == ()


# --- real dcgmi output -----------------------------------------------------------------------------------
# Output of real runs as published, with where (the power-warning JSON is a transcription, as said below). jsoncpp
# indents with tabs; the issue paste shows them as 8 spaces. dcgmi prints its "Error: ..." lines on stdout and then
# exits 253 (DCGM_ST_GENERIC_ERROR, -3).

# microsoft/VirtualClient, src/VirtualClient/VirtualClient.Actions.UnitTests/Examples/DCGMI/
# DCGMIHealthCheckResults.json (commit 0a346b188678734d6fbbfa8532ef36a8aab6848b): the `dcgmi health -c -j` output
# their DCGMI parser is tested with, byte for byte jsoncpp's layout.
REAL_HEALTHY_VIRTUALCLIENT = (
    '{\n\t"body" : \n\t{\n\t\t"Overall Health" : \n\t\t{\n\t\t\t"value" : "Healthy"\n\t\t}\n\t},'
    '\n\t"header" : \n\t[\n\t\t"Health Monitor Report"\n\t]\n}\n'
)

# https://github.com/NVIDIA/DCGM/issues/263 (2025-11-06): `dcgmi health -s a` then `dcgmi health -c -j` on an 8-GPU
# node (one GPU needing a reset that DCGM's health watches do not see).
_ISSUE_263 = """{
        "body" :_
        {
                "Overall Health" :_
                {
                        "value" : "Healthy"
                }
        },
        "header" :_
        [
                "Health Monitor Report"
        ]
}
"""
REAL_HEALTHY_DCGM_ISSUE_263 = _ISSUE_263.replace(":_", ": ")  # the paste has a space after those colons

# https://github.com/NVIDIA/DCGM/issues/176 (DCGM 3.3.6 container): `dcgmi health --check -g 1` before any
# `dcgmi health -s`; the text is dcgmi/Health.cpp's, which also prints the trailing space.
WATCHES_NOT_ENABLED = "Error: Health watches not enabled. Please enable watches. \n"

# https://github.com/NVIDIA/DCGM/issues/314 (DCGM 4.7.0): `dcgmi health --set a` on a host whose health module
# refuses the API version.
SET_API_MISMATCH = "Error: Unable to set health watches. Return: API version mismatch\n"

# A public GitHub markdown page, "NVIDIA DCGM Command Reference" (section 5, "Check GPU Health": DCGM 4.6.1 on one
# NVIDIA L4 under a training load, run twice with the same result); its repository could not be pinned down with
# the search tools at hand. This is dcgmi's text table (DcgmiOutputTree(28, 60)), not JSON.
REAL_POWER_WARNING_TEXT = """\
+---------------------------+----------------------------------------------------------+
| Health Monitor Report                                                                |
+===========================+==========================================================+
| Overall Health            | Warning                                                  |
| GPU                       |                                                          |
| -> 0                      | Warning                                                  |
|    -> Errors              |                                                          |
|       -> Power system     | Warning                                                  |
|                           | Detected clocks event due to power violation in GPU 0.   |
|                           | Monitor the power conditions. This GPU can still         |
|                           | perform workload.                                        |
+---------------------------+----------------------------------------------------------+
"""
# The same run as JSON: DcgmiOutputJson prints the tree DcgmiOutputTree draws above, node for node (a transcription,
# not a capture); the three message lines are the three "overflow" chunks (Health::AddErrorMessage, 54 characters).
REAL_POWER_WARNING_JSON = json.dumps(
    {
        "body": {
            "GPU": {
                "children": {
                    "0": {
                        "children": {
                            "Errors": {
                                "children": {
                                    "Power system": {
                                        "overflow": [
                                            "Detected clocks event due to power violation in GPU 0.",
                                            "Monitor the power conditions. This GPU can still",
                                            "perform workload.",
                                        ],
                                        "value": "Warning",
                                    }
                                }
                            }
                        },
                        "value": "Warning",
                    }
                }
            },
            "Overall Health": {"value": "Warning"},
        },
        "header": ["Health Monitor Report"],
    },
    indent="\t",
)


@pytest.mark.parametrize("output", [REAL_HEALTHY_VIRTUALCLIENT, REAL_HEALTHY_DCGM_ISSUE_263])
async def test_real_healthy_outputs_are_healthy(output: str) -> None:
    parsed = parse_health_json(output)
    assert parsed.overall == "pass" and parsed.incidents == ()
    source, _ = source_with({CHECK: output})
    assert await source.poll() == [] and source.status.is_ok


async def test_real_power_warning_is_one_warning_on_gpu_0_with_its_message() -> None:
    parsed = parse_health_json(REAL_POWER_WARNING_JSON)
    assert parsed.overall == "warn"
    assert [(i.entity_group, i.entity_id, i.system, i.health, i.reason) for i in parsed.incidents] == [
        ("GPU", "0", "Power system", "warn", "DCGM_POWER_WARN")
    ]
    assert parsed.incidents[0].message == (
        "Detected clocks event due to power violation in GPU 0. Monitor the power conditions. This GPU can still"
        " perform workload."
    )
    source, _ = source_with({CHECK: REAL_POWER_WARNING_JSON}, gpu_lookup={0: ("0000:00:03.0", "GPU-0b5f")}.get)
    (found,) = await source.poll()
    assert not found.record.critical and (found.record.pci, found.record.uuid) == ("0000:00:03.0", "GPU-0b5f")
    for policy in ("ecs", "nvidia-catalog"):
        assert not Policy(policy).classify(found.record, NOW).impairs


async def test_real_text_output_is_a_parse_error_and_never_healthy() -> None:
    # A dcgmi that ignored -j: its table carries a Warning, so it must not read as a clean bill of health.
    with pytest.raises(DcgmParseError):
        parse_health_json(REAL_POWER_WARNING_TEXT)
    source, _ = source_with({CHECK: REAL_POWER_WARNING_TEXT})
    assert await source.poll() == []
    assert source.status.state == HealthState.INSUFFICIENT_DATA and not source.status.is_ok


async def test_real_set_failure_while_enabling_watches_is_insufficient_data() -> None:
    source, runner = source_with(
        {CHECK: CommandResult(253, WATCHES_NOT_ENABLED), ENABLE: CommandResult(253, SET_API_MISMATCH)}
    )
    assert await source.poll() == []
    assert runner.calls == [CHECK, ENABLE]
    assert source.status.state == HealthState.INSUFFICIENT_DATA
    assert "API version mismatch" in (source.status.reason or "")


# --- shapes from dcgmi's source (no real capture found) ---------------------------------------------------


def test_nvswitch_incidents_named_internal_error_still_fail() -> None:
    # NVIDIA/DCGM dcgmi/Health.cpp HelperSystemToString (DCGM 4.x) has no name for the NvSwitch fatal/non-fatal
    # systems, so their incidents print as "Internal error"; DcgmFieldsGetEntityGroupString names the group "Switch".
    output = report("Failure", {"Switch": {"3": {"Internal error": ("Failure", ["NvSwitch fatal error"])}}})
    parsed = parse_health_json(output)
    assert [(i.entity_group, i.entity_id, i.system, i.health) for i in parsed.incidents] == [
        ("Switch", "3", "Internal error", "fail")
    ]


def test_dcgmi_2_3_entity_without_systems_still_fails() -> None:
    # NVIDIA/DCGM v2.3.4 dcgmi/Health.cpp CheckWatches: the entity key is the first incident's health code (20 =
    # DCGM_HEALTH_RESULT_FAIL), and an entity with a single incident gets no system under "Errors" (null).
    legacy = {
        "body": {
            "GPU": {"children": {"20": {"children": {"Errors": None}, "value": "Failure"}}},
            "Overall Health": {"value": "Failure"},
        },
        "header": ["Health Monitor Report"],
    }
    parsed = parse_health_json(json.dumps(legacy, indent="\t"))
    # "20" is a health code, not GPU 20: ids from these versions cannot be trusted, the failure can.
    assert [(i.entity_group, i.entity_id, i.system, i.health) for i in parsed.incidents] == [
        ("GPU", "20", "UNKNOWN", "fail")
    ]


# --- the source -------------------------------------------------------------------------------------------


async def test_fail_impairs_under_both_policies_and_warn_does_not() -> None:
    source, _ = source_with({CHECK: MEMORY_FAIL_GPU1})
    found = await source.poll()
    assert source.status.is_ok
    for policy in ("ecs", "nvidia-catalog"):
        verdicts = [Policy(policy).classify(o.record, NOW) for o in found]
        assert [(v.reason, v.impairs) for v in verdicts] == [("DCGM_PCIE_WARN", False), ("DCGM_MEMORY_FAIL", True)]
    assert found[1].record.kind == "dcgm" and "double-bit ECC" in found[1].record.message
    assert found[1].source == "dcgm"


async def test_gpu_ids_become_pci_and_uuid_through_the_lookup() -> None:
    identities = {1: ("0000:c1:00", "GPU-aaaa")}
    source, _ = source_with({CHECK: MEMORY_FAIL_GPU1}, gpu_lookup=identities.get)
    found = await source.poll()
    assert (found[1].record.pci, found[1].record.uuid) == ("0000:c1:00", "GPU-aaaa")
    assert found[0].record.pci is None  # GPU 0 unknown to the lookup


async def test_a_lasting_incident_is_reported_once_and_again_after_it_cleared() -> None:
    source, runner = source_with({CHECK: MEMORY_FAIL_GPU1})
    first = await source.poll()
    assert len(first) == 2
    assert await source.poll() == []
    runner.answers[CHECK] = HEALTHY
    assert await source.poll() == []
    runner.answers[CHECK] = MEMORY_FAIL_GPU1
    again = await source.poll()
    assert [o.record.reason for o in again] == ["DCGM_PCIE_WARN", "DCGM_MEMORY_FAIL"]
    assert {o.position for o in again}.isdisjoint({o.position for o in first})  # new episode, new finding id


async def test_a_warning_that_becomes_a_failure_is_reported_again() -> None:
    warn = report("Warning", {"GPU": {"0": {"Memory system": ("Warning", ["SBE rate"])}}})
    fail = report("Failure", {"GPU": {"0": {"Memory system": ("Failure", ["DBE"])}}})
    source, runner = source_with({CHECK: warn})
    assert [o.record.reason for o in await source.poll()] == ["DCGM_MEMORY_WARN"]
    runner.answers[CHECK] = fail
    (escalated,) = await source.poll()
    assert escalated.record.reason == "DCGM_MEMORY_FAIL" and escalated.record.critical


async def test_hostengine_down_is_insufficient_data_and_recovers() -> None:
    down = CommandResult(255, "Error: unable to establish a connection to the specified host: localhost\n")
    source, runner = source_with({CHECK: down})
    assert await source.poll() == []
    status = source.status
    assert status.state == HealthState.INSUFFICIENT_DATA and "unable to establish a connection" in (status.reason or "")
    assert source.configured  # installed, just not working: it counts as a down GPU source
    runner.answers[CHECK] = HEALTHY
    assert await source.poll() == [] and source.status.is_ok


async def test_a_timeout_is_insufficient_data() -> None:
    source, _ = source_with({CHECK: TimeoutError()}, timeout=3)
    await source.poll()
    assert "did not finish within 3s" in (source.status.reason or "")


async def test_watches_not_enabled_are_enabled_once() -> None:
    not_enabled = CommandResult(253, WATCHES_NOT_ENABLED)
    source, runner = source_with({CHECK: not_enabled, ENABLE: "Health monitor systems set successfully.\n"})

    async def enabled_then_healthy(argv: Sequence[str], timeout: float) -> CommandResult:
        result = await FakeRunner.__call__(runner, argv, timeout)
        if tuple(argv) == ENABLE:
            runner.answers[CHECK] = HEALTHY
        return result

    source._run = enabled_then_healthy
    assert await source.poll() == []
    assert runner.calls == [CHECK, ENABLE, CHECK] and source.status.is_ok


async def test_watches_not_enabled_without_permission_to_enable_is_insufficient_data() -> None:
    not_enabled = CommandResult(253, WATCHES_NOT_ENABLED)
    source, runner = source_with({CHECK: not_enabled}, enable_watches=False)
    await source.poll()
    assert not source.status.is_ok and "watches not enabled" in (source.status.reason or "")
    assert runner.calls == [CHECK]


async def test_a_missing_dcgmi_is_not_configured_and_does_not_count_for_gpu_health(tmp_path: Any) -> None:
    # The real runner, a real (missing) binary: no fake here.
    source = DcgmHealthSource(dcgmi=str(tmp_path / "no-such-dcgmi"))
    assert "not configured" in (source.check().reason or "")
    assert not source.configured
    await source.poll()
    assert not source.configured and "not configured" in (source.status.reason or "")

    from node_probe.sources.log_file import KernelLogFileSource

    log_file = tmp_path / "kern.log"
    log_file.write_text("")
    kernel_log = KernelLogFileSource(log_file)
    kernel_log.check()
    probe = Probe(ProbeConfig(instance_id="i-1", group="g"), FakeReporter(), sources=[kernel_log, source])
    assert probe.gpu_health() == (HealthState.OK, None)
    only_dcgm = Probe(ProbeConfig(instance_id="i-1", group="g"), FakeReporter(), sources=[source])
    assert only_dcgm.gpu_health() == (HealthState.INSUFFICIENT_DATA, "no GPU source configured")


async def test_real_runner_runs_a_command_and_times_out() -> None:
    from node_probe.host import run_command

    result = await run_command(["sh", "-c", "echo out; echo err >&2; exit 3"], 5)
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
    with pytest.raises(TimeoutError):
        await run_command(["sleep", "5"], 0.1)
