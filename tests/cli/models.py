"""Tiny batch functions for ``batchkit profile`` tests (numpy only, no model weights)."""

from __future__ import annotations

import time

import numpy as np

not_callable = 3


def saturating(batch: np.ndarray) -> np.ndarray:
    """3 ms up to 8 items, then 0.5 ms per item: throughput peaks at 8 (the knee), whatever
    the sleep overshoot on a busy machine."""
    time.sleep(0.003 if len(batch) <= 8 else 0.0005 * len(batch))
    return batch.sum(axis=1)


def broken(batch: np.ndarray) -> np.ndarray:
    """Fails on every batch."""
    raise ValueError("shapes do not match")
