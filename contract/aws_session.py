"""The one way every part makes its boto3 session: a session of its own, over service models read once a process.

A session of its own because boto3's default session is module-global and not safe to share across threads. Each
new session would read the service models again (EC2's is megabytes of JSON): a worker's clients took 0.45 s of CPU
to build, 0.10 s through the shared loader, and every event-bus client, ingest and simulated fleet in the process
paid it again. The models and endpoint data never change while it runs, so every session reads them through one
loader."""

from __future__ import annotations

import functools
import os

import boto3
import botocore.session
from botocore.loaders import Loader


class _SearchPaths(list[str]):
    """boto3 adds its own data folder to the loader of every session it makes: kept once, not once per session."""

    def append(self, path: str) -> None:
        if path not in self:
            super().append(path)


@functools.cache
def service_models() -> Loader:
    """The loader every session reads its service models and endpoint data through."""
    # As botocore's own loader: AWS_DATA_PATH first, then ~/.aws/models and botocore's data.
    extra = os.environ.get("AWS_DATA_PATH")
    paths = [os.path.expanduser(os.path.expandvars(p)) for p in extra.split(os.pathsep)] if extra else []
    return Loader(extra_search_paths=_SearchPaths(paths))


def new_session(region: str | None) -> boto3.session.Session:
    core = botocore.session.Session()
    core.register_component("data_loader", service_models())
    return boto3.session.Session(botocore_session=core, region_name=region)
