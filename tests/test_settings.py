"""The one settings object: environment over TOML, groups, Temporal Cloud credentials, clear errors."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from contract.config import ConfigError
from contract.groups import AutoRepair
from contract.temporal_client import tls_config
from worker.settings import Settings

TOML = """
[temporal]
address = "prod.a1b2c.tmprl.cloud:7233"
namespace = "prod.a1b2c"
api_key = "secret-key"

[aws]
region = "eu-west-1"

[[groups]]
name = "p5"
cluster = "training"
launch_template = "p5-gpu"
auto_repair = "DISABLED"
heartbeat_loss_threshold = "PT15M"

[[groups]]
name = "g6"
cluster = "inference"
auto_scaling_group = "g6-asg"
max_draining_percent = 10
"""


def test_toml_file_with_environment_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "autorepair.toml"
    config.write_text(TOML)
    monkeypatch.setenv("AUTOREPAIR_CONFIG", str(config))
    monkeypatch.setenv("AUTOREPAIR_AWS__REGION", "us-west-2")

    settings = Settings()

    assert settings.aws.region == "us-west-2"  # the environment wins over the file
    assert settings.temporal.api_key is not None and settings.temporal.api_key.get_secret_value() == "secret-key"
    assert "secret-key" not in repr(settings)
    assert tls_config(settings.temporal) is True  # an API key implies TLS
    p5 = settings.group("p5")
    assert p5.auto_repair is AutoRepair.DISABLED and p5.heartbeat_loss_threshold == timedelta(minutes=15)
    g6 = settings.group("g6")
    assert g6.max_draining(40) == 4 and g6.max_draining(9) == 1
    with pytest.raises(KeyError, match="unknown capacity group 'nope'"):
        settings.group("nope")


def test_drain_cap_is_ecs_rule() -> None:
    group = Settings(groups=[{"name": "g", "cluster": "c"}]).group("g")
    assert [group.max_draining(n) for n in (1, 5, 8, 9, 10, 14, 15, 20, 24, 25, 100)] == [
        1,
        1,
        1,
        1,
        2,
        2,
        3,
        4,
        4,
        5,
        20,
    ]


def test_mtls_needs_certificate_and_key_together(tmp_path: Path) -> None:
    cert = tmp_path / "client.pem"
    cert.write_text("cert")
    with pytest.raises(ValidationError, match=r"tls_client_cert and temporal\.tls_client_key"):
        Settings(temporal={"tls_client_cert": cert})
    key = tmp_path / "client.key"
    key.write_text("key")
    tls = tls_config(Settings(temporal={"tls_client_cert": cert, "tls_client_key": key}).temporal)
    assert not isinstance(tls, bool) and tls.client_cert == b"cert" and tls.client_private_key == b"key"


def test_missing_config_file_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOREPAIR_CONFIG", "/nonexistent/autorepair.toml")
    with pytest.raises(ConfigError, match=re.escape("/nonexistent/autorepair.toml: no such file (AUTOREPAIR_CONFIG")):
        Settings()


def test_invalid_group_values_are_rejected() -> None:
    with pytest.raises(ValidationError, match="max_draining_percent"):
        Settings(groups=[{"name": "g", "cluster": "c", "max_draining_percent": 0}])
    with pytest.raises(ValidationError, match="auto_repair"):
        Settings(groups=[{"name": "g", "cluster": "c", "auto_repair": "SOMETIMES"}])


def test_the_toml_text_itself_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # An ECS task hands its settings over as a variable (an SSM parameter or a secret), not as a file.
    monkeypatch.delenv("AUTOREPAIR_CONFIG", raising=False)
    monkeypatch.setenv("AUTOREPAIR_CONFIG_TOML", TOML)
    monkeypatch.setenv("AUTOREPAIR_AWS__REGION", "us-west-2")

    settings = Settings.load()

    assert settings.aws.region == "us-west-2"
    assert [g.name for g in settings.groups] == ["p5", "g6"]
    assert settings.group("p5").auto_repair is AutoRepair.DISABLED


def test_toml_text_errors_name_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOREPAIR_CONFIG", raising=False)
    typo = "[[groups]]\nname = 'p5'\ncluster = 'c'\nlaunch_template = 'lt'\nauto_repiar = 1\n"
    monkeypatch.setenv("AUTOREPAIR_CONFIG_TOML", typo)
    with pytest.raises(ConfigError, match=r"^environment variable AUTOREPAIR_CONFIG_TOML: groups\[0\]\.auto_repiar"):
        Settings.load()
    monkeypatch.setenv("AUTOREPAIR_CONFIG_TOML", "[temporal\n")
    with pytest.raises(ConfigError, match="AUTOREPAIR_CONFIG_TOML: not valid TOML"):
        Settings.load()
    config = tmp_path / "autorepair.toml"
    config.write_text(TOML)
    monkeypatch.setenv("AUTOREPAIR_CONFIG", str(config))
    with pytest.raises(ConfigError, match="both set: keep one"):
        Settings.load()


def test_tls_ends_at_the_ingest_or_at_the_load_balancer_not_both(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not both"):
        Settings(
            ingest={
                "tls_cert": tmp_path / "c.pem",
                "tls_key": tmp_path / "k.pem",
                "tls_terminated_by_load_balancer": True,
            }
        )
