"""policy.sampler(): index batches per epoch and rank, resumable, within the policy's limits."""

from __future__ import annotations

import bisect
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchkit import BucketedBatcher, DynamicBatcher, SortedBatcher, StaticBatcher
from batchkit.batchers import BatchSampler
from batchkit.batchers.base import Batcher
from tests.batchers._costs import costs, within_budget

lengths_st = st.lists(st.integers(0, 64), min_size=0, max_size=80)
budget_st = st.none() | st.integers(1, 256)


@st.composite
def policies(draw: st.DrawFn) -> Batcher:
    """One of the policies with a sampler, with random options."""
    size = draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["static", "bucketed", "sorted", "dynamic"]))
    if kind == "static":
        return StaticBatcher(size)
    if kind == "bucketed":
        bounds = sorted(draw(st.lists(st.integers(1, 64), min_size=1, max_size=5, unique=True)))
        return BucketedBatcher(
            bounds, max_batch_size=size, max_tokens=draw(budget_st), cost=draw(costs)
        )
    if kind == "sorted":
        window = draw(st.none() | st.integers(1, 20))
        return SortedBatcher(
            batch_size=size, max_tokens=draw(budget_st), window=window, cost=draw(costs)
        )
    return DynamicBatcher(size, max_tokens=draw(budget_st), cost=draw(costs))


def _ranks(
    policy: Batcher, lengths: list[int], world_size: int, **kw: object
) -> list[list[list[int]]]:
    """Every simulated rank's batches for one epoch."""
    samplers = [
        policy.sampler(lengths, rank=r, world_size=world_size, **kw)  # type: ignore[arg-type]
        for r in range(world_size)
    ]
    return [list(s) for s in samplers]


def _check_limits(policy: Batcher, lengths: list[int], batch: list[int]) -> None:
    assert batch and all(type(i) is int for i in batch)
    assert len(batch) <= policy.max_batch_size
    keys = [lengths[i] for i in batch]
    assert within_budget(policy, keys)
    if isinstance(policy, BucketedBatcher):
        assert len({bisect.bisect_left(policy.boundaries, k) for k in keys}) == 1


@given(lengths_st, policies(), st.integers(1, 5), st.booleans(), st.booleans(), st.integers(0, 9))
def test_ranks_cover_the_dataset(
    lengths: list[int],
    policy: Batcher,
    world_size: int,
    drop_last: bool,
    shuffle: bool,
    seed: int,
) -> None:
    ranks = _ranks(policy, lengths, world_size, drop_last=drop_last, shuffle=shuffle, seed=seed)
    assert len({len(r) for r in ranks}) == 1  # no rank waits on a collective
    sampler = policy.sampler(
        lengths, world_size=world_size, drop_last=drop_last, shuffle=shuffle, seed=seed
    )
    assert len(sampler) == len(ranks[0])
    counts = Counter(i for r in ranks for b in r for i in b)
    for r in ranks:
        for b in r:
            _check_limits(policy, lengths, b)
    if drop_last:
        assert all(c == 1 for c in counts.values())  # no index twice across ranks
        assert len(lengths) - len(counts) <= (world_size - 1) * policy.max_batch_size
    else:
        assert set(counts) == set(range(len(lengths)))  # every index at least once
        repeats = sum(c - 1 for c in counts.values())
        assert repeats <= (world_size - 1) * policy.max_batch_size


@given(lengths_st, policies())
def test_no_shuffle_one_rank_is_the_offline_batches(lengths: list[int], policy: Batcher) -> None:
    policy.key = len  # items below are strings of the given lengths
    offline = [b.indices for b in policy.batches(["x" * n for n in lengths])]
    assert list(policy.sampler(lengths, shuffle=False)) == offline


def test_static_drop_last_policy_yields_full_batches_only() -> None:
    sampler = StaticBatcher(4, drop_last=True).sampler(list(range(10)), world_size=2)
    assert len(sampler) == 1 and len(next(iter(sampler))) == 4


def test_fewer_batches_than_ranks_repeats_them() -> None:
    ranks = _ranks(StaticBatcher(4), [1, 2, 3], 4)
    assert [len(r) for r in ranks] == [1, 1, 1, 1]
    assert all(sorted(r[0]) == [0, 1, 2] for r in ranks)
    assert _ranks(StaticBatcher(4), [1, 2, 3], 4, drop_last=True) == [[], [], [], []]


