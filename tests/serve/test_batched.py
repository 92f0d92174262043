"""@batched end to end: threads and asyncio callers, every error path, close."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit
from batchkit import (
    BatcherClosed,
    BucketedBatcher,
    DynamicBatcher,
    QueueFull,
    RequestTimeout,
    SortedBatcher,
    StaticBatcher,
)
from tests.serve._wait import wait_until


def model(xs: list[str]) -> list[str]:
    """A deterministic 'model': each result depends on its own item only."""
    return [x.upper() + str(len(x)) for x in xs]


class Recorder:
    """Wraps a batch function and records every batch it saw."""

    def __init__(self, fn=model, delay: float = 0.0) -> None:
        self.fn, self.delay, self.batches = fn, delay, []
        self.lock = threading.Lock()

    def __call__(self, xs):
        with self.lock:
            self.batches.append(list(xs))
        if self.delay:
            time.sleep(self.delay)
        return self.fn(xs)


policy_st = st.sampled_from(["dynamic", "dynamic_tokens", "bucketed", "sorted"])


def make_policy(name: str, size: int, wait_ms: float):
    return {
        "dynamic": lambda: DynamicBatcher(size, wait_ms),
        "dynamic_tokens": lambda: DynamicBatcher(size, wait_ms, max_tokens=6 * size),
        "bucketed": lambda: BucketedBatcher([2, 5], max_batch_size=size, max_wait_ms=wait_ms),
        "sorted": lambda: SortedBatcher(batch_size=size, max_wait_ms=wait_ms),
    }[name]()


def check_batches(rec: Recorder, policy, items: list[str]) -> None:
    run = [x for b in rec.batches for x in b]
    assert sorted(run) == sorted(items)  # nothing lost, nothing duplicated
    for b in rec.batches:
        assert 1 <= len(b) <= policy.max_batch_size
        if policy.max_tokens is not None and len(b) > 1:
            assert len(b) * max(map(len, b)) <= policy.max_tokens


items_st = st.lists(st.text("abc", min_size=0, max_size=8), min_size=1, max_size=60, unique=True)


@settings(max_examples=15, deadline=None)
@given(
    items_st,
    policy_st,
    st.integers(1, 8),
    st.sampled_from([0.0, 1.0, 3.0]),
    st.integers(1, 8),
    st.integers(1, 2),
)
def test_threads_each_get_their_own_result(items, policy_name, size, wait, threads, slots) -> None:
    policy = make_policy(policy_name, size, wait)
    rec = Recorder()
    f = batchkit.batched(batcher=policy, max_concurrent_batches=slots)(rec)
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(f, items))
    f.close()
    assert results == [model([x])[0] for x in items]
    check_batches(rec, policy, items)
    assert f.stats().requests == len(items) == f.stats().items_run


@settings(max_examples=15, deadline=None)
@given(items_st, policy_st, st.integers(1, 8), st.sampled_from([0.0, 2.0]), st.booleans())
def test_tasks_each_get_their_own_result(items, policy_name, size, wait, is_async) -> None:
    policy = make_policy(policy_name, size, wait)
    rec = Recorder()
    if is_async:

        async def fn(xs):
            await asyncio.sleep(0)
            return rec(xs)
    else:
        fn = rec
    f = batchkit.batched(batcher=policy)(fn)

    async def main():
        out = await asyncio.gather(*(f.acall(x) for x in items))
        await f.aclose()
        return out

    assert asyncio.run(main()) == [model([x])[0] for x in items]
    check_batches(rec, policy, items)


def test_concurrent_async_callers_form_full_batches() -> None:
    rec = Recorder()

    @batchkit.batched(max_batch_size=16, max_wait_ms=50)
    async def f(xs):
        return rec(xs)

    async def main():
        return await asyncio.gather(*(f(str(i)) for i in range(64)))

    assert asyncio.run(main()) == [model([str(i)])[0] for i in range(64)]
    assert [len(b) for b in rec.batches] == [16, 16, 16, 16]
    assert f.stats().dispatch_reasons == {"full": 4}


def test_map_restores_order_with_sorted_policy() -> None:
    items = ["x" * n for n in [5, 1, 4, 2, 3, 9, 0, 7]]
    rec = Recorder()
    f = batchkit.batched(batcher=SortedBatcher(batch_size=3, max_wait_ms=20))(rec)
    assert f.map(items) == model(items)
    f.close()

    async def main():
        return await f2.amap(items)

    f2 = batchkit.batched(batcher=BucketedBatcher([2, 5], max_batch_size=3))(model)
    assert asyncio.run(main()) == model(items)


def test_function_error_fails_exactly_its_batch() -> None:
    boom = RuntimeError("boom")
    gate = threading.Event()

    def fn(xs):
        gate.wait(5)
        if "bad" in xs:
            raise boom
        return model(xs)

    f = batchkit.batched(batcher=StaticBatcher(2))(fn)
    with ThreadPoolExecutor(4) as pool:
        futs = {x: pool.submit(f, x) for x in ["bad", "a"]}
        time.sleep(0.05)
        futs.update({x: pool.submit(f, x) for x in ["b", "c"]})
        gate.set()
        with pytest.raises(RuntimeError) as info:
            futs["bad"].result(5)
        # The function's own exception (each caller raises its own copy), not a wrapper.
        assert type(info.value) is RuntimeError and info.value.args == ("boom",)
        with pytest.raises(RuntimeError):
            futs["a"].result(5)
        assert futs["b"].result(5) == "B1" and futs["c"].result(5) == "C1"
    f.close()


def test_returned_exception_fails_only_its_caller() -> None:
    f = batchkit.batched(lambda xs: [ValueError(x) if x == "bad" else x for x in xs])
    assert f.map(["a", "b"]) == ["a", "b"]
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(f, x) for x in ["a", "bad", "c"]]
        assert futs[0].result() == "a" and futs[2].result() == "c"
        with pytest.raises(ValueError, match="bad"):
            futs[1].result()
    f.close()


def test_wrong_length_names_both_lengths() -> None:
    f = batchkit.batched(lambda xs: xs[:-1])
    with pytest.raises(ValueError, match="returned 0 results for a batch of 1"):
        f("a")
    g = batchkit.batched(lambda xs: 42)
    with pytest.raises(TypeError, match="expected a sequence of 1 results"):
        g("a")


def test_callback_bugs_never_kill_the_worker() -> None:
    calls = {"n": 0}

    def bad_collate(xs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("collate bug")
        return xs

    f = batchkit.batched(collate=bad_collate, split=lambda out: list(out))(model)
    with pytest.raises(KeyError):
        f("a")
    assert f("a") == "A1"  # the worker survived
    g = batchkit.batched(batcher=DynamicBatcher(4, key=lambda x: 1 / len(x)))(model)
    with pytest.raises(ZeroDivisionError):
        g("")  # key bug: only this caller, at call time
    assert g("ab") == "AB2"


def test_queue_full_is_immediate() -> None:
    gate = threading.Event()
    f = batchkit.batched(max_batch_size=1, max_queue_size=2)(lambda xs: (gate.wait(5), xs)[1])
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(f, "r")
        wait_until(lambda: f.stats().in_flight > 0)
        queued = [pool.submit(f, x) for x in "ab"]
        wait_until(lambda: f.stats().queue_depth >= 2)
        with pytest.raises(QueueFull):  # at once: the gate opens only after it
            f("c")
        assert not gate.is_set()
        gate.set()
        assert running.result(5) == "r" and [q.result(5) for q in queued] == ["a", "b"]
    assert f.stats().rejected == 1


def test_timeout_fires_while_all_batches_busy_and_item_never_runs() -> None:
    gate = threading.Event()
    rec = Recorder(lambda xs: (gate.wait(5), xs)[1])
    f = batchkit.batched(max_batch_size=1)(rec)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(f, "r")
        wait_until(lambda: f.stats().in_flight > 0)
        with pytest.raises(RequestTimeout) as info:
            f("late", timeout=0.05)
        assert isinstance(info.value, TimeoutError)
        gate.set()
        assert running.result(5) == "r"
    f.close()
    assert ["late"] not in rec.batches and f.stats().timeouts == 1


def test_async_cancel_drops_item_before_it_runs() -> None:
    rec = Recorder()

    @batchkit.batched(max_batch_size=1)
    async def f(xs):
        await asyncio.sleep(0.05)
        return rec(xs)

    async def main():
        first = asyncio.create_task(f.acall("first"))
        await asyncio.sleep(0.01)
        victim = asyncio.create_task(f.acall("victim"))
        await asyncio.sleep(0.01)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        with pytest.raises(RequestTimeout):  # "first" still runs: no slot for 10 ms
            await f.acall("slow", timeout=0.01)
        assert await first == "FIRST5"
        await f.aclose()

    asyncio.run(main())
    assert rec.batches == [["first"]]
    assert f.stats().cancelled == 1


def test_priority_lower_served_first() -> None:
    gate = threading.Event()
    rec = Recorder(lambda xs: (gate.wait(5), xs)[1])
    f = batchkit.batched(max_batch_size=1)(rec)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(f, "first")
        wait_until(lambda: f.stats().in_flight > 0)
        low = pool.submit(f, "low", priority=5)
        wait_until(lambda: f.stats().queue_depth >= 1)
        high = pool.submit(f, "high", priority=-1)
        wait_until(lambda: f.stats().queue_depth >= 2)
        gate.set()
        for fut in (first, low, high):
            fut.result(5)
    assert rec.batches == [["first"], ["high"], ["low"]]


def test_close_drains_then_rejects() -> None:
    f = batchkit.batched(batcher=StaticBatcher(4))(model)
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(f, x) for x in "ab"]
        wait_until(lambda: f.stats().queue_depth >= 2)
        f.close()  # the partial static batch is served, not dropped
        assert [fu.result(5) for fu in futs] == ["A1", "B1"]
    with pytest.raises(BatcherClosed):
        f("c")
    assert f.stats().dispatch_reasons == {"closing": 1}


def test_close_timeout_answers_everyone_even_if_function_hangs() -> None:
    gate = threading.Event()
    f = batchkit.batched(max_batch_size=1)(lambda xs: (gate.wait(), xs)[1])
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(f, x) for x in "abc"]
        wait_until(lambda: f.stats().in_flight > 0 and f.stats().queue_depth >= 2)
        f.close(timeout=0.05)  # returns although the function hangs until the gate opens
        for fu in futs:
            with pytest.raises(BatcherClosed):
                fu.result(2)
    gate.set()


def test_async_close_timeout() -> None:
    @batchkit.batched(max_batch_size=1)
    async def f(xs):
        await asyncio.sleep(10)
        return xs

    async def main():
        tasks = [asyncio.create_task(f(x)) for x in "ab"]
        await asyncio.sleep(0.01)
        await f.aclose(timeout=0.05)
        for t in tasks:
            with pytest.raises(BatcherClosed):
                await t
        with pytest.raises(BatcherClosed):
            await f("c")

    asyncio.run(asyncio.wait_for(main(), 5))


def test_methods_get_a_queue_per_instance() -> None:
    class Model:
        def __init__(self, tag: str) -> None:
            self.tag = tag

        @batchkit.batched(max_batch_size=4)
        def predict(self, xs):
            return [self.tag + x for x in xs]

    a, b = Model("a"), Model("b")
    assert a.predict("1") == "a1" and b.predict("1") == "b1"
    assert a.predict is a.predict and a.predict is not b.predict
    a.predict.close()
    with pytest.raises(BatcherClosed):
        a.predict("2")
    assert b.predict("2") == "b2"


def test_strict_sizes_function_sees_only_allowed_sizes() -> None:
    rec = Recorder()
    policy = DynamicBatcher(8, 20, preferred_batch_sizes=[2, 4, 8], strict_sizes=True)
    f = batchkit.batched(batcher=policy)(rec)
    items = [str(i) for i in range(13)]
    assert f.map(items) == model(items)
    assert all(len(b) in (2, 4, 8) for b in rec.batches)
    assert f.stats().padded_slots == sum(map(len, rec.batches)) - len(items)


def test_async_function_call_returns_awaitable_and_stats() -> None:
    @batchkit.batched
    async def f(xs):
        return xs

    async def main():
        aw = f(1)
        assert asyncio.iscoroutine(aw)
        return await aw

    assert asyncio.run(main()) == 1
    s = f.stats()
    assert isinstance(s.requests, int) and s.requests == 1 and s.batches == 1
    assert s.batch_sizes == {1: 1} and s.queue_wait.count == 1


def test_batcher_and_size_together_is_an_error() -> None:
    with pytest.raises(ValueError, match="batcher"):
        batchkit.batched(batcher=DynamicBatcher(), max_batch_size=3)


def test_callable_object_with_async_call_runs_on_the_loop() -> None:
    class Model:
        async def __call__(self, xs):
            return [x * 2 for x in xs]

    f = batchkit.batched(Model())

    async def main():
        return await asyncio.gather(*(f(i) for i in range(5)))

    assert asyncio.run(main()) == [0, 2, 4, 6, 8]


def test_slots_methods_share_one_queue_per_instance() -> None:
    class Slotted:
        __slots__ = ("__weakref__",)

        @batchkit.batched(max_batch_size=8, max_wait_ms=30)
        def predict(self, xs):
            return xs

    class NoWeakref:
        __slots__ = ()

        @batchkit.batched
        def predict(self, xs):
            return xs

    m = Slotted()
    assert m.predict is m.predict
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(m.predict, range(32))) == list(range(32))
    assert m.predict.stats().batches < 32
    m.predict.close()
    with pytest.raises(BatcherClosed):
        m.predict(1)
    with pytest.raises(TypeError, match="__weakref__"):
        NoWeakref().predict(1)


def test_strict_sizes_padding_respects_token_budget() -> None:
    rec = Recorder(lambda xs: xs)
    policy = DynamicBatcher(8, 0, preferred_batch_sizes=[1, 4, 8], strict_sizes=True, max_tokens=20)
    f = batchkit.batched(batcher=policy)(rec)
    items = ["abcd" + str(i) for i in range(5)]  # 5 tokens each: at most 4 per batch
    assert f.map(items) == items
    for b in rec.batches:
        assert len(b) in (1, 4, 8) and len(b) * max(map(len, b)) <= 20


def test_map_timeout_counts_from_the_call() -> None:
    # One item per 0.2 s batch: b starts at 0.2 s, inside the 0.3 s; c would start at
    # 0.4 s and is withdrawn at 0.3 s with d. A timeout counted per item instead would
    # let every item run (no timeouts, 0.8 s in all).
    f = batchkit.batched(max_batch_size=1)(lambda xs: (time.sleep(0.2), xs)[1])
    start = time.monotonic()
    with pytest.raises(RequestTimeout):
        f.map(["a", "b", "c", "d"], timeout=0.3)
    assert time.monotonic() - start < 0.7  # returns when b finishes, at 0.4 s
    f.close()
    assert f.stats().timeouts == 2


def test_map_is_all_or_nothing_under_queue_limit() -> None:
    rec = Recorder()

    @batchkit.batched(max_batch_size=1, max_queue_size=2)
    async def g(xs):
        return rec(xs)

    async def main():
        with pytest.raises(QueueFull, match="5 items do not fit"):
            await g.amap(["a", "b", "c", "d", "e"])
        await asyncio.sleep(0.02)
        assert await g.amap(["x", "y"]) == model(["x", "y"])

    asyncio.run(main())
    assert rec.batches == [["x"], ["y"]]  # none of the rejected map's items ran


def test_listeners_see_batches_and_drops_and_cannot_break_the_runtime() -> None:
    events: list[object] = []

    class Spy:
        def on_batch(self, event):
            events.append(event)

        def on_drop(self, event):
            events.append(event)

    class Broken:
        def on_batch(self, event):
            raise RuntimeError("listener bug")

        def on_drop(self, event):
            raise RuntimeError("listener bug")

    f = batchkit.batched(batcher=DynamicBatcher(4, 0, key=len), max_queue_size=4)(model)
    f.add_listener(Broken())
    f.add_listener(Spy())
    assert f.map(["ab", "abcd"]) == ["AB2", "ABCD4"]
    with pytest.raises(QueueFull):
        f.map(["x"] * 5)
    f.close()
    batches = [e for e in events if isinstance(e, batchkit.serve.BatchEvent)]
    drops = [e for e in events if isinstance(e, batchkit.serve.DropEvent)]
    assert sum(b.size for b in batches) == 2 and all(b.failed == 0 for b in batches)
    assert sum(b.tokens for b in batches) == 6.0
    assert all(b.padded_tokens >= b.tokens and b.latency >= 0 for b in batches)
    assert drops == [batchkit.serve.DropEvent(f.__qualname__, "rejected", 5)]


def test_batch_event_counts_requests_a_timed_out_close_answered() -> None:
    events = []

    class Spy:
        def on_batch(self, event):
            events.append(event)

        def on_drop(self, event):
            pass

    gate = threading.Event()
    f = batchkit.batched(max_batch_size=1, max_wait_ms=0)(lambda xs: (gate.wait(5), xs)[1])
    f.add_listener(Spy())
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(f, "x")
        wait_until(lambda: f.stats().in_flight > 0)
        f.close(timeout=0.05)
        with pytest.raises(BatcherClosed):
            fut.result(5)
        gate.set()
        deadline = time.monotonic() + 5
        while not events and time.monotonic() < deadline:
            time.sleep(0.001)
    assert events and events[0].failed == 1


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


def test_a_blocking_call_from_an_event_loop_thread_warns_once_naming_acall() -> None:
    """f(x) blocks the loop's thread: its calls cannot batch together (batches of one)."""
    f = batchkit.batched(max_batch_size=4, max_wait_ms=1)(lambda xs: xs)

    async def main() -> list[int]:
        return [f(1), f(2)]

    with pytest.warns(RuntimeWarning, match=r"acall") as record:
        assert asyncio.run(main()) == [1, 2]
    assert len(record) == 1
    f.close()


