# syntax=docker/dockerfile:1
# gpu-autorepair's ops image: the repair worker (`autorepair worker`, the default), the ingest (`autorepair ingest`)
# and the operator's commands, installed from uv.lock with the `ops` extra only: no test tools, no demo servers.
# Build from the repository root:
#   docker build -f deploy/docker/ops.Dockerfile -t ghcr.io/gpu-autorepair/gpu-autorepair .
# Traces over OTLP (the worker's otlp_endpoint) need the `otlp` extra as well, which brings grpcio: add
# `--extra otlp` to both `uv sync` lines below.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG UV_VERSION=0.13.9
# The same index as pip's; the lock pins every version and hash, uv only fetches them.
RUN pip install --no-cache-dir --disable-pip-version-check "uv==${UV_VERSION}"
ENV UV_PROJECT_ENVIRONMENT=/opt/autorepair \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_NO_CACHE=1
WORKDIR /src
# Dependencies first, in their own layer: a change to the code alone does not download them again. --locked refuses
# a uv.lock that no longer matches pyproject.toml rather than resolving anew.
COPY pyproject.toml uv.lock ./
RUN uv sync --locked --no-dev --no-install-project --extra ops
COPY README.md LICENSE ./
COPY contract/ contract/
COPY workflows/ workflows/
COPY activities/ activities/
COPY worker/ worker/
COPY node_probe/ node_probe/
COPY ingest/ ingest/
COPY operator_cli/ operator_cli/
# The wheel carries every package it declares, the simulator's code too (its servers are the demo extra's, left out).
COPY simulator/ simulator/
RUN uv sync --locked --no-dev --no-editable --extra ops

# The final image: the interpreter and the installed environment, no uv, no sources, no build layers.
FROM ${PYTHON_IMAGE}
COPY --from=build /opt/autorepair /opt/autorepair
ENV PATH=/opt/autorepair/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin autorepair
USER 10001:10001
WORKDIR /
# Prometheus metrics of the worker (metrics_bind_address = "0.0.0.0:9464"); the ingest's port is its own setting.
EXPOSE 9464
# ECS and Kubernetes stop a container with SIGTERM: the worker then stops polling and gives in-flight activities
# graceful_shutdown_timeout to finish.
STOPSIGNAL SIGTERM
ENTRYPOINT ["autorepair"]
CMD ["worker"]
