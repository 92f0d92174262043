"""DynamicBatcher: when a batch leaves (eager or not), its options, and their checks.

The online tests drive the one scheduler with explicit times (no threads, no sleeps);
the end-to-end one runs ``@batched`` on an injected clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

import batchkit
from batchkit import DynamicBatcher
from batchkit.serve.request import new_request
from batchkit.serve.scheduler import Scheduler
from batchkit.serve.stats import DispatchReason
from tests.serve._passes import admit, poll


def add(sched: Scheduler, item: object, now: float) -> None:
    policy = sched.policy
    key = policy.key_of(item)
    req = new_request(item, key, policy.bucket_of(key), 0)
    req.enqueued_at = now
    admit(sched, req)


def items(batch: object) -> list[object]:
    return [r.item for r in batch.requests]  # type: ignore[attr-defined]


# -- eager: whether an idle device takes a partial batch at once ----------------------


def test_eager_by_default_an_idle_device_takes_a_partial_batch_at_once() -> None:
    policy = DynamicBatcher(4, max_wait_ms=10)
    assert policy.eager and policy.dispatch_when_idle
    sched = Scheduler(policy)
    add(sched, 1, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None and batch.reason is DispatchReason.IDLE and items(batch) == [1]


def test_not_eager_an_idle_device_waits_for_max_wait() -> None:
    policy = DynamicBatcher(4, max_wait_ms=10, eager=False)
    assert not policy.dispatch_when_idle
    sched = Scheduler(policy)
    add(sched, 1, 0.0)
    batch, wake = poll(sched, 0.0)
    assert batch is None and wake == pytest.approx(0.010)  # idle, yet it waits
    add(sched, 2, 0.004)
    assert poll(sched, 0.00999)[0] is None
    batch, _ = poll(sched, 0.010)
    assert batch is not None and batch.reason is DispatchReason.MAX_WAIT
    assert items(batch) == [1, 2]  # the fuller batch the wait was for


def test_not_eager_a_full_batch_leaves_at_once() -> None:
    sched = Scheduler(DynamicBatcher(3, max_wait_ms=1000, eager=False))
    for i in range(4):
        add(sched, i, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None and batch.reason is DispatchReason.FULL and items(batch) == [0, 1, 2]


def test_not_eager_with_no_wait_leaves_at_once() -> None:
    sched = Scheduler(DynamicBatcher(4, max_wait_ms=0, eager=False))
    add(sched, 1, 0.0)
    batch, _ = poll(sched, 0.0)
    assert batch is not None and batch.reason is DispatchReason.MAX_WAIT


def test_not_eager_a_partial_batch_still_leaves_on_close() -> None:
    sched = Scheduler(DynamicBatcher(4, max_wait_ms=1000, eager=False))
    add(sched, 1, 0.0)
    assert poll(sched, 0.0)[0] is None
    sched.close()
    batch, _ = poll(sched, 0.0)
    assert batch is not None and batch.reason is DispatchReason.CLOSING and items(batch) == [1]


def test_not_eager_waits_whatever_is_running() -> None:
    # Two slots: the wait counts from the oldest request, idle or busy alike.
    # (Times in quarters of a second: exact in binary, so "waited 250 ms" is exact too.)
    sched = Scheduler(DynamicBatcher(4, max_wait_ms=250, eager=False), max_concurrent_batches=2)
    add(sched, 0, 0.0)
    assert poll(sched, 0.0)[0] is None
    first, _ = poll(sched, 0.25)
    assert first is not None and first.reason is DispatchReason.MAX_WAIT
    add(sched, 1, 0.5)
    batch, wake = poll(sched, 0.5)
    assert batch is None and wake == 0.75
    second, _ = poll(sched, 0.75)
    assert second is not None and second.reason is DispatchReason.MAX_WAIT


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Until ``condition()``; the deadline only keeps a broken build from hanging."""
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"never: {what}")
        time.sleep(0.001)


def test_batched_not_eager_waits_on_its_clock_for_a_fuller_batch() -> None:
    now = 0.0
    sizes: list[int] = []
    policy = DynamicBatcher(4, max_wait_ms=10, eager=False)

    @batchkit.batched(batcher=policy, clock=lambda: now)
    def double(xs: list[int]) -> list[int]:
        sizes.append(len(xs))
        return [2 * x for x in xs]

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(double, 1)
        wait_until(lambda: double.stats().queue_depth == 1, "the first call queued")
        second = pool.submit(double, 2)
        wait_until(lambda: double.stats().queue_depth == 2, "the second call queued")
        # Nothing is running, but the clock stands still: not full, not aged, so the
        # first call is still waiting (an eager policy would have run it alone).
        assert not first.done() and sizes == []
        now = 0.010
        assert (first.result(timeout=30), second.result(timeout=30)) == (2, 4)
    assert sizes == [2]
    assert double.stats().dispatch_reasons == {"max_wait": 1}
    double.close()


def test_batched_eager_runs_a_lone_call_on_a_clock_that_stands_still() -> None:
    sizes: list[int] = []

    @batchkit.batched(batcher=DynamicBatcher(4, max_wait_ms=10), clock=lambda: 0.0)
    def double(xs: list[int]) -> list[int]:
        sizes.append(len(xs))
        return [2 * x for x in xs]

    done = threading.Event()
    results: list[int] = []
    thread = threading.Thread(target=lambda: (results.append(double(1)), done.set()))
    thread.start()
    assert done.wait(30), "an idle eager batcher must not wait for its clock"
    thread.join()
    assert results == [2] and sizes == [1]
    assert double.stats().dispatch_reasons == {"idle": 1}
    double.close()


@pytest.mark.parametrize("eager", ["no", 0, 1, None])
def test_eager_must_be_a_bool(eager: object) -> None:
    with pytest.raises(TypeError, match=f"eager must be True or False, got {eager!r}"):
        DynamicBatcher(4, eager=eager)  # type: ignore[arg-type]


def test_eager_shows_in_repr() -> None:
    assert "eager=False" in repr(DynamicBatcher(4, eager=False))
    assert "eager=True" in repr(DynamicBatcher(4))


# -- preferred sizes -------------------------------------------------------------------


def test_max_batch_size_is_checked_before_preferred_sizes_cap_it() -> None:
    with pytest.raises(ValueError, match=r"max_batch_size must be a positive int.*, got 8\.7"):
        DynamicBatcher(8.7, preferred_batch_sizes=[1, 2, 4])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"preferred_batch_sizes\[1\] must be a positive int"):
        DynamicBatcher(8, preferred_batch_sizes=[2, "4"])  # type: ignore[list-item]
    assert DynamicBatcher(8, preferred_batch_sizes=[4, 2]).max_batch_size == 4


def test_preferred_sizes_above_the_maximum_are_refused() -> None:
    with pytest.raises(ValueError, match=r"preferred_batch_sizes \[8\] exceed max_batch_size=4"):
        DynamicBatcher(4, preferred_batch_sizes=[2, 8], strict_sizes=True)  # padded 3 -> 8 > 4
    assert DynamicBatcher(preferred_batch_sizes=[4, 8]).max_batch_size == 8  # default 32 caps
