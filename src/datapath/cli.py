"""The ``datapath`` command line.

Each subcommand lives beside the code it drives: a module ``datapath.<pkg>._cli``
(or ``datapath._info``) defines ``register(subparsers)`` adding its parsers, each
with ``set_defaults(func=...)``; ``func(args) -> int`` is the exit code.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# Modules that add subcommands, in the order `datapath --help` lists them.
_COMMAND_MODULES = (
    "datapath._info",
    "datapath.loaders._cli",
    "datapath.offload._cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="datapath",
        description="Fast training when the data does not fit on the GPU.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that subcommand module does not exist (yet)
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
