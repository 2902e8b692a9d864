"""Repair policies: which records impair, which are warnings, and which rule said so."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from node_probe.classify.catalog import default_catalog
from node_probe.classify.kernel_log import parse_lines
from node_probe.classify.policy import Policy, PolicyConfig, RepeatMemory, RepeatRule, Verdict
from node_probe.classify.record import FaultRecord

NOW = datetime(2025, 1, 21, 4, 41, 44, tzinfo=UTC)
ECS_XIDS = {46, 48, 54, 62, 64, 74, 79, 95, 109, 110, 136, 140, 142, 143, 151, 155, 156, 158}


def xid(code: int, pci: str = "0000:3b:00", message: str = "something", line: int = 1) -> FaultRecord:
    return FaultRecord(
        line=line,
        raw=f"NVRM: Xid (PCI:{pci}): {code}, {message}",
        kind="xid",
        code=code,
        pci=pci,
        message=message,
    )


def record(text: str) -> FaultRecord:
    (parsed,) = parse_lines([text])
    return parsed


def test_catalog_has_the_18_ecs_xids() -> None:
    assert default_catalog().ecs_codes == ECS_XIDS
    info = default_catalog().get(79)
    assert info is not None and info.mnemonic == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert default_catalog().get(173) is None


def test_ecs_impairs_on_exactly_its_18_xids_over_codes_1_to_200() -> None:
    policy = Policy("ecs")
    impairing = {code for code in range(1, 201) if policy.classify(xid(code), NOW).impairs}
    assert impairing == ECS_XIDS


@pytest.mark.parametrize("code", sorted(ECS_XIDS))
def test_ecs_verdict_names_the_xid_and_rule(code: int) -> None:
    assert Policy().classify(xid(code), NOW) == Verdict(True, f"XID_{code}", "ecs:xid-list")


@pytest.mark.parametrize(
    ("code", "rule"),
    [
        (13, "ecs:not-in-xid-list"),
        (63, "ecs:not-in-xid-list"),
        (173, "ecs:unknown-xid"),
        (999, "ecs:unknown-xid"),
    ],
)
def test_ecs_warnings(code: int, rule: str) -> None:
    assert Policy("ecs").classify(xid(code), NOW) == Verdict(False, f"XID_{code}", rule)


@pytest.mark.parametrize("policy", ["ecs", "nvidia-catalog"])
def test_a_gpu_that_fell_off_the_bus_impairs_under_both_policies(policy: str) -> None:
    fallen = record("NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.")
    assert Policy(policy).classify(fallen, NOW) == Verdict(True, "GPU_FALLEN_OFF_BUS", f"{policy}:gpu-fallen-off-bus")


def test_a_gpu_that_failed_to_initialise_impairs_only_under_nvidia_catalog() -> None:
    # ECS's list is its 18 Xids, a lost GPU and DCGM fail: an init failure is a warning there, as the issue asks.
    init = record("NVRM: GPU 0000:09:00.0: RmInitAdapter failed! (0x26:0x65:1239)")
    assert Policy("ecs").classify(init, NOW) == Verdict(
        False, "GPU_INIT_FAILED", "ecs:gpu-init-failed-not-an-ecs-check"
    )
    assert Policy("nvidia-catalog").classify(init, NOW) == Verdict(
        True, "GPU_INIT_FAILED", "nvidia-catalog:gpu-init-failed"
    )


def test_sxid_is_a_warning_under_ecs() -> None:
    sxid = record("nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 20034, Fatal, Link 30 LTSSM Fault Up")
    assert Policy("ecs").classify(sxid, NOW) == Verdict(False, "SXID_20034", "ecs:sxid-warning")
    padded = record("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 01004, Non-fatal, Link 02")
    assert Policy("ecs").classify(padded, NOW).reason == "SXID_01004"


@pytest.mark.parametrize(
    ("code", "impairs", "rule"),
    [
        (13, False, "nvidia-catalog:bucket-RESTART_APP"),
        (31, False, "nvidia-catalog:bucket-RESTART_APP"),
        (43, False, "nvidia-catalog:bucket-IGNORE"),
        (63, False, "nvidia-catalog:bucket-IGNORE"),
        (94, False, "nvidia-catalog:bucket-RESTART_APP"),
        (48, True, "nvidia-catalog:bucket-WORKFLOW_XID_48"),
        (54, True, "nvidia-catalog:bucket-CHECK_MECHANICALS"),
        (74, True, "nvidia-catalog:bucket-WORKFLOW_NVLINK_ERR"),
        (79, True, "nvidia-catalog:bucket-RESTART_BM"),
        (95, True, "nvidia-catalog:bucket-RESET_GPU"),
        (119, True, "nvidia-catalog:bucket-RESET_GPU"),
        (149, True, "nvidia-catalog:bucket-WORKFLOW_NVLINK5_ERR"),
        (151, True, "nvidia-catalog:bucket-RESTART_VM"),
        (142, True, "nvidia-catalog:bucket-CONTACT_SUPPORT"),
        (78, False, "nvidia-catalog:bucket-UPDATE_SWFW"),
        (167, False, "nvidia-catalog:bucket-unassigned"),
        (173, False, "nvidia-catalog:unknown-xid"),
    ],
)
def test_nvidia_catalog_buckets(code: int, impairs: bool, rule: str) -> None:
    assert Policy("nvidia-catalog").classify(xid(code), NOW) == Verdict(impairs, f"XID_{code}", rule)


@pytest.mark.parametrize(
    ("severity", "impairs", "rule"),
    [
        ("Fatal", True, "nvidia-catalog:bucket-WORKFLOW_NVLINK5_ERR"),
        ("Nonfatal", False, "nvidia-catalog:nvlink5-nonfatal"),
    ],
)
def test_nvidia_catalog_follows_the_drivers_nvlink5_severity(severity: str, impairs: bool, rule: str) -> None:
    line = (
        f"NVRM: Xid (PCI:0018:01:00): 145, RLW_REMAP {severity} XC0 i0 Link 03 (0x004a8040 0x00000000 0x00000000 "
        "0x00000000 0x00000000 0x00000000 0x00000000)"
    )
    assert Policy("nvidia-catalog").classify(record(line), NOW) == Verdict(impairs, "XID_145", rule)
    # ECS does not act on NVLink5 Xids at all.
    assert not Policy("ecs").classify(record(line), NOW).impairs


def test_nvidia_catalog_never_impairs_on_application_buckets() -> None:
    policy = Policy("nvidia-catalog")
    for info in default_catalog():
        if info.immediate_bucket in ("RESTART_APP", "IGNORE"):
            assert not policy.classify(xid(info.code), NOW).impairs, info
            asks_for_reset = xid(info.code, message="Contained: SM (0x1). RST: Yes, D-RST: Yes")._replace(
                rst=True, d_rst=True
            )
            assert not policy.classify(asks_for_reset, NOW).impairs, info


@pytest.mark.parametrize(
    ("action", "impairs"),
    [
        ("0x0 (None)", False),
        ("0x1 (GPU Reset Required)", True),
        ("0x2 (Node Reboot Required)", True),
        ("0x3 (Drain P2P)", True),
        ("0x4 (Drain and Reset)", True),
        ("0x5 (Recover IMEX Domain)", False),
        ("0x6 (Unknown)", False),
        ("0x2 (OS Reboot)", True),
        ("0x1 (PF FLR)", True),
    ],
)
def test_xid_154_follows_the_announced_action(action: str, impairs: bool) -> None:
    line = f"NVRM: Xid (PCI:0018:01:00): 154, GPU recovery action changed from 0x0 (None) to {action}"
    verdict = Policy("nvidia-catalog").classify(record(line), NOW)
    assert verdict.impairs is impairs
    # Back to None withdraws NVIDIA's verdict, which never impairs (the rule says so for every verdict).
    withdrawn = action == "0x0 (None)"
    assert verdict.reason == "XID_154"
    assert (
        verdict.rule == "nvidia-catalog:verdict-withdrawn"
        if withdrawn
        else verdict.rule.startswith("nvidia-catalog:xid154")
    )
    assert not Policy("ecs").classify(record(line), NOW).impairs


def test_xid_154_without_a_parsable_action_is_a_warning() -> None:
    verdict = Policy("nvidia-catalog").classify(xid(154, message="GPU recovery action changed"), NOW)
    assert verdict == Verdict(False, "XID_154", "nvidia-catalog:xid154-unparsed")


@pytest.mark.parametrize(
    ("tail", "impairs", "rule"),
    [
        ("Ch 00000010, caused by previous Xid 48", True, "nvidia-catalog:xid45-follows-xid48"),
        ("Ch 00000010, caused by previous Xid 79", True, "nvidia-catalog:xid45-follows-xid79"),
        ("Ch 00000010, caused by previous Xid 13", False, "nvidia-catalog:xid45-follows-xid13"),
        ("Ch 00000010, caused by previous Xid 45", False, "nvidia-catalog:xid45-no-cause"),
        ("Ch 00000010", False, "nvidia-catalog:xid45-no-cause"),
    ],
)
def test_xid_45_follows_its_cause(tail: str, impairs: bool, rule: str) -> None:
    rec = record(f"NVRM: Xid (PCI:0000:01:00): 45, pid=1, name=x, {tail}")
    assert Policy("nvidia-catalog").classify(rec, NOW) == Verdict(impairs, "XID_45", rule)


def test_xid_94_never_impairs_even_when_it_asks_for_a_reset_the_xid_154_announcing_the_reset_does() -> None:
    # RESTART_APP never impairs: the reset a contained error needs arrives as Xid 154's recovery action.
    policy = Policy("nvidia-catalog")
    base = "NVRM: Xid (PCI:0000:c1:00): 94, pid=31, name=a.out, Contained: SM (0x1). "
    for flags in ("RST: No, D-RST: No", "RST: Yes, D-RST: No", "RST: No, D-RST: Yes"):
        assert policy.classify(record(base + flags), NOW) == Verdict(
            False, "XID_94", "nvidia-catalog:bucket-RESTART_APP"
        )
    reset = record(
        "NVRM: Xid (PCI:0000:c1:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
    )
    assert policy.classify(reset, NOW) == Verdict(True, "XID_154", "nvidia-catalog:xid154-action-node")
    assert not Policy("ecs").classify(record(base + "RST: Yes, D-RST: No"), NOW).impairs


def test_override_add_and_remove() -> None:
    config = PolicyConfig(add_xids={13}, remove_xids={79}, add_sxids={20034})
    policy = Policy("ecs", config)
    assert policy.classify(xid(13), NOW) == Verdict(True, "XID_13", "override:add xid13")
    assert policy.classify(xid(79), NOW) == Verdict(False, "XID_79", "override:remove xid79")
    assert policy.classify(xid(48), NOW) == Verdict(True, "XID_48", "ecs:xid-list")
    assert policy.classify(xid(999), NOW) == Verdict(False, "XID_999", "ecs:unknown-xid")
    sxid = record("nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 20034, Fatal, Link 30 LTSSM Fault Up")
    assert policy.classify(sxid, NOW) == Verdict(True, "SXID_20034", "override:add sxid20034")
    # A GPU that left the bus is never a matter of opinion.
    assert (
        Policy("ecs", PolicyConfig(remove_xids={79}))
        .classify(record("NVRM: GPU 0000:01:00.0: GPU has fallen off the bus."), NOW)
        .impairs
    )


def test_override_add_works_for_codes_missing_from_the_catalog() -> None:
    assert Policy("nvidia-catalog", PolicyConfig(add_xids={175})).classify(xid(175), NOW).impairs


def test_repeat_rule_fires_on_the_third_within_the_window_on_the_same_gpu() -> None:
    rule = RepeatRule(code=13, count=3, within=timedelta(minutes=10))
    assert rule.name == "override:repeat xid13 3/600s"
    policy = Policy("ecs", PolicyConfig(repeat=[rule]))
    verdicts = [policy.classify(xid(13), NOW + timedelta(minutes=m)) for m in (0, 4, 8)]
    assert [v.impairs for v in verdicts] == [False, False, True]
    assert verdicts[-1] == Verdict(True, "XID_13", "override:repeat xid13 3/600s")
    assert verdicts[0].rule == "ecs:not-in-xid-list"


def test_repeat_rule_does_not_fire_when_spread_out_or_on_other_gpus() -> None:
    rule = RepeatRule(code=13, count=3, within=timedelta(minutes=10))
    policy = Policy("ecs", PolicyConfig(repeat=[rule]))
    spread = [policy.classify(xid(13), NOW + timedelta(minutes=m)) for m in (0, 6, 12, 18)]
    assert not any(v.impairs for v in spread)
    other = Policy("ecs", PolicyConfig(repeat=[rule]))
    gpus = ["0000:3b:00", "0000:5e:00", "0000:3b:00", "0000:86:00"]
    assert not any(other.classify(xid(13, pci=p), NOW).impairs for p in gpus)
    sliding = [policy.classify(xid(13), NOW + timedelta(minutes=m)) for m in (25, 27)]
    assert [v.impairs for v in sliding] == [False, True]  # 18, 25, 27: three within 10 minutes


def test_repeat_rule_uses_uptime_stamps_so_old_history_read_at_once_does_not_fire() -> None:
    rule = RepeatRule(code=13, count=3, within=timedelta(minutes=10))
    policy = Policy("ecs", PolicyConfig(repeat=[rule]))
    lines = [
        f"[{t:>12.6f}] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception" for t in (10, 3000, 9000)
    ]
    assert not any(policy.classify(r, NOW).impairs for r in parse_lines(lines))
    burst = [f"[{t:>12.6f}] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception" for t in (9001, 9002)]
    assert [policy.classify(r, NOW).impairs for r in parse_lines(burst)] == [False, True]


@pytest.mark.parametrize(
    "stamps",
    [
        # syslog (kern.log): a day apart, read in one go at the probe's first start
        ["Nov 20 10:00:00 gpu-7 kernel: ", "Nov 21 10:00:00 gpu-7 kernel: ", "Nov 22 10:00:00 gpu-7 kernel: "],
        # dmesg -T
        ["[Fri Aug 30 11:43:09 2024] ", "[Sat Aug 31 11:43:09 2024] ", "[Sun Sep  1 11:43:09 2024] "],
        # dmesg -x with ISO time, and journalctl -o short-iso
        [
            "kern  :warn  : 2025-01-19T04:41:44,283302+00:00 ",
            "kern  :warn  : 2025-01-20T04:41:44,1+00:00 ",
            "2025-01-21T04:41:44+0000 gpu-7 kernel: ",
        ],
    ],
)
def test_repeat_rule_spaces_wall_clock_stamped_history_by_its_stamps_not_by_when_it_was_read(
    stamps: list[str],
) -> None:
    rule = RepeatRule(code=13, count=3, within=timedelta(minutes=10))
    policy = Policy("ecs", PolicyConfig(repeat=[rule]))
    lines = [f"{stamp}NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception" for stamp in stamps]
    records = list(parse_lines(lines))
    assert len(records) == 3 and all(r.wall_s is not None for r in records)
    assert not any(policy.classify(r, NOW).impairs for r in records)


def test_repeat_rule_forgets_matches_of_an_earlier_boot_when_uptime_restarts() -> None:
    rule = RepeatRule(code=13, count=3, within=timedelta(minutes=10))
    policy = Policy("ecs", PolicyConfig(repeat=[rule]))
    # A dmesg-style log spanning a reboot: two at the end of one boot, one early in the next.
    lines = [
        f"[{t:>12.6f}] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception" for t in (5000, 5001, 100)
    ]
    assert [policy.classify(r, NOW).impairs for r in parse_lines(lines)] == [False, False, False]
    again = [f"[{t:>12.6f}] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception" for t in (101, 102)]
    assert [policy.classify(r, NOW).impairs for r in parse_lines(again)] == [False, True]


def test_a_record_stamped_before_this_boot_is_history_and_never_impairs() -> None:
    booted = datetime(2025, 1, 21, 4, 0, 0, tzinfo=UTC).timestamp()
    policy = Policy("ecs", booted_at=booted)
    before = record("kern  :err   : 2025-01-20T22:13:01,000000+00:00 NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, x")
    assert policy.classify(before, NOW) == Verdict(False, "XID_79", "history:previous-boot")
    banner_before = record(
        "kern  :err   : 2025-01-20T22:13:01+00:00 NVRM: GPU 0000:01:00.0: GPU has fallen off the bus."
    )
    assert not policy.classify(banner_before, NOW).impairs
    # This boot's, including a line stamped a little before the boot (the clock stepped by NTP early in boot).
    early = record("kern  :err   : 2025-01-21T03:58:00+00:00 NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, x")
    assert policy.classify(early, NOW) == Verdict(True, "XID_79", "ecs:xid-list")
    # Lines without a wall-clock stamp (kmsg, dmesg's uptime) are this boot's: kmsg holds only this boot.
    assert policy.classify(xid(79), NOW).impairs
    # `autorepair classify` reads any host's log, so it leaves the boot unset and judges the records alone.
    assert Policy("ecs").classify(before, NOW).impairs


def test_repeat_rule_counts_a_record_read_again_once_and_each_source_apart() -> None:
    rule = RepeatRule(code=13, count=3, within=timedelta(minutes=10))
    policy = Policy("ecs", PolicyConfig(repeat=[rule]))
    # The same line read again after a restart is one match, however often it comes.
    again = [policy.classify(xid(13), NOW, source="kmsg", position="seq:7") for _ in range(3)]
    assert not any(v.impairs for v in again)
    # NVML's event about the same fault is counted by NVML's own count, not added to the kernel log's.
    assert not policy.classify(xid(13), NOW, source="nvml", position="event:1").impairs
    assert not policy.classify(xid(13), NOW, source="kmsg", position="seq:8").impairs
    assert policy.classify(xid(13), NOW, source="kmsg", position="seq:9").impairs


def test_repeat_memory_is_taken_over_only_in_the_same_boot_and_for_the_same_rules() -> None:
    rule = RepeatRule(code=13, count=3, within=timedelta(minutes=10))
    before = Policy("ecs", PolicyConfig(repeat=[rule]))
    for n in (1, 2):
        before.classify(xid(13), NOW, source="kmsg", position=f"seq:{n}")
    memory = RepeatMemory.model_validate_json(before.repeat_memory("boot-a").model_dump_json())

    after = Policy("ecs", PolicyConfig(repeat=[rule]))
    assert after.restore_repeats(memory, "boot-a")
    assert not after.classify(xid(13), NOW, source="kmsg", position="seq:2").impairs  # read again: no new match
    assert after.classify(xid(13), NOW, source="kmsg", position="seq:3").impairs

    other_boot = Policy("ecs", PolicyConfig(repeat=[rule]))
    assert not other_boot.restore_repeats(memory, "boot-b")
    assert not other_boot.classify(xid(13), NOW, source="kmsg", position="seq:3").impairs
    changed_rules = Policy("ecs", PolicyConfig(repeat=[rule.model_copy(update={"count": 2})]))
    assert not changed_rules.restore_repeats(memory, "boot-a")


def test_repeat_rule_for_sxid() -> None:
    policy = Policy(
        "ecs",
        PolicyConfig(repeat=[RepeatRule(kind="sxid", code=20034, count=2, within=timedelta(seconds=60))]),
    )
    sxid = record("nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 20034, Fatal, Link 30 LTSSM Fault Up")
    assert [policy.classify(sxid, NOW).impairs for _ in range(2)] == [False, True]


def test_policy_config_from_json() -> None:
    config = PolicyConfig.model_validate_json(
        '{"add_xids": [13], "remove_xids": [], "repeat": [{"code": 31, "count": 3, "within": "PT10M"}]}'
    )
    assert config.repeat[0].within == timedelta(minutes=10)
    assert config.add_xids == {13}


def test_unknown_policy_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        Policy("eks")


def test_remembered_verdicts_are_the_verdicts() -> None:
    """Records no repeat rule counts are decided once per distinct content; the answers must not change."""
    lines = [
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, Graphics Exception",
        "NVRM: Xid (PCI:0000:3b:00): 45, pid=9, name=x, Ch 00000010, caused by previous Xid 48",
        "NVRM: Xid (PCI:0000:3b:00): 45, pid=9, name=x, Ch 00000010, caused by previous Xid 13",
        "NVRM: Xid (PCI:0018:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
        "NVRM: Xid (PCI:0018:01:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
        "NVRM: Xid (PCI:0018:01:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 03",
        "NVRM: Xid (PCI:0018:01:00): 145, RLW_REMAP Fatal XC0 i0 Link 03",
        "nvidia-nvswitch3: SXid (PCI:0000:c5:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
        "NVRM: GPU 0000:09:00.0: RmInitAdapter failed! (0x26:0x65:1239)",
    ]
    records = list(parse_lines(lines * 3))
    nvml = FaultRecord(line=0, raw="", kind="nvml", code=None, pci=None, message="", reason="NVML_REMAP_FAILURE")
    for name in ("ecs", "nvidia-catalog"):
        shared = Policy(name, PolicyConfig(add_sxids={20034}))
        for item in [*records, nvml, nvml._replace(reason="NVML_GPU_UNAVAILABLE")]:
            assert shared.classify(item, NOW) == Policy(name, PolicyConfig(add_sxids={20034})).classify(item, NOW)


def test_same_verdict_for_repeats_only_where_nothing_counts_or_dates_them() -> None:
    rules = PolicyConfig(repeat=[RepeatRule(code=13, count=3, within=timedelta(minutes=10))])
    assert Policy(config=rules).same_verdict_for_repeats(xid(79))
    assert not Policy(config=rules).same_verdict_for_repeats(xid(13))
    assert Policy().same_verdict_for_repeats(xid(13))
    assert not Policy(booted_at=NOW.timestamp()).same_verdict_for_repeats(xid(79))