def test_a_blocking_call_from_a_plain_thread_does_not_warn() -> None:
    import warnings

    f = batchkit.batched(max_batch_size=4, max_wait_ms=1)(lambda xs: xs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert f(1) == 1
    f.close()


class _FailsOnce(batchkit.DynamicBatcher):
    """A policy whose select() raises once (a policy bug)."""

    failed = False

    def select(self, candidates):  # type: ignore[no-untyped-def]
        if not self.failed:
            self.failed = True
            raise RuntimeError("select is broken")
        return super().select(candidates)


def test_a_failing_policy_select_answers_its_candidates_and_serving_goes_on() -> None:
    f = batchkit.batched(batcher=_FailsOnce(4, 1))(lambda xs: [x * 2 for x in xs])
    with pytest.raises(RuntimeError, match="select is broken"):
        f(1)
    assert f(2) == 4  # the worker survived: the next call is served
    assert f.stats().failed == 1
    f.close()


def test_an_async_function_survives_a_failing_policy_select() -> None:
    async def double(xs: list[int]) -> list[int]:
        return [x * 2 for x in xs]

    f = batchkit.batched(batcher=_FailsOnce(4, 1))(double)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="select is broken"):
            await f.acall(1)
        assert await f.acall(2) == 4
        await f.aclose()

    asyncio.run(main())


