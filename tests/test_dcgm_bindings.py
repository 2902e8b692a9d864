"""DCGM through its Python bindings (node_probe/sources/dcgm_bindings.py): which DCGM source the probe picks, and how
policy-violation callbacks and health checks become records.

DCGM's bindings are not on PyPI and no DCGM is installed here, so the test writes a stand-in bindings folder:
`dcgm_structs` with the ctypes layouts of dcgm_structs.h (dcgmPolicy_v1, dcgmPolicyCallbackResponse_v2 and its
condition structs, dcgmHealthResponse_v5), written from the header, and a `pydcgm` whose host engine is this test.
The callback the source registers is called through ctypes (a C function pointer, from another thread, with a pointer
to the C struct) as libdcgm calls it. The violations are filled as DCGM's own tests expect them (NVIDIA/DCGM
testing/python3/tests/test_policy.py: one DBE in device memory, an Xid, a PCIe replay count); no real failing
callback sample from a GPU is public, so none is used here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import inspect
import stat
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import pydantic
import pynvml
import pytest

from node_probe import cli
from node_probe.classify.policy import Policy
from node_probe.probe import ProbeConfig, build_sources
from node_probe.sources.base import Observation
from node_probe.sources.dcgm import DcgmHealthSource, parse_health_json
from node_probe.sources.dcgm_bindings import (
    DcgmBindingsSource,
    dcgm_source,
    health_report,
    load_bindings,
    policy_record,
)
from operator_cli.main import main
from tests.fake_nvml import FakeGpu, FakeNvml, two_gpus
from tests.test_dcgm_source import HEALTHY, report
from tests.test_probe import eventually

NOW = datetime(2025, 1, 1, tzinfo=UTC)
GPUS = {0: ("0000:3b:00", "GPU-11111111-2222-3333-4444-555555555555"), 1: ("0000:c1:00", "GPU-aaaa")}

DCGM_STRUCTS = '''
"""Stand-in for DCGM's dcgm_structs: constants and ctypes layouts as dcgm_structs.h declares them."""
from ctypes import Structure, Union, c_bool, c_char, c_int, c_longlong, c_uint, c_uint32, c_ushort, sizeof

DCGM_OPERATION_MODE_AUTO = 1
DCGM_ST_CONNECTION_NOT_VALID = -21
DCGM_ST_LIBRARY_NOT_FOUND = -25
DCGM_POLICY_COND_DBE, DCGM_POLICY_COND_PCI, DCGM_POLICY_COND_MAX_PAGES_RETIRED = 0x1, 0x2, 0x4
DCGM_POLICY_COND_THERMAL, DCGM_POLICY_COND_POWER, DCGM_POLICY_COND_NVLINK, DCGM_POLICY_COND_XID = 0x8, 0x10, 0x20, 0x40
DCGM_POLICY_COND_IDX_DBE, DCGM_POLICY_COND_IDX_PCI, DCGM_POLICY_COND_IDX_MAX_PAGES_RETIRED = 0, 1, 2
DCGM_POLICY_COND_IDX_THERMAL, DCGM_POLICY_COND_IDX_POWER, DCGM_POLICY_COND_IDX_NVLINK = 3, 4, 5
DCGM_POLICY_COND_IDX_XID = 6
DCGM_HEALTH_WATCH_MEM, DCGM_HEALTH_WATCH_ALL = 0x10, 0xFFFFFFFF


class DCGMError(Exception):
    def __init__(self, value):
        super().__init__(f"DCGM error {value}")
        self.value = value


class c_dcgmPolicyConditionParmTypes_t(Union):
    _fields_ = [("boolean", c_bool), ("llval", c_longlong)]


class c_dcgmPolicyConditionParms_t(Structure):
    _fields_ = [("tag", c_uint), ("val", c_dcgmPolicyConditionParmTypes_t)]


class c_dcgmPolicy_v1(Structure):
    _fields_ = [("version", c_uint), ("condition", c_uint), ("mode", c_uint), ("isolation", c_uint),
                ("action", c_uint), ("validation", c_uint), ("response", c_uint),
                ("parms", c_dcgmPolicyConditionParms_t * 7)]


dcgmPolicy_version1 = sizeof(c_dcgmPolicy_v1) | (1 << 24)


