"""What a dispatch rule is: one reason a waiting batch leaves, asked bucket by bucket.

The scheduler (`batchkit.serve.scheduler`) asks its rules in order, for each bucket
with waiting requests, when that bucket's batch should leave. The first rule whose
time has come names the reason; otherwise the earliest time any rule named is when
the scheduler looks again (if nothing else happens first). A new rule is one module
in this package and one line in `batchkit.serve.dispatch.rules_for`.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol

from batchkit.serve.buckets import Bucket


class DispatchReason(str, Enum):
    """Why a batch left the queue (the keys of `Stats.dispatch_reasons`).

    Attributes:
        FULL: Its bucket held a full batch: `max_batch_size` requests, or waiting
            requests whose cost reaches `max_tokens`.
        MAX_WAIT: Its oldest request had waited `max_wait_ms`.
        IDLE: No batch was running, so waiting requests went at once.
        CLOSING: The function is closing: waiting requests go without waiting.
        DEADLINE: Under a latency target (`max_latency_ms`), waiting longer would
            make its most urgent request late.
    """

    FULL = "full"
    MAX_WAIT = "max_wait"
    IDLE = "idle"
    CLOSING = "closing"
    DEADLINE = "deadline"


class DispatchRule(Protocol):
    """One reason a bucket's batch leaves, and when.

    Attributes:
        reason: What the batch's stats and events record when this rule sends it.
    """

    reason: DispatchReason

    def due(self, bucket: Bucket, limit: int, in_flight: int, now: float) -> float | None:
        """When this rule sends the bucket's batch off, if nothing changes.

        Args:
            bucket: The bucket; it holds at least one waiting request.
            limit: The most requests its next batch may take (the policy's
                `max_batch_size`, or a size learned after out-of-memory).
            in_flight: Batches running now.
            now: The current time, on the scheduler's clock (seconds).

        Returns:
            A time at or before `now`: the batch leaves now; a later time: it leaves
            then, unless an event (an arrival, a batch ending) comes first; None:
            this rule alone never sends it until something changes.
        """
        ...
