"""Latency targets (`max_latency_ms`): which requests can still be answered in time.

Every admitted request gets a deadline, its admission time plus the target. With a
model of how long a batch takes (`batchkit.serve.latency`, learned from the batches
that ran), the scheduler asks this object three questions:

- at admission, when would this request be answered, given the work ahead of it
  (waiting requests served before it, and the batches running now)? Past its
  deadline, it is refused at once with [`Overloaded`][batchkit.Overloaded];
- while it waits, can it still be answered in time if its batch left now, alone?
  If not, it is dropped (the same error) before it costs the device anything;
- how large may the next batch be so that its most urgent member is answered in
  time, and when must the batch leave at the latest?

Until the model has seen enough batches, everything is admitted and nothing is
dropped: a prediction needs evidence.

With several buckets (length buckets, groups) the work ahead is not a
queue of full batches: buckets take turns (the one whose oldest request came first
goes next), and each batch is cut so that its own oldest member is in time, so near
capacity the turns make small batches. Admission then *plans* the turns of what waits
(`_plan`), as the scheduler will serve them, each turn at least as long as a
batch of the size its bucket's batches leave with (the requests that arrive before
it leaves join it); it keeps `TURN_ROOM` of the target in hand beyond that; and it
refuses a request whose own batch would make a request admitted before it late.
Counted as
full batches bucket by bucket, the same work let in requests that the turns then made
late: near twice capacity, nearly a third of the refusals of a three-bucket service
came as drops near the deadline instead of at admission.

A prediction can be wrong in the pessimistic direction, and a refusal is never
checked by a batch that does not run: a slow first batch (CUDA context, autotuning,
compilation) would otherwise lock the function out for good. So when it refuses a
request that has nothing ahead of it (nothing waiting, nothing running), the target
is *refusing*, and it lets one caller in as a *probe* at growing intervals (the
target, doubled after each probe, at most `MAX_PROBE_INTERVAL_S`; at once again
after a batch that ran within the target). A probe is not held to the target
(it is never dropped); its batch teaches the model like any other, and a model that
batches keep beating is refuted and learned again (`batchkit.serve.latency`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import statistics
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from batchkit.batchers.base import Batcher, take_within_budget
from batchkit.errors import Overloaded
from batchkit.serve.latency import BatchTimeLearner, LearnedLatency
from batchkit.serve.request import Request

# The share of the target kept for what follows a batch's end and the model does not
# see: resolving the caller's future, and its task or thread waking up.
ANSWER_RESERVE = 0.02
# While refusing with nothing ahead, a probe is let in after the target, then after
# twice as long, and so on up to this (or the target, if longer).
MAX_PROBE_INTERVAL_S = 1.0
# When several buckets take turns, the share of the target an admitted request keeps
# in hand beyond its planned turn: requests that arrive later join the batches of
# their bucket that go before it (a batch takes what waits in its bucket when it
# leaves), and would otherwise make it late, to be dropped near its deadline.
TURN_ROOM = 0.15
# How late the plans of admission run, as `PlanLateness` learns it: the quantile of
# lateness within each group of requests, and how many groups' values are kept (their
# median is what admission adds to its plans).
LATENESS_QUANTILE = 0.99
LATENESS_GROUP = 128
LATENESS_GROUPS = 7
# How fast the size batches leave with is followed (the weight of the newest batch in
# a moving average): a change of load shows within a few batches.
LEAVING_SIZE_WEIGHT = 0.2
LEAVING_SIZES_KEPT = 1024  # buckets whose leaving size is kept, the most recent ones


# A request in a planned lane: (priority, arrival order, the request, its deadline);
# new requests arrive after every waiting one (order math.inf).
_Planned = tuple[int, float, Request, float]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What planning the buckets' turns found (`LatencyTarget._plan`).

    Attributes:
        finish: When the last new request would be answered (past its deadline: it
            would be dropped before its turn).
        dropped: Waiting requests the turns would leave late, to be dropped.
    """

    finish: float
    dropped: list[Request]


