"""PackingBatcher: best-fit decreasing within a token budget, offline, online and as a
sampler whose ranks get equal batch counts, every index once and balanced tokens."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import batchkit
from batchkit import PackingBatcher
from tests.batchers._costs import squares, within_budget

lengths_st = st.lists(st.integers(0, 90), min_size=0, max_size=120)


def _items(lengths: list[int]) -> list[str]:
    return ["x" * n for n in lengths]


def _check_packed(policy: PackingBatcher, lengths: list[int]) -> list[list[int]]:
    batches = [b.indices for b in policy.batches(_items(lengths))]
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        keys = [lengths[i] for i in b]
        assert within_budget(policy, keys)
        assert len(b) <= policy.max_batch_size
        assert keys == sorted(keys, reverse=True)  # decreasing, as packed
    return batches


@given(lengths_st, st.integers(1, 100))
def test_batches_keep_the_budget_and_no_two_would_fit_together(
    lengths: list[int], budget: int
) -> None:
    policy = PackingBatcher(max_tokens=budget)
    batches = _check_packed(policy, lengths)
    # best fit opens a batch only when the item fits no open one, so (items over the
    # budget and zero-length ones aside) no two batches could have been one
    loads = [sum(lengths[i] for i in b) for b in batches]
    loads = [x for x in loads if 0 < x <= budget]
    for a in range(len(loads)):
        for b in range(a + 1, len(loads)):
            assert loads[a] + loads[b] > budget


@given(lengths_st, st.integers(1, 300), st.integers(1, 6), st.sampled_from(["sum", "padded"]))
def test_another_cost_or_a_size_limit_is_kept_too(
    lengths: list[int], budget: int, size: int, cost: str
) -> None:
    _check_packed(PackingBatcher(max_tokens=budget, max_batch_size=size, cost=cost), lengths)
    _check_packed(PackingBatcher(max_tokens=budget * budget, cost=squares), lengths)


@pytest.mark.parametrize("cost", ["padded", squares])
def test_zero_length_items_go_at_most_max_tokens_to_a_batch_under_any_cost(cost: object) -> None:
    # Without a size limit, zero-cost items share batches of at most max_tokens items,
    # as with the default "sum" cost (a batch of 3 empty items once left max_tokens=2).
    policy = PackingBatcher(max_tokens=2, cost=cost)  # type: ignore[arg-type]
    batches = list(policy.batches(_items([0, 0, 0, 5, 1])))
    assert [b.indices for b in batches] == [[3], [4], [0, 1], [2]]


def test_best_fit_takes_the_tightest_batch() -> None:
    # 5 -> A (room 3); 4 -> B (room 4); 3 -> A, tightest (room 0); 3 -> B (room 1);
    # 2, 2 -> C; 1 -> B, the tightest with room
    batches = list(PackingBatcher(max_tokens=8).batches(_items([5, 4, 3, 3, 2, 2, 1])))
    assert [b.indices for b in batches] == [[0, 2], [1, 3, 6], [4, 5]]


def test_an_item_over_the_budget_goes_alone() -> None:
    batches = list(PackingBatcher(max_tokens=10).batches(_items([25, 3, 4, 11])))
    assert [b.indices for b in batches] == [[0], [3], [2, 1]]


def test_float_keys_pack_by_the_loop() -> None:
    batches = list(PackingBatcher(max_tokens=1, key=float).batches([0.5, 0.25, 0.75, 0.5]))
    assert sorted(sum(b) for b in batches) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("bad", "error"),
    [(0, ValueError), (-3, ValueError), (2.5, ValueError), (None, TypeError), (True, TypeError)],
)
def test_max_tokens_must_be_a_positive_int(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="max_tokens must be a positive int"):
        PackingBatcher(max_tokens=bad)  # type: ignore[arg-type]


def test_packing_is_exported_from_batchkit_and_batchers() -> None:
    assert batchkit.PackingBatcher is batchkit.batchers.PackingBatcher is PackingBatcher


# -- online ---------------------------------------------------------------


@dataclass
class Waiting:
    key: float


def test_online_a_batch_is_the_oldest_plus_whatever_still_fits() -> None:
    policy = PackingBatcher(max_tokens=10)
    waiting = [Waiting(6), Waiting(5), Waiting(3), Waiting(9), Waiting(1)]
    assert policy.select(waiting) == [waiting[0], waiting[2], waiting[4]]
    assert policy.select([Waiting(12), Waiting(1)]) == [Waiting(12)]  # over budget: alone
    assert PackingBatcher(max_tokens=10, max_batch_size=2).select(waiting) == waiting[::2][:2]


def test_under_batched_every_batch_keeps_the_budget() -> None:
    seen: list[int] = []

    @batchkit.batched(batcher=PackingBatcher(max_tokens=12, max_wait_ms=20))
    def total(texts: list[str]) -> list[int]:
        seen.append(sum(len(t) for t in texts))
        return [len(t) for t in texts]

    try:
        texts = ["x" * n for n in [5, 7, 3, 9, 2, 4, 6, 1]]
        assert total.map(texts) == [len(t) for t in texts]
    finally:
        total.close()
    assert seen and all(s <= 12 for s in seen)


# -- as a sampler -----------------------------------------------------------


def _rank_batches(
    policy: PackingBatcher, lengths: np.ndarray, world_size: int, **kw: object
) -> list[list[list[int]]]:
    return [
        list(policy.sampler(lengths, rank=r, world_size=world_size, **kw))  # type: ignore[arg-type]
        for r in range(world_size)
    ]


@given(
    st.lists(st.integers(1, 200), min_size=0, max_size=150),
    st.integers(1, 8),
    st.integers(50, 400),
    st.integers(0, 5),
)
def test_sampler_gives_every_rank_as_many_batches_and_every_index_once(
    lengths: list[int], world_size: int, budget: int, seed: int
) -> None:
    policy = PackingBatcher(max_tokens=budget)
    ranks = _rank_batches(policy, np.array(lengths, dtype=np.int64), world_size, seed=seed)
    assert len({len(r) for r in ranks}) == 1
    counts = Counter(i for r in ranks for b in r for i in b)
    for r in ranks:
        for b in r:
            assert within_budget(policy, [lengths[i] for i in b])
    packed = len(policy.index_batches(lengths))
    if len(lengths) >= -(-packed // world_size) * world_size:
        # items enough for the next multiple of world_size: batches are split in two
        # rather than an index repeated
        assert sorted(counts) == list(range(len(lengths)))
        assert set(counts.values()) <= {1}
    else:
        assert set(counts) == set(range(len(lengths)))


def _step_imbalance(ranks: list[list[list[int]]], lengths: np.ndarray) -> float:
    """Mean over steps of (most tokens - fewest) / most, across the ranks' batches."""
    totals = np.array([[lengths[b].sum() for b in r] for r in ranks], dtype=np.float64)
    return float(np.mean((totals.max(axis=0) - totals.min(axis=0)) / totals.max(axis=0)))


