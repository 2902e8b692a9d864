"""Settings sections every process shares, and where settings come from: AUTOREPAIR_* environment variables (nested
with `__`) over an optional TOML file named by AUTOREPAIR_CONFIG, or the same TOML text itself in AUTOREPAIR_CONFIG_TOML
(for a container platform that hands settings over as a variable: an ECS task's SSM parameter or secret).

The worker's one settings object (worker/settings.py) is made of these sections; the probe and the CLI read the
sections they need from the same sources. Reading settings is strict at every depth: an unknown key, a duration that
is not positive or a rule a section states (settings_problems) is an error, and ConfigSources.load() turns any of
them, a missing file and a TOML syntax error into one ConfigError line naming the file (or environment variable),
the key and the fix.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Self, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    SecretStr,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from contract import names
from contract.healthz import DEFAULT_INGEST_METRICS_BIND, HealthBind

CONFIG_ENV = "AUTOREPAIR_CONFIG"
CONFIG_TEXT_ENV = "AUTOREPAIR_CONFIG_TOML"
ENV_PREFIX = "AUTOREPAIR_"

# True while ConfigSources validates: the settings rules below apply only then. A model that is also a wire type
# (CapacityGroup, inside workflow payloads) must still decode a newer version's field or an older version's value.
_reading_settings: ContextVar[bool] = ContextVar("autorepair_reading_settings", default=False)
# The temporal.toml profile a command's --profile names, read in place of TEMPORAL_PROFILE while its settings are.
_temporal_profile: ContextVar[str | None] = ContextVar("autorepair_temporal_profile", default=None)


@contextmanager
def temporal_profile(name: str | None) -> Iterator[None]:
    """Settings read within read the temporal CLI's profile `name` (None: TEMPORAL_PROFILE's, or `default`)."""
    token = _temporal_profile.set(name)
    try:
        yield
    finally:
        _temporal_profile.reset(token)


def duration_problem(value: timedelta) -> str | None:
    """Why a settings duration is not acceptable (None: it is). Zero or negative would fire at once, every time."""
    if value > timedelta(0):
        return None
    return f'must be a positive duration, e.g. "PT30S" (ISO 8601) or 30 (seconds), not {format_seconds(value)}'


def format_seconds(value: timedelta) -> str:
    seconds = value.total_seconds()
    return f"{seconds:g}s"


def _positive(value: timedelta) -> timedelta:
    problem = duration_problem(value)
    if problem:
        raise ValueError(problem)
    return value


# A duration that must be more than zero, always (for a section that never crosses the wire).
PositiveDuration = Annotated[timedelta, AfterValidator(_positive)]


def _settings_error(loc: tuple[str | int, ...], message: str, value: Any) -> InitErrorDetails:
    return {"type": PydanticCustomError("settings_rule", message), "loc": loc, "input": value}


class SettingsSection(BaseModel):
    """A table of the settings. Read as settings (inside ConfigSources), an unknown key, a duration that is not
    positive and every problem settings_problems() names are errors, each at its own key. Built any other way (a
    wire payload, a model_copy) it validates as a plain model, so recorded workflow payloads keep decoding."""

    # An instance handed to the settings (Settings(groups=[CapacityGroup(...)])) is checked there too.
    model_config = ConfigDict(revalidate_instances="always")

    def settings_problems(self) -> list[tuple[str | None, str]]:
        """Rules across fields, checked when read as settings: (the field to blame or None, the problem)."""
        return []

    @model_validator(mode="wrap")
    @classmethod
    def _settings_rules(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        if not _reading_settings.get():
            return handler(data)
        if isinstance(data, dict) and cls.model_config.get("extra") != "forbid":
            unknown = [key for key in data if key not in cls.model_fields]
            if unknown:
                raise ValidationError.from_exception_data(
                    cls.__name__, [{"type": "extra_forbidden", "loc": (str(k),), "input": data[k]} for k in unknown]
                )
        section = handler(data)
        errors: list[InitErrorDetails] = []
        for name in type(section).model_fields:
            value = getattr(section, name)
            if isinstance(value, timedelta) and (problem := duration_problem(value)):
                errors.append(_settings_error((name,), problem, value))
        if not errors:
            for field, problem in section.settings_problems():
                loc: tuple[str | int, ...] = (field,) if field else ()
                errors.append(_settings_error(loc, problem, getattr(section, field) if field else data))
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        return section


class TemporalSettings(SettingsSection):
    model_config = ConfigDict(extra="forbid")

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

    def beneath_environment(self, profile: str | None = None) -> TemporalSettings:
        """These settings over the `temporal` CLI's own: what was not set here (AUTOREPAIR_TEMPORAL__*, the TOML file,
        a flag) comes from TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS* and the profile of
        temporal.toml (TEMPORAL_PROFILE, or `profile`), as temporalio.envconfig reads them; then the defaults."""
        # Here, not at the top: the probe's install reads these settings and has no Temporal SDK.
        from temporalio.envconfig import ClientConfigProfile

        try:
            theirs = ClientConfigProfile.load(profile=profile or _temporal_profile.get())
        except Exception as err:  # a malformed temporal.toml, an unknown profile: said, never a stack trace
            raise ValueError(f"the temporal CLI's configuration (temporal.toml, TEMPORAL_*): {err}") from err
        found: dict[str, Any] = {
            "address": theirs.address,
            "namespace": theirs.namespace,
            "api_key": theirs.api_key,
        }
        tls = theirs.tls
        if tls is not None:
            found["tls"] = not tls.disabled
            for ours, source in (
                ("tls_client_cert", tls.client_cert),
                ("tls_client_key", tls.client_private_key),
                ("tls_server_ca", tls.server_root_ca_cert),
            ):
                if source is not None and not isinstance(source, Path):
                    raise ValueError(
                        f"the temporal CLI's TLS {ours.removeprefix('tls_')} is given as data: give its file path "
                        "(TEMPORAL_TLS_CLIENT_CERT_PATH, ..._KEY_PATH, ..._SERVER_CA_CERT_PATH, or a profile's *_path)"
                    )
                found[ours] = source
        unset = {k: v for k, v in found.items() if v is not None and k not in self.model_fields_set}
        # Validated like any setting; every field then counts as set, so that nothing reads the environment twice (a
        # flag still wins: the commands apply theirs over these).
        return self.model_validate(self.model_dump() | unset) if unset else self

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> TemporalSettings:
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("temporal.tls_client_cert and temporal.tls_client_key must be set together")
        return self


# Threads for AWS calls when the caller does not say: the Temporal SDK's default max_concurrent_activities. Here, not
# in activities/aws.py, so that reading the settings (every CLI command does) does not import boto3.
DEFAULT_CALL_THREADS = 100


class AwsSettings(SettingsSection):
    model_config = ConfigDict(extra="forbid")

    region: str = "us-east-1"
    # Set for moto (or a VPC endpoint); unset means the real AWS endpoints for the region.
    endpoint_url: str | None = None
    max_attempts: int = Field(default=5, ge=1, description="botocore's own retries, before Temporal's")
    max_concurrent_calls_per_api: int = Field(
        default=16,
        ge=1,
        description="Calls to one AWS API (service:Operation) this process has in flight at once; more wait their turn",
    )


class EventSettings(SettingsSection):
    model_config = ConfigDict(extra="forbid")

    bus_name: str = "default"
    source: str = "gpu-autorepair"
    eventbridge: bool = True
    jsonl_path: Path | None = Field(default=None, description="Also append each event to this JSON-lines file")
    # The webhook sink (activities/webhook.py): at-least-once POSTs of each event's JSON line, never blocking a repair.
    webhook_url: str | None = Field(default=None, pattern=r"^https?://", description="Also POST each event here")
    webhook_secret: SecretStr | None = Field(
        default=None, description="Signs each request: X-Autorepair-Signature: sha256=HMAC-SHA256(secret, body)"
    )
    webhook_timeout: PositiveDuration = Field(
        default=timedelta(seconds=2), description="Per request; publish_event waits at most this"
    )
    # Every sink fails open: publish_event tries each once, and what a sink refuses waits in that sink's event outbox,
    # a Temporal workflow (workflows/event_outbox.py), so an outage never holds up a repair and no worker keeps it.
    outbox_max_events: int = Field(
        default=1_000,
        ge=1,
        le=10_000,
        description="Events each sink's outbox keeps waiting; when full, the oldest is dead-lettered",
    )
    sink_timeout: PositiveDuration = Field(
        default=timedelta(seconds=2),
        description="publish_event's one try at EventBridge and at the JSON-lines file (the webhook has its own)",
    )
    outbox_deadline: PositiveDuration = Field(
        default=timedelta(hours=24),
        description="How long an event waiting in an outbox is retried before it is dead-lettered",
    )


class IngestSettings(SettingsSection):
    """`autorepair ingest`: the HTTP service GPU hosts report to (contract/ingest.py has its protocol)."""

    # Signed into every proof: a proof made for another ingest (another id) is refused here.
    id: str = Field(default="gpu-autorepair-ingest", min_length=1, max_length=128)
    bind: str = "127.0.0.1:8480"
    # Prometheus' GET /metrics, and a /healthz, in plain HTTP on a port of their own (never on `bind`, which the
    # hosts reach); "off": none.
    metrics_bind: HealthBind = DEFAULT_INGEST_METRICS_BIND
    # HTTPS with this certificate and key; plain HTTP is allowed only on a loopback bind (the demo, the tests), or
    # behind a load balancer that terminates TLS (`tls_terminated_by_load_balancer`).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_terminated_by_load_balancer: bool = Field(
        default=False,
        description=(
            "Serve plain HTTP on a non-loopback bind because a load balancer in front terminates TLS (an AWS ALB "
            "with an ACM certificate); only its security group may reach this port"
        ),
    )
    # Where the ingest sends the hosts' signed GetCallerIdentity: the regional STS endpoint (moto in the demo).
    # The signed Host header must name this endpoint's host.
    sts_endpoint: str = "https://sts.us-east-1.amazonaws.com"
    # Only callers in these accounts and, when set, under these role ARNs (arn:aws:iam::ACCOUNT:role/NAME) pass.
    allowed_accounts: list[str] = Field(default_factory=list, max_length=100)
    allowed_role_arns: list[str] = Field(default_factory=list, max_length=100)
    # Reports per instance and in total, per second (token buckets); over it: 429 with Retry-After.
    instance_rate: float = Field(default=5.0, gt=0)
    instance_burst: int = Field(default=20, ge=1)
    total_rate: float = Field(default=2000.0, gt=0)
    total_burst: int = Field(default=4000, ge=1)
    # How long an instance's group membership (tag or ECS cluster) is believed before it is looked up again; the old
    # answer is given for up to this long again while it is (ingest/membership.py).
    membership_ttl: timedelta = timedelta(minutes=5)
    # After a report proven through STS the host gets a session token for its instance, good this long (at most an
    # hour), so that its next reports cost no STS call (ingest/sessions.py). Replicas share `session_secret` to
    # accept each other's tokens; without it each makes its own at start.
    session_ttl: timedelta = Field(default=timedelta(minutes=15), le=timedelta(hours=1))
    session_secret: SecretStr | None = None

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> IngestSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("ingest.tls_cert and ingest.tls_key must be set together")
        if self.tls_cert is not None and self.tls_terminated_by_load_balancer:
            raise ValueError(
                "ingest.tls_cert and ingest.tls_terminated_by_load_balancer are both set: TLS ends at the ingest or "
                "at the load balancer, not both"
            )
        return self


class ConfigError(Exception):
    """Settings that cannot be read, as one line: where (the file or an environment variable), the key, the problem
    and, where known, the fix. Callers print it and exit with status 2."""


class ConfigSources(BaseSettings):
    """Environment over the TOML file; subclasses say which sections they read and how strict they are at the top
    level (every section below is strict: SettingsSection)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid")

    def __init__(self, **values: Any) -> None:
        with _settings_rules():
            super().__init__(**values)

    @classmethod
    def load(cls) -> Self:
        """The settings from the environment and the file, or a ConfigError naming what to fix."""
        try:
            return cls()
        except ValidationError as err:
            raise ConfigError(describe_validation_error(err, cls)) from None

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
        config_text = os.environ.get(CONFIG_TEXT_ENV)
        if config_path and config_text:
            raise ConfigError(f"{CONFIG_ENV} and {CONFIG_TEXT_ENV} are both set: keep one (a file, or its text)")
        if config_path:
            sources.append(_toml_source(settings_cls, Path(config_path)))
        elif config_text:
            sources.append(_toml_text_source(settings_cls, config_text))
        return tuple(sources)