class PlanLateness:
    """How much later than admission planned the recent requests were answered.

    Admission plans each request's answer from the model of one batch's time; a chain
    of batches ahead of it adds up their noise (each prediction's margin covers one
    batch's), and its own batch is planned with what waits now, while later arrivals
    join it before it leaves (a fuller batch takes longer). A request admitted with little
    room is then late: dropped near its deadline, which tells its caller too late to
    go elsewhere. This records, per request, its answer (or, dropped, the earliest
    answer it could have had) less its planned answer: the `LATENESS_QUANTILE` of
    each group of `LATENESS_GROUP` requests, and the median of the last
    `LATENESS_GROUPS` groups' (never below 0) is what admission adds to its plans.
    Lateness that persists is learned within a few hundred requests.

    A stall is not such a lesson: the requests that waited through it (admitted
    before it ended, answered after it began) are left out, as the batch-time model
    leaves the stall itself out of its margin. Recurring stalls would otherwise put
    one in every group: at low load, with small batches, one batch in 50 stalling
    taught a correction near the whole target, and admission refused most requests
    the device could serve in time. A sudden slowdown makes only the requests around
    it late (a group or two), which leaves the median where it was (the batch-time
    model follows a slowdown).

    Attributes:
        correction_s: What admission adds to a plan, in seconds.
    """

    def __init__(self) -> None:
        self._group: list[tuple[float, float]] = []  # (lateness, when answered)
        self._quantiles: deque[float] = deque(maxlen=LATENESS_GROUPS)
        self._stall_ended = -math.inf  # the end of the latest stall
        self.correction_s = 0.0

    def add(self, planned: float, answered: float, admitted: float) -> None:
        """A request admitted at `admitted`, planned to be answered at `planned`, was
        answered at `answered` (left out if it waited through a stall)."""
        if admitted < self._stall_ended:
            return
        group = self._group
        group.append((answered - planned, answered))
        if len(group) >= LATENESS_GROUP:
            lateness = sorted(late for late, _ in group)
            self._quantiles.append(lateness[int(LATENESS_QUANTILE * (len(lateness) - 1))])
            group.clear()
            self.correction_s = max(statistics.median(self._quantiles), 0.0)

    def stalled(self, started: float, ended: float) -> None:
        """A batch that ran from `started` to `ended` was a stall: forget the requests
        of the open group answered since it began, and leave out those admitted
        before it ended."""
        self._group = [(late, at) for late, at in self._group if at <= started]
        self._stall_ended = max(self._stall_ended, ended)

    def clear(self) -> None:
        """Forget what was learned (the model or the target changed)."""
        self._group.clear()
        self._quantiles.clear()
        self.correction_s = 0.0


