"""Offline policies: every item in exactly one batch, within size and token limits."""

from __future__ import annotations

import bisect
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchkit import Batch, BucketedBatcher, DynamicBatcher, SortedBatcher, StaticBatcher
from batchkit.batchers.base import Batcher
from tests.batchers._costs import costs, within_budget

lengths_st = st.lists(st.integers(0, 64), min_size=0, max_size=80)
budget_st = st.none() | st.integers(1, 256)


def _items(lengths: list[int]) -> list[str]:
    return ["x" * n for n in lengths]


def _check_cover(policy: Batcher, items: list[str]) -> list[Batch[str]]:
    batches = list(policy.batches(items))
    seen = [i for b in batches for i in b.indices]
    assert sorted(seen) == list(range(len(items)))
    for b in batches:
        assert isinstance(b, Batch) and isinstance(b, list)
        assert list(b) == [items[i] for i in b.indices]
        assert 1 <= len(b) <= policy.max_batch_size
        assert within_budget(policy, [len(x) for x in b])
    return batches


@given(lengths_st, st.integers(1, 9), st.booleans())
def test_static_fixed_sizes(lengths: list[int], size: int, drop_last: bool) -> None:
    items = _items(lengths)
    batches = list(StaticBatcher(size, drop_last=drop_last).batches(items))
    flat = [i for b in batches for i in b.indices]
    expected = len(items) - (len(items) % size if drop_last else 0)
    assert flat == list(range(expected))
    assert all(len(b) == size for b in batches[:-1])
    if drop_last and batches:
        assert len(batches[-1]) == size


@given(lengths_st, st.integers(1, 9), budget_st, costs)
def test_dynamic_in_order(lengths: list[int], size: int, budget: int | None, cost: Any) -> None:
    items = _items(lengths)
    batches = _check_cover(DynamicBatcher(size, max_tokens=budget, cost=cost), items)
    assert [i for b in batches for i in b.indices] == list(range(len(items)))


@given(lengths_st, st.integers(1, 9), budget_st, st.none() | st.integers(1, 20), costs)
def test_sorted_least_padding(
    lengths: list[int], size: int, budget: int | None, window: int | None, cost: Any
) -> None:
    items = _items(lengths)
    policy = SortedBatcher(batch_size=size, max_tokens=budget, window=window, cost=cost)
    batches = _check_cover(policy, items)
    if window is None:
        keys = [len(x) for b in batches for x in b]
        assert keys == sorted(keys)  # ascending key order across and within batches
    else:
        for b in batches:  # a batch never crosses a window
            assert len({i // window for i in b.indices}) == 1


@given(
    lengths_st,
    st.lists(st.integers(1, 64), min_size=1, max_size=5, unique=True),
    st.integers(1, 9),
    budget_st,
    costs,
)
def test_bucketed_never_mixes(
    lengths: list[int], bounds: list[int], size: int, budget: int | None, cost: Any
) -> None:
    bounds.sort()
    items = _items(lengths)
    policy = BucketedBatcher(bounds, max_batch_size=size, max_tokens=budget, cost=cost)
    batches = _check_cover(policy, items)
    for b in batches:
        buckets = {bisect.bisect_left(bounds, len(x)) for x in b}
        assert len(buckets) == 1
        assert [len(x) for x in b] == sorted(len(x) for x in b)


def test_item_over_budget_goes_alone() -> None:
    batches = list(DynamicBatcher(8, max_tokens=10).batches(["a" * 20, "b", "c"]))
    assert [b.indices for b in batches] == [[0], [1, 2]]


def test_bucket_assignment() -> None:
    policy = BucketedBatcher([4, 8])
    assert [policy.bucket_of(k) for k in (0, 4, 5, 8, 9, 100)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(
    "make",
    [
        lambda: StaticBatcher(0),
        lambda: DynamicBatcher(-1),
        lambda: DynamicBatcher(4, max_wait_ms=-1.0),
        lambda: DynamicBatcher(4, max_tokens=0),
        lambda: DynamicBatcher(4, strict_sizes=True),
        lambda: BucketedBatcher([]),
        lambda: BucketedBatcher([8, 4]),
        lambda: SortedBatcher(window=0),
    ],
)
def test_bad_options(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]
