"""One bucket's waiting requests: FIFO per priority, dead entries removed lazily.

The scheduler (`batchkit.serve.scheduler`) keeps one `Bucket` per bucket the policy
names (`bucket_of` of an item's key); a batch never mixes buckets. The dispatch rules
(`batchkit.serve.dispatch`) read a bucket to decide when its batch leaves.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence

from batchkit.batchers.base import Batcher
from batchkit.serve.request import DROPPED, RUNNING, WAITING, Request


class Bucket:
    """One bucket's waiting requests, FIFO per priority; dead entries removed lazily.

    `live` counts the waiting requests; the deques may also hold requests that
    left (dropped, or taken by a selection that was not a prefix) until they reach
    the front. When a single deque holds exactly `live` entries it *is* the
    service order, and the hot paths use it directly.

    Args:
        track_max_key: Keep `max_key` (an upper bound of the waiting keys) up to
            date: needed only under a token budget (`max_tokens`).
    """

    __slots__ = ("queues", "live", "max_key", "track_max_key")

    def __init__(self, track_max_key: bool) -> None:
        self.queues: dict[int, deque[Request]] = {}
        self.live = 0
        # An upper bound of the waiting keys, exact after each take; kept only under a
        # token budget (`track_max_key`), and read only there.
        self.max_key = 0.0
        self.track_max_key = track_max_key

    def append(self, req: Request) -> None:
        """Add a waiting request at the back of its priority's deque.

        Args:
            req: A waiting request of this bucket.
        """
        queue = self.queues.get(req.priority)
        if queue is None:
            queue = self.queues[req.priority] = deque()
        queue.append(req)
        self.live += 1
        if req.key > self.max_key:
            self.max_key = req.key

    def clean_queue(self) -> deque[Request] | None:
        """The one deque, if it holds only waiting requests (the common case)."""
        if len(self.queues) == 1:
            for queue in self.queues.values():
                if len(queue) == self.live:
                    return queue
        return None

    def _fronts(self) -> Iterator[tuple[int, deque[Request]]]:
        for priority in sorted(self.queues):
            queue = self.queues[priority]
            while queue and queue[0].state != WAITING:
                queue.popleft()
            if queue:
                yield priority, queue
            else:
                del self.queues[priority]

    def head(self) -> Request | None:
        """The request served next: best priority, then oldest."""
        queue = self.clean_queue()
        if queue is not None:
            return queue[0] if queue else None
        for _, queue in self._fronts():
            return queue[0]
        return None

    def oldest_enqueued_at(self) -> float:
        """When the longest-waiting request arrived (max wait counts from it)."""
        return min(queue[0].enqueued_at for _, queue in self._fronts())

    def candidates(self, limit: int | None) -> list[Request]:
        """Waiting requests in service order.

        Args:
            limit: How many at most; None for all of them.
        """
        queue = self.clean_queue()
        if queue is not None:
            return list(queue if limit is None else itertools.islice(queue, limit))
        out: list[Request] = []
        for _, queue in self._fronts():
            for req in queue:
                if req.state == WAITING:
                    out.append(req)
                    if limit is not None and len(out) == limit:
                        return out
        return out

    def last_waiting(self, count: int, max_priority: int) -> list[Request]:
        """The last `count` waiting requests, in service order, of those of priority
        `max_priority` or more urgent: the ones a batch formed at the back of that
        order would hold (fewer if fewer wait).

        Args:
            count: How many at most.
            max_priority: The least urgent priority counted.
        """
        out: list[Request] = []
        for priority in sorted((p for p in self.queues if p <= max_priority), reverse=True):
            for req in reversed(self.queues[priority]):
                if len(out) == count:
                    return out[::-1]
                if req.state == WAITING:
                    out.append(req)
        return out[::-1]

    def take(self, chosen: list[Request]) -> None:
        """These waiting requests leave for a batch: they become `RUNNING`.

        The usual batch, the front of the one clean deque, leaves it at once. (Checked
        against the deque itself: a policy's `select` may reorder or skip.)

        Args:
            chosen: Waiting requests of this bucket, as the batch holds them.
        """
        for req in chosen:
            req.state = RUNNING
        count = len(chosen)
        queue = self.clean_queue()
        # (A `Request` defines no `__eq__`: the lists compare by identity.)
        if queue is None or count > len(queue) or chosen != list(itertools.islice(queue, count)):
            self.taken(count)
            return
        for _ in range(count):  # the front of the one clean deque, which stays clean
            queue.popleft()
        self.live -= count
        if self.track_max_key:
            self._refresh_max_key()

    def taken(self, count: int) -> None:
        """Bookkeeping after `count` requests left: compact, refresh the key maximum.

        Args:
            count: How many waiting requests left (taken into a batch, or dropped);
                their state is already no longer waiting.
        """
        self.live -= count
        if len(self.queues) == 1:
            # Usually the batch was the queue's front: pop it now, so the queue stays clean.
            for queue in self.queues.values():
                while queue and queue[0].state != WAITING:
                    queue.popleft()
        for priority, queue in self.queues.items():
            if len(queue) > 2 * self.live + 64:
                self.queues[priority] = deque(r for r in queue if r.state == WAITING)
        if count and self.track_max_key:
            self._refresh_max_key()

    def _refresh_max_key(self) -> None:
        """Make `max_key` exact again after requests left."""
        self.max_key = max((r.key for r in self.candidates(None)), default=0.0)

    def drop_late_fronts(self, too_late: Callable[[Request], bool]) -> list[Request]:
        """Drop, from the front of each priority's deque, the requests `too_late` picks.

        Each deque is served front first and its deadlines grow towards the back, so
        the scan of a deque stops at its first request that is not too late.

        Args:
            too_late: Whether a waiting request can no longer be answered in time.

        Returns:
            The dropped requests (now `DROPPED`), already counted out of `live`.
        """
        late: list[Request] = []
        for _, queue in list(self._fronts()):
            while queue and (queue[0].state != WAITING or too_late(queue[0])):
                req = queue.popleft()
                if req.state == WAITING:
                    late.append(req)
        self.drop_waiting(late)
        return late

    def drop_waiting(self, reqs: Sequence[Request]) -> None:
        """Drop these waiting requests (they become `DROPPED`; the deques let go of
        them lazily).

        Args:
            reqs: Requests of this bucket that are waiting.
        """
        for req in reqs:
            req.state = DROPPED
        self.taken(len(reqs))

    def reaches_budget(self, policy: Batcher) -> bool:
        """Whether the waiting requests' cost, by the policy's `cost`, reaches `max_tokens`.

        Then waiting longer cannot make the next batch larger: the bucket is full. The
        cost's upper bound from the count and the largest key (the padded area, itself
        exact for `"padded"`) answers most polls at once; the exact cost of every
        waiting request is computed only when the bound says the budget may be reached.

        Args:
            policy: The policy whose `max_tokens` and `cost` apply.
        """
        budget = policy.max_tokens
        if budget is None:
            return False
        bound = policy.cost.upper_bound(self.live, self.max_key)
        if bound is not None and (bound < budget or policy.cost.bound_is_exact):
            return bound >= budget
        return policy.budget_reached([r.key for r in self.candidates(None)])


def by_bucket(reqs: Sequence[Request]) -> dict[Hashable, list[Request]]:
    """`reqs` by bucket name, in their order.

    Args:
        reqs: Requests of any buckets.
    """
    out: dict[Hashable, list[Request]] = {}
    for req in reqs:
        out.setdefault(req.bucket, []).append(req)
    return out
