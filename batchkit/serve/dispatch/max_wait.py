"""A batch leaves once its oldest request has waited the policy's longest wait."""

from __future__ import annotations

from batchkit.serve.buckets import Bucket
from batchkit.serve.dispatch.rule import DispatchReason


class AfterMaxWait:
    """Send a bucket's batch once its oldest waiting request has waited `max_wait_s`.

    Args:
        max_wait_s: The policy's longest wait, in seconds.
    """

    reason = DispatchReason.MAX_WAIT

    def __init__(self, max_wait_s: float) -> None:
        self.max_wait_s = max_wait_s

    def due(self, bucket: Bucket, limit: int, in_flight: int, now: float) -> float | None:
        """The oldest waiting request's admission time plus the wait.

        Args:
            bucket: The bucket.
            limit: The most requests its batch may take (not read).
            in_flight: Batches running now (not read).
            now: The current time (not read).
        """
        return bucket.oldest_enqueued_at() + self.max_wait_s