@pytest.mark.parametrize(
    "policy",
    [
        StaticBatcher(8),
        BucketedBatcher([8, 16, 32], max_batch_size=8, max_tokens=128),
        SortedBatcher(batch_size=8, window=50),
        SortedBatcher(batch_size=8),
    ],
    ids=repr,
)
def test_set_epoch_reshuffles_deterministically(policy: Batcher) -> None:
    lengths = np.random.default_rng(1).integers(1, 40, 300).tolist()
    a = policy.sampler(lengths, seed=3)
    b = policy.sampler(lengths, seed=3)
    epochs = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        epochs.append(list(a))
        assert list(b) == epochs[-1]  # same seed and epoch: same batches
        assert list(a) == epochs[-1]  # and again on the same object
    assert epochs[0] != epochs[1] != epochs[2]
    assert list(policy.sampler(lengths, seed=4)) != epochs[0]
    a.set_epoch(0)
    assert list(a) == epochs[0]


def test_bucketed_shuffles_items_within_buckets() -> None:
    lengths = [5] * 40  # one bucket, one length: only the shuffle decides the batches
    sampler = BucketedBatcher([8], max_batch_size=8).sampler(lengths)
    first = [sorted(b) for b in sampler]
    sampler.set_epoch(1)
    assert [sorted(b) for b in sampler] != first


@given(
    lengths_st,
    policies(),
    st.integers(1, 4),
    st.booleans(),
    st.integers(0, 5),
    st.data(),
)
def test_resume_after_k_batches(
    lengths: list[int],
    policy: Batcher,
    world_size: int,
    drop_last: bool,
    epoch: int,
    data: st.DataObject,
) -> None:
    rank = data.draw(st.integers(0, world_size - 1))
    kw = {"world_size": world_size, "drop_last": drop_last, "seed": 7}
    first = policy.sampler(lengths, rank=rank, **kw)  # type: ignore[arg-type]
    first.set_epoch(epoch)
    full = list(first)
    k = data.draw(st.integers(0, len(full)))
    it = iter(first)
    seen = [next(it) for _ in range(k)]
    state = first.state_dict()
    assert state["epoch"] == epoch and state["batches_yielded"] == k
    assert seen == full[:k]

    fresh = policy.sampler(lengths, rank=rank, **kw)  # type: ignore[arg-type]
    fresh.load_state_dict(dict(state))
    assert fresh.state_dict() == state
    fresh.set_epoch(epoch)  # the usual loop calls it again: the position stays
    assert list(fresh) == full[k:]
    assert fresh.state_dict()["batches_yielded"] == len(full)
    assert list(fresh) == full  # the next pass over the epoch is whole again
    fresh.set_epoch(epoch + 1)
    assert fresh.state_dict()["batches_yielded"] == 0


def test_one_ranks_state_resumes_every_rank() -> None:
    lengths = list(range(1, 50))
    policy = SortedBatcher(batch_size=4, window=10)
    rank0 = policy.sampler(lengths, rank=0, world_size=3)
    it = iter(rank0)
    next(it), next(it)
    rank2 = policy.sampler(lengths, rank=2, world_size=3)
    rank2.load_state_dict(rank0.state_dict())
    assert list(rank2) == list(policy.sampler(lengths, rank=2, world_size=3))[2:]