@contextmanager
def _settings_rules() -> Iterator[None]:
    token = _reading_settings.set(True)
    try:
        yield
    finally:
        _reading_settings.reset(token)


def _toml_source(settings_cls: type[BaseSettings], path: Path) -> TomlConfigSettingsSource:
    if not path.exists():
        raise ConfigError(
            f"{path}: no such file ({CONFIG_ENV} names it: point it at the TOML settings file, or unset it to use "
            "the defaults and AUTOREPAIR_* environment variables only)"
        )
    if not path.is_file():
        raise ConfigError(f"{path}: not a file ({CONFIG_ENV} must name the TOML settings file)")
    try:
        return TomlConfigSettingsSource(settings_cls, toml_file=path)
    except tomllib.TOMLDecodeError as err:
        key = _toml_key_at(path, str(err))
        raise ConfigError(f"{path}: {key + ': ' if key else ''}not valid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}): save it as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it: {err.strerror or err}") from None


class _TomlText(PydanticBaseSettingsSource):
    """The TOML settings handed over as text (CONFIG_TEXT_ENV) rather than as a file."""

    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def _toml_text_source(settings_cls: type[BaseSettings], text: str) -> PydanticBaseSettingsSource:
    try:
        return _TomlText(settings_cls, tomllib.loads(text))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"environment variable {CONFIG_TEXT_ENV}: not valid TOML: {err}") from None