# -- a caller's timeout is checked before anything is queued -----------------------
BAD_TIMEOUTS = [
    (float("nan"), ValueError),
    (-1.0, ValueError),
    (-math.inf, ValueError),
    (1e300, ValueError),  # longer than threading.TIMEOUT_MAX: a wait would overflow
    ("1", TypeError),
    (True, TypeError),
    ([1], TypeError),
]


@pytest.mark.parametrize(("timeout", "error"), BAD_TIMEOUTS)
def test_a_bad_timeout_is_refused_and_nothing_runs(timeout, error) -> None:
    rec = Recorder()
    f = batchkit.batched(max_batch_size=8, max_wait_ms=1)(rec)
    gen = batchkit.batched(max_batch_size=8, max_wait_ms=1)(streaming_model)

    async def from_asyncio() -> None:
        with pytest.raises(error, match="timeout"):
            await f.acall("a", timeout=timeout)
        with pytest.raises(error, match="timeout"):
            await f.amap(["b", "c"], timeout=timeout)
        with pytest.raises(error, match="timeout"):
            gen.astream("d", timeout=timeout)

    with pytest.raises(error, match="timeout"):
        f("e", timeout=timeout)
    with pytest.raises(error, match="timeout"):
        f.map(["f", "g"], timeout=timeout)
    with pytest.raises(error, match="timeout"):
        gen.stream("h", timeout=timeout)
    asyncio.run(from_asyncio())
    assert f("ok") == "OK2"  # the batch it runs in holds nothing refused before
    assert rec.batches == [["ok"]]
    assert f.stats().requests == 1 and gen.stats().requests == 0
    f.close()
    gen.close()


