"""Temporal connection settings as the `temporal` CLI's users keep them (issue 26): beneath our own settings, the
TEMPORAL_* variables and temporal.toml's profile, read through temporalio.envconfig. Precedence: a command's flags,
then AUTOREPAIR_TEMPORAL__* (or the TOML file), then TEMPORAL_* and the profile, then the defaults."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.client import Client

from contract.config import TemporalSettings
from tests.test_ops_cli import autorepair
from worker.settings import Settings

THEIRS = ("TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TEMPORAL_API_KEY", "TEMPORAL_PROFILE", "TEMPORAL_CONFIG_FILE")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (*THEIRS, "AUTOREPAIR_TEMPORAL__ADDRESS", "AUTOREPAIR_TEMPORAL__NAMESPACE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(tmp_path / "absent.toml"))  # never the developer's own


def test_the_temporal_cli_s_variables_fill_what_ours_leave_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPORAL_ADDRESS", "temporal.example:7233")
    monkeypatch.setenv("TEMPORAL_NAMESPACE", "gpu-prod")
    monkeypatch.setenv("TEMPORAL_API_KEY", "their-key")
    temporal = Settings().temporal
    assert (temporal.address, temporal.namespace) == ("temporal.example:7233", "gpu-prod")
    assert temporal.api_key is not None and temporal.api_key.get_secret_value() == "their-key"
    # Ours win where set.
    monkeypatch.setenv("AUTOREPAIR_TEMPORAL__ADDRESS", "ours:7233")
    assert (Settings().temporal.address, Settings().temporal.namespace) == ("ours:7233", "gpu-prod")


def test_a_temporal_toml_profile_is_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "temporal.toml"
    ca = tmp_path / "ca.pem"
    config.write_text(
        '[profile.default]\naddress = "default.example:7233"\n'
        f'[profile.cloud]\naddress = "acct.tmprl.cloud:7233"\nnamespace = "acct.ns"\n'
        f'[profile.cloud.tls]\nserver_ca_cert_path = "{ca}"\n'
    )
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(config))
    assert Settings().temporal.address == "default.example:7233"
    monkeypatch.setenv("TEMPORAL_PROFILE", "cloud")
    temporal = Settings().temporal
    assert (temporal.address, temporal.namespace, temporal.tls, temporal.tls_server_ca) == (
        "acct.tmprl.cloud:7233",
        "acct.ns",
        True,
        ca,
    )


def test_nothing_set_anywhere_is_the_defaults_and_explicit_settings_never_read_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().temporal.address == TemporalSettings().address == "localhost:7233"
    given = TemporalSettings(address="mine:7233", namespace="mine")
    monkeypatch.setenv("TEMPORAL_ADDRESS", "theirs:7233")
    assert given.beneath_environment().address == "mine:7233"


def test_tls_given_as_data_is_refused_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_CERT_DATA", "-----BEGIN CERTIFICATE-----")
    monkeypatch.setenv("TEMPORAL_TLS_CLIENT_KEY_DATA", "-----BEGIN PRIVATE KEY-----")
    with pytest.raises(ValidationError, match="is given as data: give its file path"):
        Settings()


async def test_temporal_address_alone_reaches_the_server(client: Client, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOREPAIR_TEMPORAL__", "TEMPORAL_"))}
    env |= {"TEMPORAL_ADDRESS": client.service_client.config.target_host, "TEMPORAL_NAMESPACE": client.namespace}
    env |= {"TEMPORAL_CONFIG_FILE": str(tmp_path / "absent.toml")}
    code, out, err = await autorepair(env, "history", "--json")
    assert code == 0, err
    assert isinstance(json.loads(out), list)  # the repairs of that server (none), not a failure to connect
    # The flag still wins over the variable: nothing listens there, so it fails to connect (exit 3), naming it.
    code, _, err = await autorepair(env, "history", "--address", "127.0.0.1:1", "--json")
    assert code == 3 and "cannot reach Temporal at 127.0.0.1:1" in err
