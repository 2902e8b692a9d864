"""Settings are strict at every depth: unknown keys, durations that are not positive, a heartbeat-loss threshold
under 3 heartbeat intervals and duplicate groups are refused, and every command says so in one line naming the
file, the key and the fix (exit status 2), never a traceback."""

from __future__ import annotations

import collections.abc
import enum
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from datetime import time, timedelta
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
from pydantic import BaseModel, ValidationError

from contract.config import (
    CONFIG_ENV,
    AwsSettings,
    ConfigError,
    EventSettings,
    SettingsSection,
    TemporalSettings,
)
from contract.groups import (
    MAX_HEARTBEAT_LOSS_THRESHOLD,
    AutoRepair,
    CapacityGroup,
    GroupConfigState,
    GroupConfigUpdate,
)
from node_probe.cli import ProbeSettings
from operator_cli.main import main
from worker.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
UNKNOWN = "no_such_key"


@pytest.fixture(autouse=True)
def _no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("AUTOREPAIR_")]:
        monkeypatch.delenv(name)


# --- the walk over every settings model -------------------------------------------------------------------------

# A step from a model to a model below it: the field, then the containers in between ("list": item 0, "dict": key).
Step = tuple[str, tuple[str, ...]]


def _routes(annotation: Any) -> Iterator[tuple[tuple[str, ...], type[BaseModel]]]:
    """Every model an annotation can hold, with the containers around it: X, X | None, list[X], dict[str, X], ..."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield (), annotation
        return
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Set):
        kind: str | None = "list"
        args = args[:1]
    elif origin in (dict, collections.abc.Mapping):
        kind, args = "dict", args[1:]
    elif origin in (Union, types.UnionType, Annotated):
        kind = None
    else:
        return
    for arg in args:
        for kinds, model in _routes(arg):
            yield ((kind, *kinds) if kind else kinds), model


def settings_models(root: type[BaseModel]) -> list[tuple[tuple[Step, ...], type[BaseModel]]]:
    """Every model reachable from root through its fields, with the route to it (root itself: no steps)."""
    found: list[tuple[tuple[Step, ...], type[BaseModel]]] = []

    def visit(model: type[BaseModel], route: tuple[Step, ...], seen: frozenset[type[BaseModel]]) -> None:
        found.append((route, model))
        for name, field in model.model_fields.items():
            for kinds, inner in _routes(field.annotation):
                if inner not in seen:
                    visit(inner, (*route, (name, kinds)), seen | {inner})

    visit(root, (), frozenset({root}))
    return found


def _sample(annotation: Any, name: str = "") -> Any:
    """A valid value for a required field (strings, enums, and a maintenance window's start and end)."""
    for kinds, model in _routes(annotation):
        if not kinds:
            return minimal(model)
    if annotation is str:
        return "x1"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return next(iter(annotation)).value
    if annotation is time:
        return "02:00" if name == "end" else "01:00"  # a window must not end where it starts
    raise AssertionError(f"teach _sample a value for a required {annotation!r}")


def minimal(model: type[BaseModel]) -> dict[str, Any]:
    """The smallest valid input of a model: its required fields only."""
    return {name: _sample(f.annotation, name) for name, f in model.model_fields.items() if f.is_required()}


def input_along(
    root: type[BaseModel], route: tuple[Step, ...], leaf: dict[str, Any]
) -> tuple[dict[str, Any], tuple[str | int, ...]]:
    """A valid input of root with `leaf` merged into the model at the end of route, and that model's loc."""
    data = minimal(root)
    table = data
    loc: tuple[str | int, ...] = ()
    models = dict(settings_models(root))
    for depth, (name, kinds) in enumerate(route, start=1):
        inner = minimal(models[route[:depth]])
        holder: Any = table
        key: str | int = name
        loc = (*loc, name)
        for kind in kinds:
            holder[key] = [{}] if kind == "list" else {"k": {}}
            holder, key = holder[key], 0 if kind == "list" else "k"
            loc = (*loc, key)
        holder[key] = inner
        table = inner
    table.update(leaf)
    return data, loc


ROOTS: list[type[BaseModel]] = [Settings, ProbeSettings]
WALK = [(root, route, model) for root in ROOTS for route, model in settings_models(root)]


def _walk_id(case: tuple[type[BaseModel], tuple[Step, ...], type[BaseModel]]) -> str:
    root, route, model = case
    return f"{root.__name__}:{'.'.join(name for name, _ in route) or '<top>'}:{model.__name__}"


def test_the_walk_reaches_every_section() -> None:
    reached = {model for root, _, model in WALK if root is Settings}
    assert {Settings, TemporalSettings, AwsSettings, EventSettings, CapacityGroup} <= reached
    # Every model below the top is a settings section, so it carries the settings rules (contract/config.py).
    for _, route, model in WALK:
        assert not route or issubclass(model, SettingsSection), f"{model.__name__} is not a SettingsSection"


@pytest.mark.parametrize("case", WALK, ids=_walk_id)
def test_an_unknown_key_is_refused_at_every_depth(case: tuple[type[BaseModel], tuple[Step, ...], type[Any]]) -> None:
    root, route, _ = case
    valid, _ = input_along(root, route, {})
    root(**valid)  # the input is valid without the unknown key
    data, loc = input_along(root, route, {UNKNOWN: "DISABLED"})
    if root is ProbeSettings and not route:
        # The probe reads only [temporal] (and log_format) of the shared file: the worker's keys are not its own.
        assert UNKNOWN not in root(**data).model_dump()
        return
    with pytest.raises(ValidationError) as caught:
        root(**data)
    assert [(e["type"], e["loc"]) for e in caught.value.errors()] == [("extra_forbidden", (*loc, UNKNOWN))]


DURATIONS = [
    (root, route, name)
    for root, route, model in WALK
    for name, field in model.model_fields.items()
    if timedelta in (field.annotation, *get_args(field.annotation))
]


def test_the_walk_finds_the_durations() -> None:
    names = {name for root, _, name in DURATIONS if root is Settings}
    assert {
        "heartbeat_loss_threshold",
        "heartbeat_interval",
        "replacement_ready_timeout",
        "task_poll_interval",
        "permit_reclaim_interval",
        "webhook_timeout",
        "health_gauge_interval",
    } <= names


@pytest.mark.parametrize("case", DURATIONS, ids=lambda c: f"{c[0].__name__}:{'.'.join([*(n for n, _ in c[1]), c[2]])}")
@pytest.mark.parametrize("value", [0, -1, "-PT5M", timedelta(0)])
def test_every_duration_must_be_positive(case: tuple[type[BaseModel], tuple[Step, ...], str], value: Any) -> None:
    root, route, name = case
    data, loc = input_along(root, route, {name: value})
    with pytest.raises(ValidationError) as caught:
        root(**data)
    errors = caught.value.errors()
    assert [e["loc"] for e in errors] == [(*loc, name)]
    assert "must be a positive duration" in errors[0]["msg"]


# --- the rules, one by one ---------------------------------------------------------------------------------------


def group(**values: Any) -> dict[str, Any]:
    return {"name": "g", "cluster": "c", **values}


def test_typo_in_a_group_table_is_refused_not_left_enabled() -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(groups=[group(), group(name="h", auto_repiar="DISABLED")])
    assert [(e["type"], e["loc"]) for e in caught.value.errors()] == [("extra_forbidden", ("groups", 1, "auto_repiar"))]


def test_typo_in_temporal_is_refused() -> None:
    with pytest.raises(ValidationError) as caught:
        Settings(temporal={"tls_client_crt": "/etc/autorepair/client.pem"})
    assert [(e["type"], e["loc"]) for e in caught.value.errors()] == [
        ("extra_forbidden", ("temporal", "tls_client_crt"))
    ]


def test_threshold_must_span_three_heartbeat_intervals() -> None:
    # The default interval is the probe's default, 60 s: 3 minutes is the shortest threshold.
    assert Settings(groups=[group(heartbeat_loss_threshold="PT3M")]).groups[0].heartbeat_interval == timedelta(
        seconds=60
    )
    with pytest.raises(ValidationError, match=r"less than 3 heartbeat intervals \(3 x 60s\).*at least 180s"):
        Settings(groups=[group(heartbeat_loss_threshold="PT179S")])
    # A faster probe allows a shorter threshold; the rule follows the group's own interval.
    fast = Settings(groups=[group(heartbeat_loss_threshold=30, heartbeat_interval=10)]).groups[0]
    assert fast.heartbeat_loss_threshold == timedelta(seconds=30)
    with pytest.raises(ValidationError) as caught:
        Settings(groups=[group(heartbeat_loss_threshold=29, heartbeat_interval=10)])
    assert [e["loc"] for e in caught.value.errors()] == [("groups", 0, "heartbeat_loss_threshold")]
    # An instance built in code is checked as well when it is handed to the settings.
    with pytest.raises(ValidationError, match="less than 3 heartbeat intervals"):
        Settings(groups=[CapacityGroup(name="g", cluster="c", heartbeat_loss_threshold=timedelta(seconds=6))])


def test_threshold_keeps_its_upper_bound() -> None:
    assert Settings(groups=[group(heartbeat_loss_threshold="P1D")]).groups[0].heartbeat_loss_threshold == (
        MAX_HEARTBEAT_LOSS_THRESHOLD
    )
    with pytest.raises(ValidationError, match="at most 86400s"):
        Settings(groups=[group(heartbeat_loss_threshold="P1DT1S")])


def test_duplicate_group_names_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"'g' is configured twice \(groups\[0\] and groups\[2\]\)"):
        Settings(groups=[group(), group(name="h"), group(cluster="other")])


