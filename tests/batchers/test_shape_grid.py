"""A policy given a `ShapeBuckets` grid batches by the grid: a request's bucket is
the grid length it pads to, a batch is called at a grid batch size, an item longer
than the grid is refused, and the grid's sizes cannot be contradicted."""

from __future__ import annotations

import pytest

import batchkit
from batchkit import ShapeBuckets

GRID = ShapeBuckets(batch_sizes=[1, 2, 4], lengths=[4, 8, 16])


@pytest.mark.parametrize(
    "policy",
    [batchkit.DynamicBatcher(8, 1, shapes=GRID), batchkit.BucketedBatcher(shapes=GRID)],
    ids=["dynamic", "bucketed"],
)
def test_the_bucket_and_the_called_size_come_from_the_grid(policy) -> None:
    assert policy.max_batch_size == 4
    assert [policy.padded_size(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    keys = [policy.key_of(x) for x in ([1] * 3, [1] * 4, [1] * 5, [1] * 16)]
    assert [policy.bucket_of(k) for k in keys] == [0, 0, 1, 2]
    with pytest.raises(ValueError, match=r"length 17, longer than .* \(16\)"):
        policy.key_of([1] * 17)
    with pytest.raises(ValueError, match=r"items\[1\]: an item has length 17"):
        policy.keys_of([[1], [1] * 17])


def test_offline_batches_never_span_two_grid_lengths() -> None:
    policy = batchkit.DynamicBatcher(4, 1, shapes=GRID)
    items = [[1] * n for n in (3, 9, 4, 10, 2, 16, 5)]
    for batch in policy.batches(items):
        assert len({GRID.length_for(len(x)) for x in batch}) == 1
        assert len(batch) <= 4


def test_a_grid_beside_sizes_that_contradict_it_is_refused() -> None:
    with pytest.raises(ValueError, match="preferred_batch_sizes"):
        batchkit.DynamicBatcher(8, 1, shapes=GRID, preferred_batch_sizes=[2])
    with pytest.raises(ValueError, match="not both"):
        batchkit.BucketedBatcher([4, 8], shapes=GRID)
    with pytest.raises(ValueError, match="needs boundaries"):
        batchkit.BucketedBatcher()
    with pytest.raises(ValueError, match="preferred_batch_sizes"):
        batchkit.DynamicBatcher(2, 1, shapes=GRID)  # the grid calls batches of 4
