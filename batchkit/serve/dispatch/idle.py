"""An idle device takes a partial batch at once: waiting gains nothing while nothing runs."""

from __future__ import annotations

from batchkit.serve.buckets import Bucket
from batchkit.serve.dispatch.rule import DispatchReason


class WhenIdle:
    """Send a bucket's batch at once when no batch is running (a policy's
    `dispatch_when_idle`: `DynamicBatcher(eager=True)`, the default)."""

    reason = DispatchReason.IDLE

    def due(self, bucket: Bucket, limit: int, in_flight: int, now: float) -> float | None:
        """`now` when nothing runs; None while a batch runs (its end polls again).

        Args:
            bucket: The bucket (not read).
            limit: The most requests its batch may take (not read).
            in_flight: Batches running now.
            now: The current time.
        """
        return now if in_flight == 0 else None
