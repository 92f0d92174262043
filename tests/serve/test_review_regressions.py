"""Regressions for bugs a review pass found (each test failed before its fix)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import batchkit
from batchkit import BatcherClosed, DynamicBatcher, RequestTimeout
from batchkit.serve.request import Request
from batchkit.serve.scheduler import Scheduler
from tests.serve._wait import wait_until


def test_concurrent_acloses_both_return() -> None:
    @batchkit.batched(max_batch_size=1)
    async def f(xs):
        await asyncio.sleep(0.05)
        return xs

    async def main():
        task = asyncio.create_task(f(1))
        await asyncio.sleep(0.01)
        closers = [asyncio.create_task(f.aclose()) for _ in range(2)]
        assert await task == 1
        done, pending = await asyncio.wait(closers, timeout=2)
        assert not pending

    asyncio.run(main())


def test_a_listener_may_call_back_into_the_runtime() -> None:
    seen = []
    f = batchkit.batched(max_batch_size=4)(lambda xs: xs)

    class Reentrant:
        def on_batch(self, event):
            seen.append(f.stats().batches)
            f.remove_listener(self)  # a one-shot listener

        def on_drop(self, event):
            pass

    f.add_listener(Reentrant())
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(f, 1).result(5) == 1
        assert pool.submit(f, 2).result(5) == 2
    assert seen == [1]
    f.close()


def test_strict_sizes_cap_is_learned_in_padded_sizes_and_probed_upward() -> None:
    policy = DynamicBatcher(8, 5, preferred_batch_sizes=(1, 2, 4, 8), strict_sizes=True)
    seen = []

    def fn(xs):
        seen.append(len(xs))
        if len(xs) > 4:
            raise MemoryError
        return xs

    f = batchkit.batched(batcher=policy)(fn)
    assert f.map(range(6)) == list(range(6))
    assert f.stats().effective_max_batch_size == {"default": 4}
    seen.clear()
    for _ in range(40):
        f.map(range(8))
    # Full batches of 4 at the cap, then a probe at the next allowed size (8), which runs
    # out of memory and is split back into 4s; nothing else is ever tried.
    assert 8 in seen and set(seen) == {4, 8}
    f.close()


def test_unstack_of_items_holding_empty_lists() -> None:
    items = [{"tags": [], "y": 1}, {"tags": [], "y": 2}]
    back = batchkit.unstack(batchkit.stack(items))
    assert [b["tags"] for b in back] == [[], []] and [int(b["y"]) for b in back] == [1, 2]
    with pytest.raises(ValueError, match="size is unknown"):  # no leaf tells the count
        batchkit.unstack(batchkit.stack([{"tags": []}, {"tags": []}]))


def test_a_batch_left_on_a_closed_loop_does_not_block_the_next_loop() -> None:
    @batchkit.batched(max_batch_size=1)
    async def f(xs):
        await asyncio.sleep(0.5)
        return xs

    first = asyncio.new_event_loop()
    task = first.create_task(f(1))
    first.run_until_complete(asyncio.sleep(0.05))
    first.close()
    assert asyncio.run(asyncio.wait_for(f(2), 5)) == 2
    del task


def test_refused_aclose_changes_nothing() -> None:
    @batchkit.batched(max_batch_size=1)
    async def f(xs):
        await asyncio.sleep(0.2)
        return xs

    results = []

    def other_thread() -> None:
        with pytest.raises(RuntimeError, match="loop it serves"):
            asyncio.run(f.aclose())

    async def main():
        task = asyncio.create_task(f(1))
        await asyncio.sleep(0.02)
        await asyncio.to_thread(other_thread)
        results.append(await task)
        results.append(await f(2))  # still open
        await f.aclose()

    asyncio.run(main())
    assert results == [1, 2]


def test_block_mode_map_timeout_counts_the_blocked_enqueue() -> None:
    f = batchkit.batched(max_batch_size=1, max_wait_ms=0, max_queue_size=1, when_full="block")(
        lambda xs: (time.sleep(0.3), xs)[1]
    )
    start = time.monotonic()
    with pytest.raises(RequestTimeout):
        f.map(["a", "b", "c"], timeout=0.5)
    assert time.monotonic() - start < 0.85
    f.close()


def test_stats_count_running_requests_a_timed_out_close_failed() -> None:
    gate = threading.Event()
    f = batchkit.batched(max_batch_size=1)(lambda xs: (gate.wait(5), xs)[1])
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(f, 1)
        wait_until(lambda: f.stats().in_flight > 0)
        f.close(timeout=0.05)
        with pytest.raises(BatcherClosed):
            fut.result(5)
    assert f.stats().failed == 1
    gate.set()


def test_room_wake_skips_waiters_whose_loop_is_closed() -> None:
    from batchkit.serve.backpressure import RoomWaiters

    room = RoomWaiters()
    dead = asyncio.new_event_loop()
    room.add_async(dead)
    dead.close()
    alive = room.add_thread()
    room.wake(1)  # the closed loop's waiter cannot be woken: the next one must be
    assert alive.acquire(timeout=1)
    assert len(room) == 0


def test_an_int_clock_reading_after_a_float_keeps_stats_working() -> None:
    """Queue waits are ``now - enqueued_at`` with full ``-`` semantics (int - float)."""
    times = iter([0.5] + [2] * 100)

    @batchkit.batched(max_batch_size=4, max_wait_ms=1, clock=lambda: next(times))
    def f(xs: list[int]) -> list[int]:
        return [x * 2 for x in xs]

    assert f(3) == 6
    stats = f.stats()
    assert stats.queue_wait.count == 1 and stats.queue_wait.max == 1.5
    f.close()


def test_the_public_scheduler_accepts_a_request_without_an_arrival_time() -> None:
    from batchkit.serve.scheduler import Scheduler

    sched = Scheduler(DynamicBatcher(4, max_wait_ms=10))
    sched.add(Request("x", 0.0, None, 0))
    batch, _ = sched.poll(0.0)
    assert batch is not None and [r.item for r in batch.requests] == ["x"]


class _LenLies:
    """A sequence whose len() is the batch size but which iterates fewer items (as a
    DataFrame iterates its columns)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(["only-one"])


