"""Basic round trips for every layout, on numpy and torch (registered leaf types too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import batchkit

SEQS = [[1, 2, 3], [4], [], [5, 6]]


@pytest.mark.parametrize("side", ["left", "right"])
def test_pad_unpad_lists(side: str) -> None:
    padded = batchkit.pad(SEQS, side=side, pad_to_multiple_of=4, pad_value=-1)
    assert padded.data.shape == (4, 4)
    assert padded.lengths.tolist() == [3, 1, 0, 2]
    assert [x.tolist() for x in padded.unpad(padded.data)] == SEQS
    assert (padded.data[~padded.mask] == -1).all()


def test_pad_torch_follows_input() -> None:
    seqs = [torch.randn(n, 2) for n in (3, 1)]
    padded = batchkit.pad(seqs)
    assert isinstance(padded.data, torch.Tensor) and padded.data.shape == (2, 3, 2)
    for got, want in zip(padded.unpad(padded.data), seqs, strict=True):
        assert torch.equal(got, want)


def test_varlen_and_pack_round_trip() -> None:
    varlen = batchkit.pack_varlen(SEQS, pad_to_multiple_of=8)
    assert varlen.cu_seqlens.tolist() == [0, 3, 4, 4, 6, 8]
    assert [x.tolist() for x in varlen.unpack(varlen.values)] == SEQS
    packed = batchkit.pack(SEQS, 4)
    assert [x.tolist() for x in packed.unpack(packed.data)] == SEQS


def test_pad_too_long_names_item() -> None:
    with pytest.raises(ValueError, match="item 0"):
        batchkit.pad(SEQS, max_length=2)


def test_stack_unstack() -> None:
    items = [{"x": np.arange(3) + i, "y": (i, "s")} for i in range(4)]
    back = batchkit.unstack(batchkit.stack(items))
    assert len(back) == 4
    for a, b in zip(back, items, strict=True):
        assert (a["x"] == b["x"]).all() and a["y"][0] == b["y"][0] and a["y"][1] == b["y"][1]


def test_unstack_of_items_holding_empty_lists() -> None:
    items = [{"tags": [], "y": 1}, {"tags": [], "y": 2}]
    back = batchkit.unstack(batchkit.stack(items))
    assert [b["tags"] for b in back] == [[], []] and [int(b["y"]) for b in back] == [1, 2]
    with pytest.raises(ValueError, match="size is unknown"):  # no leaf tells the count
        batchkit.unstack(batchkit.stack([{"tags": []}, {"tags": []}]))


class _Box:
    def __init__(self, a: object) -> None:
        self.a = np.asarray(a)


batchkit.collate.register_leaf(
    _Box,
    lambda leaves, path: _Box(np.stack([leaf.a for leaf in leaves])),
    lambda box: [_Box(x) for x in box.a],
)


def test_registered_leaves_inside_a_list_round_trip() -> None:
    items = [[_Box([i, i]), _Box([-i])] for i in range(3)]
    back = batchkit.unstack(batchkit.stack(items))
    assert len(back) == 3  # was 2: the list's entries were taken for items
    assert [[b.a.tolist() for b in item] for item in back] == [[[i, i], [-i]] for i in range(3)]
    mixed = [{"x": np.ones(2), "boxes": [_Box([i])]} for i in range(3)]
    back_mixed = batchkit.unstack(batchkit.stack(mixed))
    assert [m["boxes"][0].a.tolist() for m in back_mixed] == [[0], [1], [2]]
