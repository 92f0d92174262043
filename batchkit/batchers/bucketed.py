"""Bucketed batching: items grouped by key (length) bucket; a batch never mixes buckets."""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Sequence

from batchkit.batchers.base import Batcher, KeyFn


class BucketedBatcher(Batcher):
    """Dynamic batching within length buckets.

    An item goes to the first bucket whose boundary is >= ``key(item)``; items above
    the last boundary form a bucket of their own. Online, each bucket batches like
    :class:`~batchkit.DynamicBatcher` (full, waited ``max_wait_ms``, or idle).
    Offline, a bucket's items are batched in key order (least padding), buckets in
    ascending order; shuffling for training belongs to samplers.
    """

    def __init__(
        self,
        boundaries: Iterable[float],
        *,
        key: KeyFn = len,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        max_tokens: int | None = None,
    ) -> None:
        bounds = list(boundaries)
        if not bounds:
            raise ValueError("boundaries must name at least one bucket boundary")
        if any(nxt <= prev for prev, nxt in zip(bounds, bounds[1:])):
            raise ValueError(f"boundaries must be strictly increasing, got {bounds}")
        super().__init__(
            max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, max_tokens=max_tokens, key=key
        )
        self.boundaries = tuple(bounds)

    def bucket_of(self, key: float) -> Hashable:
        """Index of the first boundary >= ``key`` (``len(boundaries)`` above the last)."""
        return bisect.bisect_left(self.boundaries, key)

    def offline_order(self, keys: Sequence[float]) -> list[list[int]]:
        """One group per non-empty bucket, ascending; each in stable key order."""
        buckets: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            buckets.setdefault(bisect.bisect_left(self.boundaries, k), []).append(i)
        return [sorted(buckets[b], key=keys.__getitem__) for b in sorted(buckets)]
