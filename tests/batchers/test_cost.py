"""cost=: what max_tokens bounds (padded area, sum of keys, or a function of the keys)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchkit import BucketedBatcher, DynamicBatcher, SortedBatcher
from tests.batchers._costs import costs, reference_cost, squares

lengths_st = st.lists(st.integers(0, 64), min_size=0, max_size=80)


def _items(lengths: Sequence[int]) -> list[str]:
    return ["x" * n for n in lengths]


@given(lengths_st, st.integers(1, 9), st.integers(1, 256), costs)
def test_each_batch_is_the_longest_prefix_within_budget(
    lengths: list[int], size: int, budget: int, cost: Any
) -> None:
    """Arrival order: a batch ends only when full or when the next item would take its
    cost over the budget (so a cost that is ignored, or computed wrongly, shows)."""
    policy = DynamicBatcher(size, max_tokens=budget, cost=cost)
    batches = [b.indices for b in policy.batches(_items(lengths))]
    for batch, following in zip(batches, batches[1:]):
        grown = [lengths[i] for i in [*batch, following[0]]]
        assert len(batch) == size or reference_cost(policy, grown) > budget


def test_sum_packs_more_items_than_padded_at_the_same_budget() -> None:
    lengths = [60, 4, 4, 4, 4, 4, 4, 4]
    padded = DynamicBatcher(32, max_tokens=100).batches(_items(lengths))
    summed = DynamicBatcher(32, max_tokens=100, cost="sum").batches(_items(lengths))
    assert [b.indices for b in padded] == [[0], [1, 2, 3, 4, 5, 6, 7]]  # 2 x 60 > 100
    assert [b.indices for b in summed] == [list(range(8))]  # 60 + 7 x 4 = 88


def test_callable_cost_bounds_attention_work() -> None:
    lengths = [8, 8, 8, 8, 8]  # squares: 64 each; a budget of 200 holds three
    policy = DynamicBatcher(32, max_tokens=200, cost=squares)
    assert [b.indices for b in policy.batches(_items(lengths))] == [[0, 1, 2], [3, 4]]


@pytest.mark.parametrize("cost", ["padded", "sum", squares], ids=["padded", "sum", "squares"])
def test_an_item_over_budget_alone_still_goes_alone(cost: Any) -> None:
    policy = DynamicBatcher(8, max_tokens=10, cost=cost)
    assert [b.indices for b in policy.batches(_items([20, 1, 1]))] == [[0], [1, 2]]


def test_a_cost_that_falls_ends_the_batch_at_the_first_prefix_over_budget() -> None:
    """Documented: later items are not tried once a prefix is over the budget, even if
    a longer prefix would cost less again."""
    calls: list[tuple[float, ...]] = []

    def dips(keys: Sequence[float]) -> float:
        calls.append(tuple(keys))
        return 100.0 if len(keys) == 2 else 1.0

    policy = DynamicBatcher(8, max_tokens=10, cost=dips)
    calls.clear()  # (the construction check called it once)
    assert [b.indices for b in policy.batches(_items([1, 1, 1]))] == [[0], [1], [2]]
    assert all(len(keys) <= 2 for keys in calls)  # never a prefix of three


@given(lengths_st, st.integers(1, 9), st.integers(1, 256), costs, st.none() | st.integers(1, 9))
def test_sorted_batches_keep_the_budget_under_each_cost(
    lengths: list[int], size: int, budget: int, cost: Any, window: int | None
) -> None:
    policy = SortedBatcher(batch_size=size, max_tokens=budget, cost=cost, window=window)
    for b in policy.batches(_items(lengths)):
        assert len(b) == 1 or reference_cost(policy, [len(x) for x in b]) <= budget


def test_bucketed_sum_budget_counts_the_bucket_total() -> None:
    policy = BucketedBatcher([10, 100], max_batch_size=16, max_tokens=30, cost="sum")
    batches = [[len(x) for x in b] for b in policy.batches(_items([9, 9, 9, 9, 50]))]
    assert batches == [[9, 9, 9], [9], [50]]


def test_strict_sizes_count_the_repeated_padding_items() -> None:
    """A batch of 3 padded up to 4 repeats its last item: under "sum" the repeat costs
    too, so a batch that fits only unpadded is cut down to a preferred size."""
    policy = DynamicBatcher(
        4, preferred_batch_sizes=(1, 2, 4), strict_sizes=True, max_tokens=35, cost="sum"
    )
    lengths = [10, 10, 12]  # 32 as it is, 44 padded to 4 (the 12 twice)
    assert policy.select([_Req(k) for k in lengths]) == [_Req(10), _Req(10)]
    roomy = DynamicBatcher(
        4, preferred_batch_sizes=(1, 2, 4), strict_sizes=True, max_tokens=44, cost="sum"
    )
    assert len(roomy.select([_Req(k) for k in lengths])) == 3  # 44 fits: padded up later


class _Req:
    """A waiting request as select() sees it: just a key."""

    def __init__(self, key: float) -> None:
        self.key = float(key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Req) and other.key == self.key

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("cost", "error", "words"),
    [
        ("tokens", ValueError, "cost must be 'padded', 'sum' or a callable"),
        (3, TypeError, "cost must be 'padded', 'sum' or a callable"),
        (lambda keys: "many", TypeError, "must return a number, got str"),
        (lambda keys: math.nan, ValueError, "must return a number >= 0"),
        (lambda keys: -1, ValueError, "must return a number >= 0"),
        (lambda keys: True, TypeError, "must return a number, got bool"),
        (lambda keys, extra: 1.0, TypeError, "sample keys (1.0,)"),
        (lambda keys: keys[0] / 0, TypeError, "ZeroDivisionError"),
    ],
)
@pytest.mark.parametrize("make", [DynamicBatcher, BucketedBatcher, SortedBatcher])
def test_a_bad_cost_is_a_clear_error_at_construction(
    make: Any, cost: Any, error: type[Exception], words: str
) -> None:
    args = ([8],) if make is BucketedBatcher else ()
    with pytest.raises(error, match="cost") as caught:
        make(*args, max_tokens=64, cost=cost)
    assert words in str(caught.value)


def test_a_cost_that_turns_bad_later_names_the_keys() -> None:
    policy = DynamicBatcher(8, max_tokens=64, cost=lambda keys: None if len(keys) > 1 else 1)
    with pytest.raises(TypeError, match=r"cost\(keys\) must return a number, got NoneType"):
        list(policy.batches(["ab", "cd"]))


def test_the_policy_shows_its_cost() -> None:
    assert "cost='sum'" in repr(DynamicBatcher(8, max_tokens=64, cost="sum"))
    assert "cost=<cost squares>" in repr(DynamicBatcher(8, max_tokens=64, cost=squares))
    assert DynamicBatcher(8).cost.name == "padded"  # the default: today's meaning
