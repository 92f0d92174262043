"""Regressions from a second review of the collators: each test failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest

from batchkit.collate import (
    PadCollator,
    VarlenCollator,
    pack,
    pack_varlen,
    pad,
    register_leaf,
    stack,
    unstack,
)

torch = pytest.importorskip("torch")


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
    padded = pad(items)
    assert padded.data.dtype != np.float64  # was float64: 2**60 + 1 lost its last bit
    back = padded.unpad(padded.data)
    assert np.array_equal(np.asarray(back[0]), np.asarray(items[0]))
    assert pack_varlen(items).values.dtype == padded.data.dtype
    assert pack(items, 4).data.dtype == padded.data.dtype


def test_an_empty_tensor_does_not_promote_the_batch_dtype() -> None:
    items = [torch.tensor([[2**60 + 1, 2]]), torch.tensor([])]
    assert pad(items).data.dtype == torch.int64


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_pad_value_the_dtype_cannot_hold_is_refused(lib: str) -> None:
    labels = [np.array([1, 2], np.uint8), np.array([3], np.uint8)]
    if lib == "torch":
        labels = [torch.from_numpy(x) for x in labels]
    with pytest.raises(ValueError, match="pad value -100 does not fit the data's dtype"):
        pad(labels, pad_value=-100)  # torch made it 156: padding trained on
    features = [{"input_ids": [1, 2], "labels": x} for x in labels]
    with pytest.raises(ValueError, match="PadCollator: key 'labels': pad value -100"):
        PadCollator(return_tensors="pt")(features)
    with pytest.raises(ValueError, match="pad value 0.5 does not fit"):
        pad([np.array([1, 2]), np.array([3])], pad_value=0.5)
    assert pad([np.array([1.0, 2.0]), np.array([3.0])], pad_value=0.1).data[1, 1] == 0.1


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_pad_collator_gives_int64_ids_as_hugging_face_does(lib: str) -> None:
    ids = [np.array([5, 6, 7], np.int32), np.array([8], np.int32)]
    if lib == "torch":
        ids = [torch.from_numpy(x) for x in ids]
    batch = PadCollator(return_tensors="pt")([{"input_ids": x} for x in ids])
    assert batch["input_ids"].dtype == torch.int64  # was int32
    assert batch["attention_mask"].dtype == torch.int64


def test_pad_collator_gives_float32_for_float_lists_under_torch() -> None:
    features = [
        {"input_ids": [1, 2], "scores": [0.5, 0.25], "labels": [1.0, 0.0, 1.0]},
        {"input_ids": [3], "scores": [0.75], "labels": [0.0, 1.0, 0.0]},
    ]
    batch = PadCollator(return_tensors="pt", pad_values={"scores": 0.0})(features)
    assert batch["scores"].dtype == torch.float32  # was float64
    assert batch["labels"].dtype == torch.float32  # a fixed multi-label vector


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (None, TypeError, "item 1: input_ids must be a sequence of token ids, got NoneType"),
        (5, TypeError, "item 1: input_ids must be a sequence of token ids, got int"),
        (np.array(5), ValueError, r"item 1: input_ids must be a 1-D sequence .* shape \(\)"),
    ],
)
def test_varlen_collator_names_a_bad_input_ids(bad: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        VarlenCollator(return_tensors="np")([{"input_ids": [1, 2]}, {"input_ids": bad}])


def test_varlen_collator_refuses_nested_input_ids() -> None:
    features = [{"input_ids": [[1, 2]]}, {"input_ids": [[3, 4], [5, 6]]}]
    with pytest.raises(ValueError, match=r"input_ids must be 1-D sequences .* \[length, 2\]"):
        VarlenCollator(return_tensors="np")(features)  # was accepted: mismatched outputs


class _Box:
    def __init__(self, a: object) -> None:
        self.a = np.asarray(a)


register_leaf(
    _Box,
    lambda leaves, path: _Box(np.stack([leaf.a for leaf in leaves])),
    lambda box: [_Box(x) for x in box.a],
)


def test_registered_leaves_inside_a_list_round_trip() -> None:
    items = [[_Box([i, i]), _Box([-i])] for i in range(3)]
    back = unstack(stack(items))
    assert len(back) == 3  # was 2: the list's entries were taken for items
    assert [[b.a.tolist() for b in item] for item in back] == [
        [[i, i], [-i]] for i in range(3)
    ]
    mixed = [{"x": np.ones(2), "boxes": [_Box([i])]} for i in range(3)]
    assert [m["boxes"][0].a.tolist() for m in unstack(stack(mixed))] == [[0], [1], [2]]


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "uint64"])
def test_torch_unsigned_dtypes_pad_and_pack(dtype: str) -> None:
    torch_dtype = getattr(torch, dtype)
    items = [torch.ones(3, dtype=torch_dtype), torch.zeros(1, dtype=torch_dtype)]
    assert pad(items).data.dtype == torch_dtype  # NotImplementedError before
    assert pack(items, 4).data.dtype == torch_dtype


def test_pad_refuses_a_max_length_that_is_not_an_int() -> None:
    with pytest.raises(ValueError, match="max_length must be an int >= 0, got 2.5"):
        pad([[1, 2, 3]], max_length=2.5, truncate=True)  # type: ignore[arg-type]


def test_pack_varlen_refuses_more_tokens_than_int32_cu_seqlens_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """cu_seqlens is int32; past 2**31 - 1 tokens it wrapped to negative offsets. The
    limit is lowered here so the test does not need 8 GiB of tokens."""
    import batchkit.collate.varlen as varlen

    monkeypatch.setattr(varlen, "_INT32_MAX", 10)
    assert varlen.pack_varlen([np.ones(4), np.ones(6)]).cu_seqlens.tolist() == [0, 4, 10]
    with pytest.raises(ValueError, match="11 tokens in one pack; cu_seqlens is int32"):
        varlen.pack_varlen([np.ones(5), np.ones(6)])
    with pytest.raises(ValueError, match="12 tokens"):  # the padded total counts
        varlen.pack_varlen([np.ones(4), np.ones(6)], pad_to_multiple_of=4)


def test_list_items_cut_to_length_zero_keep_their_feature_axis() -> None:
    """max_length=0 used to cut the lists before conversion: [] has no feature axis, so
    [B, 0, F] came out as [B, 0]."""
    nested = [[[1, 2], [3, 4]], [[5, 6]]]
    assert pad(nested, max_length=0, truncate=True).data.shape == (2, 0, 2)
    assert pad(nested, max_length=1, truncate=True).data.shape == (2, 1, 2)
    flat = pad([[1, 2, 3], [5]], max_length=0, truncate=True).data
    assert (flat.shape, flat.dtype) == ((2, 0), np.int64)
