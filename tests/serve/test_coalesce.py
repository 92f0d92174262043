"""`@batched(coalesce=...)`: a key waiting or running is computed once, whoever calls
it; a caller that leaves detaches, and nothing runs for nobody."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit
from batchkit import (
    BatcherClosed,
    BucketedBatcher,
    DynamicBatcher,
    Overloaded,
    QueueFull,
    RequestTimeout,
    SortedBatcher,
    StaticBatcher,
)
from batchkit.batchers.base import Batcher
from tests.serve._wait import wait_until

HOLD = -1  # the item whose batch holds the only slot until the test releases it


class HeldModel:
    """A batch function (x -> 10 * x) that records its batches; the batch holding
    `HOLD` waits for `release`, so that the test can queue work behind it."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.release = threading.Event()

    def __call__(self, xs: list[Any]) -> list[Any]:
        self.batches.append(list(xs))
        if HOLD in xs:
            assert self.release.wait(10)
        return [x * 10 for x in xs]

    def items(self) -> list[Any]:
        return [x for batch in self.batches for x in batch if x != HOLD]


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    with concurrent.futures.ThreadPoolExecutor(16) as executor:
        yield executor


def held(
    model: HeldModel, pool: concurrent.futures.ThreadPoolExecutor, **options: Any
) -> tuple[batchkit.BatchedFunction[Any, Any], concurrent.futures.Future[Any]]:
    """A coalescing function whose only slot is busy with `HOLD` (queued work waits)."""
    options.setdefault("coalesce", True)
    f = batchkit.batched(model, **options)
    holding = pool.submit(f, HOLD)
    wait_until(lambda: f.load()[1] == 1)
    return f, holding


def test_duplicates_waiting_together_run_once(pool: concurrent.futures.ThreadPoolExecutor) -> None:
    model = HeldModel()
    f, holding = held(model, pool, max_batch_size=8)
    items = [1, 2, 1, 3, 1, 2, 3, 3]
    calls = [pool.submit(f, x) for x in items]
    wait_until(lambda: f.stats().coalesced == 5)
    assert f.load()[0] == 3  # three distinct keys wait
    model.release.set()
    assert [c.result(5) for c in calls] == [10 * x for x in items]
    assert holding.result(5) == 10 * HOLD
    assert sorted(model.items()) == [1, 2, 3]
    stats = f.stats()
    assert (stats.requests, stats.coalesced, stats.cache_hits) == (4, 5, 0)


def test_a_caller_joins_a_running_request(pool: concurrent.futures.ThreadPoolExecutor) -> None:
    model = HeldModel()
    f, holding = held(model, pool)
    late = pool.submit(f, HOLD)  # the key of the running batch
    wait_until(lambda: f.stats().coalesced == 1)
    model.release.set()
    assert late.result(5) == holding.result(5) == 10 * HOLD
    assert model.batches == [[HOLD]]


def test_a_key_answered_is_computed_again_by_a_later_call() -> None:
    model = HeldModel()
    f = batchkit.batched(model, coalesce=True)
    assert f(4) == 40
    assert f(4) == 40
    assert model.batches == [[4], [4]]  # (no cache: coalescing is for work in flight)


