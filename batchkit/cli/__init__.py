"""The ``batchkit`` command: ``demo``, ``profile``, ``simulate`` and ``memory``.

Each command lives in its own module with ``add_parser`` and ``run``; ``main``
parses, dispatches, and turns every expected failure (a bad argument, an
unreadable file, a missing optional dependency, too little memory) into one line on
stderr and exit status 2, never a traceback. A reader that goes away (``| head``) ends
the command quietly with status 141, as SIGPIPE would in a C tool.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from batchkit.cli import demo, memory, profile, simulate
from batchkit.cli._args import CliError

COMMANDS = (demo, profile, simulate, memory)


def build_parser() -> argparse.ArgumentParser:
    """The parser for every command."""
    parser = argparse.ArgumentParser(
        prog="batchkit",
        description="Plan, measure and demonstrate batched inference.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.add_parser(commands)
    for command in commands.choices.values():
        # Each command keeps its own parser, so that an unknown option is reported with
        # the command's usage (see main), not the top level's.
        command.set_defaults(parser=command)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("batchkit-ml")  # the distribution's name (the module is batchkit)
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``batchkit`` command line.

    Args:
        argv: The arguments after the program name; ``None``: ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 for a bad argument or input (one line on
        stderr), 130 when interrupted, 141 when stdout's reader went away, or the
        command's own status.
    """
    parser = build_parser()
    try:
        # parse_args would let the top-level parser report a command's unknown options,
        # under its own usage; the command's parser says which options it takes.
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # argparse already printed usage and the error (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    prog = f"batchkit {args.command}"
    try:
        status: int = args.run(args)
        sys.stdout.flush()  # a closed pipe surfaces here, not at interpreter exit
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as SIGPIPE would
        _silence_stdout()
        return 141
    except (CliError, ValueError, ImportError, OSError, OverflowError) as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except MemoryError as exc:
        print(f"{prog}: error: not enough memory for this run: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return status


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file (captured, replaced): nothing to flush
        pass


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text


__all__ = ["CliError", "build_parser", "main"]