def test_each_steps_batches_carry_about_the_same_tokens() -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(500, 2049, 3000)  # batches of one or two: where balance matters
    policy = PackingBatcher(max_tokens=2048)
    balanced = _step_imbalance(_rank_batches(policy, lengths, 8), lengths)
    # the same batches in a plain shuffled order: what balancing removes
    plain = batchkit.batchers.Batcher.arrange
    shuffled = [list(s) for s in _plain_order(policy, lengths, 8, plain)]
    assert balanced <= 0.01 < _step_imbalance(shuffled, lengths) / 10


def _plain_order(
    policy: PackingBatcher, lengths: np.ndarray, world_size: int, arrange: object
) -> list[list[list[int]]]:
    class Plain(PackingBatcher):
        def plan(self, keys, *, shuffled, world_size, rng, drop_last=False):  # type: ignore[no-untyped-def]
            listed = keys.tolist()
            batches = self.index_batches(listed)
            ordered = arrange(self, batches, listed, world_size=world_size, rng=rng)  # type: ignore[operator]
            return [np.asarray(b) for b in ordered]

    plain = Plain(max_tokens=policy.max_tokens or 1)
    return _rank_batches(plain, lengths, world_size)


def test_same_seed_same_batches_another_seed_another_order() -> None:
    lengths = np.random.default_rng(0).integers(1, 400, 500)
    policy = PackingBatcher(max_tokens=1024)
    first = _rank_batches(policy, lengths, 4, seed=1)
    assert first == _rank_batches(policy, lengths, 4, seed=1)
    assert first != _rank_batches(policy, lengths, 4, seed=2)


def test_a_million_lengths_pack_nearly_full() -> None:
    lengths = np.clip(np.random.default_rng(1).lognormal(6, 1, 1_000_000), 1, 8192)
    lengths = lengths.astype(np.int64)
    batches = PackingBatcher(max_tokens=8192).sampler(lengths, world_size=8).global_batches()
    assert lengths.sum() / (len(batches) * 8192) >= 0.999


def test_drop_last_drops_the_lightest_batches_instead_of_splitting() -> None:
    lengths = np.random.default_rng(4).integers(100, 1000, 1001)
    policy = PackingBatcher(max_tokens=2048)
    packed = policy.index_batches(lengths.tolist())
    assert len(packed) % 8  # (some batches do not fill a step)
    ranks = _rank_batches(policy, lengths, 8, drop_last=True)
    kept = [b for r in ranks for b in r]
    assert len(kept) == len(packed) - len(packed) % 8  # as packed: nothing split
    seen = Counter(i for b in kept for i in b)
    assert set(seen.values()) == {1}
    dropped = sorted(set(range(len(lengths))) - set(seen))
    lightest = min(int(lengths[b].sum()) for b in kept)
    assert 0 < int(lengths[dropped].sum()) <= (len(packed) % 8) * lightest
