"""PadCollator pads the keys aligned with the key it pads by (``input_ids``) and stacks
the rest; a pad value of None means "do not pad this key"."""

from __future__ import annotations

import numpy as np
import pytest

import batchkit


def _np(batch: dict) -> dict:
    return {k: np.asarray(v) for k, v in batch.items()}


@pytest.mark.parametrize("rt", ["pt", "np"])
def test_token_labels_aligned_with_input_ids_are_padded(rt: str) -> None:
    features = [
        {"input_ids": [1, 2, 3], "labels": [7, 8, 9], "scores": [0.5, 0.25, 0.0]},
        {"input_ids": [4], "labels": [6], "scores": [1.0]},
    ]
    collate = batchkit.PadCollator(
        pad_values={"scores": -1.0},
        pad_to_multiple_of=4,
        return_tensors=rt,  # type: ignore[arg-type]
    )
    batch = _np(collate(features))
    assert batch["labels"].tolist() == [[7, 8, 9, -100], [6, -100, -100, -100]]
    assert batch["scores"].tolist() == [[0.5, 0.25, 0.0, -1.0], [1.0, -1.0, -1.0, -1.0]]
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (2, 4)


@pytest.mark.parametrize("rt", ["pt", "np"])
def test_pad_value_none_means_do_not_pad(rt: str) -> None:
    """A None pad value used to pad with NaN (float keys): it now stacks the key as it is."""
    features = [
        {"input_ids": [1, 2, 3], "labels": [1.0, 0.0, 1.0], "scores": [0.5, 0.5, 0.5]},
        {"input_ids": [4, 5, 6], "labels": [0.0, 1.0, 0.0], "scores": [0.25, 0.25, 0.25]},
    ]
    collate = batchkit.PadCollator(
        pad_values={"labels": None, "scores": None},
        pad_to_multiple_of=8,
        return_tensors=rt,  # type: ignore[arg-type]
    )
    batch = _np(collate(features))
    assert batch["input_ids"].shape == (2, 8)  # input_ids still padded
    assert batch["labels"].tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    assert batch["scores"].shape == (2, 3) and not np.isnan(batch["scores"]).any()
    ragged = [{"input_ids": [1, 2], "tags": [1, 2]}, {"input_ids": [3], "tags": [3]}]
    with pytest.raises(ValueError, match=r"key 'tags' is ragged .* its pad value is None"):
        batchkit.PadCollator(pad_values={"tags": None}, return_tensors=rt)(ragged)  # type: ignore[arg-type]


def test_a_vector_as_long_as_every_input_ids_counts_as_aligned() -> None:
    """Alignment is decided by lengths alone: num_labels equal to every item's input_ids
    length makes a multi-label vector look token-level, so it is padded; pad_values=
    {"labels": None} says it is not."""
    features = [
        {"input_ids": [1, 2, 3], "labels": [1.0, 0.0, 1.0]},
        {"input_ids": [4, 5, 6], "labels": [0.0, 1.0, 0.0]},
    ]
    padded = batchkit.PadCollator(pad_to_multiple_of=4, return_tensors="np")(features)
    assert padded["labels"].shape == (2, 4)
    kept = batchkit.PadCollator(
        pad_values={"labels": None}, pad_to_multiple_of=4, return_tensors="np"
    )(features)
    assert kept["labels"].shape == (2, 3)


def test_a_ragged_key_not_aligned_with_input_ids_is_refused_by_name() -> None:
    """Keys of other lengths than input_ids (e.g. a decoder's labels) are stacked, so a
    ragged one is an error naming it, the item and both lengths; it used to be padded
    to a width of its own, which no attention_mask describes."""
    features = [
        {"input_ids": [1, 2, 3], "decoder_ids": [7, 8]},
        {"input_ids": [4], "decoder_ids": [6, 5, 4, 3]},
    ]
    collate = batchkit.PadCollator(pad_values={"decoder_ids": 0}, return_tensors="np")
    with pytest.raises(
        ValueError,
        match=r"key 'decoder_ids' is ragged .* not aligned with 'input_ids' "
        r"\(item 0: length 2, its 'input_ids' 3\)",
    ):
        collate(features)


def test_without_input_ids_the_first_paddable_key_is_padded_by() -> None:
    """No input_ids: the first key (labels excluded) with a sequence axis and a pad value
    is the one padded by; its mask becomes the attention_mask."""
    features = [
        {"label": [1.0, 0.0], "tokens": [5, 6, 7], "tags": [1, 1, 1]},
        {"label": [0.0, 1.0], "tokens": [8], "tags": [2]},
    ]
    collate = batchkit.PadCollator(pad_values={"tokens": 0, "tags": -1}, return_tensors="np")
    batch = collate(features)
    assert batch["tokens"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["tags"].tolist() == [[1, 1, 1], [2, -1, -1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[1.0, 0.0], [0.0, 1.0]]


def test_pad_value_none_for_input_ids_pads_nothing() -> None:
    features = [{"input_ids": [1, 2], "tags": [3, 4]}, {"input_ids": [5, 6], "tags": [7, 8]}]
    batch = batchkit.PadCollator(
        pad_values={"input_ids": None, "tags": 0}, pad_to_multiple_of=8, return_tensors="np"
    )(features)
    assert batch["input_ids"].shape == batch["tags"].shape == (2, 2)
    assert "attention_mask" not in batch
    ragged = [{"input_ids": [1, 2]}, {"input_ids": [3]}]
    with pytest.raises(ValueError, match="'input_ids', the key padded by, has pad value None"):
        batchkit.PadCollator(pad_values={"input_ids": None}, return_tensors="np")(ragged)


def test_by_default_the_output_follows_the_features() -> None:
    """Lists give numpy (the numpy-only install needs no torch), tensors give torch."""
    lists = [{"input_ids": [1, 2], "label": 0}, {"input_ids": [3], "label": 1}]
    batch = batchkit.PadCollator()(lists)
    assert all(isinstance(v, np.ndarray) for v in batch.values()), batch
    assert batch["input_ids"].tolist() == [[1, 2], [3, 0]]
    torch = pytest.importorskip("torch")
    tensors = [{"input_ids": torch.tensor(f["input_ids"]), "label": f["label"]} for f in lists]
    batch = batchkit.PadCollator()(tensors)
    assert all(isinstance(v, torch.Tensor) for v in batch.values()), batch
