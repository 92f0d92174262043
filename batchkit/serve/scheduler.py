"""The one scheduler every policy plugs into: buckets of waiting requests, and when a
batch leaves. Pure and synchronous: no threads, no sleeping, time comes from the
caller, so its behaviour is tested deterministically with a fake clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from batchkit.batchers.base import Batcher
from batchkit.serve.errors import QueueFull
from batchkit.serve.request import Request, State
from batchkit.serve.stats import DispatchReason, StatsRecorder

PROBE_AFTER = 32  # successful batches at a learned cap before trying a larger one


@dataclass(slots=True)
class FormedBatch:
    """Requests chosen to run together, and why they left."""

    requests: list[Request]
    reason: DispatchReason
    padded_size: int
    dispatched_at: float


class Bucket:
    """One bucket's waiting requests, FIFO per priority; dead entries removed lazily."""

    __slots__ = ("queues", "live", "max_key", "track_max_key")

    def __init__(self, track_max_key: bool) -> None:
        self.queues: dict[int, deque[Request]] = {}
        self.live = 0
        self.max_key = 0.0  # an upper bound, exact after each take (token budgets only)
        self.track_max_key = track_max_key

    def _fronts(self) -> Iterator[tuple[int, deque[Request]]]:
        for priority in sorted(self.queues):
            queue = self.queues[priority]
            while queue and queue[0].state is not State.WAITING:
                queue.popleft()
            if queue:
                yield priority, queue
            else:
                del self.queues[priority]

    def head(self) -> Request | None:
        """The request served next: best priority, then oldest."""
        for _, queue in self._fronts():
            return queue[0]
        return None

    def oldest_enqueued_at(self) -> float:
        """When the longest-waiting request arrived (max wait counts from it)."""
        return min(queue[0].enqueued_at for _, queue in self._fronts())

    def candidates(self, limit: int | None) -> list[Request]:
        """Waiting requests in service order (the first ``limit`` of them)."""
        out: list[Request] = []
        for _, queue in self._fronts():
            for req in queue:
                if req.state is State.WAITING:
                    out.append(req)
                    if limit is not None and len(out) == limit:
                        return out
        return out

    def taken(self, count: int) -> None:
        """Bookkeeping after ``count`` requests left: compact, refresh the key maximum."""
        self.live -= count
        for priority, queue in self.queues.items():
            if len(queue) > 2 * self.live + 64:
                self.queues[priority] = deque(r for r in queue if r.state is State.WAITING)
        if self.live == 0:
            self.max_key = 0.0
        elif count and self.track_max_key:
            self.max_key = max(r.key for r in self.candidates(None))