class c_dcgmPolicyConditionDbe_t(Structure):
    _fields_ = [("timestamp", c_longlong), ("location", c_int), ("numerrors", c_uint)]


class c_dcgmPolicyConditionPci_t(Structure):
    _fields_ = [("timestamp", c_longlong), ("counter", c_uint)]


class c_dcgmPolicyConditionMpr_t(Structure):
    _fields_ = [("timestamp", c_longlong), ("sbepages", c_uint), ("dbepages", c_uint)]


class c_dcgmPolicyConditionThermal_t(Structure):
    _fields_ = [("timestamp", c_longlong), ("thermalViolation", c_uint)]


class c_dcgmPolicyConditionPower_t(Structure):
    _fields_ = [("timestamp", c_longlong), ("powerViolation", c_uint)]


class c_dcgmPolicyConditionNvlink_t(Structure):
    _fields_ = [("timestamp", c_longlong), ("fieldId", c_ushort), ("counter", c_uint)]


class c_dcgmPolicyConditionXID_t(Structure):
    _fields_ = [("timestamp", c_longlong), ("errnum", c_uint)]


class _Value(Union):
    _fields_ = [("dbe", c_dcgmPolicyConditionDbe_t), ("pci", c_dcgmPolicyConditionPci_t),
                ("mpr", c_dcgmPolicyConditionMpr_t), ("thermal", c_dcgmPolicyConditionThermal_t),
                ("power", c_dcgmPolicyConditionPower_t), ("nvlink", c_dcgmPolicyConditionNvlink_t),
                ("xid", c_dcgmPolicyConditionXID_t)]


class c_dcgmPolicyCallbackResponse_v2(Structure):
    _fields_ = [("version", c_uint), ("condition", c_int), ("val", _Value), ("gpuId", c_uint)]


class c_dcgmDiagErrorDetail_t(Structure):
    _fields_ = [("msg", c_char * 1024), ("code", c_uint)]


class c_dcgmGroupEntityPair_t(Structure):
    _fields_ = [("entityGroupId", c_uint32), ("entityId", c_uint32)]


class c_dcgmIncidentInfo_t(Structure):
    _fields_ = [("system", c_uint), ("health", c_uint32), ("error", c_dcgmDiagErrorDetail_t),
                ("entityInfo", c_dcgmGroupEntityPair_t)]


class c_dcgmHealthResponse_v5(Structure):
    _fields_ = [("version", c_uint32), ("overallHealth", c_uint32), ("incidentCount", c_uint32),
                ("incidents", c_dcgmIncidentInfo_t * 1024)]
'''

PYDCGM = '''
"""Stand-in for pydcgm: its host engine is the test (`ENGINE`), reached the way the real one is."""
import types
import dcgm_structs

ENGINE = types.SimpleNamespace(error=None, connects=[], policies=[], registered=[], watches=[], health=None)


class _Health:
    def Set(self, systems, updateInterval=None, maxKeepAge=None):
        ENGINE.watches.append(systems)

    def Check(self, version=None):
        if ENGINE.error is not None:
            raise dcgm_structs.DCGMError(ENGINE.error)
        return ENGINE.health or dcgm_structs.c_dcgmHealthResponse_v5()


class _Policy:
    def Set(self, policy, statusHandle=None):
        ENGINE.policies.append(policy)

    def Register(self, condition, callback=None, userData=None):
        ENGINE.registered.append((condition, callback))


class _Group:
    def __init__(self, name, gpu_ids):
        self.name, self.gpu_ids, self.health, self.policy = name, gpu_ids, _Health(), _Policy()


class _System:
    def GetAllSupportedGpuIds(self):
        return [0, 1]

    def GetGroupWithGpuIds(self, groupName, gpuIds):
        return _Group(groupName, gpuIds)


class DcgmHandle:
    def __init__(self, handle=None, ipAddress=None, opMode=dcgm_structs.DCGM_OPERATION_MODE_AUTO, **kwargs):
        if ENGINE.error == dcgm_structs.DCGM_ST_LIBRARY_NOT_FOUND:
            raise dcgm_structs.DCGMError(ENGINE.error)
        ENGINE.connects.append((ipAddress, opMode))

    def GetSystem(self):
        return _System()

    def Shutdown(self):
        pass
