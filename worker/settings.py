"""The worker's one typed settings object: environment variables (AUTOREPAIR_...) over an optional TOML file."""

from __future__ import annotations

from datetime import timedelta

from pydantic import Field

from contract.config import AwsSettings, ConfigSources, EventSettings, TemporalSettings
from contract.groups import CapacityGroup


class Settings(ConfigSources):
    """Everything the worker reads: strict, an unknown key is an error."""

    temporal: TemporalSettings = Field(default_factory=TemporalSettings)
    aws: AwsSettings = Field(default_factory=AwsSettings)
    events: EventSettings = Field(default_factory=EventSettings)
    groups: list[CapacityGroup] = Field(default_factory=list)
    log_format: str = Field(default="auto", pattern="^(auto|json|console)$")
    metrics_bind_address: str | None = None
    health_gauge_interval: timedelta = Field(
        default=timedelta(seconds=30), gt=timedelta(0), description="How often instances by health status are counted"
    )
    otlp_endpoint: str | None = None

    def group(self, name: str) -> CapacityGroup:
        for group in self.groups:
            if group.name == name:
                return group
        known = ", ".join(g.name for g in self.groups) or "none"
        raise KeyError(f"unknown capacity group {name!r} (configured: {known})")