def streaming_model(xs):
    yield [x.upper() for x in xs]


def test_an_infinite_timeout_is_no_bound_on_both_faces() -> None:
    f = batchkit.batched(max_batch_size=8, max_wait_ms=1)(model)
    gen = batchkit.batched(max_batch_size=8, max_wait_ms=1)(streaming_model)

    async def from_asyncio():
        chunks = [c async for c in gen.astream("d", timeout=math.inf)]
        return (
            await f.acall("a", timeout=math.inf),
            await f.amap(["b"], timeout=math.inf),
            chunks,
        )

    assert f("x", timeout=math.inf) == "X1"
    assert f.map(["y", "zz"], timeout=math.inf) == ["Y1", "ZZ2"]
    assert list(gen.stream("s", timeout=math.inf)) == ["S"]
    assert asyncio.run(from_asyncio()) == ("A1", ["B1"], ["D"])
    assert f.stats().timeouts == 0
    f.close()
    gen.close()


# -- how a batch function's output is split per item -------------------------------
def test_a_mapping_result_is_split_per_item() -> None:
    np = pytest.importorskip("numpy")

    def forward(xs):
        x = np.asarray(xs, dtype=float)
        return {"logits": x * 10, "hidden": np.stack([x, -x], axis=1)}

    f = batchkit.batched(batcher=StaticBatcher(2))(forward)
    with ThreadPoolExecutor(2) as pool:
        one, two = pool.map(f, [1, 2])
    assert set(one) == set(two) == {"logits", "hidden"}  # mappings, not the keys
    assert (one["logits"], two["logits"]) == (10.0, 20.0)
    assert list(one["hidden"]) == [1.0, -1.0] and list(two["hidden"]) == [2.0, -2.0]
    f.close()