def test_an_output_that_iterates_fewer_results_than_its_len_fails_its_callers() -> None:
    """Not a silent shift of results between callers: every caller of the batch fails."""

    @batchkit.batched(max_batch_size=3, max_wait_ms=50)
    def f(xs: list[int]) -> _LenLies:
        return _LenLies(len(xs))

    with pytest.raises(ValueError, match="yielded 1"):
        f.map([0, 1, 2])  # one batch of three
    stats = f.stats()
    assert stats.batches == 1 and stats.failed == 3
    f.close()


# -- a second review, of the per-request hot path (bulk arrivals, the poll-due flag) --


def test_stop_iteration_from_collate_fails_its_callers_and_not_the_batcher() -> None:
    def collate(items):
        if "bad" in items:
            raise StopIteration("bad item")
        return items

    @batchkit.batched(max_batch_size=4, max_wait_ms=1, collate=collate)
    async def f(xs):
        return xs

    async def main() -> None:
        with pytest.raises(RuntimeError, match="raised StopIteration: bad item") as info:
            await asyncio.wait_for(f("bad"), 2)  # hung: a future refuses StopIteration
        assert isinstance(info.value.__cause__, StopIteration)
        assert await asyncio.wait_for(f("ok"), 2) == "ok"  # hung: the poll flag stayed set
        await asyncio.wait_for(f.aclose(), 2)

    asyncio.run(main())


