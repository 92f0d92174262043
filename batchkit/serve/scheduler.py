"""The one scheduler every policy plugs into: buckets of waiting requests, and when a
batch leaves. Pure and synchronous: no threads, no sleeping, time comes from the
caller, so its behaviour is tested deterministically with a fake clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from batchkit.batchers.base import Batcher
from batchkit.batchers.groups import GroupedBucket
from batchkit.errors import Overloaded, QueueFull
from batchkit.serve.buckets import Bucket
from batchkit.serve.caps import SizeCaps
from batchkit.serve.dispatch import DispatchReason, DispatchRule, rules_for
from batchkit.serve.request import Request
from batchkit.serve.stats import StatsRecorder
from batchkit.serve.targets import LatencyTarget
from batchkit.serve.waiting import Waiting


@dataclass(slots=True)
class Admission:
    """What `Scheduler.add` decided.

    Attributes:
        refused: Why the requests were not admitted (`QueueFull`, or its subclass
            `Overloaded`); None when they wait now.
        dropped: The waiting requests dropped as too late on the way (their error,
            `Overloaded`, set), for the caller to answer.
    """

    refused: QueueFull | None
    dropped: list[Request]


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
        self.waiting = Waiting(policy.group is not None, on_room)
        self.in_flight = 0
        self._closing = False
        # The dispatch rules, and with a policy `group` (a bucket is then (group, the
        # policy's bucket)) how many groups a batch may take from: set by set_policy.
        self._rules: list[DispatchRule] = []
        self.groups_per_batch = 1
        self.candidate_limit: int | None = None  # how many candidates `select` needs
        self.caps = SizeCaps() if caps is None else caps
        self.set_policy(policy)
        self.running: dict[int, FormedBatch] = {}
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
        self.groups_per_batch = policy.max_groups_per_batch or 1
        self.candidate_limit = policy.candidate_limit  # (a policy is not changed in place)

    def set_max_latency(self, seconds: float) -> None:
        """Give every request a latency target from now on, those waiting too (their
        deadline counts from their admission). The learned model is kept.

        Args:
            seconds: The target, from admission to result.
        """
        waiting = self.waiting.every()
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
        return self.waiting.count

    def add(self, req: Request) -> Admission:
        """Admit a request (it gets the next arrival number, `seq`), or refuse it.

        The waiting requests that a latency target can no longer answer in time are
        dropped first (see `_drop_too_late`), so the newcomer is planned without them.

        Args:
            req: A waiting request, its key, bucket, priority and admission time set.

        Returns:
            What was decided: the refusal, if any (`QueueFull`: `max_queue_size`
            requests already wait, counted as rejected; its subclass `Overloaded`:
            under a latency target, predicted to be answered too late, counted as
            overloaded), and the waiting requests dropped on the way, for the caller
            to answer.
        """
        return self._admit([req], many=False)

    def add_all(self, reqs: Sequence[Request]) -> Admission:
        """Admit several requests of one caller (one priority, one admission time): all
        of them, or none (see `add`).

        Args:
            reqs: Waiting requests, their key, bucket, priority and admission time set.

        Returns:
            What was decided, as `add`'s: they are refused together when they do not
            all fit under `max_queue_size`, or when the last of them is predicted to
            be answered too late.
        """
        return self._admit(reqs, many=True)

    def _admit(self, reqs: Sequence[Request], *, many: bool) -> Admission:
        if not reqs:
            return Admission(None, [])
        dropped = self._drop_too_late(reqs[0].enqueued_at)
        placed = self.waiting.count
        if placed + len(reqs) > self._queue_limit:
            self.stats.rejected += len(reqs)
            what = f"{len(reqs)} items do not fit: " if many else ""
            full = f"{placed} requests are waiting (max_queue_size={self.max_queue_size})"
            return Admission(QueueFull(what + full), dropped)
        probe = False
        if self.target is not None:
            try:
                probe = self._check_latency(reqs)
            except Overloaded as refused:
                return Admission(refused, dropped)
        track_max_key = self.policy.max_tokens is not None
        for req in reqs:
            self.stats.requests = req.seq = self.stats.requests + 1  # seq: arrival order
            if self.waiting.grouped:
                self.stats.record_group_request(req.group)
            self.waiting.place(req, track_max_key)
            if self.target is not None:
                self.target.set_deadline(req, probe)
        return Admission(None, dropped)

    def _check_latency(self, reqs: Sequence[Request]) -> bool:
        """Refuse requests predicted to be answered past the latency target; True when
        they are let in as a probe (see `LatencyTarget.admit`)."""
        target = self.target
        assert target is not None
        now = reqs[0].enqueued_at
        for ahead, req in enumerate(reqs, 1):  # as `_admit` will set them
            req.seq = self.stats.requests + ahead
            target.set_deadline(req)
        try:
            return target.admit(
                reqs,
                self.waiting.buckets,
                self._slots_free_at(now),
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
            target, when the next waiting request becomes too late (a pass then
            drops it), else None. `dropped`: the
            waiting requests this pass dropped, their error set for the caller to
            answer: those a latency target can no longer answer in time
            (`Overloaded`, counted as shed), and, when the policy's `select` raised
            (or chose nothing), the candidates it was choosing among, with what it
            raised (counted as failed; `wake_at` is then `now`: look again).
        """
        target = self._predicting_target()
        dropped: Sequence[Request] = () if target is None else self._drop_too_late(now)
        if self.in_flight >= self.max_concurrent_batches:
            # No batch can leave; under a target, look again when the next waiting
            # request becomes too late, to tell it then (not when a long batch ends).
            drop_at = None if target is None else target.next_drop_at(self.waiting.buckets)
            return None, drop_at, dropped
        if self.waiting.count == 0:
            return None, None, dropped
        ready, wake_at = self._ready_bucket(now)
        if ready is None:
            return None, wake_at, dropped
        return self._take(*ready, now, dropped)

    def _ready_bucket(
        self, now: float
    ) -> tuple[tuple[Hashable, Bucket, DispatchReason] | None, float | None]:
        """`((name, bucket, reason), None)` for the bucket whose batch leaves now; else
        `(None, when to look again)`. Call while requests wait."""
        waiting = self.waiting
        every_bucket_ready = self._closing or (
            self.policy.dispatch_when_idle and not self.in_flight
        )
        if waiting.grouped and every_bucket_ready:
            # The oldest head goes, for the first rule that fires: with a bucket per
            # group, asking every bucket would make each pass cost as many groups.
            name, bucket = waiting.oldest_head()
            reason, _ = self._due(name, bucket, now)  # (idle or closing fires, at least)
            if reason is not None:
                return (name, bucket, reason), None
        best: tuple[int, int] | None = None  # (priority, seq) of the head served first
        chosen: tuple[Hashable, Bucket, DispatchReason] | None = None
        wake_at: float | None = None
        for name, bucket in waiting.buckets.items():
            if bucket.live == 0:
                continue
            reason, due = self._due(name, bucket, now)
            if due is not None and (wake_at is None or due < wake_at):
                wake_at = due
            if reason is None:
                continue
            if len(waiting.buckets) == 1:
                return (name, bucket, reason), None
            head = bucket.head()
            assert head is not None
            if best is None or (head.priority, head.seq) < best:
                best, chosen = (head.priority, head.seq), (name, bucket, reason)
        return chosen, wake_at

    def _due(
        self, name: Hashable, bucket: Bucket, now: float
    ) -> tuple[DispatchReason | None, float | None]:
        """`(reason, None)`: the bucket's batch leaves now, for the first rule whose
        time has come; else `(None, the earliest of the rules' times)`, when to look
        again (None: only an event can make it ready)."""
        policy = self.policy
        limit = self.caps.limit(name, policy) if self.caps.active else policy.max_batch_size
        earliest: float | None = None
        for rule in self._rules:
            due = rule.due(bucket, limit, self.in_flight, now)
            if due is not None and now >= due:
                return rule.reason, None
            if due is not None and (earliest is None or due < earliest):
                earliest = due
        return None, earliest

    def _drop_too_late(self, now: float) -> list[Request]:
        """Drop the waiting requests a latency target can no longer answer in time (see
        `LatencyTarget.too_late`): each pass and each admission does so first (while
        every slot is busy no batch leaves, and a request that became too late behind a
        long batch would otherwise be told only when the batch ends). Returns them,
        their error (`Overloaded`) set, counted as shed; none without a target, or
        while its model learns."""
        target = self._predicting_target()
        if target is None:
            return []
        slots = self._slots_free_at(now)
        ends = [batch.expected_end for batch in self.running.values()]
        waiting = self.waiting
        late = target.too_late(waiting.buckets, slots, ends, now)
        if late:
            self.stats.shed += len(late)
            waiting.left(late)
        return late

    def _predicting_target(self) -> LatencyTarget | None:
        """The latency target, once its model is ready and requests wait: only then
        can a waiting request be too late."""
        if self.target is None or not self.waiting.count or not self.target.ready:
            return None
        return self.target

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
        target, policy, waiting = self.target, self.policy, self.waiting
        if target is not None and target.ready:
            limit = self.caps.limit(name, policy)
            front = bucket.candidates(4 * limit)
            late = front[: target.late_at_front(front, now, limit)]
            if late:
                waiting.remove(late)
                target.set_errors(late, now)
                self.stats.shed += len(late)
                dropped = [*dropped, *late]
        candidates = waiting.candidates(name, self.candidate_limit, self.groups_per_batch)
        try:
            chosen = policy.select(candidates)
            if not chosen:  # a batch of nobody would be formed again at every poll
                raise ValueError(
                    f"{type(policy).__name__}.select() chose no request of the "
                    f"{len(candidates)} waiting: a batch must take at least one"
                )
        except Exception as exc:
            # A policy bug must not stall every caller: the requests its `select` was
            # choosing among fail with what it raised; the others go on waiting.
            waiting.remove(candidates)
            for req in candidates:
                req.error = exc
            self.stats.failed += len(candidates)
            return None, now, [*dropped, *candidates]
        if self.caps.active:
            self.caps.cut(chosen, name, policy)
        if target is not None:
            target.trim(chosen, now)
        waiting.take(name, chosen)
        self.in_flight += 1
        padded = policy.padded_size(len(chosen))
        self.stats.record_batch(chosen, reason, padded, now)
        batch = FormedBatch(chosen, reason, padded, now)
        if target is not None and target.ready:
            batch.expected_end = now + target.batch_seconds(chosen)
        self.running[id(batch)] = batch
        return batch, None, dropped

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
