"""A `ShapeBuckets` grid fixes every collated batch's shape to one of its cells: dummy
rows and padding are added, the inverse gives the items alone back, and an item too
long (or a batch too large) for the grid is refused, naming it."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit
from batchkit import ShapeBuckets

GRID = ShapeBuckets(batch_sizes=[4, 1, 2], lengths=[8, 4])


def test_a_grid_sorts_its_sizes_and_finds_the_smallest_cell_that_holds_a_batch() -> None:
    assert GRID.batch_sizes == (1, 2, 4) and GRID.lengths == (4, 8)
    assert GRID.cells == [(1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8)]
    assert [GRID.batch_size_for(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert [GRID.length_for(n) for n in (0, 4, 5, 8)] == [4, 4, 8, 8]
    assert [GRID.bucket_of(n) for n in (1, 4, 5, 8)] == [0, 0, 1, 1]
    assert GRID.padded_tokens([3, 5, 1]) == 4 * 8
    assert pickle.loads(pickle.dumps(GRID)) == GRID and hash(GRID) == hash(
        ShapeBuckets([1, 2, 4], [4, 8])
    )


@pytest.mark.parametrize(
    ("batch_sizes", "lengths", "error", "match"),
    [
        ([], [4], ValueError, "batch_sizes must name at least one"),
        ([1, 0], [4], ValueError, r"batch_sizes\[1\] must be >= 1"),
        ([1], [4.0], TypeError, r"lengths\[0\] must be an int"),
        ([1], "48", TypeError, "lengths must be an iterable of ints"),
        ([True], [4], TypeError, r"batch_sizes\[0\] must be an int"),
    ],
)
def test_a_bad_grid_is_refused_naming_the_argument(batch_sizes, lengths, error, match) -> None:
    with pytest.raises(error, match=match):
        ShapeBuckets(batch_sizes=batch_sizes, lengths=lengths)


def test_a_length_past_the_grid_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"item 2 has length 9, longer than .* \(8\)"):
        GRID.check_lengths([1, 2, 9], "item")
    with pytest.raises(ValueError, match=r"a batch of 5 items is larger than .* \(4\)"):
        GRID.batch_size_for(5)


items_strategy = st.lists(st.integers(0, 8), min_size=1, max_size=4).map(
    lambda lengths: [np.arange(1, n + 1) * (i + 1) for i, n in enumerate(lengths)]
)


@settings(max_examples=40)
@given(items_strategy, st.sampled_from(["right", "left"]))
def test_pad_in_a_grid_is_a_cell_whose_inverse_gives_the_items_back(items, side) -> None:
    batch = batchkit.pad(items, shapes=GRID, side=side)
    longest = max(len(x) for x in items)
    assert batch.data.shape == (GRID.batch_size_for(len(items)), GRID.length_for(longest))
    assert batch.num_items == len(items) and batch.batch_size == batch.data.shape[0]
    for got, item in zip(batch.unpad(batch.data), items, strict=True):
        np.testing.assert_array_equal(got, item)
    pooled = batch.split(batch.data.sum(1), per_token=False)
    assert [int(p) for p in pooled] == [int(x.sum()) for x in items]
    # dummy rows repeat the last item: no row the model sees is empty
    for row in range(len(items), batch.batch_size):
        np.testing.assert_array_equal(batch.data[row], batch.data[len(items) - 1])


@settings(max_examples=40)
@given(items_strategy)
def test_pack_varlen_in_a_grid_has_the_cells_sizes_whatever_the_items(items) -> None:
    batch = batchkit.pack_varlen(items, shapes=GRID)
    rows = GRID.batch_size_for(len(items))
    length = GRID.length_for(max(len(x) for x in items))
    assert batch.values.shape == (rows * length,)
    assert batch.cu_seqlens.shape == (2 * rows + 1,) and batch.cu_seqlens[-1] == rows * length
    assert type(batch.max_seqlen) is int and batch.max_seqlen == length
    assert int(np.diff(batch.cu_seqlens).max()) <= length  # padding cut to the cell's length
    assert batch.position_ids.shape == (rows * length,)
    for got, item in zip(batch.unpack(batch.values), items, strict=True):
        np.testing.assert_array_equal(got, item)
    for got, item in zip(batch.split(batch.values * 3), items, strict=True):
        np.testing.assert_array_equal(got, item * 3)


def test_pad_collator_in_a_grid_pads_every_aligned_key_to_the_cell() -> None:
    collate = batchkit.PadCollator(shapes=GRID)
    features = [
        {"input_ids": [1, 2, 3], "labels": [0, 1, 0], "score": 0.5},
        {"input_ids": [4, 5, 6, 7, 8], "labels": [1, 1, 1, 1, 1], "score": 1.5},
        {"input_ids": [9], "labels": [1], "score": 2.5},
    ]
    batch = collate(features)
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 8)
    assert batch["attention_mask"].shape == (4, 8) and batch["score"].shape == (4,)
    ids = batch.split(batch["input_ids"], per_token=True)
    assert [x.tolist() for x in ids] == [f["input_ids"] for f in features]
    assert [float(s) for s in batch.split(batch["score"])] == [0.5, 1.5, 2.5]
    assert collate.length_of(features[1]) == 5


@pytest.mark.parametrize(
    "collate",
    [
        lambda xs: batchkit.pad(xs, shapes=GRID),
        lambda xs: batchkit.pack_varlen(xs, shapes=GRID),
        lambda xs: batchkit.PadCollator(shapes=GRID)([{"input_ids": x} for x in xs]),
    ],
    ids=["pad", "pack_varlen", "PadCollator"],
)
def test_an_item_longer_than_the_grid_is_refused_naming_it_and_its_length(collate) -> None:
    with pytest.raises(ValueError, match=r"item 1 has length 9, longer than .*\(8\)"):
        collate([[1, 2], list(range(9))])
    with pytest.raises(ValueError, match=r"5 items is larger than .* \(4\)"):
        collate([[1]] * 5)


def test_a_grid_beside_options_that_set_the_same_sizes_is_refused() -> None:
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        batchkit.pad([[1]], shapes=GRID, pad_to_multiple_of=8)
    with pytest.raises(ValueError, match="num_segments"):
        batchkit.pack_varlen([[1]], shapes=GRID, num_segments=4)
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        batchkit.PadCollator(shapes=GRID, pad_to_multiple_of=8)
    with pytest.raises(TypeError, match="ShapeBuckets"):
        batchkit.PadCollator(shapes=(4, 8))  # type: ignore[arg-type]


def test_pad_in_a_grid_on_torch_keeps_lengths_on_the_host() -> None:
    torch = pytest.importorskip("torch")
    items = [torch.arange(3, device="meta"), torch.arange(5, device="meta")]  # no host copy
    batch = batchkit.pad(items, shapes=GRID)
    assert batch.data.shape == (2, 8) and batch.data.device.type == "meta"
    varlen = batchkit.pack_varlen(items, shapes=GRID)
    assert varlen.values.shape == (16,) and varlen.max_seqlen == 8
    assert [tuple(x.shape) for x in varlen.unpack(varlen.values)] == [(3,), (5,)]
