"""Output dtypes: what comes out for what comes in (an empty item never promotes the
batch's dtype; every torch integer dtype pads and packs; list floats follow torch's
default float under torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import batchkit


@pytest.mark.parametrize(
    "items",
    [
        [[[2**60 + 1, 2]], []],  # list items with a feature axis, one empty
        [np.array([2**60 + 1, 2]), np.array([], dtype=np.float64)],  # an empty float array
        [[[True, False]], []],
    ],
    ids=["list-features", "numpy-empty-float", "bool"],
)
def test_an_empty_item_does_not_promote_the_batch_dtype(items: list) -> None:
    padded = batchkit.pad(items)
    assert padded.data.dtype != np.float64  # was float64: 2**60 + 1 lost its last bit
    back = padded.unpad(padded.data)
    assert np.array_equal(np.asarray(back[0]), np.asarray(items[0]))
    assert batchkit.pack_varlen(items).values.dtype == padded.data.dtype
    assert batchkit.pack(items, 4).data.dtype == padded.data.dtype


def test_an_empty_tensor_does_not_promote_the_batch_dtype() -> None:
    items = [torch.tensor([[2**60 + 1, 2]]), torch.tensor([])]
    assert batchkit.pad(items).data.dtype == torch.int64


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_torch_unsigned_dtypes_pad_and_pack(dtype: str) -> None:
    torch_dtype = getattr(torch, dtype)
    items = [torch.ones(3, dtype=torch_dtype), torch.zeros(1, dtype=torch_dtype)]
    assert batchkit.pad(items).data.dtype == torch_dtype  # NotImplementedError before
    assert batchkit.pack(items, 4).data.dtype == torch_dtype


def test_pad_collator_gives_float32_for_float_lists_under_torch() -> None:
    features = [
        {"input_ids": [1, 2], "scores": [0.5, 0.25], "labels": [1.0, 0.0, 1.0]},
        {"input_ids": [3], "scores": [0.75], "labels": [0.0, 1.0, 0.0]},
    ]
    batch = batchkit.PadCollator(return_tensors="pt", pad_values={"scores": 0.0})(features)
    assert batch["scores"].dtype == torch.float32  # was float64
    assert batch["labels"].dtype == torch.float32  # a fixed multi-label vector
