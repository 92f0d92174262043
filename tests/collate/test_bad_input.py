"""Bad input raises TypeError/ValueError naming the offending item index or key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchkit

LAYOUTS: dict[str, Callable[[Any], Any]] = {
    "pad": batchkit.pad,
    "pack_varlen": batchkit.pack_varlen,
    "pack": lambda seqs: batchkit.pack(seqs, 64),
}

GOOD = {
    "list": [1, 2, 3],
    "np": np.array([1, 2, 3]),
    "pt": torch.tensor([1, 2, 3]),
}

BAD_ITEMS: list[tuple[Any, type[Exception]]] = [
    (None, TypeError),
    ("abc", TypeError),
    (b"abc", TypeError),
    (5, TypeError),
    (2.5, TypeError),
    ({"a": 1}, TypeError),
]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", sorted(GOOD))
@pytest.mark.parametrize(("bad", "exc"), BAD_ITEMS, ids=repr)
@pytest.mark.parametrize("where", [0, 1, 2])
def test_bad_item_named(layout: str, kind: str, bad: Any, exc: type[Exception], where: int) -> None:
    items = [GOOD[kind]] * 3
    items[where] = bad
    with pytest.raises(exc, match=rf"item {where}\b"):
        LAYOUTS[layout](items)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("first", sorted(GOOD))
@pytest.mark.parametrize("other", sorted(GOOD))
def test_mixed_types_named(layout: str, first: str, other: str) -> None:
    if first == other:
        return
    items = [GOOD[first], GOOD[first], GOOD[other], GOOD[first]]
    with pytest.raises(TypeError, match=r"item 2\b"):
        LAYOUTS[layout](items)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["np", "pt"])
@given(shapes=st.lists(st.sampled_from([(3,), (3, 2), (2, 3), (1, 2, 2)]), min_size=2, max_size=5))
def test_mismatched_feature_shapes(layout: str, kind: str, shapes: list[tuple[int, ...]]) -> None:
    make = np.zeros if kind == "np" else torch.zeros
    items = [make(s) for s in shapes]
    bad = [i for i, s in enumerate(shapes) if s[1:] != shapes[0][1:]]
    if not bad:
        LAYOUTS[layout](items)
        return
    with pytest.raises(ValueError, match=rf"item {bad[0]}\b"):
        LAYOUTS[layout](items)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_list_item_feature_mismatch_and_ragged_nesting(layout: str) -> None:
    with pytest.raises(ValueError, match=r"item 1\b"):
        LAYOUTS[layout]([[[1, 2], [3, 4]], [[1, 2, 3]]])
    with pytest.raises(ValueError, match=r"item 1\b"):
        LAYOUTS[layout]([[[1, 2]], [[1, 2], [3]]])
    with pytest.raises(TypeError, match=r"item 1\b"):
        LAYOUTS[layout]([[1, 2], ["a", "b"]])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["np", "pt"])
def test_scalar_item(layout: str, kind: str) -> None:
    scalar = np.array(3) if kind == "np" else torch.tensor(3)
    items = [GOOD[kind], scalar]
    with pytest.raises(ValueError, match=r"item 1\b"):
        LAYOUTS[layout](items)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_empty_batch_and_non_sequence(layout: str) -> None:
    with pytest.raises(ValueError, match="empty"):
        LAYOUTS[layout]([])
    with pytest.raises(TypeError):
        LAYOUTS[layout](5)
    with pytest.raises(TypeError):
        LAYOUTS[layout]("abc")


def test_string_dtype_array_named() -> None:
    with pytest.raises(TypeError, match=r"item 1\b"):
        batchkit.pad([np.array([1]), np.array(["a"])])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mixed_devices_named(layout: str) -> None:
    items = [torch.zeros(2), torch.zeros(2), torch.zeros(2, device="cuda")]
    with pytest.raises(ValueError, match=r"item 2\b"):
        LAYOUTS[layout](items)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_in_cuda_out() -> None:
    items = [torch.arange(3, device="cuda"), torch.arange(2, device="cuda")]
    for out in (
        batchkit.pad(items).data,
        batchkit.pack_varlen(items).cu_seqlens,
        batchkit.pack(items, 4).segment_ids,
        batchkit.PadCollator()([{"input_ids": t} for t in items])["attention_mask"],
    ):
        assert out.device.type == "cuda"


def test_too_long_items_named() -> None:
    with pytest.raises(ValueError, match=r"item 2\b"):
        batchkit.pad([[1], [1, 2], [1, 2, 3]], max_length=2)
    with pytest.raises(ValueError, match=r"item 1\b"):
        batchkit.pack([np.zeros(2), np.zeros(5)], 4)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="side"):
        batchkit.pad([[1]], side="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        batchkit.pad([[1]], pad_to_multiple_of=0)
    with pytest.raises(ValueError, match="return_tensors"):
        batchkit.pad([[1]], return_tensors="tf")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strategy"):
        batchkit.pack([[1]], 4, strategy="worst_fit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_length"):
        batchkit.pack([[1]], 0)


# ------------------------------------------------------------------------- stack


def test_stack_errors_name_item_and_key() -> None:
    with pytest.raises(ValueError, match=r"item 1\['x'\]"):
        batchkit.stack([{"x": np.zeros(2)}, {"x": np.zeros(3)}])
    with pytest.raises(ValueError, match=r"item 1"):
        batchkit.stack([{"x": 1}, {"y": 1}])
    with pytest.raises(TypeError, match=r"item 2\['x'\]"):
        batchkit.stack([{"x": np.zeros(2)}, {"x": np.zeros(2)}, {"x": torch.zeros(2)}])
    with pytest.raises(TypeError, match=r"item 1\[0\]"):
        batchkit.stack([(1, 2), (np.zeros(1), 2)])
    with pytest.raises(ValueError, match="at least one"):
        batchkit.stack([])


# ---------------------------------------------------------------------- collators


@pytest.mark.parametrize("rt", ["np", "pt"])
def test_pad_collator_errors_name_key(rt: str) -> None:
    collate = batchkit.PadCollator(return_tensors=rt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'tags'"):
        collate([{"input_ids": [1, 2], "tags": [1, 2]}, {"input_ids": [1], "tags": [1]}])
    with pytest.raises(TypeError, match="'label'"):
        collate([{"input_ids": [1], "label": 1}, {"input_ids": [1], "label": [1, 2]}])
    with pytest.raises(ValueError, match="'scores'"):
        collate([{"input_ids": [1], "scores": [[1.0]]}, {"input_ids": [1], "scores": [[1.0]] * 2}])
    with pytest.raises(ValueError, match=r"'scores'.*item 1\b"):
        collate([{"input_ids": [1], "scores": [1.0]}, {"input_ids": [1], "scores": [[1.0]]}])
    with pytest.raises((TypeError, ValueError), match=r"'input_ids'.*item 1\b"):
        collate([{"input_ids": [1]}, {"input_ids": None}])
    with pytest.raises((TypeError, ValueError), match=r"'input_ids'.*item 1\b"):
        collate([{"input_ids": [1]}, {"input_ids": 7}])
    with pytest.raises(ValueError, match=r"item 1"):
        collate([{"input_ids": [1]}, {"input_ids": [1], "extra": 1}])
    with pytest.raises(TypeError, match=r"item 1"):
        collate([{"input_ids": [1]}, [1]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="empty"):
        collate([])


@pytest.mark.parametrize("rt", ["np", "pt"])
def test_varlen_collator_errors(rt: str) -> None:
    collate = batchkit.VarlenCollator(return_tensors=rt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"item 1\b.*labels"):
        collate([{"input_ids": [1, 2], "labels": [1, 2]}, {"input_ids": [1, 2], "labels": [1]}])
    # item index counts dropped empty sequences
    with pytest.raises(ValueError, match=r"item 2\b"):
        collate(
            [
                {"input_ids": [1], "labels": [1]},
                {"input_ids": [], "labels": []},
                {"input_ids": [1, 2], "labels": [1, 2, 3]},
            ]
        )
    with pytest.raises(ValueError, match="input_ids"):
        collate([{"labels": [1]}])
    with pytest.raises(ValueError, match="empty"):
        collate([{"input_ids": []}])
    with pytest.raises((TypeError, ValueError), match=r"'input_ids'.*item 1\b"):
        collate([{"input_ids": [1]}, {"input_ids": [[1, 2]]}])


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_pad_value_the_dtype_cannot_hold_is_refused(lib: str) -> None:
    labels = [np.array([1, 2], np.uint8), np.array([3], np.uint8)]
    if lib == "torch":
        labels = [torch.from_numpy(x) for x in labels]
    with pytest.raises(ValueError, match="pad value -100 does not fit the data's dtype"):
        batchkit.pad(labels, pad_value=-100)  # torch made it 156: padding trained on
    features = [{"input_ids": list(range(len(x))), "labels": x} for x in labels]
    with pytest.raises(ValueError, match="PadCollator: key 'labels': pad value -100"):
        batchkit.PadCollator(return_tensors="pt")(features)
    with pytest.raises(ValueError, match="pad value 0.5 does not fit"):
        batchkit.pad([np.array([1, 2]), np.array([3])], pad_value=0.5)
    assert batchkit.pad([np.array([1.0, 2.0]), np.array([3.0])], pad_value=0.1).data[1, 1] == 0.1


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
        batchkit.VarlenCollator(return_tensors="np")([{"input_ids": [1, 2]}, {"input_ids": bad}])


def test_varlen_collator_refuses_nested_input_ids() -> None:
    features = [{"input_ids": [[1, 2]]}, {"input_ids": [[3, 4], [5, 6]]}]
    with pytest.raises(ValueError, match=r"input_ids must be 1-D sequences .* \[length, 2\]"):
        batchkit.VarlenCollator(return_tensors="np")(features)  # was accepted: mismatched outputs


def test_pad_refuses_a_max_length_that_is_not_an_int() -> None:
    with pytest.raises(ValueError, match="max_length must be an int >= 0, got 2.5"):
        batchkit.pad([[1, 2, 3]], max_length=2.5, truncate=True)  # type: ignore[arg-type]


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
