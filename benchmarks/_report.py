"""What the benchmark scripts compute and print from their samples: percentiles,
medians, the rotated order of interleaved repeats, and one PASS/MISS line per target."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(xs: Sequence[float], q: float) -> float:
    """The sample at quantile `q` of `xs` (nearest rank); NaN for no sample.

    Args:
        xs: The samples.
        q: The quantile, in [0, 1].
    """
    if not xs:
        return math.nan
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def med(xs: Sequence[float]) -> float:
    """The median of `xs`; NaN for no sample.

    Args:
        xs: The samples.
    """
    return statistics.median(xs) if xs else math.nan


def rotated(names: Sequence[str], k: int) -> list[str]:
    """`names` started at position `k` (mod its length): repeat `k`'s order, so that
    no system is always the first to run after a pause.

    Args:
        names: The systems, in their usual order.
        k: The repeat's number.
    """
    if not names:
        return []
    k %= len(names)
    return [*names[k:], *names[:k]]


def check(label: str, ok: bool, detail: str) -> bool:
    """Print one target's verdict line (PASS or MISS) and return `ok`.

    Args:
        label: What the target is.
        ok: Whether it was met.
        detail: The measured value, as printed.
    """
    print(f"{'PASS' if ok else 'MISS'}  {label}: {detail}")
    return ok
