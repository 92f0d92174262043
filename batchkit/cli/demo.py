"""``batchkit demo``: the main job, a built-in encoder served one at a time and batched."""

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
        help="serve a built-in CPU encoder one at a time and batched; print the speed-up",
        description=(
            "Serve a burst of concurrent requests to a small built-in encoder, one at a "
            "time and through @batched (the same warm-up for both, then timed rounds in "
            "alternating order), check the results are equal within a tolerance, and "
            "print throughput, p50/p99 latency, mean batch size, speed-up and why "
            "batches left. Uses torch's encoder when torch is installed, else a numpy "
            "one (nothing beyond the core install is needed)."
        ),
    )
    p.add_argument(
        "--requests", type=positive_int, default=1024, help="requests per round (default 1024)"
    )
    p.add_argument(
        "--callers", type=positive_int, default=64, help="concurrent caller threads (default 64)"
    )
    p.add_argument(
        "--rounds", type=positive_int, default=3,
        help="timed rounds per server, in alternating order (default 3)",
    )  # fmt: skip
    p.add_argument(
        "--model", choices=["auto", "numpy", "torch"], default="auto",
        help="the built-in encoder: torch's, numpy's, or auto (torch when installed)",
    )  # fmt: skip
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
        0; 1 if batched results differ from one-at-a-time results; 2 if
        ``--model torch`` is asked for without torch installed.
    """
    from batchkit.tools import demo

    return demo.main(
        args.requests, args.callers, rounds=args.rounds, backend=args.model, progress=args.progress
    )
