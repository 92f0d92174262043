"""policy.stream(): batches of an iterable in a bounded buffer, seeded, sharded by rank,
ranks on one bucket per step with sync_buckets, each DataLoader worker its own shard."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchkit import BucketedBatcher, DynamicBatcher, PackingBatcher, SortedBatcher, StaticBatcher
from batchkit.batchers.base import Batcher
from tests.batchers._costs import within_budget

lengths_st = st.lists(st.integers(1, 64), min_size=0, max_size=150)


@st.composite
def policies(draw: st.DrawFn) -> Batcher:
    """Every kind of policy, with random limits."""
    size = draw(st.integers(1, 9))
    budget = draw(st.none() | st.integers(64, 256))
    kind = draw(st.sampled_from(["static", "dynamic", "bucketed", "sorted", "packing"]))
    if kind == "static":
        return StaticBatcher(size)
    if kind == "dynamic":
        return DynamicBatcher(size, max_tokens=budget)
    if kind == "bucketed":
        bounds = sorted(draw(st.lists(st.integers(1, 64), min_size=1, max_size=4, unique=True)))
        return BucketedBatcher(bounds, max_batch_size=size, max_tokens=budget)
    if kind == "sorted":
        return SortedBatcher(batch_size=size, max_tokens=budget)
    return PackingBatcher(max_tokens=budget or 128)


class Counting:
    """An iterable of strings of the given lengths that counts the items taken from it."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.taken = 0

    def __iter__(self) -> Iterator[str]:
        for n in self.lengths:
            self.taken += 1
            yield "x" * n


@given(lengths_st, policies(), st.integers(1, 40), st.integers(0, 3))
def test_the_source_never_runs_more_than_buffer_size_ahead(
    lengths: list[int], policy: Batcher, buffer_size: int, seed: int
) -> None:
    source = Counting(lengths)
    stream = policy.stream(source, buffer_size=buffer_size, seed=seed)
    assert source.taken == 0  # lazy: nothing read before the first batch is asked for
    handed = 0
    seen: list[int] = []
    for batch in stream:
        assert source.taken - handed <= buffer_size  # read, not yet handed out
        handed += len(batch)
        assert list(batch) == ["x" * lengths[i] for i in batch.indices]
        assert within_budget(policy, [len(x) for x in batch])
        assert 1 <= len(batch) <= policy.max_batch_size
        seen += batch.indices
    assert sorted(seen) == list(range(len(lengths)))  # one rank: every item exactly once


@given(lengths_st, policies(), st.integers(1, 40), st.integers(1, 5), st.booleans())
def test_ranks_get_as_many_batches_and_share_the_items(
    lengths: list[int], policy: Batcher, buffer_size: int, world_size: int, drop_last: bool
) -> None:
    items = ["x" * n for n in lengths]
    ranks = [
        [
            b.indices
            for b in policy.stream(
                items, buffer_size=buffer_size, rank=r, world_size=world_size, drop_last=drop_last
            )
        ]
        for r in range(world_size)
    ]
    assert len({len(r) for r in ranks}) == 1  # no rank waits on a collective
    counts = Counter(i for r in ranks for b in r for i in b)
    if drop_last:
        assert set(counts.values()) <= {1}  # no item twice
    else:
        assert set(counts) == set(range(len(lengths)))  # every item at least once


def test_a_long_stream_split_across_ranks_covers_every_item_once() -> None:
    lengths = np.random.default_rng(5).integers(1, 500, 3000).tolist()
    items = ["x" * n for n in lengths]
    policy = PackingBatcher(max_tokens=2048)
    ranks = [
        [b.indices for b in policy.stream(items, buffer_size=400, rank=r, world_size=4, seed=2)]
        for r in range(4)
    ]
    flat = sorted(i for r in ranks for b in r for i in b)
    assert flat == list(range(len(items)))
    assert len({len(r) for r in ranks}) == 1


def test_same_seed_same_stream_another_seed_another_order() -> None:
    items = ["x" * n for n in np.random.default_rng(0).integers(1, 64, 500).tolist()]
    policy = BucketedBatcher([8, 16, 32, 64], max_batch_size=8)

    def run(seed: int) -> list[list[int]]:
        return [b.indices for b in policy.stream(items, buffer_size=100, seed=seed)]

    assert run(1) == run(1)
    assert run(1) != run(2)
    unshuffled = [b.indices for b in policy.stream(items, buffer_size=100, shuffle=False)]
    assert unshuffled == [b.indices for b in policy.stream(items, buffer_size=100, shuffle=False)]