def test_a_joiner_that_times_out_leaves_and_the_others_are_served(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    model = HeldModel()
    f, _ = held(model, pool)
    staying = pool.submit(f, 7)
    wait_until(lambda: f.load()[0] == 1)
    with pytest.raises(RequestTimeout):
        f(7, timeout=0)
    model.release.set()
    assert staying.result(5) == 70
    assert model.items() == [7]
    assert f.stats().timeouts == 1


def test_a_request_every_caller_left_is_withdrawn_before_it_runs() -> None:
    gate = asyncio.Event()
    seen: list[list[int]] = []

    @batchkit.batched(coalesce=True)
    async def model(xs: list[int]) -> list[int]:
        seen.append(list(xs))
        if HOLD in xs:
            await gate.wait()
        return [10 * x for x in xs]

    async def main() -> None:
        holding = asyncio.ensure_future(model.acall(HOLD))
        await asyncio.sleep(0.01)
        callers = [asyncio.ensure_future(model.acall(5)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert model.load() == (1, 1)
        callers[0].cancel()
        await asyncio.sleep(0)
        assert model.load() == (1, 1)  # two callers still wait for 5
        callers[1].cancel()
        callers[2].cancel()
        await asyncio.sleep(0)
        assert model.load() == (0, 1)  # withdrawn: nobody waits for it
        gate.set()
        assert await holding == 10 * HOLD
        for caller in callers:
            with pytest.raises(asyncio.CancelledError):
                await caller
        assert await model.acall(5) == 50  # a new call of the key queues it again

    asyncio.run(main())
    assert seen == [[HOLD], [5]]
    stats = model.stats()
    assert (stats.cancelled, stats.requests, stats.coalesced) == (3, 3, 2)


def test_the_shared_request_waits_at_its_most_urgent_callers_priority(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    model = HeldModel()
    f, _ = held(model, pool, max_batch_size=1)
    first = pool.submit(f, 1, priority=0)
    wait_until(lambda: f.load()[0] == 1)
    second = pool.submit(f, 2, priority=5)
    wait_until(lambda: f.load()[0] == 2)
    urgent = pool.submit(f, 2, priority=-1)  # joins 2, which now goes before 1
    wait_until(lambda: f.stats().coalesced == 1)
    model.release.set()
    assert (first.result(5), second.result(5), urgent.result(5)) == (10, 20, 20)
    assert model.items() == [2, 1]


def test_a_caller_that_joins_is_not_refused_by_a_full_queue(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    model = HeldModel()
    f, _ = held(model, pool, max_queue_size=1)
    waiting = pool.submit(f, 3)
    wait_until(lambda: f.load()[0] == 1)
    with pytest.raises(QueueFull):
        f(4)  # a new key needs room
    joined = pool.submit(f, 3)  # joining adds no work: never refused
    wait_until(lambda: f.stats().coalesced == 1)
    model.release.set()
    assert waiting.result(5) == joined.result(5) == 30
    assert f.stats().rejected == 1


def test_under_a_latency_target_a_caller_that_joins_is_not_refused(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    model = HeldModel()

    def slow(xs: list[int]) -> list[int]:
        clock.now += 0.5  # every batch takes five times the target
        return model(xs)

    f = batchkit.batched(slow, coalesce=True, max_latency_ms=100, clock=clock)
    assert [f(i) for i in range(8)] == [10 * i for i in range(8)]  # it learns the device
    holding = pool.submit(f, HOLD)
    wait_until(lambda: f.load()[1] == 1)
    with pytest.raises(Overloaded):
        f(3)  # new work would be late
    joined = pool.submit(f, HOLD)  # joining adds no work: never refused
    wait_until(lambda: f.stats().coalesced == 1)
    model.release.set()
    assert holding.result(5) == joined.result(5) == 10 * HOLD
    assert f.stats().overloaded == 1


def blocked_for_room(f: batchkit.BatchedFunction[Any, Any]) -> int:
    admission = f.runtime.core.backpressure
    assert admission is not None
    return len(admission.waiters)


def test_with_when_full_block_a_joiner_shares_the_wait_for_room(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    model = HeldModel()
    f, _ = held(model, pool, max_queue_size=1, when_full="block")
    waiting = pool.submit(f, 1)  # fills the queue
    wait_until(lambda: f.load()[0] == 1)
    blocked = pool.submit(f, 2)  # waits for room
    wait_until(lambda: blocked_for_room(f) == 1)
    joined = pool.submit(f, 2)  # joins it while it waits for room
    wait_until(lambda: f.stats().coalesced == 1)
    model.release.set()
    assert (waiting.result(5), blocked.result(5), joined.result(5)) == (10, 20, 20)
    assert sorted(model.items()) == [1, 2]


def test_with_when_full_block_joiners_of_a_caller_that_left_get_room_or_queue_full(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    model = HeldModel()
    f, _ = held(model, pool, max_queue_size=1, when_full="block")
    pool.submit(f, 1)
    wait_until(lambda: f.load()[0] == 1)
    blocked = pool.submit(f, 2, timeout=1.0)  # waits for room, at most 1 s
    wait_until(lambda: blocked_for_room(f) == 1)
    joined = pool.submit(f, 2)  # no timeout of its own
    wait_until(lambda: f.stats().coalesced == 1)
    with pytest.raises(RequestTimeout):
        blocked.result(5)
    with pytest.raises(QueueFull):  # still no room: its own, clear error
        joined.result(5)
    model.release.set()
    assert f(2) == 20  # a later call queues it afresh


def test_with_when_full_block_joiners_keep_a_request_its_cancelled_caller_left() -> None:
    gate = asyncio.Event()

    @batchkit.batched(coalesce=True, max_queue_size=1, when_full="block")
    async def model(xs: list[int]) -> list[int]:
        if HOLD in xs:
            await gate.wait()
        return [10 * x for x in xs]

    async def main() -> None:
        holding = asyncio.ensure_future(model.acall(HOLD))
        await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(model.acall(1))  # fills the queue
        await asyncio.sleep(0.01)
        first = asyncio.ensure_future(model.acall(2))  # waits for room
        await asyncio.sleep(0.01)
        joined = asyncio.ensure_future(model.acall(2))
        await asyncio.sleep(0.01)
        assert model.stats().coalesced == 1
        gate.set()  # room frees as the held batch ends...
        first.cancel()  # ...as the caller waiting for it leaves
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await joined == 20  # queued for the caller left
        assert (await holding, await waiting) == (10 * HOLD, 10)

    asyncio.run(main())


def test_an_error_reaches_every_caller_of_the_key(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    model = HeldModel()

    def failing(xs: list[int]) -> list[Any]:
        out = model(xs)
        return [ValueError(f"bad {x}") if x == 6 else y for x, y in zip(xs, out)]

    f = batchkit.batched(failing, coalesce=True)
    holding = pool.submit(f, HOLD)
    wait_until(lambda: f.load()[1] == 1)
    bad = [pool.submit(f, 6) for _ in range(3)]
    good = pool.submit(f, 2)
    wait_until(lambda: f.stats().coalesced == 2)
    model.release.set()
    for caller in bad:
        with pytest.raises(ValueError, match="bad 6"):
            caller.result(5)
    assert good.result(5) == 20
    assert holding.result(5) == 10 * HOLD
    assert model.items().count(6) == 1


def test_a_key_function_that_raises_fails_only_its_caller(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    model = HeldModel()

    def key(x: int) -> int:
        if x == 13:
            raise LookupError("no key for 13")
        return x

    f, _ = held(model, pool, coalesce=key)
    other = pool.submit(f, 2)
    wait_until(lambda: f.load()[0] == 1)
    with pytest.raises(LookupError, match="no key for 13"):
        f(13)
    model.release.set()
    assert other.result(5) == 20
    assert f.stats().requests == 2  # HOLD and 2: 13 never queued


def test_an_unhashable_item_is_refused_by_name_before_anything_is_queued() -> None:
    f = batchkit.batched(lambda xs: xs, coalesce=True)
    with pytest.raises(TypeError, match="coalescing key must be hashable, got list.*coalesce="):
        f([1, 2])
    assert f.stats().requests == 0
    keyed = batchkit.batched(lambda xs: [sum(x) for x in xs], coalesce=tuple)
    assert keyed([1, 2]) == 3


def test_callers_of_a_key_never_share_a_mutable_result(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    release = threading.Event()

    def model(xs: list[int]) -> list[np.ndarray]:
        if HOLD in xs:
            assert release.wait(10)
        return [np.full(3, float(x)) for x in xs]

    f = batchkit.batched(model, coalesce=True)
    pool.submit(f, HOLD)
    wait_until(lambda: f.load()[1] == 1)
    calls = [pool.submit(f, 2) for _ in range(3)]
    wait_until(lambda: f.stats().coalesced == 2)
    release.set()
    results = [c.result(5) for c in calls]
    results[0] += 100.0  # one caller mutates its array in place
    np.testing.assert_array_equal(results[1], [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(results[2], [2.0, 2.0, 2.0])
    assert len({id(r) for r in results}) == 3


def test_a_generator_function_is_refused_at_decoration() -> None:
    def chunks(xs: list[int]) -> Iterator[list[int]]:
        yield xs

    with pytest.raises(TypeError, match="coalesce= is not supported for a generator"):
        batchkit.batched(chunks, coalesce=True)
    with pytest.raises(TypeError, match="cache= is not supported for a generator"):
        batchkit.batched(chunks, cache={})


def test_bad_options_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="coalesce must be True, False or a function"):
        batchkit.batched(lambda xs: xs, coalesce="yes")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="cache must be a mapping"):
        batchkit.batched(lambda xs: xs, cache=[])  # type: ignore[call-overload]


def test_the_key_includes_the_group(pool: concurrent.futures.ThreadPoolExecutor) -> None:
    model = HeldModel()

    def by_group(x: int) -> str:
        return "held" if x == HOLD else ("odd" if x % 2 else "even")

    f, _ = held(model, pool, group=by_group, coalesce=lambda x: x % 10)
    calls = [pool.submit(f, x) for x in (1, 11, 2, 12, 21)]  # keys 1, 1, 2, 2, 1
    wait_until(lambda: f.stats().coalesced == 3)
    model.release.set()
    assert [c.result(5) for c in calls] == [10, 10, 20, 20, 10]  # the first of each key
    assert sorted(model.items()) == [1, 2]
    # Equal keys in different groups are different requests.
    g = batchkit.batched(model, group=lambda x: x > 100, coalesce=lambda x: x % 100)
    assert g.map([5, 105, 5]) == [50, 1050, 50]


def test_map_and_amap_coalesce_their_own_duplicates() -> None:
    model = HeldModel()
    f = batchkit.batched(model, coalesce=True, max_batch_size=8)
    assert f.map([1, 2, 1, 1, 3]) == [10, 20, 10, 10, 30]
    assert sorted(model.items()) == [1, 2, 3]

    async def main() -> list[int]:
        return await f.amap([4, 4, 5])

    assert asyncio.run(main()) == [40, 40, 50]
    assert sorted(model.items()) == [1, 2, 3, 4, 5]
    assert f.stats().coalesced == 3


def test_a_map_that_does_not_fit_queues_and_joins_nothing(
    pool: concurrent.futures.ThreadPoolExecutor,
) -> None:
    model = HeldModel()
    f, _ = held(model, pool, max_queue_size=2)
    waiting = pool.submit(f, 1)
    wait_until(lambda: f.load()[0] == 1)
    with pytest.raises(QueueFull):
        f.map([1, 2, 3])  # 2 and 3 do not fit: 1 is not joined either
    assert f.stats().coalesced == 0
    model.release.set()
    assert waiting.result(5) == 10
    assert model.items() == [1]


@pytest.mark.parametrize(
    "policy",
    [
        DynamicBatcher(8, max_wait_ms=1),
        SortedBatcher(batch_size=8, max_wait_ms=1, key=len),
        BucketedBatcher(boundaries=[2, 4], max_batch_size=8, max_wait_ms=1, key=len),
        StaticBatcher(3),  # (three keys: one full batch)
    ],
    ids=lambda p: type(p).__name__,
)
def test_every_policy_coalesces(policy: Batcher) -> None:
    seen: Counter[str] = Counter()

    def upper(xs: list[str]) -> list[str]:
        seen.update(xs)
        return [x.upper() for x in xs]

    f = batchkit.batched(upper, batcher=policy, coalesce=True)
    items = ["a", "bb", "a", "ccc", "bb", "a"]
    assert f.map(items) == [x.upper() for x in items]
    assert f.stats().coalesced == 3
    assert seen == {"a": 1, "bb": 1, "ccc": 1}


def test_calls_after_close_are_refused() -> None:
    f = batchkit.batched(lambda xs: xs, cache={1: 1})
    f.close()
    with pytest.raises(BatcherClosed):
        f(1)  # even a key the cache holds


def test_an_async_function_coalesces_its_callers() -> None:
    seen: list[list[int]] = []

    @batchkit.batched(coalesce=True, max_batch_size=16)
    async def double(xs: list[int]) -> list[int]:
        seen.append(list(xs))
        await asyncio.sleep(0)
        return [2 * x for x in xs]

    async def main() -> list[int]:
        return list(await asyncio.gather(*(double(i % 3) for i in range(9))))

    assert asyncio.run(main()) == [2 * (i % 3) for i in range(9)]
    assert Counter(x for batch in seen for x in batch) == {0: 1, 1: 1, 2: 1}


# -- properties -------------------------------------------------------------------
class Ledger:
    """A batch function (x -> x * x + 1) that checks, as it runs, that no key is in
    two running batches and that every key it runs still has a caller."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running: Counter[int] = Counter()
        self.f: batchkit.BatchedFunction[int] | None = None
        self.violations: list[str] = []

    def __call__(self, xs: list[int]) -> list[int]:
        with self.lock:
            for x in set(xs):
                if self.running[x] or xs.count(x) > 1:
                    self.violations.append(f"{x} computed twice at once")
                self.running[x] += 1
            self._check_callers(xs)
        try:
            return [x * x + 1 for x in xs]
        finally:
            with self.lock:
                self.running.subtract(set(xs))

    def _check_callers(self, xs: list[int]) -> None:
        assert self.f is not None
        front = self.f._layers.coalescer
        assert front is not None
        with self.f.runtime.core.lock:  # (callers detach only under it)
            for x in xs:
                shared = front._shared.get(x)
                if shared is None or not shared.callers:
                    self.violations.append(f"{x} ran for nobody")


Call = tuple[int, float | None]  # (item, timeout)
calls_strategy = st.lists(
    st.tuples(st.integers(0, 5), st.sampled_from([None, None, None, 0.0, 0.002])),
    min_size=1,
    max_size=40,
)


@settings(max_examples=25, deadline=None)
@given(calls=calls_strategy, threads=st.integers(2, 8))
def test_threads_every_caller_gets_its_own_outcome_once(calls: list[Call], threads: int) -> None:
    ledger = Ledger()
    f = batchkit.batched(ledger, coalesce=True, max_batch_size=4, max_concurrent_batches=2)
    ledger.f = f

    def one(call: Call) -> str:
        item, timeout = call
        try:
            result = f(item, timeout=timeout)
        except RequestTimeout:
            return "timeout"
        assert result == item * item + 1
        return "result"

    with concurrent.futures.ThreadPoolExecutor(threads) as executor:
        outcomes = list(executor.map(one, calls))
    f.close()
    assert ledger.violations == []
    stats = f.stats()
    assert stats.timeouts == outcomes.count("timeout")
    assert stats.requests + stats.coalesced == len(calls)


@settings(max_examples=25, deadline=None)
@given(
    calls=calls_strategy,
    cancel=st.lists(st.booleans(), min_size=40, max_size=40),
    use_map=st.booleans(),
)
def test_asyncio_every_caller_gets_its_own_outcome_once(
    calls: list[Call], cancel: list[bool], use_map: bool
) -> None:
    ledger = Ledger()

    @batchkit.batched(coalesce=True, max_batch_size=4, max_concurrent_batches=2)
    async def model(xs: list[int]) -> list[int]:
        await asyncio.sleep(0)
        return ledger(xs)

    ledger.f = model

    async def one(call: Call) -> str:
        item, timeout = call
        try:
            if use_map:
                [result] = await model.amap([item], timeout=timeout)
            else:
                result = await model.acall(item, timeout=timeout)
        except RequestTimeout:
            return "timeout"
        assert result == item * item + 1
        return "result"

    async def main() -> list[str | BaseException]:
        tasks = [asyncio.ensure_future(one(c)) for c in calls]
        await asyncio.sleep(0)
        for task, stop in zip(tasks, cancel):
            if stop:
                task.cancel()
            await asyncio.sleep(0)
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    outcomes = asyncio.run(main())
    ended = ("result", "timeout")
    assert all(o in ended or isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert ledger.violations == []
    stats = model.stats()
    assert stats.requests + stats.coalesced == len(calls)
    assert stats.queue_depth == 0 and stats.in_flight == 0