def _toml_key_at(path: Path, message: str) -> str | None:
    """The dotted key on the line a TOML syntax error points at (groups[1].auto_repair), where one can be seen."""
    found = re.search(r"at line (\d+)", message)
    if not found:
        return None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    number = int(found.group(1))
    table, arrays = "", dict[str, int]()
    for line in lines[: number - 1]:
        if header := re.match(r"\s*\[\[\s*([\w.\-]+)\s*\]\]", line):
            name = header.group(1)
            arrays[name] = arrays.get(name, -1) + 1
            table = f"{name}[{arrays[name]}]"
        elif header := re.match(r"\s*\[\s*([\w.\-]+)\s*\]", line):
            table = header.group(1)
    key = re.match(r"\s*([\w.\-]+)\s*=", lines[number - 1]) if number <= len(lines) else None
    if key is None:
        return table or None
    return f"{table}.{key.group(1)}" if table else key.group(1)


# --- one line for a ValidationError --------------------------------------------------------------------------------


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models an annotation holds: X, X | None, list[X], dict[str, X], Annotated[X, ...]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def _annotations_at(settings_cls: type[BaseModel], loc: tuple[str | int, ...]) -> tuple[list[str], list[Any]]:
    """The keys the table at loc[:-1] knows, and the annotations loc's last key may have."""
    models: list[type[BaseModel]] = [settings_cls]
    for part in loc[:-1]:
        if isinstance(part, str):
            models = [
                inner for m in models if part in m.model_fields for inner in _models_in(m.model_fields[part].annotation)
            ]
    known = [name for model in models for name in model.model_fields]
    last = loc[-1] if loc else None
    annotations = [m.model_fields[last].annotation for m in models if isinstance(last, str) and last in m.model_fields]
    return known, annotations


