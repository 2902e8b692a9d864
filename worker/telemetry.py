"""OpenTelemetry traces and Prometheus metrics for the worker, both off unless configured."""

from __future__ import annotations

from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from activities.metrics import HISTOGRAM_BUCKETS
from contract.config import ConfigError
from worker.settings import Settings


def runtime(settings: Settings) -> Runtime | None:
    """Temporal's runtime metrics (workflow/activity latencies, task slots, ...) on a Prometheus endpoint, and ours
    (activities/metrics.py), which the activities record through Temporal's metric meter onto the same endpoint."""
    if not settings.metrics_bind_address:
        return None
    return Runtime(
        telemetry=TelemetryConfig(
            metrics=PrometheusConfig(
                bind_address=settings.metrics_bind_address,
                # Counters end in _total, as the ingest's and the probe's do (and OpenMetrics says): one naming
                # scheme across the components. Temporal's own counters are renamed with ours.
                counters_total_suffix=True,
                histogram_bucket_overrides=HISTOGRAM_BUCKETS,
            )
        )
    )


def tracing_interceptors(settings: Settings) -> list[TracingInterceptor]:
    """One trace per workflow, spans per activity, exported over OTLP/gRPC when an endpoint is configured."""
    if not settings.otlp_endpoint:
        return []
    try:
        # Its own extra: it brings grpcio, which a worker that exports no traces should not carry.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as err:
        raise ConfigError(
            f"otlp_endpoint = {settings.otlp_endpoint!r} needs the OTLP exporter, which cannot be imported here "
            f"({err}): pip install 'gpu-autorepair[otlp]', or leave otlp_endpoint unset"
        ) from err
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "gpu-autorepair-worker"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    trace.set_tracer_provider(provider)
    return [TracingInterceptor()]