def test_on_the_wire_a_group_stays_lenient() -> None:
    """CapacityGroup is also in workflow payloads: a newer version's field and an older version's value (a live
    threshold set before the 3-interval rule) must still decode, or recorded histories would stop replaying."""
    state = GroupConfigState.model_validate_json(
        '{"group": "g", "effective": {"name": "g", "cluster": "c", "heartbeat_loss_threshold": "PT1M",'
        ' "a_field_of_a_newer_version": 1}}'
    )
    assert state.effective is not None and state.effective.heartbeat_loss_threshold == timedelta(minutes=1)


def test_live_update_respects_the_heartbeat_interval() -> None:
    effective = CapacityGroup(name="g", cluster="c", heartbeat_interval=timedelta(seconds=60))
    too_short = GroupConfigUpdate(heartbeat_loss_threshold=timedelta(minutes=2))
    assert too_short.problems() == []  # without the group, only the bounds are known
    [problem] = too_short.problems(effective)
    assert "less than 3 heartbeat intervals (3 x 60s)" in problem and "at least 180s" in problem
    assert GroupConfigUpdate(heartbeat_loss_threshold=timedelta(minutes=3)).problems(effective) == []
    fast = effective.model_copy(update={"heartbeat_interval": timedelta(seconds=10)})
    assert too_short.problems(fast) == []
    for bad in (timedelta(0), timedelta(seconds=-1), MAX_HEARTBEAT_LOSS_THRESHOLD + timedelta(seconds=1)):
        [problem] = GroupConfigUpdate(heartbeat_loss_threshold=bad).problems(effective)
        assert "more than 0s and at most 86400s" in problem
    assert GroupConfigUpdate(auto_repair=AutoRepair.DISABLED).problems(effective) == []


