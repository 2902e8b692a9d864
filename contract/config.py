"""Settings sections every process shares, and where settings come from: AUTOREPAIR_* environment variables (nested
with `__`) over an optional TOML file named by AUTOREPAIR_CONFIG.

The worker's one settings object (worker/settings.py) is made of these sections; the probe and the CLI read the
sections they need from the same sources.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from contract import names

CONFIG_ENV = "AUTOREPAIR_CONFIG"


class TemporalSettings(BaseModel):
    address: str = "localhost:7233"
    namespace: str = "default"
    task_queue: str = names.DEFAULT_TASK_QUEUE
    # Temporal Cloud: an API key, or mTLS with a client certificate and key.
    api_key: SecretStr | None = None
    tls: bool = False
    tls_client_cert: Path | None = None
    tls_client_key: Path | None = None
    tls_server_ca: Path | None = None
    ui_url: str = "http://localhost:8233"

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> TemporalSettings:
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("temporal.tls_client_cert and temporal.tls_client_key must be set together")
        return self


class AwsSettings(BaseModel):
    region: str = "us-east-1"
    # Set for moto (or a VPC endpoint); unset means the real AWS endpoints for the region.
    endpoint_url: str | None = None
    max_attempts: int = Field(default=5, ge=1, description="botocore's own retries, before Temporal's")


class EventSettings(BaseModel):
    bus_name: str = "default"
    source: str = "gpu-autorepair"
    eventbridge: bool = True
    jsonl_path: Path | None = Field(default=None, description="Also append each event to this JSON-lines file")
    # The webhook sink (activities/webhook.py): at-least-once POSTs of each event's JSON line, never blocking a repair.
    webhook_url: str | None = Field(default=None, pattern=r"^https?://", description="Also POST each event here")
    webhook_secret: SecretStr | None = Field(
        default=None, description="Signs each request: X-Autorepair-Signature: sha256=HMAC-SHA256(secret, body)"
    )
    webhook_timeout: timedelta = Field(
        default=timedelta(seconds=2), gt=timedelta(0), description="Per request; publish_event waits at most this"
    )
    webhook_outbox_dir: Path = Field(
        default=Path("/var/lib/autorepair/webhook-outbox"),
        description="Events the webhook has not accepted yet wait here, one file each, and survive restarts",
    )
    webhook_outbox_max_events: int = Field(default=10_000, ge=1, description="When full, the oldest event is dropped")


class ConfigSources(BaseSettings):
    """Environment over the TOML file; subclasses say which sections they read and how strict they are."""

    model_config = SettingsConfigDict(env_prefix="AUTOREPAIR_", env_nested_delimiter="__", extra="forbid")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_path = os.environ.get(CONFIG_ENV)
        if config_path:
            if not Path(config_path).is_file():
                raise FileNotFoundError(f"{CONFIG_ENV}={config_path}: no such file")
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=config_path))
        return tuple(sources)