class LatencyTarget:
    """The deadline arithmetic of one batched function's `max_latency_ms`.

    Not thread-safe: the scheduler calls it under the serving core's lock.

    Args:
        target_s: Each request's target, from admission to result, in seconds.
        policy: The batching policy (its cost, budget and sizes shape the prediction).
    """

    def __init__(self, target_s: float, policy: Batcher) -> None:
        self.target_s = target_s
        # Batches are planned to end this much before the target, to leave time for
        # answering the caller; predicted answer times include it.
        self.reserve_s = target_s * ANSWER_RESERVE
        self.policy = policy
        self.learner = BatchTimeLearner()
        self.lateness = PlanLateness()
        # Refusing with nothing ahead since then (None: not refusing); the next probe
        # is let in from `_next_probe_at`, after `_probe_interval` more each time.
        self._refusing_since: float | None = None
        self._next_probe_at = 0.0
        self._probe_interval = target_s
        self._probes = 0
        self._probe_pending = False  # a probe was let in, and no batch observed since
        # Waiting requests per (priority, bucket): [count, sum of each request's own
        # cost], for "how much work is ahead of a new request" without walking the
        # queue (each bucket makes batches of its own).
        self._waiting: dict[tuple[int, Hashable], list[float]] = {}
        # A batch's cost over the sum of its items' own costs (above 1 for a padded
        # layout: its longest item times its size), averaged over recent batches.
        self._packing = 1.0
        # The size each bucket's batches leave with, lately (`trim` follows it): the
        # batch a new request joins is planned at least that large, since the requests
        # that arrive after it join it too.
        self._leaving_size: dict[Hashable, float] = {}
        # Each lane's waiting requests, (seq, entry, request) in a heap, for planning
        # the turns of several buckets (`_plan`); one that left from behind the front
        # is skipped lazily (`_gone`, by id: held there, so its id is not reused).
        self._order: dict[tuple[int, Hashable], list[tuple[int, int, Request]]] = {}
        self._gone: dict[int, Request] = {}
        self._entries = itertools.count()

    def retarget(self, target_s: float, waiting: Sequence[Request]) -> None:
        """Use `target_s` from now on, for the requests already waiting too.

        Args:
            target_s: The new target, in seconds.
            waiting: Every waiting request (their deadlines are set again, from their
                admission time).
        """
        self.target_s = target_s
        self.reserve_s = target_s * ANSWER_RESERVE
        self.lateness.clear()
        self._waiting.clear()
        self._order.clear()
        self._gone.clear()
        for req in waiting:
            self.entered(req)

    @property
    def ready(self) -> bool:
        """Whether the batch-time model has seen enough batches to predict."""
        return self.learner.ready

    def model(self) -> LearnedLatency:
        """The learned model in milliseconds, with what admission does with it (its
        `state`; while warming, only `samples` and `refuted` are set)."""
        learner = self.learner
        fit = learner.snapshot()
        if fit is None:
            return LearnedLatency(
                0.0, 0.0, 0.0, 0.0, learner.samples, state="warming", refuted=learner.refuted
            )
        lateness_ms = self.lateness.correction_s * 1e3
        if self._refusing_since is None:
            return dataclasses.replace(
                fit,
                state="relearning" if learner.relearning else "serving",
                refuted=learner.refuted,
                lateness_ms=lateness_ms,
            )
        return dataclasses.replace(
            fit,
            state="probing" if self._probe_pending else "refusing",
            refusing_since=self._refusing_since,
            probes=self._probes,
            refuted=learner.refuted,
            lateness_ms=lateness_ms,
        )

    # -- what a batch costs and takes ----------------------------------------------
    def batch_cost(self, keys: Sequence[float]) -> float:
        """The policy's cost of a batch with these keys (0 for a keyless policy).

        Args:
            keys: The batch's keys.
        """
        return 0.0 if self.policy.key is None else float(self.policy.cost.of(keys))

    def batch_seconds(self, requests: Sequence[Request]) -> float:
        """The predicted time of a batch of these requests (call only when `ready`).

        Args:
            requests: The batch's requests.
        """
        padded = self.policy.padded_size(len(requests))
        return self.learner.predict(padded, self.batch_cost([r.key for r in requests]))

    def observe(
        self, requests: Sequence[Request], padded_size: int, seconds: float, now: float
    ) -> None:
        """A batch ran cleanly (no split, no retry): learn from its time.

        Args:
            requests: Its requests.
            padded_size: The size the function was called with.
            seconds: From leaving the queue to its results.
            now: When it ended.
        """
        keys = [r.key for r in requests]
        cost = self.batch_cost(keys)
        if seconds + self.reserve_s <= self.target_s:
            # A batch that would have been in time: if refusing, probe again at once.
            self._next_probe_at = 0.0
            self._probe_interval = self.target_s
        self._probe_pending = False
        refuted = self.learner.refuted
        if self.learner.observe(padded_size, cost, seconds):
            self.lateness.stalled(now - seconds, now)
        if self.learner.refuted > refuted:  # the plans were made with the refuted model
            self._stop_refusing()
            self.lateness.clear()
        own = sum(self.batch_cost([k]) for k in keys)
        if own > 0:
            self._packing += 0.1 * (cost / own - self._packing)

    # -- the work ahead ----------------------------------------------------------------
    def entered(self, req: Request, probe: bool = False) -> None:
        """`req` now waits (its deadline set from its admission time).

        Args:
            req: An admitted request, its `enqueued_at` set.
            probe: It was let in as a probe: no deadline binds it (it is never
                dropped, nor does it hurry or cut its batch).
        """
        if probe:
            req.deadline = math.inf
        else:
            req.deadline = req.enqueued_at + self.target_s - self.reserve_s
        lane = (req.priority, req.bucket)
        counts = self._waiting.get(lane)
        if counts is None:
            counts = self._waiting[lane] = [0, 0.0]
        counts[0] += 1
        counts[1] += self.batch_cost([req.key])
        heapq.heappush(self._order.setdefault(lane, []), (req.seq, next(self._entries), req))

    def left(self, requests: Sequence[Request]) -> None:
        """These requests no longer wait (taken into a batch, or dropped).

        Args:
            requests: Requests that were waiting.
        """
        for req in requests:
            lane = (req.priority, req.bucket)
            counts = self._waiting[lane]
            counts[0] -= 1
            counts[1] -= self.batch_cost([req.key])
            order = self._order[lane]
            if counts[0] == 0:
                del self._waiting[lane]
                for _, _, other in self._order.pop(lane):
                    self._gone.pop(id(other), None)
            elif order[0][2] is req:
                heapq.heappop(order)
                while id(order[0][2]) in self._gone:  # (one still waits: counts > 0)
                    del self._gone[id(heapq.heappop(order)[2])]
            else:
                self._gone[id(req)] = req

    def check_admission(
        self,
        reqs: Sequence[Request],
        now: float,
        slots_free_at: Sequence[float],
        max_batch_size: int,
        idle: bool = False,
        last_waiting: Callable[[int], Sequence[Request]] | None = None,
    ) -> bool:
        """Refuse `reqs` (one caller's, one priority) if the last of them would be late.

        The work ahead is every waiting request of the same or a more urgent
        priority. In one bucket: in batches of `max_batch_size` (fewer, smaller ones
        under a cost budget), each taking the model's time, on the slots as they free
        up, the new requests' batch counted last. When that batch, longer with them,
        would end past the deadline of a request already in it, they are planned in
        the batch after it, as a full one: the scheduler cuts a batch to save its
        most urgent member when it leaves (`trim`), and the requests that arrive
        later join that next batch. (Each earlier member was planned with its batch
        as it was then; let the later arrivals fill it regardless, and past capacity
        every batch ends late for its oldest members, is cut to save them, and the
        cut batches make the device slower still.) In several: the buckets' turns as
        the scheduler serves them (`_plan`), plus `TURN_ROOM` of the target for the
        requests that will join the batches ahead; and the new requests are refused
        too when their batches would make a waiting request of another bucket late.

        Args:
            reqs: The new requests (not yet waiting).
            now: The current time.
            slots_free_at: When each of the `max_concurrent_batches` slots is free
                (`now` for a free one, the predicted end of the batch running there).
            max_batch_size: The largest batch.
            idle: Nothing waits and nothing runs: a refusal now rests on the model
                alone, and a probe may be let in instead.
            last_waiting: In one bucket, the last `n` waiting requests served before
                the new ones (their bucket's `Bucket.last_waiting`): the batch they
                join. None: that batch is not checked.

        Returns:
            True when they are let in as a probe (enter them with `probe=True`).

        Raises:
            Overloaded: The predicted answer of the last request is past the target
                (in the next batch, when their own would be late for a request in
                it), or letting them in would make a request admitted before them
                late (with several buckets, in the turns).
        """
        if not self.ready or not reqs:
            return False
        work, ahead = self._work_with(reqs)
        if len(work) == 1:
            ((bucket, (items, cost)),) = work.items()
            finish, apart = self._finish_in_one_bucket(
                reqs, bucket, items, cost, now, slots_free_at, max_batch_size, last_waiting
            )
        else:
            finish = self._finish_across_buckets(reqs, now, slots_free_at, max_batch_size)
            apart = False
        planned = finish + self.reserve_s
        predicted = planned - now + self.lateness.correction_s
        if predicted <= self.target_s:
            for req in reqs:
                req.planned_answer = planned
            if self._refusing_since is not None:
                self._stop_refusing()
            return False
        if idle and len(reqs) <= max_batch_size:
            if self._refusing_since is None:
                self._refusing_since = now
            if now >= self._next_probe_at:
                self._let_in_probe(now)
                return True
        where = (
            "in the next batch (its own, longer with it, would end past the deadline "
            "of a request admitted before it)"
            if apart
            else f"({ahead} requests ahead of it)"
        )
        raise Overloaded(
            f"predicted {predicted * 1e3:.1f} ms to answer this request {where}, over "
            f"the target max_latency_ms={self.target_s * 1e3:g}",
            predicted_s=predicted,
            target_s=self.target_s,
        )

    def _work_with(self, reqs: Sequence[Request]) -> tuple[dict[Hashable, list[float]], int]:
        """The work served before the last of `reqs` (one priority): per bucket, its
        `[items, cost]`, the waiting requests of the same or a more urgent priority
        and `reqs` themselves; and how many requests wait ahead of them."""
        priority = reqs[0].priority
        work: dict[Hashable, list[float]] = {}
        for (p, bucket), (count, total) in self._waiting.items():
            if p <= priority:
                lane = work.setdefault(bucket, [0.0, 0.0])
                lane[0] += count
                lane[1] += total
        ahead = int(sum(count for count, _ in work.values()))
        for req in reqs:
            lane = work.setdefault(req.bucket, [0.0, 0.0])
            lane[0] += 1
            lane[1] += self.batch_cost([req.key])
        return work, ahead

    def _let_in_probe(self, now: float) -> None:
        self._probes += 1
        self._probe_pending = True
        self._next_probe_at = now + self._probe_interval
        self._probe_interval = min(
            2 * self._probe_interval, max(MAX_PROBE_INTERVAL_S, self.target_s)
        )

    def _stop_refusing(self) -> None:
        self._refusing_since = None
        self._probes = 0
        self._next_probe_at = 0.0
        self._probe_interval = self.target_s

    def _finish_in_one_bucket(
        self,
        reqs: Sequence[Request],
        bucket: Hashable,
        items: float,
        cost: float,
        now: float,
        slots_free_at: Sequence[float],
        max_batch_size: int,
        last_waiting: Callable[[int], Sequence[Request]] | None,
    ) -> tuple[float, bool]:
        """When the last of `reqs`, the last of `items` waiting requests of one bucket
        (their own total cost `cost`), is answered (see `check_admission`); and whether
        that is in the batch after their own, which they would make late for a
        request already in it."""
        cost *= self._packing  # (the batches' cost, not the sum of their items')
        leaving = self._leaving_size.get(bucket, 0.0)
        finish = self._finish_time(items, cost, slots_free_at, max_batch_size, leaving)
        in_time = finish + self.reserve_s - now + self.lateness.correction_s <= self.target_s
        if (
            not in_time
            or last_waiting is None
            or not self._late_for_batch_mates(
                items, cost, len(reqs), finish, max_batch_size, last_waiting
            )
        ):
            return finish, False
        joining_cost = self.batch_cost([req.key for req in reqs]) * self._packing
        finish = self._finish_in_next_batch(
            items - len(reqs),
            cost - joining_cost,
            len(reqs),
            joining_cost,
            slots_free_at,
            max_batch_size,
        )
        return finish, True

    def _late_for_batch_mates(
        self,
        items: float,
        cost: float,
        joining: int,
        finish: float,
        max_batch_size: int,
        last_waiting: Callable[[int], Sequence[Request]],
    ) -> bool:
        """Whether `joining` new requests, the last of `items` (total cost `cost`) in one
        bucket, whose batch would end at `finish`, make it end past the deadline of a
        request already waiting in that batch (see `check_admission`)."""
        _, _, last = self._split(items, cost / items, max_batch_size)
        mates = int(last - joining)
        if mates <= 0:  # (they start a batch of their own)
            return False
        return finish > min(req.deadline for req in last_waiting(mates))

    def _finish_in_next_batch(
        self,
        items: float,
        cost: float,
        joining: int,
        joining_cost: float,
        slots_free_at: Sequence[float],
        max_batch_size: int,
    ) -> float:
        """When `joining` new requests (total cost `joining_cost`) are answered in the
        batch after those of `items` waiting ones (total `cost`): planned as a full
        batch, since the requests that arrive after them join it before it leaves
        (and a batch longer than that starts the one after it)."""
        before, full_s, last_s = self._batches(items, cost, max_batch_size)
        free = sorted(slots_free_at)
        slots = len(free)
        ends = [free[i] + (before // slots + (i < before % slots)) * full_s for i in range(slots)]
        ends[before % slots] += last_s
        per_item = joining_cost / joining
        full = self._split(joining, per_item, max_batch_size)[0]
        own = self.learner.predict(self.policy.padded_size(full), full * per_item)
        return min(ends) + own

    def _split(self, items: float, per_item: float, max_batch_size: int) -> tuple[int, int, float]:
        """How `items` waiting requests of one bucket, of cost `per_item` each, leave
        in batches: a full batch's size (the largest batch, fewer under a cost
        budget), the full batches before the last one, and the last one's size."""
        full = max_batch_size
        budget = self.policy.max_tokens
        if budget is not None and per_item > 0:
            full = max(1, min(full, int(budget // per_item)))
        before = math.ceil(items / full) - 1
        return full, before, items - before * full

    def _batches(
        self, items: float, cost: float, max_batch_size: int, last_at_least: float = 0.0
    ) -> tuple[int, float, float]:
        """How `items` waiting requests of one bucket (total cost `cost`) leave: the
        full batches before the last one, a full batch's time, the last one's time
        (with at least `last_at_least` requests in it, up to a full batch)."""
        per_item = cost / items
        full, before, last = self._split(items, per_item, max_batch_size)
        last = max(last, min(full, last_at_least))
        full_s = self.learner.predict(self.policy.padded_size(full), full * per_item)
        last_s = self.learner.predict(self.policy.padded_size(math.ceil(last)), last * per_item)
        return before, full_s, last_s

    def _finish_across_buckets(
        self,
        reqs: Sequence[Request],
        now: float,
        slots_free_at: Sequence[float],
        max_batch_size: int,
    ) -> float:
        """When the last of `reqs` would be answered as the buckets take turns (`_plan`),
        with `TURN_ROOM` of the target kept for the requests that will join the
        batches ahead.

        Raises:
            Overloaded: In time, but with them the turns would drop more of the
                requests already waiting than without them.
        """
        priority = reqs[0].priority
        plan = self._plan(reqs, priority, now, slots_free_at, max_batch_size, joined=True)
        finish = plan.finish + TURN_ROOM * self.target_s
        if finish - now + self.reserve_s <= self.target_s:
            before = self._plan([], priority, now, slots_free_at, max_batch_size, joined=True)
            more_late = len(plan.dropped) - len(before.dropped)
            if more_late > 0:
                raise Overloaded(
                    f"admitting this request would make {more_late} "
                    f"request(s) admitted before it, in other buckets, miss the target "
                    f"max_latency_ms={self.target_s * 1e3:g}",
                    predicted_s=finish - now + self.reserve_s,
                    target_s=self.target_s,
                )
        return finish

    def _plan(
        self,
        reqs: Sequence[Request],
        priority: int,
        now: float,
        slots_free_at: Sequence[float],
        max_batch_size: int,
        joined: bool = False,
    ) -> Plan:
        """The waiting requests of `priority` or more urgent, and `reqs` admitted now,
        served as the scheduler serves several buckets, if nothing else arrived.

        At each turn, as the scheduler polls: each bucket's front requests that would
        be late even alone are dropped; then the bucket whose oldest request came
        first forms a batch (at most `max_batch_size`, within the cost budget), cut as
        `trim` cuts it so that its most urgent member is in time, on the slot that
        frees first. Buckets taking turns make smaller batches than each bucket's
        waiting work would make alone (each is cut by its own oldest member's
        deadline): counted as full batches bucket by bucket, that work would admit
        requests which the turns then make late, to be dropped near their deadline.

        Args:
            reqs: New requests of `priority` (none: plan what waits).
            priority: The priority planned for (buckets of worse ones come after).
            now: The current time (the new requests' admission).
            slots_free_at: When each batch slot is free.
            max_batch_size: The largest batch.
            joined: Plan each turn's batch with the requests that will join it before
                it leaves (admission): at least the size its bucket's batches leave
                with (`_turn_seconds`). False plans what waits now alone.
        """
        lanes = self._lanes_with(reqs, priority, now + self.target_s - self.reserve_s)
        finish = now
        dropped: list[Request] = []
        slots = sorted(slots_free_at)
        # Turns follow one another at their expected times (the margin less the
        # residuals' spread); the new requests' answer adds the spread once, grown with
        # the square root of the turns up to it: one batch's noise is in each
        # prediction, but over several in a row it partly cancels.
        spread = self.learner.spread_s
        turns = 0
        while lanes:
            start = slots[0]
            for name in list(lanes):  # each bucket's fronts that are late even alone
                lane = lanes[name]
                while lane and start + self.batch_seconds([lane[0][2]]) > lane[0][3]:
                    if lane[0][1] == math.inf:  # a new request would be dropped
                        return Plan(start + self.batch_seconds([lane[0][2]]), dropped)
                    dropped.append(lane.popleft()[2])
                if not lane:
                    del lanes[name]
            if not lanes:
                break
            name = min(lanes, key=lambda n: lanes[n][0][:2])  # the oldest front first
            lane = lanes[name]
            front = list(itertools.islice(lane, 4 * max_batch_size))  # as `_take` sees it
            for _ in range(self._overdue(front, start, max_batch_size)):
                entry = lane.popleft()
                if entry[1] == math.inf:  # a new request would be dropped: past its deadline
                    return Plan(math.nextafter(entry[3], math.inf), dropped)
                dropped.append(entry[2])
            planned = self._planned_batch(lane, start, max_batch_size)
            batch = [entry[2] for entry in planned]
            seconds = self.batch_seconds(batch)
            if joined:
                seconds = max(seconds, self._turn_seconds(name[1], batch, max_batch_size))
            end = start + seconds - spread
            heapq.heapreplace(slots, end)
            turns += 1
            if any(entry[1] == math.inf for entry in planned):  # the new requests' turn
                finish = end + spread * math.sqrt(turns)
            if not lanes[name]:
                del lanes[name]
        return Plan(finish, dropped)

    def _turn_seconds(
        self, bucket: Hashable, batch: Sequence[Request], max_batch_size: int
    ) -> float:
        """A planned turn's time with the requests that will join its batch before it
        leaves: a batch of the size its bucket's batches leave with (up to a full one,
        within the cost budget), at this batch's cost per item; 0 when the batch is as
        large already (its own time then stands)."""
        leaving = self._leaving_size.get(bucket, 0.0)
        if leaving <= len(batch):
            return 0.0
        per_item = self.batch_cost([req.key for req in batch]) / len(batch)
        size = min(math.ceil(leaving), self._split(leaving, per_item, max_batch_size)[0])
        return self.learner.predict(self.policy.padded_size(size), size * per_item)

    def _lanes_with(
        self, reqs: Sequence[Request], priority: int, deadline: float
    ) -> dict[tuple[int, Hashable], deque[_Planned]]:
        """Every lane of `priority` or more urgent, its waiting requests in service
        order, and `reqs` (with `deadline`) after them, as `_Planned` entries."""
        lanes: dict[tuple[int, Hashable], deque[_Planned]] = {}
        for key, heap in self._order.items():
            if key[0] <= priority:
                lanes[key] = deque(
                    (req.priority, float(seq), req, req.deadline)
                    for seq, _, req in sorted(heap)
                    if id(req) not in self._gone
                )
        for req in reqs:
            lanes.setdefault((priority, req.bucket), deque()).append(
                (priority, math.inf, req, deadline)
            )
        return lanes

    def _planned_batch(
        self, lane: deque[_Planned], start: float, max_batch_size: int
    ) -> list[_Planned]:
        """The batch a lane forms at `start`, as the scheduler forms it: its first
        `max_batch_size` entries within the cost budget, cut (as `trim` cuts) until
        its most urgent member is in time; taken off the lane."""
        batch = [lane.popleft() for _ in range(min(max_batch_size, len(lane)))]
        budget = self.policy.max_tokens
        if budget is not None:
            keys = (entry[2].key for entry in batch)
            keep = take_within_budget(keys, max_batch_size, budget, self.policy.cost)
            lane.extendleft(reversed(batch[keep:]))
            del batch[keep:]
        while len(batch) > 1 and start > self._latest_start(batch):
            lane.appendleft(batch.pop())
        return batch

    def _finish_time(
        self,
        items: float,
        cost: float,
        slots_free_at: Sequence[float],
        max_batch_size: int,
        last_at_least: float = 0.0,
    ) -> float:
        """When the last of `items` waiting requests (total cost `cost`) is answered:
        full batches first, the last one with what is left over (planned with at
        least `last_at_least` requests, up to a full batch)."""
        before, full_s, last_s = self._batches(items, cost, max_batch_size, last_at_least)
        # Each batch to the slot that frees first: the last one runs on the
        # (before mod slots)-th slot to free up, after `before div slots` batches there.
        free = sorted(slots_free_at)
        return free[before % len(free)] + (before // len(free)) * full_s + last_s

    # -- while requests wait -----------------------------------------------------------
    def hopeless(self, req: Request, start: float) -> bool:
        """Whether `req` would be late even in a batch of its own leaving at `start`.

        Args:
            req: A waiting request.
            start: The earliest time its batch could leave.
        """
        return start + self.batch_seconds([req]) > req.deadline

    def late_in_turns(
        self, now: float, slots_free_at: Sequence[float], max_batch_size: int
    ) -> list[Request]:
        """The waiting requests that the buckets' turns ahead of them now make late.

        `behind_schedule` for several buckets: the turns are planned as admission
        plans them (`_plan`, at their expected times), over every waiting request.
        Called when a batch ran past its predicted end, so that a request the
        turns can no longer serve in time is answered then, not at its deadline.

        Args:
            now: The current time.
            slots_free_at: When each batch slot is free.
            max_batch_size: The largest batch.

        Returns:
            The requests to drop.
        """
        if not self._order:
            return []
        priority = max(p for p, _ in self._order)
        return self._plan([], priority, now, slots_free_at, max_batch_size).dropped

    def behind_schedule(
        self,
        waiting: Sequence[Request],
        slots_free_at: Sequence[float],
        max_batch_size: int,
    ) -> list[Request]:
        """The waiting requests that the work ahead of them now makes late.

        Admission let each request in on a schedule; a batch that ran long (a stall,
        a slowdown) delays everything behind it. Each request is judged as at
        admission, by the requests ahead of it in `waiting` that stay (the late ones
        are taken out of the work ahead), in full batches on the slots as they free
        up. It is called when a batch ran past its predicted end, so that what can no
        longer be in time is answered then, not at its deadline.

        Args:
            waiting: Waiting requests of one bucket, in service order.
            slots_free_at: When each batch slot is free.
            max_batch_size: The largest batch.

        Returns:
            The requests to drop, in service order.
        """
        late: list[Request] = []
        kept = 0
        cost = 0.0
        for req in waiting:
            own = self.batch_cost([req.key])
            total = (cost + own) * self._packing
            if self._finish_time(kept + 1, total, slots_free_at, max_batch_size) > req.deadline:
                late.append(req)
            else:
                kept += 1
                cost += own
        return late

    def answered(self, requests: Sequence[Request], now: float) -> None:
        """A batch's requests were answered at `now`: learn how late their plans ran.

        Args:
            requests: The batch's requests.
            now: When their batch ended.
        """
        for req in requests:
            planned = getattr(req, "planned_answer", None)  # (set when admitted on a plan)
            if planned is not None:
                self.lateness.add(planned, now, req.enqueued_at)

    def dropped(self, req: Request, start: float) -> Overloaded:
        """A waiting request is dropped as too late: learn how late its plan ran (its
        earliest answer, alone in a batch leaving at `start`), and return its error.

        Args:
            req: The request.
            start: The earliest time its batch could have left.
        """
        run = self.batch_seconds([req])
        planned = getattr(req, "planned_answer", None)
        if planned is not None:
            self.lateness.add(planned, start + run + self.reserve_s, req.enqueued_at)
        waited = start - req.enqueued_at
        return Overloaded(
            f"dropped before it ran: waited {waited * 1e3:.1f} ms, and its batch would "
            f"take {run * 1e3:.1f} ms more, over the target "
            f"max_latency_ms={self.target_s * 1e3:g}",
            predicted_s=waited + run + self.reserve_s,
            target_s=self.target_s,
        )

    def overdue_front(self, waiting: Sequence[Request], now: float, max_batch_size: int) -> int:
        """How many of the first waiting requests to drop so that a full batch is in time.

        When a full batch of the first requests would end past its most urgent
        member's deadline, and at least a full batch waits behind them, the device
        is the bottleneck: shrinking the batch to save the oldest would make every
        request behind them later still. Then the oldest are dropped instead, as
        few as make the next full batch in time. With fewer waiting, or when no
        full batch would be in time, nothing is dropped here (`trim` shrinks the
        batch instead).

        Args:
            waiting: Waiting requests in service order.
            now: When the batch leaves.
            max_batch_size: The largest batch.

        Returns:
            How many requests, from the front of `waiting`, to drop.
        """
        if not self.ready:
            return 0
        return self._overdue([(0, 0.0, r, r.deadline) for r in waiting], now, max_batch_size)

    def _overdue(self, front: Sequence[_Planned], start: float, max_batch_size: int) -> int:
        """`overdue_front` on planned entries (their deadlines as planned)."""
        for first in range(len(front) - max_batch_size + 1):
            if start <= self._latest_start(front[first : first + max_batch_size]):
                return first
        return 0

    def _latest_start(self, batch: Sequence[_Planned]) -> float:
        """`latest_start` of planned entries (their deadlines as planned)."""
        return min(entry[3] for entry in batch) - self.batch_seconds([e[2] for e in batch])

    def trim(self, chosen: list[Request], now: float) -> None:
        """Shorten a batch about to leave until its most urgent member is answered in time;
        and follow the size its bucket's batches leave with (admission plans with it).

        Args:
            chosen: The batch, in order; its last members are removed (they stay
                waiting) while it has more than one and would end past the earliest
                deadline among them.
            now: When it leaves.
        """
        if self.ready:
            while len(chosen) > 1 and now > self.latest_start(chosen):
                chosen.pop()
        if chosen:
            sizes, bucket = self._leaving_size, chosen[0].bucket
            seen = sizes.pop(bucket, float(len(chosen)))  # (re-added last: the newest)
            sizes[bucket] = seen + LEAVING_SIZE_WEIGHT * (len(chosen) - seen)
            if len(sizes) > LEAVING_SIZES_KEPT:  # (groups may be many: keep the recent)
                del sizes[next(iter(sizes))]

    def latest_start(self, batch: Sequence[Request]) -> float:
        """When `batch` must leave at the latest for its most urgent member to be in time.

        Args:
            batch: The batch that would leave now (non-empty; call when `ready`).
        """
        return min(r.deadline for r in batch) - self.batch_seconds(batch)
