"""The worker's one typed settings object: environment variables (AUTOREPAIR_...) over an optional TOML file."""

from __future__ import annotations

from datetime import timedelta

from pydantic import Field, field_validator, model_validator

from contract.breaker import FleetBreakerSettings
from contract.config import (
    AwsSettings,
    ConfigSources,
    EventSettings,
    IngestSettings,
    PositiveDuration,
    TemporalSettings,
)
from contract.groups import CapacityGroup
from contract.healthz import DEFAULT_WORKER_HEALTH_BIND, HealthBind
from worker.tuning import WorkerTuning


class Settings(ConfigSources):
    """Everything the worker reads: strict at every depth, an unknown key is an error (contract/config.py)."""

    temporal: TemporalSettings = Field(default_factory=TemporalSettings)
    aws: AwsSettings = Field(default_factory=AwsSettings)
    events: EventSettings = Field(default_factory=EventSettings)
    ingest: IngestSettings = Field(default_factory=IngestSettings)
    groups: list[CapacityGroup] = Field(default_factory=list)
    fleet_breaker: FleetBreakerSettings = Field(default_factory=FleetBreakerSettings)
    # How much the worker takes on at once: the Temporal SDK's Worker options and the AWS calls' threads.
    worker: WorkerTuning = Field(default_factory=WorkerTuning)
    log_format: str = Field(default="auto", pattern="^(auto|json|console)$")
    # Prometheus' /metrics (the SDK's and ours, worker/telemetry.py); unset or "off": none.
    metrics_bind_address: HealthBind = None
    # GET /healthz for the container's health check (worker/health_endpoint.py); "off": none.
    health_bind_address: HealthBind = DEFAULT_WORKER_HEALTH_BIND
    health_gauge_interval: PositiveDuration = Field(
        default=timedelta(seconds=30), description="How often instances by health status are counted"
    )
    repair_running_long: PositiveDuration = Field(
        default=timedelta(hours=2),
        description=(
            "A repair still running this long after it started counts in autorepair_repairs_running_long (the "
            "AutorepairRepairRunningLong alert): longer than its waits should ever take"
        ),
    )
    otlp_endpoint: str | None = None
    graceful_shutdown_timeout: PositiveDuration = Field(
        default=timedelta(seconds=60),
        description=(
            "On SIGTERM or SIGINT the worker stops polling and gives in-flight activities this long to finish before "
            "cancelling them; the orchestrator's stop timeout must be longer"
        ),
    )

    @model_validator(mode="after")
    def _temporal_beneath_the_cli_s(self) -> Settings:
        # Beneath ours, the `temporal` CLI's own settings (TEMPORAL_ADDRESS, ..., temporal.toml): docs §0.
        self.temporal = self.temporal.beneath_environment()
        return self

    @field_validator("groups")
    @classmethod
    def _unique_group_names(cls, groups: list[CapacityGroup]) -> list[CapacityGroup]:
        first: dict[str, int] = {}
        for index, group in enumerate(groups):
            if group.name in first:
                raise ValueError(
                    f"capacity group {group.name!r} is configured twice (groups[{first[group.name]}] and "
                    f"groups[{index}]): give each [[groups]] table its own name, or merge the two"
                )
            first[group.name] = index
        return groups

    def group(self, name: str) -> CapacityGroup:
        for group in self.groups:
            if group.name == name:
                return group
        known = ", ".join(g.name for g in self.groups) or "none"
        raise KeyError(f"unknown capacity group {name!r} (configured: {known})")
