# syntax=docker/dockerfile:1
# gpu-autorepair's probe image: the node probe on each GPU host (`autorepair probe`, `probe-report`, `classify`),
# installed from uv.lock with the `probe` extra only: no Temporal SDK, no grpcio, a few tens of MiB on a host that
# needs its memory during an Xid storm.
# Build from the repository root:
#   docker build -f deploy/docker/probe.Dockerfile -t ghcr.io/gpu-autorepair/gpu-autorepair-probe .
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
# Dependencies first, in their own layer; --locked refuses a uv.lock that no longer matches pyproject.toml.
COPY pyproject.toml uv.lock ./
RUN uv sync --locked --no-dev --no-install-project --extra probe
COPY README.md LICENSE ./
COPY contract/ contract/
COPY workflows/ workflows/
COPY activities/ activities/
COPY worker/ worker/
COPY node_probe/ node_probe/
COPY ingest/ ingest/
COPY operator_cli/ operator_cli/
# Every package the wheel declares is copied so that it builds; the probe imports only node_probe, contract and the
# command's own (operator_cli/main.py sets each command up lazily), and the rest lack their extras' dependencies.
COPY simulator/ simulator/
RUN uv sync --locked --no-dev --no-editable --extra probe

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/autorepair /opt/autorepair
ENV PATH=/opt/autorepair/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin autorepair
# Unprivileged by default. Reading /dev/kmsg takes more: the ECS task definition runs the probe as root with every
# capability dropped but SYSLOG (deploy/ecs/gpu-autorepair.yaml).
USER 10001:10001
WORKDIR /
STOPSIGNAL SIGTERM
ENTRYPOINT ["autorepair"]
# The orchestrator gives the arguments (the group, where findings go, the sources); without them the probe names the
# one missing and exits 2.
CMD ["probe"]
