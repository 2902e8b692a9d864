"""The Temporal options of every `autorepair` command that talks to Temporal, spelled once: the worker, the ingest, the
probe's --direct-temporal and the operator's commands all take `--address`, `-n/--namespace`, `--api-key` and
`--profile`, as the `temporal` CLI does.

Unset, each falls back to the shared settings (AUTOREPAIR_TEMPORAL__* or the TOML file), then the `temporal` CLI's own
(TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_PROFILE and temporal.toml), TLS included.
`--profile` stands in for TEMPORAL_PROFILE: where the profile sits in that order does not change, only which one is
read."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any, Protocol, Self, TypeVar

from pydantic import SecretStr

from contract.config import TemporalSettings, temporal_profile


class WithTemporal(Protocol):
    """A settings object with a [temporal] section: the worker's, the ingest's (the same) or the probe's."""

    @property
    def temporal(self) -> TemporalSettings: ...

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self: ...


S = TypeVar("S", bound=WithTemporal)


def add_temporal_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address", "--temporal-address", dest="temporal_address", default=None, help="Temporal frontend"
    )
    parser.add_argument("-n", "--namespace", default=None)
    parser.add_argument("--api-key", default=None, help="Temporal Cloud API key")
    parser.add_argument("--profile", default=None, metavar="NAME", help="the profile of temporal.toml to read")


def profile_of(args: argparse.Namespace) -> str | None:
    """The command's --profile; None for a command without one (it reads TEMPORAL_PROFILE's, or `default`)."""
    profile = getattr(args, "profile", None)
    return profile if isinstance(profile, str) else None


def with_temporal_arguments(temporal: TemporalSettings, args: argparse.Namespace) -> TemporalSettings:
    """`temporal` with the command's --address, --namespace, --api-key (and --task-queue, where it has one)."""
    key = getattr(args, "api_key", None)
    overrides = {
        "address": getattr(args, "temporal_address", None),
        "namespace": getattr(args, "namespace", None),
        "api_key": SecretStr(key) if key else None,
        "task_queue": getattr(args, "task_queue", None),
    }
    return temporal.model_copy(update={k: v for k, v in overrides.items() if v})


def load_settings(load: Callable[[], S], args: argparse.Namespace) -> S:
    """`load()` as the command reads its settings: within --profile's profile, with its Temporal options applied."""
    with temporal_profile(profile_of(args)):
        settings = load()
    return settings.model_copy(update={"temporal": with_temporal_arguments(settings.temporal, args)})
