"""The ``datapath`` command line: a thin dispatcher.

Each subcommand lives beside the code it drives: a module listed in `COMMAND_MODULES`
defines ``register(subparsers)`` adding its parsers, each with ``set_defaults(func=...)``;
``func(args) -> int`` is the exit code.

A user error (a bad argument, a missing file, a dataset that does not parse: any
`datapath.errors.DatapathError`, ``ValueError`` or ``OSError``) prints one line,
``datapath <command>: error: <what to do>``, and exits with 2 (1 for other failures of
the work itself); ``--verbose`` adds the traceback.  Ctrl-C exits with 130; SIGTERM, in a
command that writes files (``prepare-dataset``), removes what it was writing and exits with 143.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from datapath._runtime.errors import DatapathError
from datapath._runtime.interrupts import Terminated

# Modules that add subcommands, in the order `datapath --help` lists them.
COMMAND_MODULES = (
    "datapath.apps.info",
    "datapath.apps.cli",
    "datapath.analysis.cli",
)

USER_ERRORS: tuple[type[BaseException], ...] = (DatapathError, ValueError, OSError)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="datapath", description="Fast training when the data does not fit on the GPU.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging; tracebacks on errors")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that subcommand module does not exist (yet)
                continue
            raise
        mod.register(sub)
    return parser


def _version() -> str:
    import torch  # noqa: PLC0415

    from datapath import __version__  # noqa: PLC0415

    return f"datapath {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"


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
    prog = f"datapath {args.command}"
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Terminated:  # SIGTERM inside a command that cleans up after it (`terminate_raises`)
        print(f"{prog}: terminated (SIGTERM); nothing was left behind", file=sys.stderr)
        return Terminated.exit_code
    except USER_ERRORS as exc:
        if args.verbose:
            traceback.print_exc()
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, OSError) and exc.filename and str(exc.filename) not in message:
            message = f"{message}: {exc.filename}"
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2 if not isinstance(exc, DatapathError) or _is_usage(exc) else 1


def _is_usage(exc: DatapathError) -> bool:
    """True for errors in what the user asked (bad input), False for failures while doing it."""
    return isinstance(exc, ValueError)


if __name__ == "__main__":
    sys.exit(main())
