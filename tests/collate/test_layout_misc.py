"""Targeted checks: conversions, inverse shape checks, collator pad values, numpy-int options."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import batchkit


def test_inverse_rejects_wrong_leading_axes() -> None:
    seqs = [[1, 2, 3], [4]]
    padded = batchkit.pad(seqs)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        padded.unpad(np.zeros((2, 4)))
    varlen = batchkit.pack_varlen(seqs)
    with pytest.raises(ValueError, match=r"\(4,\)"):
        varlen.unpack(np.zeros(5))
    packed = batchkit.pack(seqs, 4)
    with pytest.raises(ValueError, match="unpack"):
        packed.unpack(np.zeros((1, 3)))


def test_unpad_any_trailing_axes_both_sides() -> None:
    for side in ("left", "right"):
        padded = batchkit.pad([[1, 2, 3], [4], []], side=side)  # type: ignore[arg-type]
        hidden = np.arange(3 * 3 * 5).reshape(3, 3, 5)
        got = padded.unpad(hidden)
        assert [g.shape for g in got] == [(3, 5), (1, 5), (0, 5)]
        mask = np.asarray(padded.mask)
        for i, g in enumerate(got):
            np.testing.assert_array_equal(g, hidden[i][mask[i]])


def test_list_floats_follow_torch_default_when_pt() -> None:
    assert batchkit.pad([[1.5], [2.0, 3.0]]).data.dtype == np.float64
    assert batchkit.pad([[1.5], [2.0, 3.0]], return_tensors="pt").data.dtype == torch.float32
    assert batchkit.pad([[[1.5]], [[2.0]]], return_tensors="pt").data.dtype == torch.float32
    assert batchkit.pad([[1], [2, 3]], return_tensors="pt").data.dtype == torch.int64


def test_all_empty_lists_are_int64() -> None:
    assert batchkit.pad([[], []]).data.dtype == np.int64
    assert batchkit.pack_varlen([[]], return_tensors="pt").values.dtype == torch.int64


def test_torch_in_torch_out_and_np_conversion() -> None:
    seqs = [torch.arange(3, dtype=torch.int32), torch.arange(1, dtype=torch.int32)]
    for layout in (batchkit.pad(seqs), batchkit.pack_varlen(seqs), batchkit.pack(seqs, 4)):
        for value in vars_of(layout):
            assert isinstance(value, torch.Tensor)
    for layout in (
        batchkit.pad(seqs, return_tensors="np"),
        batchkit.pack_varlen(seqs, return_tensors="np"),
        batchkit.pack(seqs, 4, return_tensors="np"),
    ):
        for value in vars_of(layout):
            assert isinstance(value, np.ndarray)


def vars_of(layout: object) -> list[object]:
    names = (
        "data",
        "mask",
        "lengths",
        "values",
        "cu_seqlens",
        "position_ids",
        "seq_lens",
        "segment_ids",
    )
    return [getattr(layout, n) for n in names if hasattr(layout, n)]


def test_numpy_integer_options() -> None:
    padded = batchkit.pad([[1]], pad_to_multiple_of=np.int64(4))  # type: ignore[arg-type]
    assert padded.data.shape == (1, 4)
    assert batchkit.pack([[1, 2]], np.int32(3)).data.shape == (1, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize("rt", ["np", "pt"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_pad_collator_pad_values(rt: str, side: str) -> None:
    collate = batchkit.PadCollator(
        pad_values={"input_ids": 9, "tags": -1},
        padding_side=side,  # type: ignore[arg-type]
        pad_to_multiple_of=4,
        return_tensors=rt,  # type: ignore[arg-type]
    )
    out = collate(
        [
            {"input_ids": [1, 2], "label": [5, 6], "tags": [1, 1], "pixels": np.ones((2, 2))},
            {"input_ids": [3], "label": [7], "tags": [2], "pixels": np.zeros((2, 2))},
        ]
    )
    assert set(out) == {"input_ids", "labels", "tags", "pixels", "attention_mask"}
    as_np = {k: np.asarray(v) for k, v in out.items()}
    right = side == "right"
    assert as_np["input_ids"].tolist() == (
        [[1, 2, 9, 9], [3, 9, 9, 9]] if right else [[9, 9, 1, 2], [9, 9, 9, 3]]
    )
    assert as_np["labels"].tolist() == (
        [[5, 6, -100, -100], [7, -100, -100, -100]]
        if right
        else [[-100, -100, 5, 6], [-100, -100, -100, 7]]
    )
    assert (as_np["tags"] == -1).sum() == 5
    assert as_np["pixels"].shape == (2, 2, 2)
    assert as_np["attention_mask"].dtype == np.int64
    assert as_np["attention_mask"].sum(1).tolist() == [2, 1]


def test_list_items_cut_to_length_zero_keep_their_feature_axis() -> None:
    """max_length=0 used to cut the lists before conversion: [] has no feature axis, so
    [B, 0, F] came out as [B, 0]."""
    nested = [[[1, 2], [3, 4]], [[5, 6]]]
    assert batchkit.pad(nested, max_length=0, truncate=True).data.shape == (2, 0, 2)
    assert batchkit.pad(nested, max_length=1, truncate=True).data.shape == (2, 1, 2)
    flat = batchkit.pad([[1, 2, 3], [5]], max_length=0, truncate=True).data
    assert (flat.shape, flat.dtype) == ((2, 0), np.int64)
