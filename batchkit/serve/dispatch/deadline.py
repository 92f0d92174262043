"""Under a latency target, a batch leaves before waiting longer would make its most
urgent request late (the latest start the learned latency model allows)."""

from __future__ import annotations

from batchkit.serve.buckets import Bucket
from batchkit.serve.dispatch.rule import DispatchReason
from batchkit.serve.targets import LatencyTarget


class BeforeDeadline:
    """Send a bucket's batch at the latest start that still answers its requests
    within their latency target (see `LatencyTarget.latest_start`), once the target's
    model is ready.

    Args:
        target: The function's latency target.
    """

    reason = DispatchReason.DEADLINE

    def __init__(self, target: LatencyTarget) -> None:
        self.target = target

    def due(self, bucket: Bucket, limit: int, in_flight: int, now: float) -> float | None:
        """The latest start of the batch the bucket would form now; None while the
        target's model is still learning.

        Args:
            bucket: The bucket.
            limit: The most requests its batch may take.
            in_flight: Batches running now (not read).
            now: The current time (not read).
        """
        if not self.target.ready:
            return None
        return self.target.latest_start(bucket.candidates(limit))
