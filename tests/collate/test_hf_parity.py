"""PadCollator / VarlenCollator equal transformers' collators on the same features (offline)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchkit

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

PAD_ID = 3


def _tokenizer(side: str) -> Any:
    from tokenizers.models import WordLevel

    vocab = {"[UNK]": 0, "a": 1, "b": 2, "[PAD]": PAD_ID, **{f"w{i}": i for i in range(4, 50)}}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    fast.padding_side = side
    assert fast.pad_token_id == PAD_ID
    return fast


TOKENIZERS = {side: _tokenizer(side) for side in ("left", "right")}


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key, w in want.items():
        g = got[key]
        assert type(g) is type(w), (key, type(g), type(w))
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape, (key, g.dtype, w.dtype)
            assert torch.equal(g, w), key
        elif isinstance(w, np.ndarray):
            assert g.dtype == w.dtype and g.shape == w.shape, (key, g.dtype, w.dtype)
            np.testing.assert_array_equal(g, w, err_msg=key)
        else:
            assert g == w, key


def _both_pad_collators(side: str, multiple: int | None, rt: str) -> tuple[Any, Any]:
    """transformers' DataCollatorWithPadding and the PadCollator that should equal it."""
    hf = transformers.DataCollatorWithPadding(
        TOKENIZERS[side], pad_to_multiple_of=multiple, return_tensors=rt
    )
    ours = batchkit.PadCollator(
        pad_values={"input_ids": PAD_ID},
        padding_side=side,  # type: ignore[arg-type]
        pad_to_multiple_of=multiple,
        return_tensors=rt,  # type: ignore[arg-type]
    )
    return hf, ours


@st.composite
def _features(draw: st.DrawFn, min_len: int = 0) -> list[dict[str, Any]]:
    lengths = draw(st.lists(st.integers(min_len, 12), min_size=1, max_size=6))
    with_types = draw(st.booleans())
    with_mask = draw(st.booleans())
    with_special = draw(st.booleans())
    label = draw(st.sampled_from([None, st.integers(0, 3), st.floats(-2, 2, width=32)]))
    feats = []
    for n in lengths:
        ids = draw(st.lists(st.integers(0, 49), min_size=n, max_size=n))
        f: dict[str, Any] = {"input_ids": ids}
        if with_types:
            f["token_type_ids"] = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        if with_mask:
            f["attention_mask"] = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        if with_special:
            f["special_tokens_mask"] = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        if label is not None:
            f["label"] = draw(label)
        feats.append(f)
    return feats


@given(
    features=_features(),
    side=st.sampled_from(["left", "right"]),
    multiple=st.sampled_from([None, 8]),
    rt=st.sampled_from(["pt", "np"]),
)
def test_pad_collator_matches_data_collator_with_padding(
    features: list[dict[str, Any]], side: str, multiple: int | None, rt: str
) -> None:
    hf, ours = _both_pad_collators(side, multiple, rt)
    _assert_same(ours(features), hf(features))


@given(features=_features(), rt=st.sampled_from(["pt", "np"]))
def test_pad_collator_array_features_match(features: list[dict[str, Any]], rt: str) -> None:
    """Features given as numpy arrays / tensors collate like their list form."""
    ours = batchkit.PadCollator(pad_values={"input_ids": PAD_ID}, return_tensors=rt)  # type: ignore[arg-type]
    want = ours(features)
    converters = (
        lambda v: np.asarray(v, dtype=np.int64),
        lambda v: torch.tensor(v, dtype=torch.int64),
    )
    for convert in converters:
        arrays = [
            {k: convert(v) if isinstance(v, list) else v for k, v in f.items()} for f in features
        ]
        _assert_same(ours(arrays), want)


@st.composite
def _flat_features(draw: st.DrawFn) -> list[dict[str, Any]]:
    lengths = draw(st.lists(st.integers(0, 10), min_size=1, max_size=6).filter(any))
    with_labels = draw(st.booleans())
    feats = []
    for n in lengths:
        f: dict[str, Any] = {
            "input_ids": draw(st.lists(st.integers(0, 49), min_size=n, max_size=n))
        }
        if with_labels:
            f["labels"] = draw(st.lists(st.integers(-100, 49), min_size=n, max_size=n))
        feats.append(f)
    return feats


@given(features=_flat_features(), rt=st.sampled_from(["pt", "np"]))
def test_varlen_collator_matches_data_collator_with_flattening(
    features: list[dict[str, Any]], rt: str
) -> None:
    hf = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_position_ids=True, return_tensors=rt
    )
    ours = batchkit.VarlenCollator(return_tensors=rt)  # type: ignore[arg-type]
    got, want = ours(features), hf(features)
    _assert_same(got, want)
    assert type(got["max_length_q"]) is int and type(got["max_length_k"]) is int
    assert "attention_mask" not in got


@given(features=_flat_features(), rt=st.sampled_from(["pt", "np"]))
def test_varlen_collator_sample_index(features: list[dict[str, Any]], rt: str) -> None:
    got = batchkit.VarlenCollator(return_tensors=rt, return_sample_index=True)(features)  # type: ignore[arg-type]
    idx = np.asarray(got["sample_index"])
    assert idx.dtype == np.int64
    assert idx.tolist() == [i for i, f in enumerate(features) if len(f["input_ids"])]
    plain = batchkit.VarlenCollator(return_tensors=rt)(features)  # type: ignore[arg-type]
    assert "sample_index" not in plain


