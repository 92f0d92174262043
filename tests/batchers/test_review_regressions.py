"""Regressions from a review of the policies and samplers: each test failed before its fix."""

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
        list(policy.batches([3.0, float("nan"), 1.0]))  # was sorted/bucketed silently wrong


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


@pytest.mark.parametrize(
    ("boundaries", "match"),
    [
        ([10, float("nan"), 30], r"boundaries\[1\] must be a number, got nan"),
        (["a", "b"], r"boundaries\[0\] must be a number, got 'a'"),
        ([1, None], r"boundaries\[1\] must be a number, got None"),
        ([True, 5], r"boundaries\[0\]"),
    ],
)
def test_bucket_boundaries_must_be_numbers(boundaries: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BucketedBatcher(boundaries)


def test_boundaries_must_be_iterable() -> None:
    with pytest.raises(TypeError, match="boundaries must be an iterable of numbers, got int"):
        BucketedBatcher(5)  # type: ignore[arg-type]


def test_max_batch_size_is_checked_before_preferred_sizes_cap_it() -> None:
    with pytest.raises(ValueError, match="max_batch_size must be a positive int, got 8.7"):
        DynamicBatcher(8.7, preferred_batch_sizes=[1, 2, 4])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"preferred_batch_sizes\[1\] must be a positive int"):
        DynamicBatcher(8, preferred_batch_sizes=[2, "4"])  # type: ignore[list-item]
    assert DynamicBatcher(8, preferred_batch_sizes=[4, 2]).max_batch_size == 4


def test_a_refused_resume_state_changes_nothing() -> None:
    sampler = SortedBatcher(batch_size=2).sampler([3, 1, 2, 5, 4, 6, 7, 8, 9, 1], seed=0)
    sampler.set_epoch(2)
    it = iter(sampler)
    next(it), next(it)
    before = sampler.state_dict()
    with pytest.raises(ValueError, match="batches_yielded=99"):
        sampler.load_state_dict({"epoch": 7, "batches_yielded": 99})
    assert sampler.state_dict() == before  # was epoch 7: a position that never existed


def test_preferred_sizes_above_the_maximum_are_refused() -> None:
    with pytest.raises(ValueError, match=r"preferred_batch_sizes \[8\] exceed max_batch_size=4"):
        DynamicBatcher(4, preferred_batch_sizes=[2, 8], strict_sizes=True)  # padded 3 -> 8 > 4
    assert DynamicBatcher(preferred_batch_sizes=[4, 8]).max_batch_size == 8  # default 32 caps


@pytest.mark.parametrize(
    "other",
    [
        {"drop_last": True},
        {"shuffle": False},
        {"lengths": [3, 1, 2, 5, 4, 6, 7, 8, 2]},
        {"policy": SortedBatcher(batch_size=3)},
    ],
    ids=["drop_last", "shuffle", "dataset", "policy"],
)
def test_a_state_saved_for_other_batches_is_refused(other: dict) -> None:
    options = {
        "policy": SortedBatcher(batch_size=2),
        "lengths": [3, 1, 2, 5, 4, 6, 7, 8, 9],  # 5 batches on 2 ranks: drop_last matters
        "drop_last": False,
        "shuffle": True,
    }

    def make(opts: dict):  # rank 0 of 2
        return opts["policy"].sampler(
            opts["lengths"], world_size=2, drop_last=opts["drop_last"], shuffle=opts["shuffle"]
        )

    saver = make(options)
    it = iter(saver)
    next(it)
    state = saver.state_dict()
    same = make(options)
    options.update(other)
    loader = make(options)
    before = loader.state_dict()
    with pytest.raises(ValueError, match="saved for other batches"):
        loader.load_state_dict(state)  # was accepted: resumed into a different batch list
    assert loader.state_dict() == before
    same.load_state_dict(state)  # the same batches: accepted
    assert list(same) == list(it)
