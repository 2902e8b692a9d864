"""`autorepair completion bash|zsh|tcsh`: the shell's completion script for every command, its subcommands and their
flags, written by shtab from the command's own parser (README.md, "Shell completion")."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import shtab

from operator_cli.exit_codes import OK

SHELLS = ("bash", "zsh", "tcsh")


def add_completion_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shell", choices=SHELLS, help="the shell the script is for")


def completion_runner(
    whole_parser: Callable[[], argparse.ArgumentParser],
) -> Callable[[argparse.Namespace], int]:
    """The command's run, given how to build `autorepair`'s parser with every command's arguments (they are
    otherwise added only to the command parsed)."""

    def run(args: argparse.Namespace) -> int:
        sys.stdout.write(shtab.complete(whole_parser(), shell=args.shell))
        return OK

    return run