def test_varlen_collator_does_not_mutate_features() -> None:
    features = [{"input_ids": np.array([5, 6, 7]), "labels": np.array([1, 2, 3])}]
    batchkit.VarlenCollator(return_tensors="np")(features)
    assert features[0]["labels"].tolist() == [1, 2, 3]
    assert features[0]["input_ids"].tolist() == [5, 6, 7]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_pad_collator_gives_int64_ids_as_hugging_face_does(lib: str) -> None:
    ids = [np.array([5, 6, 7], np.int32), np.array([8], np.int32)]
    if lib == "torch":
        ids = [torch.from_numpy(x) for x in ids]
    batch = batchkit.PadCollator(return_tensors="pt")([{"input_ids": x} for x in ids])
    assert batch["input_ids"].dtype == torch.int64  # was int32
    assert batch["attention_mask"].dtype == torch.int64


@st.composite
def _multi_label_features(draw: st.DrawFn, num_labels: int = 3) -> list[dict[str, Any]]:
    """Multi-label targets: a fixed [num_labels] float vector per item, beside input_ids
    of other lengths (at least one item's differs, so the vector is not aligned)."""
    lengths = draw(
        st.lists(st.integers(0, 12), min_size=1, max_size=6).filter(
            lambda ns: any(n != num_labels for n in ns)
        )
    )
    return [
        {
            "input_ids": draw(st.lists(st.integers(0, 49), min_size=n, max_size=n)),
            "labels": draw(
                st.lists(st.sampled_from([0.0, 1.0]), min_size=num_labels, max_size=num_labels)
            ),
        }
        for n in lengths
    ]


@given(
    features=_multi_label_features(),
    side=st.sampled_from(["left", "right"]),
    multiple=st.sampled_from([None, 8]),
    rt=st.sampled_from(["pt", "np"]),
)
def test_fixed_length_labels_are_stacked_as_hugging_face_does(
    features: list[dict[str, Any]], side: str, multiple: int | None, rt: str
) -> None:
    """[B, num_labels] targets stay [B, num_labels]: they were padded to [B, 8] with -100."""
    hf, ours = _both_pad_collators(side, multiple, rt)
    got = ours(features)
    assert tuple(got["labels"].shape) == (len(features), 3)
    _assert_same(got, hf(features))


@st.composite
def _typed_mask_features(draw: st.DrawFn) -> tuple[list[dict[str, Any]], str]:
    """Array features whose masks come in other dtypes than int64: a bool attention_mask,
    int32 special_tokens_mask and token_type_ids. At least two lengths differ, so the
    batch is padded (transformers keeps a bool mask bool only when nothing is)."""
    lengths = draw(
        st.lists(st.integers(0, 10), min_size=2, max_size=6).filter(lambda ns: len(set(ns)) > 1)
    )
    lib = draw(st.sampled_from(["np", "pt"]))
    convert = np.asarray if lib == "np" else torch.tensor
    feats = []
    for n in lengths:
        bits = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        ints = np.asarray(bits, dtype=np.int32)
        feats.append(
            {
                "input_ids": convert(
                    np.asarray(
                        draw(st.lists(st.integers(0, 49), min_size=n, max_size=n)), dtype=np.int64
                    )
                ),
                "attention_mask": convert(np.asarray(bits, dtype=bool)),
                "special_tokens_mask": convert(ints),
                "token_type_ids": convert(ints[::-1].copy()),
            }
        )
    return feats, lib


@given(
    data=_typed_mask_features(),
    side=st.sampled_from(["left", "right"]),
    multiple=st.sampled_from([None, 8]),
    rt=st.sampled_from(["pt", "np"]),
)
def test_bool_and_int32_masks_come_out_int64_as_hugging_face_does(
    data: tuple[list[dict[str, Any]], str], side: str, multiple: int | None, rt: str
) -> None:
    """A bool attention_mask stayed bool and an int32 special_tokens_mask int32."""
    features, _ = data
    hf, ours = _both_pad_collators(side, multiple, rt)
    _assert_same(ours(features), hf(features))


@pytest.mark.parametrize("rt", ["pt", "np"])
def test_masks_are_int64_even_when_no_row_needs_padding(rt: str) -> None:
    """Where transformers keeps a bool mask bool (no row padded), PadCollator still gives
    int64: a batch's dtypes do not depend on whether its lengths happen to agree."""
    features = [
        {
            "input_ids": np.array([5, 6]),
            "attention_mask": np.array([True, False]),
            "special_tokens_mask": np.array([1, 0], dtype=np.int32),
        }
        for _ in range(2)
    ]
    batch = batchkit.PadCollator(return_tensors=rt)(features)  # type: ignore[arg-type]
    for key in ("input_ids", "attention_mask", "special_tokens_mask"):
        assert str(batch[key].dtype).removeprefix("torch.") == "int64", key
    assert np.asarray(batch["attention_mask"]).tolist() == [[1, 0], [1, 0]]
