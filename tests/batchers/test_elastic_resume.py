"""A sampler state saved on W ranks resumes on any W2: the rest of the epoch covers each
index not yet yielded (exactly once when packed), the same every run; a state from
another dataset length or seed is refused."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchkit import BucketedBatcher, PackingBatcher, SortedBatcher, StaticBatcher
from batchkit.batchers.base import Batcher
from tests.batchers.test_sampler import policies

LENGTHS = np.random.default_rng(11).integers(1, 1500, 4000)


def _run(
    policy: Batcher,
    lengths: np.ndarray,
    world_size: int,
    steps: int | None,
    state: dict | None = None,
    **kw: object,
) -> tuple[list[list[list[int]]], dict]:
    """`steps` batches on every rank (None: to the end), from `state`; each rank's
    batches and the state rank 0 saves afterwards."""
    samplers = []
    for r in range(world_size):
        s = policy.sampler(lengths, rank=r, world_size=world_size, **kw)  # type: ignore[arg-type]
        s.set_epoch(1)
        if state is not None:
            s.load_state_dict(json.loads(json.dumps(state)))  # a state survives JSON
        samplers.append(s)
    out = []
    for s in samplers:
        it = iter(s)
        out.append([next(it) for _ in range(steps)] if steps is not None else list(it))
    assert len({len(s) for s in samplers}) == 1  # every rank: as many batches
    return out, samplers[0].state_dict()


def _indices(ranks: list[list[list[int]]]) -> Counter[int]:
    return Counter(i for r in ranks for b in r for i in b)


@pytest.mark.parametrize(("before", "after"), [(8, 4), (4, 8), (8, 3), (1, 8)])
def test_packed_epoch_resumed_on_other_ranks_covers_every_index_exactly_once(
    before: int, after: int
) -> None:
    policy = PackingBatcher(max_tokens=4096)
    first, state = _run(policy, LENGTHS, before, steps=20, seed=3)
    rest, _ = _run(policy, LENGTHS, after, steps=None, state=state, seed=3)
    counts = _indices(first) + _indices(rest)
    assert sorted(counts) == list(range(len(LENGTHS)))
    assert set(counts.values()) == {1}
    for r in rest:
        for b in r:
            assert LENGTHS[b].sum() <= 4096 or len(b) == 1
    # same seed, same order: a second resume from that state gives the same batches
    assert _run(policy, LENGTHS, after, steps=None, state=state, seed=3)[0] == rest


def test_a_resume_of_a_resume_still_covers_every_index_once() -> None:
    policy = PackingBatcher(max_tokens=4096)
    a, state = _run(policy, LENGTHS, 8, steps=10)
    b, state = _run(policy, LENGTHS, 4, steps=15, state=state)
    assert "resumed_from" in state
    c, state2 = _run(policy, LENGTHS, 4, steps=5, state=state)  # same ranks: goes on
    d, _ = _run(policy, LENGTHS, 8, steps=None, state=state2)
    counts = _indices(a) + _indices(b) + _indices(c) + _indices(d)
    assert sorted(counts) == list(range(len(LENGTHS))) and set(counts.values()) == {1}


@given(
    st.lists(st.integers(0, 64), min_size=0, max_size=80),
    policies(),
    st.integers(1, 5),
    st.integers(1, 5),
    st.booleans(),
    st.data(),
)
def test_any_policy_resumed_on_other_ranks_covers_the_rest(
    lengths: list[int],
    policy: Batcher,
    before: int,
    after: int,
    drop_last: bool,
    data: st.DataObject,
) -> None:
    arr = np.array(lengths, dtype=np.int64)
    total = len(policy.sampler(arr, world_size=before, drop_last=drop_last))
    steps = data.draw(st.integers(0, total))
    first, state = _run(policy, arr, before, steps=steps, drop_last=drop_last)
    rest, _ = _run(policy, arr, after, steps=None, state=state, drop_last=drop_last)
    whole, _ = _run(policy, arr, before, steps=None, drop_last=drop_last)
    done = _indices(first)
    if drop_last:
        assert set((done + _indices(rest)).values()) <= {1}  # no index twice
    else:
        # what the first ranks had not reached, the new ones cover
        assert set(_indices(whole)) - set(done) <= set(_indices(rest))
        # an index both yielded and still to come is one the epoch repeats as padding
        # (drop_last=False pads with batches from the start, as on the same ranks)
        repeated = {i for i, n in _indices(whole).items() if n > 1}
        assert set(done) & set(_indices(rest)) <= repeated


def test_same_ranks_resume_exactly_where_they_stopped() -> None:
    policy = BucketedBatcher([100, 500, 1500], max_batch_size=16, max_tokens=8192)
    whole, _ = _run(policy, LENGTHS, 4, steps=None)
    first, state = _run(policy, LENGTHS, 4, steps=7)
    rest, _ = _run(policy, LENGTHS, 4, steps=None, state=state)
    assert [f + r for f, r in zip(first, rest)] == whole


@pytest.mark.parametrize(
    ("other", "match"),
    [
        ({"lengths": LENGTHS[:-1]}, "num_samples=4000"),
        ({"seed": 9}, "seed=0"),
        ({"policy": SortedBatcher(batch_size=8)}, "other batches"),
    ],
)
def test_a_state_for_another_dataset_length_seed_or_policy_is_refused(
    other: dict, match: str
) -> None:
    _, state = _run(StaticBatcher(8), LENGTHS, 4, steps=3)
    opts = {"policy": StaticBatcher(8), "lengths": LENGTHS, "seed": 0, **other}
    sampler = opts["policy"].sampler(opts["lengths"], world_size=2, seed=opts["seed"])
    sampler.set_epoch(1)
    before = list(sampler)
    with pytest.raises(ValueError, match=match):
        sampler.load_state_dict(state)
    assert list(sampler) == before  # a refused state changes nothing


def test_a_resume_on_the_same_ranks_yields_the_epochs_padding_once() -> None:
    # three items on two ranks: the epoch pads with a repeat of its first batch
    policy = StaticBatcher(1)
    lengths = np.zeros(3, dtype=np.int64)
    whole, _ = _run(policy, lengths, 2, steps=None)
    first, state = _run(policy, lengths, 2, steps=1)
    rest, _ = _run(policy, lengths, 2, steps=None, state=state)
    assert _indices(first) + _indices(rest) == _indices(whole)