def test_a_mapping_whose_values_do_not_lead_with_the_batch_is_refused() -> None:
    np = pytest.importorskip("numpy")
    def forward(xs):
        return {"logits": np.zeros((len(xs), 3)), "pooled": np.zeros(3)}  # not per item

    f = batchkit.batched(max_batch_size=2)(forward)
    with pytest.raises(ValueError, match="returned a dict whose values do not all lead"):
        f.map([1, 2])
    f.close()


@pytest.mark.parametrize("one_value", ["ab", b"ab", bytearray(b"ab")], ids=repr)
def test_a_str_or_bytes_result_is_refused_naming_the_function(one_value) -> None:
    def caption(xs):
        return one_value  # one value for the batch, not one per item

    f = batchkit.batched(batcher=StaticBatcher(2))(caption)
    kind = type(one_value).__name__
    with pytest.raises(TypeError, match=f"caption returned a {kind}, one value"):
        f.map(["x", "y"])  # len() agrees: it was split into characters (or ints)

    async def main():
        return await asyncio.gather(f.acall("x"), f.acall("y"), return_exceptions=True)

    assert all(isinstance(e, TypeError) for e in asyncio.run(main()))
    f.close()


def test_a_set_result_is_refused() -> None:
    f = batchkit.batched(max_batch_size=4)(lambda xs: {x * 2 for x in xs})
    with pytest.raises(TypeError, match="returned a set, whose order is arbitrary"):
        f.map([1, 2, 3])
    f.close()


