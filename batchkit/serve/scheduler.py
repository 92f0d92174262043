"""The one scheduler every policy plugs into: buckets of waiting requests, and when a
batch leaves. Pure and synchronous: no threads, no sleeping, time comes from the
caller, so its behaviour is tested deterministically with a fake clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from batchkit.batchers.base import Batcher
from batchkit.batchers.groups import GroupedBucket
from batchkit.errors import Overloaded, QueueFull
from batchkit.serve.buckets import Bucket, by_bucket
from batchkit.serve.caps import SizeCaps
from batchkit.serve.dispatch import DispatchReason, DispatchRule, rules_for
from batchkit.serve.request import DROPPED, WAITING, Request
from batchkit.serve.stats import StatsRecorder
from batchkit.serve.targets import LatencyTarget


@dataclass(slots=True)
class FormedBatch:
    """Requests chosen to run together, and why they left.

    Attributes:
        requests: The batch's requests, in the order the function sees them.
        reason: Why the batch left the queue.
        padded_size: The size the function is called with (strict sizes pad up).
        dispatched_at: When it left the queue (the scheduler's clock, seconds).
        answered: A timed-out close already answered its requests.
        expected_end: When it is predicted to end, under a latency target whose model
            is ready; None otherwise.
    """

    requests: list[Request]
    reason: DispatchReason
    padded_size: int
    dispatched_at: float
    answered: bool = False
    expected_end: float | None = None


class Scheduler:
    """Waiting requests grouped in buckets; decides which batch leaves, and when.

    The pure core behind `@batched` and [`simulate`][batchkit.simulate]: no threads,
    no sleeping; time is passed in (`decide(now)`), so its behaviour is tested with a
    fake clock. Requests are placed in buckets by the policy (`bucket_of` of their
    key), FIFO per priority. `decide` forms the next batch; `finish` frees its slot.
    Each batch is cut to its bucket's size cap learned after out-of-memory (`caps`).

    Not thread-safe: the serving core calls it under its lock.

    `decide(now)` says what a pass decided: the batch that leaves, when to look
    again, and the waiting requests it dropped (their error set) for the caller to
    answer; it calls nobody back.

    Args:
        policy: The batching policy: its hooks (`key_of`, `bucket_of`, `select`,
            `padded_size`, ...) and its timing (`max_wait_s`,
            `dispatch_when_idle`).
        max_queue_size: How many requests may wait; None (the default) is no bound.
        max_concurrent_batches: How many formed batches may be running at once (not
            yet finished); default 1.
        max_latency_s: Each request's latency target, from admission to result, in
            seconds; None (the default) for none. With one, the scheduler learns how
            long batches take (from `finish`), refuses at admission what it predicts
            would be late ([`Overloaded`][batchkit.Overloaded]), drops waiting
            requests that can no longer be in time (`decide` returns them), sends a
            batch off early rather than let its oldest member be late, and forms no
            batch so large that its most urgent member would be late.
        caps: The buckets' batch-size caps learned after out-of-memory (see
            `batchkit.serve.caps.SizeCaps`; the serving core teaches them); caps of
            its own, never taught, when None.
        on_room: Called (under the caller's lock) whenever requests leave the
            queue: who waits for room (`when_full="block"`) may be let in.
    """

    def __init__(
        self,
        policy: Batcher,
        *,
        max_queue_size: int | None = None,
        max_concurrent_batches: int = 1,
        max_latency_s: float | None = None,
        caps: SizeCaps | None = None,
        on_room: Callable[[], None] | None = None,
    ) -> None:
        self.policy = policy
        self.target: LatencyTarget | None = None
        if max_latency_s is not None:
            self.target = LatencyTarget(max_latency_s, policy)
        self.max_queue_size = max_queue_size
        self._queue_limit = float("inf") if max_queue_size is None else max_queue_size
        self.max_concurrent_batches = max_concurrent_batches
        self.buckets: dict[Hashable, Bucket] = {}
        # With groups, each bucket's head as it was when pushed, (priority, seq, tie,
        # name), oldest first: when every bucket is ready, the oldest head goes, found
        # without asking every bucket (see `_oldest_head`).
        self._heads: list[tuple[int, int, int, Hashable]] = []
        self._pushes = itertools.count()
        self._placed = 0  # waiting requests (each in its bucket)
        self.in_flight = 0
        self._closing = False
        # The dispatch rules, and with a policy `group` (a bucket is then (group, the
        # policy's bucket)) how many groups a batch may take from: set by set_policy.
        self._rules: list[DispatchRule] = []
        self.grouped = False
        self.groups_per_batch = 1
        self.candidate_limit: int | None = None  # how many candidates `select` needs
        self.caps = SizeCaps() if caps is None else caps
        self.set_policy(policy)
        self.running: dict[int, FormedBatch] = {}
        self.on_room = on_room
        self.stats = StatsRecorder()

    def set_policy(self, policy: Batcher) -> None:
        """Use `policy` for the batches formed from now on (a live settings change).

        Args:
            policy: The new policy (same key and buckets as the old one).
        """
        self.policy = policy
        if self.target is not None:
            self.target.policy = policy
        self._rules = rules_for(policy, self.target, closing=self._closing)
        self.grouped = policy.group is not None
        self.groups_per_batch = policy.max_groups_per_batch or 1
        self.candidate_limit = policy.candidate_limit  # (a policy is not changed in place)

    def set_max_latency(self, seconds: float) -> None:
        """Give every request a latency target from now on, those waiting too (their
        deadline counts from their admission). The learned model is kept.

        Args:
            seconds: The target, from admission to result.
        """
        waiting = [req for bucket in self.buckets.values() for req in bucket.candidates(None)]
        if self.target is None:
            self.target = LatencyTarget(seconds, self.policy)
            self._rules = rules_for(self.policy, self.target, closing=self._closing)
        self.target.retarget(seconds, waiting)

    @property
    def closing(self) -> bool:
        """Whether `close` was called: what waits leaves at once, and nothing reopens it."""
        return self._closing

    def close(self) -> None:
        """Send every waiting batch at once from now on (`DispatchReason.CLOSING`):
        nothing more will arrive."""
        self._closing = True
        self._rules = rules_for(self.policy, self.target, closing=True)

    def set_max_queue_size(self, limit: int) -> None:
        """Bound the queue from now on (requests already waiting stay, even past it).

        Args:
            limit: How many requests may wait.
        """
        self.max_queue_size = limit
        self._queue_limit = limit

    # -- requests in and out ----------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests waiting to run."""
        return self._placed

    def add(self, req: Request) -> None:
        """Enqueue a request (it gets the next arrival number, `seq`).

        Args:
            req: A waiting request, its key, bucket and priority set.

        Raises:
            QueueFull: `max_queue_size` requests already wait; the request is not
                enqueued (and counted as rejected).
            Overloaded: Under a latency target, it is predicted to be answered too
                late; it is not enqueued (and counted as overloaded).
        """
        if self._placed >= self._queue_limit:
            self.stats.rejected += 1
            raise QueueFull(
                f"{self._placed} requests are waiting (max_queue_size={self.max_queue_size})"
            )
        probe = self.target is not None and self._check_latency([req])
        self._enqueue(req, probe)

    def add_all(self, reqs: Sequence[Request]) -> None:
        """Enqueue several requests of one caller (one priority): all of them, or none.

        Args:
            reqs: Waiting requests, their key, bucket, priority and admission time set.

        Raises:
            QueueFull: They do not all fit under `max_queue_size` (counted as
                rejected).
            Overloaded: Under a latency target, the last of them is predicted to be
                answered too late (counted as overloaded).
        """
        limit = self.max_queue_size
        if limit is not None and self._placed + len(reqs) > limit:
            self.stats.rejected += len(reqs)
            raise QueueFull(
                f"{len(reqs)} items do not fit: {self._placed} requests are "
                f"waiting (max_queue_size={limit})"
            )
        probe = self.target is not None and bool(reqs) and self._check_latency(reqs)
        for req in reqs:
            self._enqueue(req, probe)

    def _enqueue(self, req: Request, probe: bool = False) -> None:
        self.stats.requests = req.seq = self.stats.requests + 1  # seq: arrival order
        if self.grouped:
            self.stats.record_group_request(req.group)
        bucket = self.buckets.get(req.bucket)
        if bucket is None:
            bucket = self.buckets[req.bucket] = Bucket(self.policy.max_tokens is not None)
        bucket.append(req)
        if self.grouped and bucket.head() is req:
            heapq.heappush(self._heads, (req.priority, req.seq, next(self._pushes), req.bucket))
        self._placed += 1
        if self.target is not None:
            self.target.set_deadline(req, probe)

    def _check_latency(self, reqs: Sequence[Request]) -> bool:
        """Refuse requests predicted to be answered past the latency target; True when
        they are let in as a probe (see `LatencyTarget.admit`)."""
        target = self.target
        assert target is not None
        now = reqs[0].enqueued_at
        for ahead, req in enumerate(reqs, 1):  # as `_enqueue` will set them
            req.seq = self.stats.requests + ahead
            target.set_deadline(req)
        try:
            return target.admit(
                reqs,
                self.buckets,
                self._slots_free_at(now),
                self.policy.max_batch_size,
                now,
                idle=self.in_flight == 0 and self.num_waiting == 0,
            )
        except Overloaded:
            self.stats.overloaded += len(reqs)
            raise

    def _slots_free_at(self, now: float) -> list[float]:
        """When each batch slot frees up: a running batch's predicted end (now when
        unknown or past), now for a free slot."""
        ends = [
            now if b.expected_end is None else max(b.expected_end, now)
            for b in self.running.values()
        ]
        return ends + [now] * max(self.max_concurrent_batches - len(ends), 0)

    def _left_waiting(self, reqs: list[Request]) -> None:
        """These waiting requests left the queue (taken, dropped or failed; their
        bucket already knows): count them out, and tell who waits for room."""
        self._placed -= len(reqs)
        for name in {req.bucket: None for req in reqs} if self.grouped else ():
            bucket = self.buckets.get(name)
            if bucket is None:
                continue
            head = bucket.head() if bucket.live else None
            if head is not None:  # (its head may have left: `_oldest_head` finds it)
                heapq.heappush(self._heads, (head.priority, head.seq, next(self._pushes), name))
            else:
                # Groups come and go (one per caller, say): a bucket left empty is
                # forgotten, or memory would grow with the groups ever seen.
                del self.buckets[name]
        if self.on_room is not None:
            self.on_room()

    def drop(self, req: Request) -> bool:
        """Withdraw a request that has not started.

        Args:
            req: A request added before.

        Returns:
            True if it was waiting (it is now dropped); False if it already runs or
            ended (nothing changed).
        """
        if req.state != WAITING:
            return False
        self.buckets[req.bucket].drop_waiting([req])
        self._left_waiting([req])
        return True

    def raise_priority(self, req: Request, priority: int) -> None:
        """Serve a waiting request at a more urgent `priority` from now on, in its
        arrival order there (a request several callers share waits at its most urgent
        caller's). Nothing changes for a request that no longer waits, or that is
        already as urgent.

        Args:
            req: A request added before.
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

    def drop_all(self) -> list[Request]:
        """Withdraw every waiting request (used when a close times out)."""
        dropped = []
        for bucket in self.buckets.values():
            for req in bucket.candidates(None):
                req.state = DROPPED
                dropped.append(req)
            bucket.queues.clear()
            bucket.live = 0
        self._left_waiting(dropped)
        return dropped

    def _limit(self, name: Hashable) -> int:
        """The most requests the bucket's next batch may take (its learned cap)."""
        return self.caps.limit(name, self.policy)

    # -- dispatch ----------------------------------------------------------
    def decide(self, now: float) -> tuple[FormedBatch | None, float | None, Sequence[Request]]:
        """One scheduling pass: the next batch to run now (if any), when to look again
        if nothing changes, and the waiting requests dropped on the way.

        A bucket's batch is ready when a dispatch rule says so (see
        `batchkit.serve.dispatch`): it is full (`max_batch_size` requests, or the cost
        budget reached), closing, nothing runs (for a policy that dispatches when
        idle), its oldest request has waited `max_wait_s`, or a latency target's
        deadline comes. Of the ready buckets, the one whose next request has the best
        priority, then the earliest arrival, goes first. A formed batch holds a slot
        until `finish`.

        Args:
            now: The current time, in seconds on the caller's clock.

        Returns:
            `(batch, wake_at, dropped)`. `batch`: the batch that leaves now, or None;
            then `wake_at` is the time of the next rule's deadline (a max-wait
            expiry), or None when only an event (an arrival, a batch finishing,
            close) can make a batch ready; with every slot busy, under a latency
            target, when the next waiting request becomes hopeless (a pass then
            drops it), else None. `dropped`: the
            waiting requests this pass dropped, their error set for the caller to
            answer: those a latency target can no longer answer in time
            (`Overloaded`, counted as shed), and, when the policy's `select` raised
            (or chose nothing), the candidates it was choosing among, with what it
            raised (counted as failed; `wake_at` is then `now`: look again).
        """
        target = self._predicting_target()
        dropped: Sequence[Request] = () if target is None else self.shed_too_late(now)
        if self.in_flight >= self.max_concurrent_batches:
            # No batch can leave; under a target, look again when the next waiting
            # request becomes hopeless, to tell it then (not when a long batch ends).
            drop_at = None if target is None else target.next_drop_at(self.buckets)
            return None, drop_at, dropped
        if self._placed == 0:
            return None, None, dropped
        every_bucket_ready = self._closing or (
            self.policy.dispatch_when_idle and not self.in_flight
        )
        if self.grouped and every_bucket_ready:
            # The oldest head goes, for the first rule that fires: with a bucket per
            # group, asking every bucket would make each pass cost as many groups.
            name, bucket = self._oldest_head()
            limit = self._limit(name) if self.caps.active else self.policy.max_batch_size
            for rule in self._rules:  # (idle or closing fires, if nothing before it)
                due = rule.due(bucket, limit, self.in_flight, now)
                if due is not None and now >= due:
                    return self._take(name, bucket, rule.reason, now, dropped)
        best: tuple[int, int] | None = None  # (priority, seq) of the head served first
        chosen: tuple[Hashable, Bucket, DispatchReason] | None = None
        wake_at: float | None = None
        for name, bucket in self.buckets.items():
            if bucket.live == 0:
                continue
            # The bucket's batch leaves for the first rule whose time has come; else
            # each rule's time is a time to look again.
            limit = self._limit(name) if self.caps.active else self.policy.max_batch_size
            reason: DispatchReason | None = None
            for rule in self._rules:
                due = rule.due(bucket, limit, self.in_flight, now)
                if due is not None and now >= due:
                    reason = rule.reason
                    break
                if due is not None and (wake_at is None or due < wake_at):
                    wake_at = due
            if reason is None:
                continue
            if len(self.buckets) == 1:
                return self._take(name, bucket, reason, now, dropped)
            head = bucket.head()
            assert head is not None
            if best is None or (head.priority, head.seq) < best:
                best, chosen = (head.priority, head.seq), (name, bucket, reason)
        if chosen is None:
            return None, wake_at, dropped
        return self._take(*chosen, now, dropped)

    def shed_too_late(self, now: float) -> list[Request]:
        """Drop the waiting requests a latency target can no longer answer in time (see
        `LatencyTarget.too_late`); `decide` does so first, and admission may call it
        while every slot is busy (no pass runs then, and a request that became hopeless
        behind a long batch would otherwise be told only when the batch ends).

        Args:
            now: The current time.

        Returns:
            The dropped requests, their error (`Overloaded`) set, counted as shed, for
            the caller to answer; none without a target, or while its model learns.
        """
        target = self._predicting_target()
        if target is None:
            return []
        slots = self._slots_free_at(now)
        ends = [batch.expected_end for batch in self.running.values()]
        shed = target.too_late(self.buckets, slots, ends, self.policy.max_batch_size, now)
        self._shed(shed)
        return shed

    def _predicting_target(self) -> LatencyTarget | None:
        """The latency target, once its model is ready and requests wait: only then
        can a waiting request be too late."""
        if self.target is None or not self._placed or not self.target.ready:
            return None
        return self.target

    def _shed(self, shed: list[Request]) -> None:
        """Count out the waiting requests shed as too late (their error set)."""
        if not shed:
            return
        self.stats.shed += len(shed)
        self._left_waiting(shed)

    def _take(
        self,
        name: Hashable,
        bucket: Bucket,
        reason: DispatchReason,
        now: float,
        dropped: Sequence[Request],
    ) -> tuple[FormedBatch | None, float | None, Sequence[Request]]:
        """Form the bucket's batch: `(batch, None, dropped)`; `(None, now, dropped +
        its candidates)` (look again) when the policy's `select` failed."""
        target = self.target
        if target is not None and target.ready:
            limit = self._limit(name)
            front = bucket.candidates(4 * limit)
            overdue = front[: target.overdue(front, now, limit)]
            if overdue:
                bucket.drop_waiting(overdue)
                target.set_errors(overdue, now)
                self._shed(overdue)
                dropped = [*dropped, *overdue]
        policy = self.policy
        candidates = bucket.candidates(self.candidate_limit)
        if self.groups_per_batch > 1 and isinstance(name, GroupedBucket):
            candidates += self._other_groups_candidates(name, len(candidates))
        try:
            chosen = policy.select(candidates)
            if not chosen:  # a batch of nobody would be formed again at every poll
                raise ValueError(
                    f"{type(policy).__name__}.select() chose no request of the "
                    f"{len(candidates)} waiting: a batch must take at least one"
                )
        except Exception as exc:
            self._fail_selection(candidates, exc)
            return None, now, [*dropped, *candidates]
        if self.caps.active:
            self.caps.cut(chosen, name, self.policy)
        if target is not None:
            target.trim(chosen, now)
        if self.groups_per_batch > 1 and any(req.bucket != name for req in chosen):
            for other, reqs in by_bucket(chosen).items():
                self.buckets[other].take(reqs)
        else:
            bucket.take(chosen)
        self.in_flight += 1
        self._left_waiting(chosen)
        padded = policy.padded_size(len(chosen))
        self.stats.record_batch(chosen, reason, padded, now)
        batch = FormedBatch(chosen, reason, padded, now)
        if target is not None and target.ready:
            batch.expected_end = now + target.batch_seconds(chosen)
        self.running[id(batch)] = batch
        return batch, None, dropped

    def _oldest_head(self) -> tuple[Hashable, Bucket]:
        """The bucket whose head (best priority, then earliest arrival) goes first.

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

    def _other_groups_candidates(self, name: GroupedBucket, have: int) -> list[Request]:
        """Under `max_groups_per_batch` > 1: the waiting requests of the next oldest
        other groups of the same policy bucket (at most `max_groups_per_batch - 1` of
        them, oldest head first), to fill a batch that one group leaves short."""
        limit = self.candidate_limit
        room = None if limit is None else limit - have  # None: every candidate
        if room is not None and room <= 0:
            return []
        heads = []
        for other_name, other in self.buckets.items():
            same_bucket = isinstance(other_name, GroupedBucket) and other_name.bucket == name.bucket
            if other_name != name and other.live and same_bucket:
                head = other.head()
                assert head is not None
                heads.append((head.priority, head.seq, other_name))
        heads.sort(key=lambda h: (h[0], h[1]))
        more: list[Request] = []
        for _, _, other_name in heads[: self.groups_per_batch - 1]:
            more += self.buckets[other_name].candidates(None if room is None else room - len(more))
            if room is not None and len(more) >= room:
                break
        return more

    def _fail_selection(self, candidates: list[Request], error: Exception) -> None:
        """A policy bug must not stall every caller: drop the requests its `select`
        was choosing among, with what it raised; the others go on waiting."""
        for name, reqs in by_bucket(candidates).items():
            self.buckets[name].drop_waiting(reqs)
        for req in candidates:
            req.error = error
        self.stats.failed += len(candidates)
        self._left_waiting(candidates)

    def finish(self, batch: FormedBatch, now: float, *, clean: bool = True) -> None:
        """A batch ended (whatever its outcome): its slot is free again.

        Args:
            batch: A batch `decide` returned, not finished before.
            now: The current time, in seconds (its latency is counted to it).
            clean: It ran as one call that completed (not split, retried, timed out
                or abandoned), so its time teaches a latency target's model.
        """
        self.in_flight -= 1
        del self.running[id(batch)]
        elapsed = now - batch.dispatched_at
        self.stats.batch_latency.append(elapsed)
        if self.target is not None:
            self.target.finished(
                batch.requests, batch.padded_size, elapsed, batch.expected_end, now, clean
            )

    @property
    def drained(self) -> bool:
        """Nothing waiting and nothing running."""
        return self.num_waiting == 0 and self.in_flight == 0


def group_bucket(policy: Batcher, key: float, group: Hashable) -> GroupedBucket:
    """The bucket of a grouped request: its group and the policy's bucket of its key.

    Args:
        policy: The batching policy (its `bucket_of`).
        key: The request's key.
        group: The request's group.
    """
    return GroupedBucket(group, policy.bucket_of(key))