def test_state_between_iter_and_first_batch() -> None:
    sampler = StaticBatcher(2).sampler([1] * 10)
    sampler.load_state_dict({"epoch": 0, "batches_yielded": 3})
    iter(sampler)
    assert sampler.state_dict()["batches_yielded"] == 3


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"rank": 2, "world_size": 2}, ValueError),
        ({"rank": -1}, ValueError),
        ({"world_size": 0}, ValueError),
        ({"seed": -1}, ValueError),
        ({"lengths": [1, -2]}, ValueError),
        ({"lengths": [1, 2.5]}, TypeError),
        ({"lengths": [True]}, TypeError),
        ({"lengths": "abc"}, TypeError),
        ({"lengths": np.array([1.0, 2.0])}, TypeError),
        ({"lengths": np.array([3, -1])}, ValueError),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception]) -> None:
    lengths = kwargs.pop("lengths", [1, 2, 3])
    with pytest.raises(error):
        StaticBatcher(2).sampler(lengths, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"epoch": 0}, "lacks"),
        ({"epoch": -1, "batches_yielded": 0}, "epoch"),
        ({"epoch": 0, "batches_yielded": 99}, "only 2 batches"),
        ({"epoch": 0, "batches_yielded": 0, "seed": 5}, "seed=5"),
        ({"epoch": 0, "batches_yielded": 0, "num_samples": 4}, "num_samples=4"),
        ({"epoch": 0, "batches_yielded": 0, "world_size": 0}, "world_size"),
        (
            {"epoch": 0, "batches_yielded": 0, "world_size": 2, "batches_digest": "0" * 16},
            "other batches",
        ),
    ],
)
def test_bad_state(state: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StaticBatcher(2).sampler([1, 2, 3]).load_state_dict(state)
    with pytest.raises(ValueError, match="epoch"):
        StaticBatcher(2).sampler([1]).set_epoch(-1)


def test_numpy_lengths_and_empty_dataset() -> None:
    sampler = SortedBatcher(batch_size=2).sampler(np.array([3, 1, 2], dtype=np.int32))
    assert sorted(i for b in sampler for i in b) == [0, 1, 2]
    empty = SortedBatcher(batch_size=2).sampler([], world_size=3)
    assert len(empty) == 0 and list(empty) == []
    assert isinstance(empty, BatchSampler) and "BatchSampler(" in repr(empty)


def test_does_not_import_torch() -> None:
    code = (
        "import sys, batchkit\n"
        "s = batchkit.BucketedBatcher([4, 8]).sampler([1, 5, 9, 3], world_size=2)\n"
        "list(s); len(s); s.state_dict()\n"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- estimated bucket boundaries ----------------------------------------------


@given(st.lists(st.integers(0, 500), min_size=1, max_size=200), st.integers(1, 8))
def test_from_lengths_gives_k_buckets(lengths: list[int], k: int) -> None:
    if len(set(lengths)) < k:
        with pytest.raises(ValueError, match="distinct"):
            BucketedBatcher.from_lengths(lengths, num_buckets=k)
        return
    policy = BucketedBatcher.from_lengths(lengths, num_buckets=k, max_batch_size=4)
    assert len(policy.boundaries) == k and policy.boundaries[-1] == max(lengths)
    assert set(policy.boundaries) <= set(lengths)
    assert policy.max_batch_size == 4


def test_from_lengths_balances_tokens() -> None:
    lengths = np.random.default_rng(0).integers(1, 1000, 20_000)
    policy = BucketedBatcher.from_lengths(lengths, num_buckets=4)
    tokens: Counter[object] = Counter()
    for n in lengths.tolist():
        tokens[policy.bucket_of(n)] += n
    shares = [tokens[b] / lengths.sum() for b in range(4)]
    assert all(0.22 < s < 0.28 for s in shares), shares
    with pytest.raises(ValueError, match="num_buckets"):
        BucketedBatcher.from_lengths(lengths, num_buckets=0)


def _padding_waste(policy: Batcher, lengths: list[int]) -> float:
    real = slots = 0
    for batch in policy.sampler(lengths):
        keys = [lengths[i] for i in batch]
        real, slots = real + sum(keys), slots + len(batch) * max(keys)
    return 1 - real / slots


def test_estimated_boundaries_waste_less_than_powers_of_two() -> None:
    rng = np.random.default_rng(0)
    lengths = np.maximum(1, rng.lognormal(4.0, 1.0, 5000).round()).astype(int).tolist()
    powers = [2**k for k in range(3, 13) if 2 ** (k - 1) < max(lengths)]  # 8 .. covering max
    fixed = BucketedBatcher(powers, max_batch_size=32)
    estimated = BucketedBatcher.from_lengths(lengths, num_buckets=len(powers), max_batch_size=32)
    assert _padding_waste(estimated, lengths) < _padding_waste(fixed, lengths) - 0.02


# -- a real DataLoader ----------------------------------------------------------


def test_dataloader_with_workers() -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchkit import PadCollator

    lengths = [1 + (7 * i) % 23 for i in range(60)]
    dataset = [{"input_ids": list(range(1, n + 1)), "label": i} for i, n in enumerate(lengths)]
    sampler = BucketedBatcher([8, 16, 24], max_batch_size=8).sampler(
        lengths, rank=1, world_size=2, seed=1
    )
    loader: DataLoader[dict[str, object]] = DataLoader(
        dataset,  # type: ignore[arg-type]
        batch_sampler=sampler,
        collate_fn=PadCollator(return_tensors="pt"),
        num_workers=2,
    )
    assert len(loader) == len(sampler)
    got = []
    for batch in loader:
        assert batch["input_ids"].shape == batch["attention_mask"].shape
        assert batch["attention_mask"].dtype == torch.int64
        got.append(sorted(batch["labels"].tolist()))
    assert got == [sorted(b) for b in sampler]


def test_a_refused_resume_state_changes_nothing() -> None:
    sampler = SortedBatcher(batch_size=2).sampler([3, 1, 2, 5, 4, 6, 7, 8, 9, 1], seed=0)
    sampler.set_epoch(2)
    it = iter(sampler)
    next(it), next(it)
    before = sampler.state_dict()
    with pytest.raises(ValueError, match="batches_yielded=99"):
        sampler.load_state_dict({"epoch": 7, "batches_yielded": 99})
    assert sampler.state_dict() == before  # not epoch 7: a position that never existed


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
        loader.load_state_dict(state)
    assert loader.state_dict() == before
    same.load_state_dict(state)  # the same batches: accepted
    assert list(same) == list(it)
