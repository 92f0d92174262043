"""Shared timing helper for the benchmark scripts: medians of interleaved repeats.

Every benchmark compares systems *in the same run*, so that a slow machine, a busy
neighbour or thermal throttling moves all of them together and the printed ratios
stay meaningful even when absolute times do not. :func:`measure` does that by
interleaving: each repeat runs every case once (in a rotated order, so that no case
is always first after a pause), and the statistic reported per case is the median
over repeats. Ratios come from the same samples (:func:`speedup`).

Absolute times printed by the scripts are for orientation only; nothing asserts on
them.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Timing", "fmt_time", "measure", "print_table", "report_target", "speedup"]


@dataclass(frozen=True)
class Timing:
    """Per-call seconds of one case: one sample per repeat."""

    name: str
    samples: tuple[float, ...]
    number: int  # calls per sample

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def iqr(self) -> tuple[float, float]:
        """(first quartile, third quartile) of the samples."""
        q = statistics.quantiles(self.samples, n=4) if len(self.samples) > 1 else [self.median] * 3
        return q[0], q[2]


def _calibrate(fn: Callable[[], Any], min_time: float, max_number: int = 10_000) -> int:
    """Calls per sample so that one sample takes at least ``min_time`` seconds."""
    number = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time or number >= max_number:
            return number
        # Aim a little above min_time; at most x10 per step.
        number = min(
            max_number,
            max(number + 1, int(number * min(10.0, 1.2 * min_time / max(elapsed, 1e-9)))),
        )


def measure(
    cases: Mapping[str, Callable[[], Any]],
    *,
    repeats: int = 15,
    min_time: float = 0.01,
    warmup: int = 2,
) -> dict[str, Timing]:
    """Time every case, interleaved, and return per-call :class:`Timing` by name.

    Each case is warmed up ``warmup`` times, then calibrated to a number of calls per
    sample of at least ``min_time`` seconds. Each of ``repeats`` rounds then takes one
    sample of every case, in an order rotated by one per round. The garbage collector
    is paused inside a sample (as :mod:`timeit` does) and run between rounds.
    """
    names = list(cases)
    for name in names:
        for _ in range(warmup):
            cases[name]()
    numbers = {name: _calibrate(cases[name], min_time) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(repeats):
            gc.collect()
            gc.disable()
            k = r % len(names)
            for name in names[k:] + names[:k]:
                fn, number = cases[name], numbers[name]
                t0 = time.perf_counter()
                for _ in range(number):
                    fn()
                samples[name].append((time.perf_counter() - t0) / number)
            if gc_was_enabled:
                gc.enable()
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: Timing(name, tuple(samples[name]), numbers[name]) for name in names}


def speedup(slow: Timing, fast: Timing) -> tuple[float, float, float]:
    """How many times faster ``fast`` is than ``slow``.

    Returns ``(ratio of medians, q1, q3)`` where q1/q3 are the quartiles of the
    per-round ratios (rounds are interleaved, so a round's two samples saw the same
    machine state): a quick read of how much the ratio itself is noise.
    """
    ratio = slow.median / fast.median
    paired = [s / f for s, f in zip(slow.samples, fast.samples, strict=True)]
    if len(paired) > 1:
        q = statistics.quantiles(paired, n=4)
        return ratio, q[0], q[2]
    return ratio, ratio, ratio


def fmt_time(seconds: float) -> str:
    """Seconds as a short human string (ns, us, ms or s)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:7.1f} {unit}"
    return f"{seconds / 1e-9:7.1f} ns"


def print_table(title: str, timings: Mapping[str, Timing], baseline: str | None = None) -> None:
    """Print one row per case: median, IQR, and (with ``baseline``) speedup over it."""
    width = max(len(n) for n in timings)
    print(f"\n## {title}")
    header = f"{'system':<{width}}  {'median':>10}  {'IQR':>21}"
    if baseline is not None:
        header += f"  speedup vs {baseline}"
    print(header)
    for name, t in timings.items():
        q1, q3 = t.iqr
        iqr = f"{fmt_time(q1).strip()} - {fmt_time(q3).strip()}"
        row = f"{name:<{width}}  {fmt_time(t.median):>10}  {iqr:>21}"
        if baseline is not None:
            row += f"  {timings[baseline].median / t.median:>8.2f}x"
        print(row)


def report_target(
    label: str,
    ratio: float,
    q: tuple[float, float],
    *,
    goal: float,
    band: float = 0.0,
    strict: bool = False,
) -> bool:
    """Print a PASS/MISS line for ``ratio`` against ``goal`` and return whether it passed.

    ``band`` forgives that much noise (``ratio >= goal * (1 - band)``); ``strict``
    asks for ``ratio > goal`` ("faster", not "as fast"). ``q`` is the per-round IQR.
    """
    if strict:
        ok, need = ratio > goal, f"> {goal:g}x"
    else:
        ok = ratio >= goal * (1.0 - band)
        need = f">= {goal:g}x" + (f" (noise band {band:.0%})" if band else "")
    print(
        f"{'PASS' if ok else 'MISS'}  {label}: {ratio:.2f}x "
        f"(per-round IQR {q[0]:.2f}-{q[1]:.2f}), target {need}"
    )
    return ok
