"""Under a latency target: which waiting requests to drop as too late, and when.

A request admitted on a plan can still become hopeless while it waits: the batches
ahead ran longer than predicted, a batch stalled, or later arrivals of more urgent
priorities went first. Dropped at once, its caller gets its 503 while it still has
time to go elsewhere, and its place serves a request that can be in time. This module
decides which, from the buckets the scheduler holds and what its latency target
predicts (`batchkit.serve.targets.LatencyTarget`); the scheduler counts what it
dropped out of the queue and hands it back to the serving core to answer.

Three checks, cheapest first:

- at every pass, the front of each bucket's deques: a request that would be late even
  alone in the next batch to leave (`LatencyTarget.hopeless`);
- once the schedule slipped (a batch ended past its predicted end, or one still
  runs past it), the work ahead of each waiting request: the batches before it in its
  bucket, or with several buckets, the buckets' turns planned again;
- as a batch forms, its oldest requests when a full batch waits behind them and would
  miss the oldest one's deadline anyway (`LatencyTarget.overdue_front`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence

from batchkit.serve.buckets import Bucket, by_bucket
from batchkit.serve.request import WAITING, Request
from batchkit.serve.targets import LatencyTarget

# After a request's latest hopeful start: a wake-up then finds it surely hopeless
# (a start at exactly that time plus its batch's time may round to its deadline).
DROP_TIME_SLACK_S = 1e-6


class Shedding:
    """The drops of waiting requests a latency target makes, for one scheduler.

    Every request it returns is no longer waiting (its bucket already let it go) and
    has its error set (`Overloaded`, from `LatencyTarget.dropped`).

    Args:
        target: The latency target (its model must be ready before any call here).
    """

    def __init__(self, target: LatencyTarget) -> None:
        self.target = target
        # A batch ran past its predicted end, so the schedule the waiting requests
        # were admitted on slipped; and when a batch still running late may next make
        # the waiting ones be judged again.
        self._slipped = False
        self._next_recheck = 0.0

    def too_late(
        self,
        buckets: Mapping[Hashable, Bucket],
        slots: list[float],
        running_ends: Sequence[float | None],
        now: float,
        limit: Callable[[Hashable], int],
        max_batch_size: int,
    ) -> list[Request]:
        """Drop the waiting requests that would be late even alone in the next batch;
        and, once the schedule slipped, those the work ahead of them makes late.

        Args:
            buckets: The scheduler's buckets, by name.
            slots: When each batch slot frees up (a running batch's predicted end, or
                now), as admission plans with them.
            running_ends: The running batches' predicted ends (None: unknown).
            now: The current time.
            limit: The most requests a bucket's next batch may take, by its name.
            max_batch_size: The policy's maximum batch size.

        Returns:
            The dropped requests.
        """
        target = self.target
        start = min(slots)
        shed: list[Request] = []
        for bucket in buckets.values():
            if bucket.live:
                shed += bucket.shed_fronts(lambda req: target.hopeless(req, start))
        if self._slipped or self._running_late(running_ends, now):
            self._slipped = False
            shed += self._behind_schedule(buckets, slots, now, limit, max_batch_size)
        self._set_errors(shed, start)
        return shed

    def overdue_front(self, bucket: Bucket, limit: int, now: float) -> list[Request]:
        """Drop the oldest requests whose deadline a full batch leaving now would miss,
        when a full batch waits behind them (see `LatencyTarget.overdue_front`).

        Args:
            bucket: The bucket whose batch is being formed.
            limit: The most requests that batch may take.
            now: The current time (the batch leaves now).

        Returns:
            The dropped requests (at most three batches' worth).
        """
        waiting = bucket.candidates(4 * limit)
        overdue = waiting[: self.target.overdue_front(waiting, now, limit)]
        if overdue:
            bucket.drop_waiting(overdue)
            self._set_errors(overdue, now)
        return overdue

    def next_drop_at(self, buckets: Mapping[Hashable, Bucket]) -> float | None:
        """When the next waiting request becomes hopeless if no slot frees before: the
        earliest, over the buckets' heads, of its deadline less its own batch's time
        (a microsecond after, so that `too_late` then surely drops it). None when
        nothing waits with a deadline (a probe has none).

        Args:
            buckets: The scheduler's buckets, by name.
        """
        target = self.target
        soonest = math.inf
        for bucket in buckets.values():
            head = bucket.head() if bucket.live else None
            if head is not None and head.deadline != math.inf:
                soonest = min(soonest, head.deadline - target.batch_seconds([head]))
        return None if soonest == math.inf else soonest + DROP_TIME_SLACK_S

    def batch_ended(self, expected_end: float | None, now: float) -> None:
        """A batch ended at `now`; past its predicted end, the schedule slipped, and the
        next `too_late` judges the work ahead of every waiting request again.

        Args:
            expected_end: Its predicted end (None: it had none).
            now: When it ended.
        """
        if expected_end is not None and now > expected_end:
            self._slipped = True

    def _running_late(self, running_ends: Sequence[float | None], now: float) -> bool:
        """Whether a running batch is past its predicted end (checked again at most
        every tenth of the target while it runs on)."""
        if now < self._next_recheck:
            return False
        for end in running_ends:
            if end is not None and now > end:
                self._next_recheck = now + self.target.target_s / 10
                return True
        return False

    def _behind_schedule(
        self,
        buckets: Mapping[Hashable, Bucket],
        slots: list[float],
        now: float,
        limit: Callable[[Hashable], int],
        max_batch_size: int,
    ) -> list[Request]:
        """Drop the waiting requests that the work ahead of them now makes late: in
        one bucket, the batches before them; in several, the buckets' turns."""
        target = self.target
        live = [(name, bucket) for name, bucket in buckets.items() if bucket.live]
        if len(live) > 1:
            late = [  # (the fronts just shed still wait in the target's lanes)
                req
                for req in target.late_in_turns(now, slots, max_batch_size)
                if req.state == WAITING
            ]
            for name, reqs in by_bucket(late).items():
                buckets[name].drop_waiting(reqs)
            return late
        shed: list[Request] = []
        for name, bucket in live:
            late = target.behind_schedule(bucket.candidates(None), slots, limit(name))
            if late:
                bucket.drop_waiting(late)
                shed += late
        return shed

    def _set_errors(self, shed: list[Request], start: float) -> None:
        for req in shed:
            req.error = self.target.dropped(req, start)