def test_a_policy_failing_once_does_not_silence_later_arrivals() -> None:
    class Flaky(DynamicBatcher):
        calls = 0

        def select(self, candidates):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("transient")
            return super().select(candidates)

    @batchkit.batched(batcher=Flaky(max_batch_size=4, max_wait_ms=1))
    async def f(xs):
        return xs

    async def main() -> None:
        first = asyncio.ensure_future(f(1))
        await asyncio.sleep(0.05)
        assert await asyncio.wait_for(f(2), 2) == 2
        assert await asyncio.wait_for(first, 2) == 1
        await f.aclose()

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda loop, ctx: None)  # the one failing pump is logged
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_a_select_that_reorders_its_list_still_takes_what_it_chose() -> None:
    from batchkit.serve.scheduler import Scheduler

    class ShortestFirst(DynamicBatcher):
        candidate_limit = None

        def select(self, candidates):
            candidates.sort(key=lambda r: r.key)  # in place
            return candidates[:2]

    sched = Scheduler(ShortestFirst(max_batch_size=2, max_wait_ms=0, key=len))
    for item in ["ccc", "a", "bb"]:
        sched.add(Request(item, float(len(item)), None, 0))
    served = []
    while True:
        batch, _ = sched.poll(0.0)
        if batch is None:
            break
        served += [r.item for r in batch.requests]
        sched.finish(batch, 0.0)
    assert served == ["a", "bb", "ccc"]  # was ['a', 'bb', 'bb']: ccc lost, bb run twice


def test_a_cancelled_batch_task_answers_its_callers_and_frees_its_slot() -> None:
    @batchkit.batched(max_batch_size=4, max_wait_ms=1)
    async def f(xs):
        return xs

    async def main() -> None:
        first = asyncio.ensure_future(f(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        runs = [t for t in asyncio.all_tasks() if "_run" in repr(t.get_coro())]
        assert runs
        for t in runs:
            t.cancel()  # before its first step: its batch was never settled
        with pytest.raises(BatcherClosed, match="task running this batch was cancelled"):
            await asyncio.wait_for(first, 2)
        assert await asyncio.wait_for(f(2), 2) == 2  # hung: the slot stayed busy
        assert f.stats().failed == 1
        await f.aclose()

    asyncio.run(main())


# -- session 5 review: the hot-path shortcuts --------------------------------------


def test_a_select_replaced_on_the_policy_instance_is_not_taken_for_a_prefix() -> None:
    """The queue-front shortcut trusts only the built-in select methods; one replaced on
    the instance (a mock, a monkeypatch) that is not a prefix used to pop the wrong
    entries: request 2 ran three times, 0 and 1 were lost."""
    from batchkit.batchers.dynamic import DynamicBatcher

    policy = DynamicBatcher(max_batch_size=4, max_wait_ms=1000)
    policy.select = lambda cands: [cands[-1]]  # type: ignore[method-assign]
    sched = Scheduler(policy)
    for i in range(3):
        sched.add(Request(i, 0.0, None, 0))
    served = []
    while (batch := sched.poll(0.0)[0]) is not None:
        served += [r.item for r in batch.requests]
        sched.finish(batch, 0.0)
    assert served == [2, 1, 0]


def test_a_keyless_policy_in_several_buckets_serves_the_oldest_head_first() -> None:
    """Scheduler users (simulate(keys=...)) may bucket a keyless policy's requests: the
    arrival order must still break ties between buckets."""
    from batchkit.batchers.bucketed import BucketedBatcher

    policy = BucketedBatcher([4, 8], key=None, max_batch_size=1, max_wait_ms=0)
    sched = Scheduler(policy)

    def add(item: str, key: float) -> None:
        sched.add(Request(item, key, policy.bucket_of(key), 0))

    add("first-short", 2.0)  # makes bucket 0 the first in dict order
    batch, _ = sched.poll(0.0)
    assert batch is not None
    sched.finish(batch, 0.0)
    add("older-long", 6.0)
    add("newer-short", 2.0)
    sched.closing = True
    batch, _ = sched.poll(0.0)
    assert batch is not None and [r.item for r in batch.requests] == ["older-long"]
