"""Live settings: f.configure() changes what it is given, atomically, for batches formed
from then on; a bad value changes nothing; nothing queued is lost or run twice."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import batchkit
from batchkit import BucketedBatcher, DynamicBatcher, SortedBatcher, StaticBatcher
from tests.serve._wait import wait_until


def test_configure_without_arguments_reads_the_settings_in_force() -> None:
    f = batchkit.batched(max_batch_size=8, max_wait_ms=3, max_queue_size=100)(lambda xs: xs)
    settings = f.configure()
    assert (settings.max_batch_size, settings.max_wait_ms) == (8, 3.0)
    assert (settings.max_concurrent_batches, settings.max_queue_size) == (1, 100)
    f.close()


def test_a_smaller_max_batch_size_applies_to_the_next_batches_not_the_running_one() -> None:
    gate = threading.Event()
    sizes: list[int] = []

    def fn(xs: list[int]) -> list[int]:
        sizes.append(len(xs))
        gate.wait(5)
        return xs

    f = batchkit.batched(max_batch_size=8, max_wait_ms=1000)(fn)
    with ThreadPoolExecutor(16) as pool:
        first = pool.submit(f, -1)
        wait_until(lambda: f.stats().in_flight == 1)
        futures = [pool.submit(f, i) for i in range(12)]
        wait_until(lambda: f.stats().queue_depth == 12)
        assert f.configure(max_batch_size=3).max_batch_size == 3
        gate.set()
        assert first.result(5) == -1 and [x.result(5) for x in futures] == list(range(12))
    f.close()
    assert sizes[0] == 1 and max(sizes[1:]) == 3 and sum(sizes) == 13


def test_raising_concurrency_starts_another_batch_at_once() -> None:
    gate = threading.Event()
    running = threading.Semaphore(0)

    def fn(xs: list[int]) -> list[int]:
        running.release()
        gate.wait(5)
        return xs

    f = batchkit.batched(max_batch_size=1, max_wait_ms=0)(fn)
    with ThreadPoolExecutor(4) as pool:
        a = pool.submit(f, 1)
        assert running.acquire(timeout=5)
        b = pool.submit(f, 2)
        wait_until(lambda: f.stats().queue_depth == 1)
        f.configure(max_concurrent_batches=2)
        assert running.acquire(timeout=5)  # the second batch runs beside the first
        assert f.stats().in_flight == 2
        gate.set()
        assert (a.result(5), b.result(5)) == (1, 2)
    f.close()


def test_max_wait_ms_set_live_is_in_force_and_the_callers_policy_is_left_alone() -> None:
    policy = DynamicBatcher(max_batch_size=8, max_wait_ms=10)
    f = batchkit.batched(batcher=policy)(lambda xs: xs)
    f.configure(max_wait_ms=50)
    assert f.configure().max_wait_ms == 50.0
    assert policy.max_wait_s == 0.010  # the caller's policy object is not changed
    f.close()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": 2.5}, "max_batch_size"),
        ({"max_wait_ms": -1}, "max_wait_ms"),
        ({"max_wait_ms": float("nan")}, "max_wait_ms"),
        ({"max_concurrent_batches": 0}, "max_concurrent_batches"),
        ({"max_wait_ms": 1e300}, "max_wait_ms"),
        ({"max_queue_size": -3}, "max_queue_size"),
    ],
)
def test_a_bad_value_raises_value_error_and_changes_nothing(
    kwargs: dict[str, Any], message: str
) -> None:
    f = batchkit.batched(max_batch_size=8, max_wait_ms=3)(lambda xs: xs)
    before = f.configure()
    with pytest.raises(ValueError, match=message):
        f.configure(**kwargs)
    assert f.configure() == before
    f.close()


def test_one_bad_value_among_good_ones_changes_none_of_them() -> None:
    f = batchkit.batched(max_batch_size=8, max_wait_ms=3)(lambda xs: xs)
    before = f.configure()
    with pytest.raises(ValueError, match="max_wait_ms"):
        f.configure(max_batch_size=2, max_concurrent_batches=4, max_wait_ms=-5)
    assert f.configure() == before
    f.close()


def test_an_unknown_setting_is_a_type_error() -> None:
    f = batchkit.batched(lambda xs: xs)
    with pytest.raises(TypeError):
        f.configure(max_batch=4)  # type: ignore[call-arg]
    f.close()


def test_a_policy_without_the_setting_refuses_it_by_name() -> None:
    f = batchkit.batched(batcher=StaticBatcher(4))(lambda xs: xs)
    assert f.configure().max_wait_ms is None
    with pytest.raises(ValueError, match="StaticBatcher has no max_wait_ms"):
        f.configure(max_wait_ms=5)
    assert f.configure(max_batch_size=2).max_batch_size == 2
    f.close()
    g = batchkit.batched(
        batcher=DynamicBatcher(8, 5, preferred_batch_sizes=(2, 4), strict_sizes=True)
    )(lambda xs: xs)
    with pytest.raises(ValueError, match="preferred_batch_sizes"):
        g.configure(max_batch_size=8)
    g.close()


@pytest.mark.parametrize(
    "policy",
    [
        DynamicBatcher(8, 1),
        BucketedBatcher([4, 16], max_batch_size=8, max_wait_ms=1),
        SortedBatcher(batch_size=8, max_wait_ms=1),
        StaticBatcher(8),
    ],
    ids=["dynamic", "bucketed", "sorted", "static"],
)
def test_every_policy_takes_its_settings_under_load_and_loses_nothing(policy: Any) -> None:
    f = batchkit.batched(batcher=policy)(lambda xs: [x * 2 for x in xs])
    stop = threading.Event()
    has_wait = policy.max_wait_s is not None

    def knob_turner() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            f.configure(
                max_batch_size=1 + i % 8,
                max_concurrent_batches=1 + i % 3,
                max_wait_ms=(i % 3) * 0.5 if has_wait else None,
            )

    turner = threading.Thread(target=knob_turner)
    turner.start()
    items = [str(i) * (1 + i % 7) for i in range(400)]
    try:
        with ThreadPoolExecutor(16) as pool:
            out = list(pool.map(lambda x: f(x, timeout=None), items))
        if isinstance(policy, StaticBatcher):
            f.close()  # a static batch of fewer than the size leaves only at close
    finally:
        stop.set()
        turner.join(5)
    assert out == [x * 2 for x in items]
    stats = f.stats()
    assert stats.requests == stats.items_run == len(items)
    f.close()


def test_a_queue_bound_set_live_refuses_past_it_on_an_event_loop() -> None:
    gate = asyncio.Event()

    @batchkit.batched(max_batch_size=1, max_wait_ms=0)
    async def f(xs: list[int]) -> list[int]:
        await gate.wait()
        return xs

    async def main() -> None:
        first = asyncio.ensure_future(f.acall(0))  # admitted while unbounded
        await asyncio.sleep(0.01)
        f.configure(max_queue_size=2)
        queued = [asyncio.ensure_future(f.acall(i)) for i in (1, 2)]
        await asyncio.sleep(0.01)
        with pytest.raises(batchkit.QueueFull):
            await f.acall(3)
        gate.set()
        assert await asyncio.gather(first, *queued) == [0, 1, 2]
        await f.aclose()

    asyncio.run(main())


def test_a_whole_number_float_batch_size_is_taken_and_stored_as_an_int() -> None:
    f = batchkit.batched(max_batch_size=8, max_wait_ms=3)(lambda xs: xs)
    settings = f.configure(max_batch_size=4.0)  # as a YAML or JSON config gives it
    assert type(settings.max_batch_size) is int and settings.max_batch_size == 4
    with pytest.raises(ValueError, match="max_batch_size must be a positive int"):
        f.configure(max_batch_size=4.5)
    assert f.configure().max_batch_size == 4
    f.close()


def test_check_settings_returns_the_counts_as_ints() -> None:
    from batchkit.serve.options import check_settings, reconfigured

    assert check_settings(16.0, 2.5, 2, 100, 50.0) == (16, 2.5, 2, 100, 50.0)
    batch = check_settings(16.0, None, None, None)[0]
    assert type(batch) is int
    changed = reconfigured(DynamicBatcher(32, 5), 16.0, None)  # type: ignore[arg-type]
    assert type(changed.max_batch_size) is int and changed.max_batch_size == 16


def test_options_store_their_counts_as_ints() -> None:
    from batchkit.serve.options import Options

    options = Options(DynamicBatcher(8), max_queue_size=64.0, max_concurrent_batches=2.0)  # type: ignore[arg-type]
    assert type(options.max_queue_size) is int and options.max_queue_size == 64
    assert type(options.max_concurrent_batches) is int and options.max_concurrent_batches == 2
    with pytest.raises(ValueError, match="max_concurrent_batches"):
        Options(DynamicBatcher(8), max_concurrent_batches=1.5)  # type: ignore[arg-type]


def test_whole_number_float_counts_are_taken_by_batched_and_configure_as_ints() -> None:
    f = batchkit.batched(max_batch_size=4.0, max_queue_size=16.0, max_concurrent_batches=2.0)(  # type: ignore[arg-type]
        lambda xs: xs
    )
    assert f.map([1, 2, 3]) == [1, 2, 3]
    settings = f.configure()
    assert (settings.max_batch_size, settings.max_queue_size) == (4, 16)
    assert type(settings.max_concurrent_batches) is int and settings.max_concurrent_batches == 2
    settings = f.configure(max_concurrent_batches=3.0, max_queue_size=32.0)  # type: ignore[arg-type]
    assert (settings.max_concurrent_batches, settings.max_queue_size) == (3, 32)
    assert type(settings.max_concurrent_batches) is int and type(settings.max_queue_size) is int
    assert f.map(range(10)) == list(range(10))  # the slot arithmetic takes them
    with pytest.raises(ValueError, match="max_queue_size must be a positive int"):
        f.configure(max_queue_size=2.5)  # type: ignore[arg-type]
    f.close()
