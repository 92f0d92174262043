"""Command-line pieces the comparison scripts share."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def chosen_systems(
    parser: argparse.ArgumentParser, spec: str, known: Sequence[str]
) -> tuple[str, ...]:
    """The rows a comma-separated `--systems` value names, in the script's own order.

    Args:
        parser: The script's parser (an unknown name is its usage error).
        spec: The option's value, e.g. ``"batchkit,minimal"``.
        known: Every row the script can run, in its order.
    """
    chosen = set(spec.split(","))
    unknown = chosen - set(known)
    if unknown:
        parser.error(f"unknown systems: {sorted(unknown)} (choose from {', '.join(known)})")
    return tuple(s for s in known if s in chosen)
