"""A batch leaves when it is full: as many requests as it may take, or a token budget
reached (waiting longer cannot make it larger)."""

from __future__ import annotations

from batchkit.batchers.base import Batcher
from batchkit.serve.buckets import Bucket
from batchkit.serve.dispatch.rule import DispatchReason


class WhenFull:
    """Send a bucket's batch when it holds `limit` requests, or when its waiting
    requests' cost reaches the policy's `max_tokens`.

    Args:
        policy: The policy whose `max_tokens` and `cost` apply.
    """

    reason = DispatchReason.FULL

    def __init__(self, policy: Batcher) -> None:
        self.policy = policy
        self.budgeted = policy.max_tokens is not None

    def due(self, bucket: Bucket, limit: int, in_flight: int, now: float) -> float | None:
        """`now` when the bucket is full; None otherwise (only arrivals fill it).

        Args:
            bucket: The bucket.
            limit: The most requests its batch may take.
            in_flight: Batches running now (not read).
            now: The current time.
        """
        if bucket.live >= limit or (self.budgeted and bucket.reaches_budget(self.policy)):
            return now
        return None
