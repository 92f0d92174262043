"""The waiting requests a latency target drops as too late, and when.

Driven directly, with a target taught on an exact emulated device (10 ms + 1 ms per
item) and one bucket of requests, the times chosen far from any boundary."""

from __future__ import annotations

import pytest

from batchkit import DynamicBatcher, Overloaded
from batchkit.serve.buckets import Bucket
from batchkit.serve.request import DROPPED, WAITING, Request
from batchkit.serve.targets import LatencyTarget

TARGET = 0.105
MAX_BATCH = 16


def device(n: int) -> float:
    return 0.010 + 0.001 * n


def taught_target() -> LatencyTarget:
    target = LatencyTarget(TARGET, DynamicBatcher(MAX_BATCH))
    now = 0.0
    for n in (1, 4, 8, 16, 2, 12, 6, 10):
        reqs = [Request(i, 0.0, None, 0) for i in range(n)]
        now += device(n)
        target.finished(reqs, n, device(n), None, now, clean=True)
    assert target.ready
    return target


def waiting(target: LatencyTarget, bucket: Bucket, count: int, at: float) -> list[Request]:
    reqs = []
    for i in range(count):
        req = Request(i, 0.0, None, 0, enqueued_at=at)
        target.set_deadline(req)
        bucket.append(req)
        reqs.append(req)
    return reqs


def too_late(target: LatencyTarget, bucket: Bucket, now: float, slot: float, ends: list) -> list:
    return target.too_late({None: bucket}, [slot], ends, now)


def test_a_request_late_even_alone_in_the_next_batch_is_dropped_with_its_error() -> None:
    target = taught_target()
    bucket = Bucket(track_max_key=False)
    (old,) = waiting(target, bucket, 1, at=0.0)
    (young,) = waiting(target, bucket, 1, at=0.050)
    # A batch runs until 0.095: the old request's own batch would end past 0.103.
    shed = too_late(target, bucket, now=0.060, slot=0.095, ends=[0.095])
    assert shed == [old] and old.state == DROPPED
    assert isinstance(old.error, Overloaded) and "dropped before it ran" in str(old.error)
    assert young.state == WAITING and bucket.live == 1


def test_the_work_ahead_is_judged_once_the_schedule_slipped() -> None:
    target = taught_target()
    bucket = Bucket(track_max_key=False)
    reqs = waiting(target, bucket, 40, at=0.0)
    # On schedule (the running batch is not yet past its predicted end): each request
    # alone would be in time, so none is judged by the work ahead of it.
    assert too_late(target, bucket, now=0.040, slot=0.080, ends=[0.080]) == []
    # The batch ends at 0.080, past its predicted 0.050: now three batches of work
    # ahead cannot all end by the deadline (about 0.103), and what cannot is dropped.
    target.finished([], 0, 0.030, 0.050, now=0.080, clean=False)
    shed = too_late(target, bucket, now=0.080, slot=0.080, ends=[])
    kept = [req for req in reqs if req.state == WAITING]
    assert shed and kept and kept == reqs[: len(kept)] and len(kept) < MAX_BATCH
    assert shed == reqs[len(kept) :] and bucket.live == len(kept)


def test_a_batch_running_late_is_looked_at_again_every_tenth_of_the_target() -> None:
    target = taught_target()
    bucket = Bucket(track_max_key=False)
    # A batch predicted to end at 0.050 still runs at 0.060: judged now (nothing waits).
    assert too_late(target, bucket, now=0.060, slot=0.060, ends=[0.050]) == []
    waiting(target, bucket, 40, at=0.0)
    # Within a tenth of the target, the work ahead is not judged again...
    assert too_late(target, bucket, now=0.065, slot=0.065, ends=[0.050]) == []
    # ...after it, it is: two full batches cannot end by the deadline.
    assert too_late(target, bucket, now=0.075, slot=0.075, ends=[0.050])


def test_the_oldest_are_dropped_when_a_full_batch_behind_them_would_be_in_time() -> None:
    target = taught_target()
    bucket = Bucket(track_max_key=False)
    old = waiting(target, bucket, 2, at=0.0)
    waiting(target, bucket, MAX_BATCH, at=0.080)  # a full batch of younger ones
    # A full batch leaving at 0.080 ends at 0.106, past the old ones' deadline: cut
    # for them it would make every request behind later still, so they go instead.
    front = bucket.candidates(4 * MAX_BATCH)
    assert front[: target.late_at_front(front, 0.080, MAX_BATCH)] == old


def test_nothing_is_dropped_from_the_front_with_no_full_batch_behind_it() -> None:
    target = taught_target()
    bucket = Bucket(track_max_key=False)
    reqs = waiting(target, bucket, 2, at=0.0) + waiting(target, bucket, 4, at=0.080)
    assert target.late_at_front(bucket.candidates(4 * MAX_BATCH), 0.080, MAX_BATCH) == 0
    assert bucket.candidates(None) == reqs


def test_the_next_drop_is_when_the_soonest_head_becomes_too_late() -> None:
    target = taught_target()
    old, young = Bucket(track_max_key=False), Bucket(track_max_key=False)
    assert target.next_drop_at({None: old}) is None  # nothing waits
    (first,) = waiting(target, old, 1, at=0.0)
    waiting(target, young, 1, at=0.050)
    drop_at = target.next_drop_at({"old": old, "young": young})
    assert drop_at is not None
    assert drop_at == pytest.approx(first.deadline - target.batch_seconds([first]), abs=1e-5)
    # Just after it, a pass surely drops that request (and only it).
    shed = target.too_late({"old": old, "young": young}, [drop_at], [], drop_at)
    assert shed == [first]
