"""Connecting to Temporal: the dev server, a self-hosted cluster, or Temporal Cloud (API key or mTLS)."""

from __future__ import annotations

from collections.abc import Sequence

from temporalio.client import Client, Interceptor, TLSConfig
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import Runtime

from contract.config import TemporalSettings


def tls_config(settings: TemporalSettings) -> TLSConfig | bool:
    if settings.tls_client_cert is None and settings.tls_server_ca is None:
        # Temporal Cloud with an API key needs TLS without client certificates.
        return settings.tls or settings.api_key is not None
    return TLSConfig(
        client_cert=settings.tls_client_cert.read_bytes() if settings.tls_client_cert else None,
        client_private_key=settings.tls_client_key.read_bytes() if settings.tls_client_key else None,
        server_root_ca_cert=settings.tls_server_ca.read_bytes() if settings.tls_server_ca else None,
    )


async def connect(
    settings: TemporalSettings,
    runtime: Runtime | None = None,
    lazy: bool = False,
    interceptors: Sequence[Interceptor] = (),
) -> Client:
    return await Client.connect(
        settings.address,
        namespace=settings.namespace,
        api_key=settings.api_key.get_secret_value() if settings.api_key else None,
        tls=tls_config(settings),
        data_converter=pydantic_data_converter,
        runtime=runtime,
        lazy=lazy,
        interceptors=interceptors,
    )
