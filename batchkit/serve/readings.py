"""What a batched function reports about itself: the settings in force, its counters,
its load and its health, each read under the serving core's lock."""

from __future__ import annotations

import threading

from batchkit.serve.caps import SizeCaps
from batchkit.serve.options import Settings, read_settings
from batchkit.serve.scheduler import Scheduler
from batchkit.serve.stats import Stats


class Readings:
    """The read side of one batched function.

    Args:
        lock: The serving core's lock (each reading takes it).
        sched: The function's scheduler.
        caps: The buckets' size caps learned after out-of-memory.

    Attributes:
        abandoned_workers: Worker threads stuck in a timed-out call (kept by a thread
            driver; written under the lock).
        healthy: Whether stuck threads are still replaced (kept by a thread driver).
    """

    def __init__(self, lock: threading.RLock, sched: Scheduler, caps: SizeCaps) -> None:
        self.lock = lock
        self.sched = sched
        self.caps = caps
        self.abandoned_workers = 0
        self.healthy = True

    def settings(self) -> Settings:
        """The settings in force."""
        with self.lock:
            sched = self.sched
            target = sched.target
            return read_settings(
                sched.policy,
                sched.max_concurrent_batches,
                sched.max_queue_size,
                None if target is None else target.target_s,
            )

    def load(self) -> tuple[int, int]:
        """`(queue depth, batches in flight)` now: what `stats` reports, without its
        percentiles (a metrics scrape reads this for every function)."""
        with self.lock:
            return self.sched.num_waiting, self.sched.in_flight

    def health(self) -> tuple[int, int, bool]:
        """`(abandoned workers, batch timeouts, healthy)` now, cheaply (what a metrics
        scrape reads, without `stats()`'s percentiles)."""
        with self.lock:
            return self.abandoned_workers, self.sched.stats.batch_timeouts, self.healthy

    def stats(self) -> Stats:
        """A snapshot of the counters."""
        with self.lock:
            sched = self.sched
            return sched.stats.snapshot(
                queue_depth=sched.num_waiting,
                in_flight=sched.in_flight,
                caps={"default" if b is None else str(b): cap for b, cap in self.caps.items()},
                abandoned_workers=self.abandoned_workers,
                healthy=self.healthy,
                latency_model=None if sched.target is None else sched.target.model(),
            )