'''


@pytest.fixture
def bindings_dir(tmp_path: Path) -> Iterator[Path]:
    """The stand-in bindings in a folder of their own, forgotten (modules and path) after the test."""
    folder = tmp_path / "bindings" / "python3"
    folder.mkdir(parents=True)
    (folder / "dcgm_structs.py").write_text(textwrap.dedent(DCGM_STRUCTS))
    (folder / "dcgm_fields.py").write_text("DCGM_FE_GPU = 1\n")
    (folder / "pydcgm.py").write_text(textwrap.dedent(PYDCGM))
    saved = list(sys.path)
    try:
        yield folder
    finally:
        sys.path[:] = saved
        for name in ("dcgm_structs", "dcgm_fields", "pydcgm"):
            sys.modules.pop(name, None)


def engine() -> Any:
    return sys.modules["pydcgm"].ENGINE


def structs() -> ModuleType:
    return sys.modules["dcgm_structs"]


def lookup(index: int) -> tuple[str | None, str | None] | None:
    return GPUS.get(index)


def violation(condition: str, gpu: int, **values: int) -> Any:
    """A dcgmPolicyCallbackResponse_v2 as libdcgm hands one to the callback."""
    s = structs()
    response = s.c_dcgmPolicyCallbackResponse_v2()
    response.version = 2
    response.condition = getattr(s, f"DCGM_POLICY_COND_{condition}")
    response.gpuId = gpu
    member = getattr(response.val, {"PCI": "pci", "DBE": "dbe"}.get(condition, condition.lower()))
    member.timestamp = 1_735_689_600_000_000  # 2025-01-01, in microseconds
    for name, value in values.items():
        setattr(member, name, value)
    return response


def call_from_dcgm_thread(callback: Any, response: Any) -> None:
    """What libdcgm does: call the registered C function with a pointer to its struct, on a thread of its own."""
    caller = threading.Thread(target=callback, args=(ctypes.pointer(response), 0))
    caller.start()
    caller.join()


def test_without_bindings_the_probe_runs_dcgmi(tmp_path: Path) -> None:
    assert load_bindings([tmp_path / "none"]) is None
    source = dcgm_source(poll_interval=60, gpu_lookup=None, dirs=[tmp_path / "none"])
    assert type(source) is DcgmHealthSource
    # This machine has no DCGM: the probe's own choice is dcgmi too.
    (built,) = build_sources(ProbeConfig(instance_id="i-1", group="g", dcgm=True))
    assert type(built) is DcgmHealthSource


def test_with_bindings_in_dcgms_folder_the_probe_uses_them(bindings_dir: Path, tmp_path: Path) -> None:
    source = dcgm_source(poll_interval=60, gpu_lookup=lookup, dirs=[tmp_path / "none", bindings_dir])
    assert isinstance(source, DcgmBindingsSource) and source.bindings.where == str(bindings_dir)
    assert str(bindings_dir) in sys.path  # its modules import each other by name


async def test_policy_is_set_and_violations_become_records(bindings_dir: Path) -> None:
    bindings = load_bindings([bindings_dir])
    assert bindings is not None
    source = DcgmBindingsSource(bindings, poll_interval=0.05, gpu_lookup=lookup, power_limit_w=700)
    seen: list[Observation] = []
    async with collecting(source, seen):
        await eventually(lambda: bool(engine().registered) and source.status.is_ok)
        s = structs()
        ((condition, callback),) = engine().registered
        watched = s.DCGM_POLICY_COND_DBE | s.DCGM_POLICY_COND_PCI | s.DCGM_POLICY_COND_NVLINK | s.DCGM_POLICY_COND_XID
        assert condition == watched | s.DCGM_POLICY_COND_THERMAL | s.DCGM_POLICY_COND_POWER
        (policy,) = engine().policies
        assert policy.condition == condition and policy.version == s.dcgmPolicy_version1
        assert (policy.parms[s.DCGM_POLICY_COND_IDX_DBE].tag, policy.parms[0].val.boolean) == (0, True)
        assert (policy.parms[s.DCGM_POLICY_COND_IDX_THERMAL].tag, policy.parms[3].val.llval) == (1, 90)
        assert policy.parms[s.DCGM_POLICY_COND_IDX_POWER].val.llval == 700
        assert engine().connects == [("127.0.0.1", s.DCGM_OPERATION_MODE_AUTO)]

        call_from_dcgm_thread(callback, violation("DBE", 1, location=2, numerrors=1))
        call_from_dcgm_thread(callback, violation("XID", 0, errnum=79))
        call_from_dcgm_thread(callback, violation("PCI", 0, counter=12))
        call_from_dcgm_thread(callback, violation("THERMAL", 1, thermalViolation=93))
        await eventually(lambda: len(seen) == 4)
    dbe, xid, pcie, hot = (o.record for o in seen)
    assert (dbe.kind, dbe.reason, dbe.critical, dbe.pci, dbe.uuid) == ("dcgm", "DCGM_POLICY_DBE", True, *GPUS[1])
    assert dbe.message == "GPU 1: 1 double-bit ECC error(s) in device memory (DCGM policy violation)"
    assert dbe.wall_s == datetime(2025, 1, 1, tzinfo=UTC).timestamp()
    assert (xid.kind, xid.code, xid.pci) == ("xid", 79, GPUS[0][0])
    assert (pcie.reason, pcie.critical, hot.reason) == ("DCGM_POLICY_PCIE", False, "DCGM_POLICY_THERMAL")
    verdicts = [Policy("ecs").classify(record, NOW) for record in (dbe, xid, pcie, hot)]
    assert [(v.reason, v.impairs) for v in verdicts] == [
        ("DCGM_POLICY_DBE", True),
        ("XID_79", True),
        ("DCGM_POLICY_PCIE", False),
        ("DCGM_POLICY_THERMAL", False),
    ]
    assert len({o.position for o in seen}) == 4


async def test_power_is_watched_only_with_a_limit_and_an_unknown_condition_is_no_record(bindings_dir: Path) -> None:
    bindings = load_bindings([bindings_dir])
    assert bindings is not None
    source = DcgmBindingsSource(bindings, poll_interval=60, gpu_lookup=lookup)
    await source.poll()
    ((condition, _),) = engine().registered
    assert not condition & structs().DCGM_POLICY_COND_POWER
    unknown = violation("DBE", 0, numerrors=1)
    unknown.condition = 0x100
    assert policy_record(unknown, structs()) is None


async def test_health_checks_give_dcgmis_incidents_and_a_lost_hostengine_is_insufficient_data(
    bindings_dir: Path,
) -> None:
    bindings = load_bindings([bindings_dir])
    assert bindings is not None
    source = DcgmBindingsSource(bindings, poll_interval=60, gpu_lookup=lookup)
    assert await source.poll() == [] and source.status.is_ok
    s = structs()
    response = s.c_dcgmHealthResponse_v5()
    response.overallHealth, response.incidentCount = 20, 1
    incident = response.incidents[0]
    incident.system, incident.health = s.DCGM_HEALTH_WATCH_MEM, 20
    incident.error.msg = b"A volatile double-bit ECC error has occurred on GPU 1."
    incident.entityInfo.entityGroupId, incident.entityInfo.entityId = 1, 1
    engine().health = response
    (observation,) = await source.poll()
    record = observation.record
    assert (record.reason, record.critical, record.pci) == ("DCGM_MEMORY_FAIL", True, GPUS[1][0])
    # The same incident as dcgmi's JSON gives: one reason whichever way DCGM is read.
    from_json = parse_health_json(
        report("Failure", {"GPU": {"1": {"Memory system": ("Failure", [incident.error.msg.decode()])}}})
    )
    assert health_report(response) == from_json

    engine().error = s.DCGM_ST_CONNECTION_NOT_VALID
    assert await source.poll() == []
    assert not source.status.is_ok and "nv-hostengine at 127.0.0.1" in (source.status.reason or "")
    engine().error = None
    assert await source.poll() == [] and source.status.is_ok  # reconnected; the failure was already reported
    assert len(engine().connects) == 2


async def test_bindings_without_libdcgm_fall_back_to_dcgmi(bindings_dir: Path, tmp_path: Path) -> None:
    bindings = load_bindings([bindings_dir])
    assert bindings is not None
    dcgmi = tmp_path / "dcgmi"
    dcgmi.write_text(f"#!/bin/sh\ncat <<'EOF'\n{HEALTHY}EOF\n")
    dcgmi.chmod(dcgmi.stat().st_mode | stat.S_IXUSR)
    engine().error = structs().DCGM_ST_LIBRARY_NOT_FOUND
    source = DcgmBindingsSource(bindings, poll_interval=60, gpu_lookup=lookup, dcgmi=str(dcgmi))
    assert await source.poll() == []
    assert source.use_dcgmi and source.status.is_ok and engine().connects == []


@contextlib.asynccontextmanager
async def collecting(source: DcgmBindingsSource, seen: list[Observation]) -> AsyncIterator[None]:
    async def run() -> None:
        async for observation in source.observations():
            seen.append(observation)

    task = asyncio.create_task(run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- the thermal and power limits: flags, the probe's config, and the power default from NVML ------------------


class PowerNvml(FakeNvml):
    """tests/fake_nvml.py's pynvml, with each GPU's enforced power limit (milliwatts) as pynvml reads it."""

    def __init__(self, gpus: list[FakeGpu], limits_mw: list[int]) -> None:
        super().__init__(gpus)
        self.limits_mw = limits_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        gpu = self._gpu(handle)
        self._check(gpu, "nvmlDeviceGetEnforcedPowerLimit")
        return self.limits_mw[self.gpus.index(gpu)]


def limits_set() -> tuple[int | None, int | None]:
    """(thermal C, power W) of the policy last set on the host engine; None for a condition not watched."""
    s = structs()
    (condition, _) = engine().registered[-1]
    policy = engine().policies[-1]
    found: list[int | None] = []
    for bit, index in ((s.DCGM_POLICY_COND_THERMAL, 3), (s.DCGM_POLICY_COND_POWER, 4)):
        watched = bool(condition & bit)
        assert bool(policy.condition & bit) == watched
        if watched:
            assert policy.parms[index].tag == 1  # a limit, not a boolean
        found.append(int(policy.parms[index].val.llval) if watched else None)
    return found[0], found[1]


def probe_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_probe_arguments(parser)
    return parser.parse_args(["--group", "g", *argv])


def test_the_stand_ins_enforced_power_limit_is_pynvmls() -> None:
    real = inspect.signature(pynvml.nvmlDeviceGetEnforcedPowerLimit)
    assert list(inspect.signature(PowerNvml([], []).nvmlDeviceGetEnforcedPowerLimit).parameters) == list(
        real.parameters
    )


def test_the_probes_dcgm_limit_flags() -> None:
    default = probe_args()
    assert (default.dcgm_thermal_limit, default.dcgm_power_limit) == (90, None)
    given = probe_args("--dcgm-thermal-limit", "85", "--dcgm-power-limit", "650")
    assert (given.dcgm_thermal_limit, given.dcgm_power_limit) == (85, 650)


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--dcgm-power-limit", "0", "must be at least 25 and at most 5000 watts, not 0"),
        ("--dcgm-power-limit", "-700", "must be at least 25 and at most 5000 watts, not -700"),
        ("--dcgm-power-limit", "70000", "must be at least 25 and at most 5000 watts, not 70000"),
        ("--dcgm-power-limit", "700.5", "'700.5' is not a whole number of watts"),
        ("--dcgm-power-limit", "700W", "'700W' is not a whole number of watts"),
        ("--dcgm-thermal-limit", "20", "must be at least 30 and at most 120 degrees C, not 20"),
        ("--dcgm-thermal-limit", "200", "must be at least 30 and at most 120 degrees C, not 200"),
        ("--dcgm-thermal-limit", "hot", "'hot' is not a whole number of degrees C"),
    ],
)
def test_a_bad_dcgm_limit_is_one_line_and_exit_status_2(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["probe", "--group", "g", "--direct-temporal", f"{flag}={value}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == f"autorepair probe: error: argument {flag}: {says} (see autorepair probe --help)\n"


def test_the_probes_config_holds_the_limits_to_the_same_bounds() -> None:
    config = ProbeConfig(instance_id="i-1", group="g", dcgm_thermal_limit_c=85, dcgm_power_limit_w=650)
    assert (config.dcgm_thermal_limit_c, config.dcgm_power_limit_w) == (85, 650)
    assert ProbeConfig(instance_id="i-1", group="g").dcgm_power_limit_w is None
    for bad in ({"dcgm_power_limit_w": 0}, {"dcgm_thermal_limit_c": 121}):
        with pytest.raises(pydantic.ValidationError):
            ProbeConfig(instance_id="i-1", group="g", **bad)


async def test_the_flags_reach_dcgms_policy(
    bindings_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(bindings_dir))  # the bindings as installed, where the probe looks first
    args = probe_args(
        "--instance-id", "i-1", "--direct-temporal", "--kernel-log", str(tmp_path / "kern.log"),
        "--spool-dir", str(tmp_path / "spool"), "--no-nvml", "--no-container-runtime", "--no-daemons",
        "--dcgm-thermal-limit", "85", "--dcgm-power-limit", "650",
    )  # fmt: skip
    probe = await cli.build_probe(args)
    assert (probe.config.dcgm_thermal_limit_c, probe.config.dcgm_power_limit_w) == (85, 650)
    (dcgm,) = [s for s in build_sources(probe.config) if isinstance(s, DcgmBindingsSource)]
    await dcgm.poll()
    assert limits_set() == (85, 650)


async def test_without_a_power_flag_the_limit_is_the_lowest_gpus_enforced_one(bindings_dir: Path) -> None:
    bindings = load_bindings([bindings_dir])
    assert bindings is not None
    nvml = PowerNvml(two_gpus(), [700_000, 350_400])
    source = DcgmBindingsSource(bindings, poll_interval=60, gpu_lookup=lookup, nvml=nvml)
    assert await source.poll() == [] and source.status.is_ok
    assert limits_set() == (90, 351)  # 350.4 W rounded up: a GPU held at its limit is no violation
    assert nvml.inits == nvml.shutdowns == 1
    # Read again at each connect: an operator may have changed a GPU's limit (nvidia-smi -pl) meanwhile.
    nvml.limits_mw = [700_000, 300_000]
    engine().error = structs().DCGM_ST_CONNECTION_NOT_VALID
    await source.poll()
    engine().error = None
    await source.poll()
    assert len(engine().policies) == 2 and limits_set() == (90, 300)


@pytest.mark.parametrize(
    "broken",
    [
        {"init_error": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND},
        {"gpu_error": pynvml.NVML_ERROR_NOT_SUPPORTED},
        {"no_gpus": True},
        {"no_nvml": True},
    ],
)
async def test_where_nvml_cannot_say_power_is_not_watched(bindings_dir: Path, broken: dict[str, Any]) -> None:
    bindings = load_bindings([bindings_dir])
    assert bindings is not None
    nvml = PowerNvml([] if broken.get("no_gpus") else two_gpus(), [700_000, 700_000])
    nvml.init_error = broken.get("init_error")
    if "gpu_error" in broken:
        nvml.gpus[1].errors["nvmlDeviceGetEnforcedPowerLimit"] = broken["gpu_error"]
    given = None if broken.get("no_nvml") else nvml
    source = DcgmBindingsSource(bindings, poll_interval=60, gpu_lookup=lookup, nvml=given)
    assert await source.poll() == [] and source.status.is_ok  # the rest of DCGM is watched all the same
    assert limits_set() == (90, None)
    assert nvml.shutdowns == nvml.inits  # NVML left as found


async def test_a_power_flag_overrides_nvml_which_is_then_not_asked(bindings_dir: Path) -> None:
    bindings = load_bindings([bindings_dir])
    assert bindings is not None
    nvml = PowerNvml(two_gpus(), [700_000, 350_000])
    source = DcgmBindingsSource(bindings, poll_interval=60, gpu_lookup=lookup, power_limit_w=650, nvml=nvml)
    await source.poll()
    assert limits_set() == (90, 650)
    assert nvml.calls == []


@pytest.mark.parametrize("nvml_on", [True, False])
async def test_the_probe_reads_the_power_default_through_its_own_nvml(
    bindings_dir: Path, monkeypatch: pytest.MonkeyPatch, nvml_on: bool
) -> None:
    """The NVML source's module is the one asked; with NVML off (--no-nvml, or no driver library) NVML is left
    alone and power is not watched."""
    monkeypatch.syspath_prepend(str(bindings_dir))
    nvml = PowerNvml(two_gpus(), [700_000, 400_000])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    sources = build_sources(ProbeConfig(instance_id="i-1", group="g", nvml=nvml_on, dcgm=True))
    (dcgm,) = [s for s in sources if isinstance(s, DcgmBindingsSource)]
    await dcgm.poll()
    assert limits_set() == (90, 400 if nvml_on else None)
    assert (nvml.inits > 0) is nvml_on
