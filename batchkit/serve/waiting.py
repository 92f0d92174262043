"""The waiting requests of one scheduler, each in its bucket, and who waits for room.

With groups (a bucket per group and policy bucket) the buckets come and go with the
groups, and the buckets' heads are kept oldest first, so that the oldest waiting
request is found without asking every bucket.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from batchkit.batchers.groups import GroupedBucket
from batchkit.serve.buckets import Bucket, by_bucket
from batchkit.serve.request import DROPPED, WAITING, Request


class Waiting:
    """The waiting requests, by bucket (FIFO per priority in each).

    Not thread-safe: the scheduler's caller holds its lock.

    Args:
        grouped: Buckets are `GroupedBucket`s (the policy has a `group`): a bucket
            left empty is forgotten, and the buckets' heads are kept oldest first.
        on_room: Called whenever requests leave: who waits for room
            (`when_full="block"`) may be let in.

    Attributes:
        buckets: The buckets by name; each holds at least one waiting request when
            grouped.
        count: How many requests wait.
    """

    def __init__(self, grouped: bool, on_room: Callable[[], None] | None) -> None:
        self.buckets: dict[Hashable, Bucket] = {}
        self.grouped = grouped
        self.on_room = on_room
        self.count = 0
        # With groups, each bucket's head as it was when pushed, (priority, seq, tie,
        # name), oldest first (see `oldest_head`).
        self._heads: list[tuple[int, int, int, Hashable]] = []
        self._pushes = itertools.count()

    def place(self, req: Request, track_max_key: bool) -> None:
        """Put a waiting request (its `seq` set) at the back of its bucket.

        Args:
            req: The request.
            track_max_key: A new bucket keeps its `max_key` (under a token budget).
        """
        bucket = self.buckets.get(req.bucket)
        if bucket is None:
            bucket = self.buckets[req.bucket] = Bucket(track_max_key)
        bucket.append(req)
        if self.grouped and bucket.head() is req:
            heapq.heappush(self._heads, (req.priority, req.seq, next(self._pushes), req.bucket))
        self.count += 1

    def left(self, reqs: Sequence[Request]) -> None:
        """These waiting requests left (taken, dropped or failed; their bucket already
        knows): count them out, and tell who waits for room."""
        self.count -= len(reqs)
        for name in {req.bucket: None for req in reqs} if self.grouped else ():
            bucket = self.buckets.get(name)
            if bucket is None:
                continue
            head = bucket.head() if bucket.live else None
            if head is not None:  # (its head may have left: `oldest_head` finds it)
                heapq.heappush(self._heads, (head.priority, head.seq, next(self._pushes), name))
            else:
                # Groups come and go (one per caller, say): a bucket left empty is
                # forgotten, or memory would grow with the groups ever seen.
                del self.buckets[name]
        if self.on_room is not None:
            self.on_room()

    def remove(self, reqs: Sequence[Request]) -> None:
        """Take waiting requests out of their buckets (dropped or failed), and count
        them out."""
        for name, some in by_bucket(reqs).items():
            self.buckets[name].drop_waiting(some)
        self.left(reqs)

    def withdraw(self, req: Request) -> bool:
        """Withdraw a request that has not started.

        Args:
            req: A request placed before.

        Returns:
            True if it was waiting (it is now dropped); False if it already runs or
            ended (nothing changed).
        """
        if req.state != WAITING:
            return False
        self.remove([req])
        return True

    def raise_priority(self, req: Request, priority: int) -> None:
        """Serve a waiting request at a more urgent `priority` from now on, in its
        arrival order there (a request several callers share waits at its most urgent
        caller's). Nothing changes for a request that no longer waits, or that is
        already as urgent.

        Args:
            req: A request placed before.
            priority: The priority it should wait at.
        """
        if req.state != WAITING or priority >= req.priority:
            return
        bucket = self.buckets[req.bucket]
        old = bucket.queues[req.priority]
        old.remove(req)
        if not old:  # (one deque left keeps the bucket's fast path)
            del bucket.queues[req.priority]
        req.priority = priority
        queue = bucket.queues.setdefault(priority, deque())
        at = len(queue)
        while at and queue[at - 1].seq > req.seq:
            at -= 1
        queue.insert(at, req)
        if self.grouped and bucket.head() is req:
            heapq.heappush(self._heads, (priority, req.seq, next(self._pushes), req.bucket))

    def withdraw_all(self) -> list[Request]:
        """Withdraw every waiting request (used when a close times out)."""
        dropped = []
        for bucket in self.buckets.values():
            for req in bucket.candidates(None):
                req.state = DROPPED
                dropped.append(req)
            bucket.queues.clear()
            bucket.live = 0
        self.left(dropped)
        return dropped

    def every(self) -> list[Request]:
        """Every waiting request, bucket by bucket."""
        return [req for bucket in self.buckets.values() for req in bucket.candidates(None)]

    def oldest_head(self) -> tuple[Hashable, Bucket]:
        """With groups, the bucket whose head (best priority, then earliest arrival)
        goes first.

        A bucket's head is pushed when it arrives first, and again whenever requests
        leave the bucket; an entry whose request is no longer its bucket's head is
        stale, dropped when it comes up. Call while requests wait.
        """
        heads = self._heads
        while True:
            priority, seq, _, name = heads[0]
            bucket = self.buckets.get(name)
            head = None if bucket is None or not bucket.live else bucket.head()
            if head is not None and head.priority == priority and head.seq == seq:
                assert bucket is not None
                return name, bucket
            heapq.heappop(heads)

    def candidates(self, name: Hashable, limit: int | None, groups: int) -> list[Request]:
        """A bucket's first waiting requests, in service order, for a batch to choose
        from; with `groups` > 1, then those of the next oldest other groups of the same
        policy bucket (at most `groups - 1` of them, oldest head first), to fill a
        batch that one group leaves short.

        Args:
            name: The bucket whose batch is formed.
            limit: How many candidates at most; None for every one.
            groups: How many groups a batch may take from.
        """
        candidates = self.buckets[name].candidates(limit)
        if groups < 2 or not isinstance(name, GroupedBucket):
            return candidates
        room = None if limit is None else limit - len(candidates)
        if room is not None and room <= 0:
            return candidates
        heads = []
        for other_name, other in self.buckets.items():
            same_bucket = isinstance(other_name, GroupedBucket) and other_name.bucket == name.bucket
            if other_name != name and other.live and same_bucket:
                head = other.head()
                assert head is not None
                heads.append((head.priority, head.seq, other_name))
        heads.sort(key=lambda h: (h[0], h[1]))
        more: list[Request] = []
        for _, _, other_name in heads[: groups - 1]:
            more += self.buckets[other_name].candidates(None if room is None else room - len(more))
            if room is not None and len(more) >= room:
                break
        return candidates + more

    def take(self, name: Hashable, chosen: list[Request]) -> None:
        """A batch formed from the bucket `name` takes `chosen` (with groups, some may
        be of other buckets), and they leave.

        Args:
            name: The bucket whose batch was formed.
            chosen: The batch's requests, all waiting.
        """
        if self.grouped and any(req.bucket != name for req in chosen):
            for other, reqs in by_bucket(chosen).items():
                self.buckets[other].take(reqs)
        else:
            self.buckets[name].take(chosen)
        self.left(chosen)
