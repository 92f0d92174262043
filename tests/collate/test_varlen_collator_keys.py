"""VarlenCollator carries the keys it does not interpret (never drops them silently):
token-level keys are flattened like input_ids, per-sequence keys stacked; it refuses a
key it cannot carry, or one named like its own outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import batchkit


@pytest.mark.parametrize("rt", ["np", "pt", None])
def test_a_per_sequence_key_is_stacked_over_the_kept_sequences(rt: str | None) -> None:
    features = [
        {"input_ids": [1, 2], "idx": 7},
        {"input_ids": [], "idx": 8},  # empty: dropped, and its idx with it
        {"input_ids": [3], "idx": 9},
    ]
    batch = batchkit.VarlenCollator(return_tensors=rt)(features)
    assert np.asarray(batch["idx"]).tolist() == [7, 9]
    assert np.asarray(batch["cu_seq_lens_q"]).tolist() == [0, 2, 3]
    assert isinstance(batch["idx"], torch.Tensor if rt == "pt" else np.ndarray)


def test_a_token_level_key_is_flattened_like_input_ids() -> None:
    features = [
        {"input_ids": [1, 2, 3], "token_type_ids": [0, 0, 1], "weights": [[0.5]] * 3},
        {"input_ids": [4], "token_type_ids": [1], "weights": [[2.0]]},
    ]
    batch = batchkit.VarlenCollator()(features)
    assert batch["token_type_ids"].tolist() == [[0, 0, 1, 1]]
    assert batch["weights"].shape == (1, 4, 1)
    assert batch["weights"][0, :, 0].tolist() == [0.5, 0.5, 0.5, 2.0]


def test_the_attention_mask_is_left_out_as_the_layout_has_no_padding() -> None:
    features = [{"input_ids": [1, 2], "attention_mask": [1, 1]}, {"input_ids": [3]}]
    features[1]["attention_mask"] = [1]
    assert "attention_mask" not in batchkit.VarlenCollator()(features)


def test_a_ragged_key_not_as_long_as_input_ids_is_refused_by_name() -> None:
    features = [{"input_ids": [1, 2], "spans": [1]}, {"input_ids": [3], "spans": [1, 2, 3]}]
    with pytest.raises(ValueError, match=r"key 'spans' is ragged .* not as long as input_ids"):
        batchkit.VarlenCollator()(features)


def test_a_key_named_like_an_output_is_refused() -> None:
    features = [{"input_ids": [1, 2], "position_ids": [0, 1]}]
    with pytest.raises(ValueError, match=r"\['position_ids'\] are names of the layout's own"):
        batchkit.VarlenCollator()(features)
