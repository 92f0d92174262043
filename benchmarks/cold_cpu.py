"""How much slower the same Python runs right after a thread wakes from a sleep.

A batcher's worker runs its bookkeeping (settle the finished batch, take the next,
wake the callers) right after the model call returns, i.e. after 5-50 ms of sleeping
in the accelerator call. On a VM whose vCPU idles meanwhile, caches and predictors
are cold then; this prints the ratio for one fixed piece of work (copying and scanning
32 results, as settling a batch does) after sleeps of several lengths, against the
same work in a tight loop. A ratio well above 1 at 10 ms explains why the worker's
between-batch bookkeeping costs several times what a micro-benchmark says.

Usage::

    python benchmarks/cold_cpu.py     # ~10 s
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


def median_us(sleep_s: float, repeats: int = 200) -> float:
    results: list[Any] = list(range(32))
    samples = []
    for _ in range(repeats):
        if sleep_s:
            time.sleep(sleep_s)
        t0 = time.perf_counter()
        for _ in range(3):
            settle_like(results)
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def main() -> int:
    warm = median_us(0.0)
    print(f"tight loop: {warm:.1f} us")
    for sleep_s in (0.0001, 0.001, 0.01):
        cold = median_us(sleep_s)
        print(f"after a {sleep_s * 1e3:g} ms sleep: {cold:.1f} us ({cold / warm:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
