"""The arrival lane: requests appended without the lock are placed exactly once, in
order, even when a call from another thread places the arrivals meanwhile."""

from __future__ import annotations

import threading
from collections import deque

import pytest

from batchkit import DynamicBatcher
from batchkit.serve.lane import ArrivalLane
from batchkit.serve.request import Request, new_request
from batchkit.serve.scheduler import Scheduler


class _RacingArrivals(deque):  # type: ignore[type-arg]
    """An arrivals deque into which one more request lands during the first pop, as a
    lock-free caller's append can while another thread places the arrivals."""

    def __init__(self, late: Request) -> None:
        super().__init__()
        self.late: Request | None = late

    def popleft(self) -> Request:
        req: Request = super().popleft()
        if self.late is not None:
            self.append(self.late)
            self.late = None
        return req


def _opened_on_another_thread() -> ArrivalLane:
    lane = ArrivalLane()
    opener = threading.Thread(target=lane.open, args=(object(),))  # (any loop object)
    opener.start()
    opener.join()
    return lane


def test_an_arrival_appended_without_the_lock_during_placement_is_kept_for_the_next() -> None:
    lane = _opened_on_another_thread()  # placed from this thread: not the lane's
    early = [new_request(i, 0.0, None, 0) for i in range(3)]
    late = new_request("late", 0.0, None, 0)
    lane.arrivals = _RacingArrivals(late)
    lane.arrivals.extend(early)
    sched = Scheduler(DynamicBatcher(8, max_wait_ms=10), max_concurrent_batches=2, lane=lane)
    first, _ = sched.poll(0.0)  # idle: leaves with what was placed
    assert first is not None and first.requests == early
    assert sched.num_waiting == 1  # the late one waits, counted once
    assert sched.poll(0.005)[0] is None  # a batch runs: it waits for its max wait
    second, _ = sched.poll(0.010)
    assert second is not None and second.requests == [late]
    assert sched.stats.requests == 4


@pytest.mark.parametrize("opened", ["never", "on this thread", "on this thread, then shut"])
def test_arrivals_no_other_thread_appends_to_are_all_placed_in_one_step(opened: str) -> None:
    lane = ArrivalLane()
    if opened != "never":
        lane.open(object())  # type: ignore[arg-type]
    if opened.endswith("shut"):
        lane.shut()
    reqs = [new_request(i, 0.0, None, 0) for i in range(5)]
    lane.arrivals.extend(reqs)
    sched = Scheduler(DynamicBatcher(8, max_wait_ms=10), lane=lane)
    assert sched.arrivals is lane.arrivals and sched.num_waiting == 5
    batch, _ = sched.poll(0.0)
    assert batch is not None and batch.requests == reqs
    assert not lane.arrivals and sched.num_waiting == 0 and sched.stats.requests == 5


def test_a_shut_lane_keeps_its_thread_for_an_append_still_under_way() -> None:
    lane = _opened_on_another_thread()
    lane.shut()
    assert lane.loop is None
    queue: deque[Request] = deque()
    lane.arrivals = _RacingArrivals(new_request("late", 0.0, None, 0))
    lane.arrivals.append(new_request("early", 0.0, None, 0))
    assert lane.move_into(queue) == 1 and [r.item for r in queue] == ["early"]
    assert [r.item for r in lane.arrivals] == ["late"]  # kept, not cleared away
    lane.forget_thread()  # (a fork: no other thread is left)
    assert lane.move_into(queue) == 1 and not lane.arrivals
