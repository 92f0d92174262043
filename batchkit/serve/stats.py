"""Counters and latency samples, and the immutable snapshot ``f.stats()`` returns."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from batchkit.percentiles import SAMPLE_WINDOW, Percentiles

if TYPE_CHECKING:
    from batchkit.serve.request import Request



class DispatchReason(str, Enum):
    """Why a batch left the queue."""

    FULL = "full"
    MAX_WAIT = "max_wait"
    IDLE = "idle"  # no batch was running: waiting requests go at once
    CLOSING = "closing"


@dataclass(frozen=True)
class Stats:
    """A snapshot of one batcher's activity since it was created."""

    requests: int
    batches: int
    calls: int  # function calls: more than batches when batches were split and retried
    items_run: int
    padded_slots: int
    rejected: int
    timeouts: int
    cancelled: int
    closed: int  # waiting requests answered with BatcherClosed when a close timed out
    failed: int
    oom_splits: int  # parts split in halves after running out of memory
    isolated: int  # items that failed alone after their batch was split
    effective_max_batch_size: dict[str, int]  # per bucket, learned after out-of-memory
    queue_depth: int
    in_flight: int
    batch_sizes: dict[int, int]
    dispatch_reasons: dict[str, int]
    queue_wait: Percentiles
    batch_latency: Percentiles  # to the last chunk, for a streaming function
    time_to_first_chunk: Percentiles = field(default_factory=Percentiles.empty)  # streams only
    batch_timeouts: int = 0  # calls of the function given up after batch_timeout
    abandoned_workers: int = 0  # sync worker threads still stuck in a timed-out call
    healthy: bool = True  # False once stuck threads pass the bound and are not replaced

    @property
    def mean_batch_size(self) -> float:
        """Average real items per batch."""
        return self.items_run / self.batches if self.batches else 0.0


@dataclass
class StatsRecorder:
    """Mutable counters; updated under the runtime's lock."""

    requests: int = 0
    batches: int = 0
    calls: int = 0
    items_run: int = 0
    padded_slots: int = 0
    rejected: int = 0
    timeouts: int = 0
    cancelled: int = 0
    closed: int = 0
    failed: int = 0
    oom_splits: int = 0
    isolated: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    reasons: dict[DispatchReason, int] = field(default_factory=dict)
    queue_wait: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))
    batch_latency: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))
    first_chunk: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))
    batch_timeouts: int = 0

    def record_batch(
        self, requests: list[Request], reason: DispatchReason, padded: int, now: float
    ) -> None:
        """A batch of ``requests`` left the queue at ``now`` (called once per batch)."""
        size = len(requests)
        self.batches += 1
        self.items_run += size
        self.padded_slots += padded - size
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        # (A comprehension's specialised slot reads beat map() with attrgetter here.)
        self.queue_wait.extend([now - req.enqueued_at for req in requests])

    def snapshot(
        self,
        *,
        queue_depth: int,
        in_flight: int,
        caps: dict[str, int],
        unplaced: int = 0,
        abandoned_workers: int = 0,
        healthy: bool = True,
    ) -> Stats:
        """Freeze the current values (``unplaced``: admitted requests not yet counted)."""
        return Stats(
            requests=self.requests + unplaced,
            batches=self.batches,
            calls=self.calls,
            items_run=self.items_run,
            padded_slots=self.padded_slots,
            rejected=self.rejected,
            timeouts=self.timeouts,
            cancelled=self.cancelled,
            closed=self.closed,
            failed=self.failed,
            oom_splits=self.oom_splits,
            isolated=self.isolated,
            effective_max_batch_size=caps,
            queue_depth=queue_depth,
            in_flight=in_flight,
            batch_sizes=dict(sorted(self.batch_sizes.items())),
            dispatch_reasons={r.value: n for r, n in self.reasons.items()},
            queue_wait=Percentiles.of(self.queue_wait),
            batch_latency=Percentiles.of(self.batch_latency),
            time_to_first_chunk=Percentiles.of(self.first_chunk),
            batch_timeouts=self.batch_timeouts,
            abandoned_workers=abandoned_workers,
            healthy=healthy,
        )
