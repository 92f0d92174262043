"""How much slower the same Python runs right after a thread wakes from a sleep.

A batcher's worker runs its bookkeeping (settle the finished batch, take the next,
wake the callers) right after the model call returns, i.e. after 5-50 ms of sleeping
in the accelerator call. On a VM whose vCPU idles meanwhile, caches and predictors
are cold then; this prints the ratio for one fixed piece of work (copying and scanning
32 results, as settling a batch does) after sleeps of several lengths, against the
same work repeated at once (warm), each pair back to back. A ratio well above 1 at
10 ms explains why the worker's between-batch bookkeeping costs several times what a
micro-benchmark says.

Usage::

    python benchmarks/cold_cpu.py     # ~5 s
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from typing import Any


def settle_like(results: list[Any]) -> int:
    """Copy 32 results and scan them for exceptions (the shape of BatchRun.succeeded)."""
    chunk = list(results)
    failed = any(map(isinstance, chunk, itertools.repeat(BaseException)))
    return len([x for x in chunk if x is not None]) + failed


def _timed(results: list[Any]) -> float:
    t0 = time.perf_counter()
    for _ in range(3):
        settle_like(results)
    return (time.perf_counter() - t0) * 1e6


def cold_and_warm_us(sleep_s: float, repeats: int = 300) -> tuple[float, float, float]:
    """Medians of (the work right after a sleep, the same work again at once, their
    ratio): each pair is measured back to back, so the machine's drift cancels."""
    results: list[Any] = list(range(32))
    cold, warm, ratio = [], [], []
    for _ in range(repeats):
        time.sleep(sleep_s)
        c = _timed(results)
        w = _timed(results)
        cold.append(c)
        warm.append(w)
        ratio.append(c / w)
    return statistics.median(cold), statistics.median(warm), statistics.median(ratio)


def main() -> int:
    for sleep_s in (0.0001, 0.001, 0.01):
        cold, warm, ratio = cold_and_warm_us(sleep_s)
        print(
            f"after a {sleep_s * 1e3:g} ms sleep: {cold:.1f} us, then again at once "
            f"{warm:.1f} us: {ratio:.2f}x (median of paired ratios)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