def dotted_key(loc: tuple[str | int, ...]) -> str:
    """('groups', 1, 'auto_repiar') -> groups[1].auto_repiar"""
    key = ""
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key


def _source_of(loc: tuple[str | int, ...]) -> str:
    """Where the value at loc came from: the environment variable that sets it (or a table above it), else the file."""
    keys = []
    for part in loc:
        if not isinstance(part, str):
            break
        keys.append(part.upper())
    for end in range(len(keys), 0, -1):
        name = ENV_PREFIX + "__".join(keys[:end])
        if name in os.environ:
            return f"environment variable {name}"
    if os.environ.get(CONFIG_TEXT_ENV):
        return f"environment variable {CONFIG_TEXT_ENV}"
    return os.environ.get(CONFIG_ENV) or "settings"


def _problem(error: Any, settings_cls: type[BaseModel]) -> str:
    loc = tuple(error["loc"])
    known, annotations = _annotations_at(settings_cls, loc)
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        if close:
            return f"unknown key: did you mean {close[0]}?"
        return f"unknown key: remove it (known here: {', '.join(known)})" if known else "unknown key: remove it"
    message = str(error["msg"]).removeprefix("Value error, ")
    secret = any(SecretStr in (annotation, *get_args(annotation)) for annotation in annotations)
    value = error.get("input")
    if error["type"] not in ("settings_rule", "value_error", "missing") and not secret and not isinstance(value, dict):
        shown = repr(value)
        message += f" (got {shown if len(shown) <= 60 else shown[:57] + '...'})"
    return message


def describe_validation_error(err: ValidationError, settings_cls: type[BaseModel]) -> str:
    """One line: the source, the dotted key and the problem of the first error, and how many more there are."""
    errors = err.errors()
    first = errors[0]
    loc = tuple(first["loc"])
    key = dotted_key(loc)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    where = f"{_source_of(loc)}: {key}" if key else _source_of(loc)
    return f"{where}: {_problem(first, settings_cls)}{more}"
