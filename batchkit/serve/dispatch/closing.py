"""While the function closes, what waits leaves at once: nothing more will arrive."""

from __future__ import annotations

from batchkit.serve.buckets import Bucket
from batchkit.serve.dispatch.rule import DispatchReason


class WhenClosing:
    """Send every bucket's batch at once: the rule `Scheduler.close` adds."""

    reason = DispatchReason.CLOSING

    def due(self, bucket: Bucket, limit: int, in_flight: int, now: float) -> float | None:
        """`now`: nothing more will arrive, so waiting gains nothing.

        Args:
            bucket: The bucket (not read).
            limit: The most requests its batch may take (not read).
            in_flight: Batches running now (not read).
            now: The current time.
        """
        return now
