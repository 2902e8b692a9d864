"""`autorepair setup`: register the search attributes our workflows and queries use, once per namespace."""

from __future__ import annotations

import argparse

from contract import search_attributes
from operator_cli import exit_codes
from operator_cli.arguments import add_common_arguments
from operator_cli.client import connect_client, temporal_settings
from operator_cli.output import emit


def add_setup_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)


async def run_setup(args: argparse.Namespace) -> int:
    """Register whichever search attributes the namespace lacks, and say which."""
    from worker.setup import ensure_search_attributes

    temporal = temporal_settings(args)
    added = await ensure_search_attributes(await connect_client(temporal))
    document = {
        "namespace": temporal.namespace,
        "added": added,
        "registered": sorted(key.name for key in search_attributes.ALL),
    }

    def text(wide: bool) -> None:
        print(f"search attributes added: {', '.join(added)}" if added else "search attributes already registered")
        if wide:
            print(f"namespace {temporal.namespace}: {', '.join(document['registered'])}")

    emit(args, document, text)
    return exit_codes.OK
