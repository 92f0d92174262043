"""Keys: any real number (numpy scalars too) orders and buckets items; NaN, a negative key
under a token budget, or a key function that fails is refused, naming the item, offline
and online (where only the caller with the bad item fails)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import batchkit
from batchkit import BucketedBatcher, DynamicBatcher, SortedBatcher


def _ident(x: float) -> float:
    return x


@pytest.mark.parametrize(
    "policy",
    [SortedBatcher(key=_ident, batch_size=2), BucketedBatcher([2, 5], key=_ident)],
    ids=["sorted", "bucketed"],
)
def test_a_nan_key_is_refused_naming_the_item(policy) -> None:
    with pytest.raises(ValueError, match=r"items\[1\]: key\(item\) must be a number >= 0, got nan"):
        list(policy.batches([3.0, float("nan"), 1.0]))


def test_a_negative_key_is_refused_under_a_token_budget_only() -> None:
    with pytest.raises(ValueError, match=r"items\[0\]: .* >= 0, got -5"):
        list(DynamicBatcher(8, max_tokens=10, key=_ident).batches([-5, -5, -5]))
    # without a budget a key only orders: a negative one (descending lengths) is fine
    got = list(SortedBatcher(key=lambda s: -len(s), batch_size=2).batches(["a", "ccc", "bb"]))
    assert got == [["ccc", "bb"], ["a"]]


def test_numpy_scalar_keys_are_numbers() -> None:
    items = [np.array([1, 2]), np.array([0]), np.array([5])]
    got = list(SortedBatcher(key=lambda a: a.sum(), batch_size=2).batches(items))
    assert [b.indices for b in got] == [[1, 0], [2]]
    got = list(SortedBatcher(key=lambda x: np.float32(x), batch_size=2).batches([2.0, 1.0]))
    assert [list(b) for b in got] == [[1.0, 2.0]]


def test_a_failing_key_names_the_item() -> None:
    with pytest.raises(TypeError, match=r"items\[1\]: object of type 'int' has no len\(\)"):
        list(SortedBatcher().batches(["ab", 3, "c"]))


def test_an_online_caller_with_a_nan_key_fails_alone() -> None:
    @batchkit.batched(batcher=SortedBatcher(key=_ident, batch_size=4))
    def f(xs):
        return xs

    with pytest.raises(ValueError, match="must be a number >= 0, got nan"):
        f(float("nan"))
    assert f(2.0) == 2.0
    f.close()

    @batchkit.batched(batcher=SortedBatcher(key=_ident, batch_size=4))
    async def g(xs):
        return xs

    async def main() -> None:
        with pytest.raises(ValueError, match="got nan"):
            await g(float("nan"))
        assert await g(1.0) == 1.0
        await g.aclose()

    asyncio.run(main())


def test_key_must_return_number() -> None:
    with pytest.raises(TypeError, match="number"):
        list(SortedBatcher(key=str).batches([1, 2]))