class Scheduler:
    """Waiting requests grouped in buckets; decides which batch leaves, and when.

    Not thread-safe: the runtimes call it under their own lock (or on their loop).
    """

    def __init__(
        self,
        policy: Batcher,
        *,
        max_queue_size: int | None = None,
        max_concurrent_batches: int = 1,
    ) -> None:
        self.policy = policy
        self.max_queue_size = max_queue_size
        self._queue_limit = float("inf") if max_queue_size is None else max_queue_size
        self.max_concurrent_batches = max_concurrent_batches
        self.buckets: dict[Hashable, Bucket] = {}
        self.num_waiting = 0
        self.in_flight = 0
        self.closing = False
        self.running: dict[int, FormedBatch] = {}
        # Learned after out-of-memory: a bucket's effective maximum batch size, raised
        # again by a quarter after PROBE_AFTER successful batches at the cap.
        self.caps: dict[Hashable, int] = {}
        self.on_room: Callable[[], None] | None = None  # called when requests leave the queue
        self._cap_successes: dict[Hashable, int] = {}
        self.stats = StatsRecorder()
        self._seq = itertools.count(1)  # arrival order: breaks ties between equal priorities

    # -- requests in and out ----------------------------------------------
    def add(self, req: Request) -> None:
        """Enqueue a request, or raise ``QueueFull`` (counted) without enqueuing it."""
        # The hot path of every call: kept flat (no helper calls) on purpose.
        if self.num_waiting >= self._queue_limit:
            self.stats.rejected += 1
            raise QueueFull(
                f"{self.num_waiting} requests are waiting (max_queue_size={self.max_queue_size})"
            )
        bucket = self.buckets.get(req.bucket)
        if bucket is None:
            bucket = self.buckets[req.bucket] = Bucket(self.policy.max_tokens is not None)
        queue = bucket.queues.get(req.priority)
        if queue is None:
            queue = bucket.queues[req.priority] = deque()
        req.seq = next(self._seq)
        queue.append(req)
        bucket.live += 1
        if req.key > bucket.max_key:
            bucket.max_key = req.key
        self.num_waiting += 1
        self.stats.requests += 1

    def drop(self, req: Request) -> bool:
        """Withdraw a request that has not started; False if it already runs or ended."""
        if req.state is not State.WAITING:
            return False
        req.state = State.DROPPED
        bucket = self.buckets[req.bucket]
        bucket.taken(1)
        self.num_waiting -= 1
        if self.on_room is not None:
            self.on_room()
        return True

    def drop_all(self) -> list[Request]:
        """Withdraw every waiting request (used when a close times out)."""
        dropped = []
        for bucket in self.buckets.values():
            for req in bucket.candidates(None):
                req.state = State.DROPPED
                dropped.append(req)
            bucket.queues.clear()
            bucket.live = 0
        self.num_waiting = 0
        if self.on_room is not None:
            self.on_room()
        return dropped

    # -- dispatch ----------------------------------------------------------
    # -- learned limits ------------------------------------------------------
    def learn_cap(self, bucket: Hashable, size: int) -> None:
        """A batch of this bucket ran out of memory; ``size`` items fit."""
        self.caps[bucket] = min(size, self.caps.get(bucket, self.policy.max_batch_size))
        self._cap_successes[bucket] = 0

    def note_success(self, bucket: Hashable, size: int) -> None:
        """A batch ran without running out of memory: probe upward after enough of them."""
        cap = self.caps.get(bucket)
        if cap is None or size < cap:
            return
        self._cap_successes[bucket] = done = self._cap_successes.get(bucket, 0) + 1
        if done >= PROBE_AFTER:
            # A quarter more, or the next size the policy allows (strict sizes pad up).
            raised = max(cap + max(1, cap // 4), self.policy.padded_size(cap + 1))
            self._cap_successes[bucket] = 0
            if raised >= self.policy.max_batch_size:
                del self.caps[bucket]
            else:
                self.caps[bucket] = raised

    def _limit(self, name: Hashable) -> int:
        return (
            self.caps.get(name, self.policy.max_batch_size)
            if self.caps
            else (self.policy.max_batch_size)
        )

    # -- dispatch ----------------------------------------------------------
    def _reason(self, name: Hashable, bucket: Bucket, now: float) -> DispatchReason | None:
        policy = self.policy
        if bucket.live >= self._limit(name) or (
            policy.max_tokens is not None and bucket.live * bucket.max_key >= policy.max_tokens
        ):
            return DispatchReason.FULL
        if self.closing:
            return DispatchReason.CLOSING
        if policy.dispatch_when_idle and self.in_flight == 0:
            return DispatchReason.IDLE
        wait = policy.max_wait_s
        if wait is not None and now - bucket.oldest_enqueued_at() >= wait:
            return DispatchReason.MAX_WAIT
        return None

    def poll(self, now: float) -> tuple[FormedBatch | None, float | None]:
        """The next batch to run now (if any), and when to poll again if nothing changes.

        The returned wake-up time is None when only an event (an arrival, a batch
        finishing, close) can make a batch ready.
        """
        if self.num_waiting == 0 or self.in_flight >= self.max_concurrent_batches:
            return None, None
        ready: list[tuple[int, int, Hashable, DispatchReason]] = []
        wake_at: float | None = None
        for name, bucket in self.buckets.items():
            if bucket.live == 0:
                continue
            reason = self._reason(name, bucket, now)
            head = bucket.head()
            assert head is not None
            if reason is not None:
                heapq.heappush(ready, (head.priority, head.seq, name, reason))
            elif self.policy.max_wait_s is not None:
                due = bucket.oldest_enqueued_at() + self.policy.max_wait_s
                wake_at = due if wake_at is None else min(wake_at, due)
        if not ready:
            return None, wake_at
        _, _, name, reason = ready[0]
        return self._take(name, reason, now), None

    def _take(self, name: Hashable, reason: DispatchReason, now: float) -> FormedBatch:
        bucket = self.buckets[name]
        chosen = self.policy.select(bucket.candidates(self.policy.candidate_limit))
        if self.caps and name in self.caps:
            cap = self.caps[name]
            del chosen[cap:]
            while len(chosen) > 1 and self.policy.padded_size(len(chosen)) > cap:
                chosen.pop()
        for req in chosen:
            req.state = State.RUNNING
        bucket.taken(len(chosen))
        self.num_waiting -= len(chosen)
        self.in_flight += 1
        if self.on_room is not None:
            self.on_room()
        padded = self.policy.padded_size(len(chosen))
        stats = self.stats
        stats.batches += 1
        stats.items_run += len(chosen)
        stats.padded_slots += padded - len(chosen)
        stats.batch_sizes[len(chosen)] += 1
        stats.reasons[reason.value] += 1
        stats.queue_wait.extend(now - r.enqueued_at for r in chosen)
        batch = FormedBatch(chosen, reason, padded, now)
        self.running[id(batch)] = batch
        return batch

    def finish(self, batch: FormedBatch, now: float) -> None:
        """A batch ended (whatever its outcome): its slot is free again."""
        self.in_flight -= 1
        del self.running[id(batch)]
        self.stats.batch_latency.append(now - batch.dispatched_at)

    @property
    def drained(self) -> bool:
        """Nothing waiting and nothing running."""
        return self.num_waiting == 0 and self.in_flight == 0