# -- pickling: by reference to the module-level name --------------------------------
@batchkit.batched(max_batch_size=4)
def module_level_double(xs):
    return [x * 2 for x in xs]


def test_a_module_level_batched_function_pickles_by_reference() -> None:
    import pickle

    assert pickle.loads(pickle.dumps(module_level_double)) is module_level_double
    assert module_level_double(4) == 8  # (its queue and workers are untouched)


def test_a_batched_function_not_at_module_level_refuses_to_pickle_saying_what_to_do() -> None:
    import pickle

    local = batchkit.batched(max_batch_size=4)(model)  # model's own name is not it
    with pytest.raises(pickle.PicklingError, match="module-level name.*Define it with @batched"):
        pickle.dumps(local)


# -- a dropped function closes ----------------------------------------------------------
DROPPED = """
import asyncio, gc, threading, time, weakref
import batchkit

def made_at_run_time(is_async):
    held = bytearray(10)  # what the closure keeps alive

    if is_async:
        async def model(xs):
            return [len(held) + x for x in xs]
    else:
        def model(xs):
            return [len(held) + x for x in xs]

    f = batchkit.batched(max_batch_size=2, max_wait_ms=1)(model)
    if is_async:
        assert asyncio.run(f.acall(1)) == 11
    else:
        assert f(1) == 11
    return weakref.ref(f), weakref.ref(model)

for is_async in (False, True):
    f, model = made_at_run_time(is_async)
    gc.collect()
    assert f() is None  # the wrapper is collected...
    deadline = time.monotonic() + 10
    # ...then its workers exit, and the function they held (with its closure) is freed.
    while model() is not None or any(t.name.startswith("batchkit-") for t in threading.enumerate()):
        assert time.monotonic() < deadline, model() and gc.get_referrers(model())
        time.sleep(0.01)
        gc.collect()
print("served")
"""


def test_a_dropped_function_stops_its_workers_and_frees_its_closure() -> None:
    # In a child: the test run's own functions and threads must not count.
    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            [sys.executable, "-c", DROPPED], cwd=root, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the child hung")
    assert done.returncode == 0 and done.stdout.strip() == "served", done.stderr[-3000:]
