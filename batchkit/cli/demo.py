"""``batchkit demo``: the main job, a built-in encoder served unbatched and batched."""

from __future__ import annotations

import argparse
from typing import Any

from batchkit.cli._args import positive_int


def add_parser(commands: Any) -> None:
    """Register the command.

    Args:
        commands: The ``add_subparsers()`` object of the ``batchkit`` parser.
    """
    p: argparse.ArgumentParser = commands.add_parser(
        "demo",
        help="serve a built-in CPU encoder unbatched and batched; print the speed-up",
        description=(
            "Serve a burst of concurrent requests to a small built-in transformer encoder, "
            "one at a time and then through @batched, check the results are equal, and "
            "print throughput, p50/p99 latency, mean batch size and speed-up. Needs torch."
        ),
    )
    p.add_argument("--requests", type=positive_int, default=1024, help="requests (default 1024)")
    p.add_argument(
        "--callers", type=positive_int, default=64, help="concurrent caller threads (default 64)"
    )
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="show a progress bar (default: when stderr is a terminal)")  # fmt: skip
    bar.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo.

    Args:
        args: The parsed command line.

    Returns:
        0, or 1 if batched results differ from one-at-a-time results.
    """
    from batchkit.tools import demo

    return demo.main(args.requests, args.callers, progress=args.progress)