def test_the_probe_reads_only_temporal_of_the_shared_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "autorepair.toml"
    config.write_text(
        'log_format = "json"\n[temporal]\naddress = "t:7233"\n[[groups]]\nname = "g"\ncluster = "c"\nfuture_key = 1\n'
    )
    monkeypatch.setenv(CONFIG_ENV, str(config))
    settings = ProbeSettings.load()
    assert (settings.temporal.address, settings.log_format) == ("t:7233", "json")
    config.write_text('[temporal]\naddress = "t:7233"\ntls_client_crt = "/x.pem"\n')
    with pytest.raises(ConfigError, match=r"temporal\.tls_client_crt: unknown key: did you mean tls_client_cert\?"):
        ProbeSettings.load()


# --- one line, exit status 2, for every command --------------------------------------------------------------------


def _config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "autorepair.toml"
    path.write_text(text)
    return path


TYPO_IN_GROUP = (
    '[[groups]]\nname = "a"\ncluster = "c"\n\n[[groups]]\nname = "b"\ncluster = "c"\nauto_repiar = "DISABLED"\n'
)
TYPO_IN_TEMPORAL = '[temporal]\naddress = "t:7233"\ntls_client_crt = "/etc/autorepair/client.pem"\n'


def _command(argv: list[str], text: str, key: str) -> Any:
    return pytest.param(argv, text, key, id=" ".join(a for a in argv[:2] if not a.startswith("-")))


