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
    hf = transformers.DataCollatorWithPadding(
        TOKENIZERS[side], pad_to_multiple_of=multiple, return_tensors=rt
    )
    ours = batchkit.PadCollator(
        pad_values={"input_ids": PAD_ID},
        padding_side=side,  # type: ignore[arg-type]
        pad_to_multiple_of=multiple,
        return_tensors=rt,  # type: ignore[arg-type]
    )
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
