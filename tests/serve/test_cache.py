"""`@batched(cache=...)`: successes kept by key in any mapping; a hit never queues."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest
from cachetools import LRUCache
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit
from batchkit import RequestTimeout


class Squares:
    """x -> x * x, counting what it computes; negative items fail alone."""

    def __init__(self) -> None:
        self.seen: Counter[int] = Counter()
        self.lock = threading.Lock()

    def __call__(self, xs: list[int]) -> list[Any]:
        with self.lock:
            self.seen.update(xs)
        return [ValueError(f"negative {x}") if x < 0 else x * x for x in xs]


def test_a_hit_is_answered_without_queueing() -> None:
    model = Squares()
    cache: dict[Any, Any] = {}
    f = batchkit.batched(model, cache=cache)
    assert f(3) == 9
    assert cache == {3: 9}
    assert f(3) == 9
    assert model.seen == {3: 1}
    stats = f.stats()
    assert (stats.requests, stats.batches, stats.cache_hits) == (1, 1, 1)
    assert "coalesced 0, cache hits 1 (callers answered without a request)" in str(stats)


def test_only_successes_are_stored() -> None:
    model = Squares()
    cache: dict[Any, Any] = {}
    f = batchkit.batched(model, cache=cache)
    for _ in range(2):
        with pytest.raises(ValueError, match="negative -2"):
            f(-2)
    assert cache == {}
    assert model.seen == {-2: 2}  # an error is computed again on the next call


def test_cache_clear_and_the_mappings_own_api_empty_it() -> None:
    model = Squares()
    cache: LRUCache[Any, Any] = LRUCache(maxsize=2)
    f = batchkit.batched(model, cache=cache)
    assert f.map([1, 2, 3]) == [1, 4, 9]
    assert sorted(cache) == [2, 3]  # the LRU keeps two
    f.cache_clear()
    assert len(cache) == 0
    f(2)
    cache.clear()
    f(2)
    assert model.seen == {1: 1, 2: 3, 3: 1}


def test_cache_clear_without_a_cache_is_refused() -> None:
    with pytest.raises(TypeError, match="has no cache to clear"):
        batchkit.batched(lambda xs: xs).cache_clear()
    with pytest.raises(TypeError, match="has no cache to clear"):
        batchkit.batched(lambda xs: xs, coalesce=True).cache_clear()


class Store:
    """An adapter to an external store: no `clear()`, and it can be made to fail."""

    def __init__(self) -> None:
        self.data: dict[Any, Any] = {}
        self.broken = False

    def __getitem__(self, key: Any) -> Any:
        if self.broken:
            raise ConnectionError("store unreachable")
        return self.data[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.broken:
            raise ConnectionError("store unreachable")
        self.data[key] = value


def test_an_adapter_without_clear_is_emptied_through_its_own_api() -> None:
    store = Store()
    f = batchkit.batched(Squares(), cache=store)
    assert f(4) == 16
    assert store.data == {4: 16}
    with pytest.raises(TypeError, match=r"has no clear\(\)"):
        f.cache_clear()


def test_a_cache_that_fails_is_logged_and_the_caller_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Store()
    store.broken = True
    f = batchkit.batched(Squares(), cache=store)
    with caplog.at_level(logging.ERROR, logger="batchkit"):
        assert f(5) == 25
    assert "the cache failed to look a key up" in caplog.text
    assert "the cache refused a result" in caplog.text


def test_the_cache_key_is_the_coalesce_key_with_the_group() -> None:
    model = Squares()
    cache: dict[Any, Any] = {}
    f = batchkit.batched(model, cache=cache, coalesce=abs, group=lambda x: x > 0)
    assert f.map([2, 3, 2]) == [4, 9, 4]
    assert cache == {(True, 2): 4, (True, 3): 9}
    assert f(3) == 9  # a hit
    assert model.seen == {2: 1, 3: 1}


def test_hits_are_copies_the_cached_entry_never_changes() -> None:
    def ones(xs: list[int]) -> list[np.ndarray]:
        return [np.ones(2) * x for x in xs]

    cache: dict[Any, Any] = {}
    f = batchkit.batched(ones, cache=cache)
    first = f(3)
    first += 1  # the caller's own copy
    again = f(3)
    np.testing.assert_array_equal(again, [3.0, 3.0])
    np.testing.assert_array_equal(cache[3], [3.0, 3.0])
    again[0] = 0
    np.testing.assert_array_equal(f(3), [3.0, 3.0])


def test_async_callers_and_amap_use_the_cache() -> None:
    cache: dict[Any, Any] = {}

    @batchkit.batched(cache=cache)
    async def halves(xs: list[int]) -> list[float]:
        return [x / 2 for x in xs]

    async def main() -> None:
        assert await halves(4) == 2.0
        assert await halves.amap([4, 6, 4]) == [2.0, 3.0, 2.0]
        assert await halves.acall(6) == 3.0

    asyncio.run(main())
    assert halves.stats().cache_hits == 3


@settings(max_examples=25, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.integers(-1, 6), st.sampled_from([None, None, 0.0])), min_size=1, max_size=40
    ),
    maxsize=st.integers(1, 4),
)
def test_threads_with_an_lru_every_caller_gets_its_own_result(
    calls: list[tuple[int, float | None]], maxsize: int
) -> None:
    model = Squares()
    cache: LRUCache[Any, Any] = LRUCache(maxsize=maxsize)
    f = batchkit.batched(model, cache=cache, max_batch_size=4, max_concurrent_batches=2)

    def one(call: tuple[int, float | None]) -> str:
        item, timeout = call
        try:
            result = f(item, timeout=timeout)
        except RequestTimeout:
            return "timeout"
        except ValueError as exc:
            assert item < 0 and str(exc) == f"negative {item}"
            return "error"
        assert result == item * item
        return "result"

    with concurrent.futures.ThreadPoolExecutor(6) as executor:
        outcomes = list(executor.map(one, calls))
    f.close()
    stats = f.stats()
    assert stats.requests + stats.coalesced + stats.cache_hits == len(calls)
    assert stats.timeouts == outcomes.count("timeout")
    assert all(key >= 0 for key in cache)  # only successes
    assert sum(model.seen.values()) == stats.items_run
