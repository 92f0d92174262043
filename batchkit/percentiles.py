"""Percentiles of a window of latency samples: what serving and continuous batching
both report, so it lives below both."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

SAMPLE_WINDOW = 4096  # latency percentiles cover the most recent samples


@dataclass(frozen=True)
class Percentiles:
    """p50/p90/p99/max of a latency sample, in seconds (NaN when empty).

    Attributes:
        p50: The median.
        p90: The 90th percentile.
        p99: The 99th percentile.
        max: The largest sample.
        count: Samples summarised (at most the most recent 4096).
    """

    p50: float
    p90: float
    p99: float
    max: float
    count: int

    @classmethod
    def empty(cls) -> Percentiles:
        """No samples: every figure NaN."""
        nan = float("nan")
        return cls(nan, nan, nan, nan, 0)

    @classmethod
    def of(cls, samples: deque[float]) -> Percentiles:
        """Summarise a window of samples (linear interpolation between them).

        Args:
            samples: Latencies in seconds; empty gives NaN figures and a count of 0.
        """
        if not samples:
            return cls.empty()
        arr = np.fromiter(samples, dtype=np.float64, count=len(samples))
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return cls(float(p50), float(p90), float(p99), float(arr.max()), len(arr))