def test_sync_buckets_puts_every_rank_on_one_bucket_per_step() -> None:
    rng = np.random.default_rng(1)
    items = ["x" * n for n in rng.integers(1, 100, 2000).tolist()]
    bounds = [10, 30, 60, 100]
    policy = BucketedBatcher(bounds, max_batch_size=6)

    def ranks(sync: bool) -> list[list[list[str]]]:
        return [
            list(policy.stream(items, buffer_size=300, rank=r, world_size=4, sync_buckets=sync))
            for r in range(4)
        ]

    def mixed_steps(per_rank: list[list[list[str]]]) -> int:
        return sum(
            len({bisect.bisect_left(bounds, len(b[0])) for b in step}) > 1
            for step in zip(*per_rank)
        )

    synced = ranks(True)
    assert mixed_steps(synced) == 0
    assert mixed_steps(ranks(False)) > 0  # without it, ranks meet other buckets
    counts = Counter(i for r in synced for b in r for i in b.indices)  # type: ignore[attr-defined]
    assert set(counts) == set(range(len(items)))
    # only the end evens out each bucket's last step, repeating fewer than a step's batches
    assert sum(counts.values()) - len(items) <= (len(bounds) + 1) * 3 * 6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"buffer_size": 0}, "buffer_size must be a positive int"),
        ({"buffer_size": -5}, "buffer_size must be a positive int"),
        ({"rank": 2, "world_size": 2}, r"rank must be an int in \[0, world_size=2\)"),
        ({"world_size": 0}, "world_size must be a positive int"),
        ({"seed": -1}, "seed must be an int >= 0"),
    ],
)
def test_bad_arguments_are_refused_at_the_call(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StaticBatcher(2).stream(iter([]), **kwargs)  # type: ignore[arg-type]


class _Shard:
    """An IterableDataset that streams packed batches, each DataLoader worker its own shard."""

    def __init__(self, lengths: list[int], rank: int, world_size: int) -> None:
        self.lengths, self.rank, self.world_size = lengths, rank, world_size

    def __iter__(self) -> Iterator[list[int]]:
        import torch.utils.data

        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        policy = PackingBatcher(max_tokens=256, key=int)  # the items are the lengths
        items = iter(self.lengths)  # (each worker reads the whole stream, keeps its shard)
        for batch in policy.stream(
            items,
            buffer_size=200,
            seed=0,
            rank=self.rank * workers + worker,
            world_size=self.world_size * workers,
        ):
            yield batch.indices


def test_dataloader_workers_each_stream_their_own_shard() -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader, IterableDataset

    lengths = np.random.default_rng(2).integers(1, 120, 1500).tolist()

    class Dataset(_Shard, IterableDataset):  # type: ignore[misc, type-arg]
        pass

    seen: list[int] = []
    for rank in range(2):
        loader = DataLoader(Dataset(lengths, rank, 2), batch_size=None, num_workers=2)
        seen += [i for batch in loader for i in batch]
    assert sorted(seen) == list(range(len(lengths)))


def test_a_bad_item_is_named_by_its_position_in_the_stream() -> None:
    stream = SortedBatcher(batch_size=2).stream(["ab", "c", "de", 3, "f"], buffer_size=2)
    with pytest.raises(TypeError, match=r"from position 2: items\[1\]"):
        list(stream)


@pytest.mark.parametrize(
    "policy",
    [StaticBatcher(16), DynamicBatcher(16), SortedBatcher(key=float, batch_size=16)],
    ids=["static", "dynamic", "sorted"],
)
@given(
    count=st.integers(0, 700),
    buffer_size=st.integers(16, 600),
    shuffle=st.booleans(),
)
def test_a_size_policys_stream_gives_full_batches_except_the_last(
    policy: Batcher, count: int, buffer_size: int, shuffle: bool
) -> None:
    # A fill's short remainder waits for the next fill instead of going as a short batch
    # (shuffled, the last fill's batches come in a random order: the short one among them).
    batches = list(policy.stream(range(count), buffer_size=buffer_size, shuffle=shuffle))
    sizes = [len(b) for b in batches]
    if shuffle:
        assert sorted(sizes, reverse=True)[:-1] == [16] * (len(batches) - 1)
    else:
        assert sizes[:-1] == [16] * (len(batches) - 1)
    assert sorted(i for b in batches for i in b) == list(range(count))


def test_static_batches_over_6000_items_in_a_buffer_of_500_are_all_full() -> None:
    sizes = Counter(len(b) for b in StaticBatcher(16).stream(range(6000), buffer_size=500))
    assert sizes == Counter({16: 375})


@given(lengths=st.lists(st.integers(1, 64), max_size=400), buffer_size=st.integers(32, 300))
def test_a_bucketed_stream_leaves_at_most_one_short_batch_per_bucket(
    lengths: list[int], buffer_size: int
) -> None:
    policy = BucketedBatcher([16, 32, 64], max_batch_size=8)
    batches = list(policy.stream([[0] * n for n in lengths], buffer_size=buffer_size))
    short = Counter(policy.bucket_of(len(b[0])) for b in batches if len(b) < 8)
    assert all(n == 1 for n in short.values())
    assert sum(len(b) for b in batches) == len(lengths)