@pytest.mark.parametrize(
    ("argv", "text", "key"),
    [
        _command(["worker"], TYPO_IN_GROUP, "groups[1].auto_repiar"),
        _command(["setup"], TYPO_IN_GROUP, "groups[1].auto_repiar"),
        _command(["describe-instances", "--group", "a"], TYPO_IN_GROUP, "groups[1].auto_repiar"),
        _command(["history"], TYPO_IN_GROUP, "groups[1].auto_repiar"),
        _command(
            ["inject", "--instance", "i-1", "--group", "a", "--xid", "79"], TYPO_IN_GROUP, "groups[1].auto_repiar"
        ),
        _command(["group", "describe", "--name", "a"], TYPO_IN_GROUP, "groups[1].auto_repiar"),
        _command(["group", "update", "--name", "a", "--reset"], TYPO_IN_GROUP, "groups[1].auto_repiar"),
        _command(["demo"], TYPO_IN_GROUP, "groups[1].auto_repiar"),
        _command(["probe", "--group", "a", "--instance-id", "i-1"], TYPO_IN_TEMPORAL, "temporal.tls_client_crt"),
        _command(["classify", "/dev/null"], TYPO_IN_TEMPORAL, "temporal.tls_client_crt"),
    ],
)
def test_every_command_refuses_bad_settings_in_one_line(
    argv: list[str],
    text: str,
    key: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = _config(tmp_path, text)
    monkeypatch.setenv(CONFIG_ENV, str(config))
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"autorepair {argv[0]}: invalid configuration: {config}: {key}: unknown key")
    assert "did you mean" in captured.err


def test_an_environment_variable_is_named_as_the_source(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("AUTOREPAIR_AWS__MAX_ATTEMPTS", "zero")
    assert main(["history"]) == 2
    assert capsys.readouterr().err == (
        "autorepair history: invalid configuration: environment variable AUTOREPAIR_AWS__MAX_ATTEMPTS: "
        "aws.max_attempts: Input should be a valid integer, unable to parse string as an integer (got 'zero')\n"
    )


def run_autorepair(*argv: str, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real command, as an operator runs it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOREPAIR_")}
    if config is not None:
        env[CONFIG_ENV] = str(config)
    return subprocess.run(
        [sys.executable, "-m", "operator_cli.main", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_one_line_exit_2(result: subprocess.CompletedProcess[str], *parts: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    for part in parts:
        assert part in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        pytest.param(None, ("no such file", "AUTOREPAIR_CONFIG"), id="missing file"),
        pytest.param(
            '[aws]\nregion = "eu-west-1"\n\n[[groups]]\nname = "a"\ncluster = "c"\n\n[[groups]]\nname = "b"\n'
            "auto_repair = DISABLED\n",
            ("groups[1].auto_repair: not valid TOML", "line 10"),
            id="malformed TOML",
        ),
        pytest.param(
            '[[groups]]\nname = "a"\ncluster = "c"\n\n[[groups]]\nname = "b"\ncluster = "c"\n'
            'max_draining_percent = "lots"\n',
            ("groups[1].max_draining_percent: Input should be a valid integer", "(got 'lots')"),
            id="wrong type",
        ),
        pytest.param(
            '[[groups]]\nname = "a"\ncluster = "c"\nheartbeat_loss_threshold = "PT1M"\n',
            ("groups[0].heartbeat_loss_threshold", "make it at least 180s"),
            id="threshold under 3 intervals",
        ),
    ],
)
def test_the_real_command_fails_in_one_line(text: str | None, parts: tuple[str, ...], tmp_path: Path) -> None:
    config = tmp_path / "autorepair.toml"
    if text is not None:
        config.write_text(text)
    result = run_autorepair("describe-instances", "--group", "a", config=config)
    assert_one_line_exit_2(result, f"autorepair describe-instances: invalid configuration: {config}: ", *parts)
