"""Bucket: one bucket's waiting requests in service order."""

from __future__ import annotations

from batchkit.serve.buckets import Bucket
from batchkit.serve.request import DROPPED, Request, new_request


def waiting(bucket: Bucket, priority: int, count: int) -> list[Request]:
    reqs = [new_request(i, 0.0, None, priority) for i in range(count)]
    for req in reqs:
        bucket.append(req)
    return reqs


def test_the_last_waiting_are_the_back_of_the_service_order_up_to_a_priority() -> None:
    bucket = Bucket(track_max_key=False)
    urgent = waiting(bucket, 0, 3)
    usual = waiting(bucket, 1, 2)
    later = waiting(bucket, 2, 4)  # less urgent than asked: not counted
    assert bucket.last_waiting(4, max_priority=1) == [*urgent[1:], *usual]
    assert bucket.last_waiting(2, max_priority=0) == urgent[1:]
    assert bucket.last_waiting(20, max_priority=1) == [*urgent, *usual]  # all there are
    assert bucket.last_waiting(0, max_priority=2) == []
    assert bucket.last_waiting(1, max_priority=2) == later[-1:]


def test_the_last_waiting_skip_requests_that_left() -> None:
    bucket = Bucket(track_max_key=False)
    reqs = waiting(bucket, 0, 5)
    bucket.drop_waiting([reqs[3]])  # (the deque lets go of it lazily)
    assert reqs[3].state == DROPPED
    assert bucket.last_waiting(3, max_priority=0) == [reqs[1], reqs[2], reqs[4]]
