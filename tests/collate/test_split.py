"""`split` on each layout: per-token leaves give each item its own steps, other
leaves are taken by row, mappings leaf by leaf; an output whose shape cannot tell
the two readings apart is refused with the leaf and shapes named."""

from __future__ import annotations

import pickle
from collections import OrderedDict

import numpy as np
import pytest

import batchkit
from batchkit.collate import FeatureBatch, PadCollator, VarlenCollator, to_device

ITEMS = [np.arange(1, 6), np.array([7]), np.array([8, 9])]


class ModelOutputLike(OrderedDict):
    """A mapping rebuilt from a dict, as Hugging Face's ``ModelOutput`` is."""


def as_lists(results):
    return [r.tolist() for r in results]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_split_gives_each_item_its_steps_and_its_row(side) -> None:
    batch = batchkit.pad(ITEMS, side=side)
    assert as_lists(batch.split(batch.data * 2)) == [[2, 4, 6, 8, 10], [14], [16, 18]]
    hidden = np.repeat(batch.data[..., None], 4, axis=-1)  # [B, L, 4]
    assert [r.shape for r in batch.split(hidden)] == [(5, 4), (1, 4), (2, 4)]
    pooled = (batch.data * batch.mask).sum(1)  # [B]
    assert as_lists(batch.split(pooled)) == [15, 7, 17]


def test_varlen_split_cuts_tokens_and_leaves_the_padding_segment_out() -> None:
    batch = batchkit.pack_varlen(ITEMS, pad_to_multiple_of=16)
    assert batch.total_length == 16
    assert as_lists(batch.split(batch.values * 2)) == [[2, 4, 6, 8, 10], [14], [16, 18]]
    assert as_lists(batch.split(np.array([10, 20, 30]))) == [10, 20, 30]


def test_packed_split_joins_a_split_items_pieces_and_keeps_input_order() -> None:
    batch = batchkit.pack(ITEMS, 3, split=True)
    assert len(batch.pieces[0]) == 2
    assert as_lists(batch.split(batch.data * 2)) == [[2, 4, 6, 8, 10], [14], [16, 18]]
    assert as_lists(batch.split(np.array([[1, 1], [2, 2], [3, 3]]))) == [[1, 1], [2, 2], [3, 3]]


def test_a_mapping_is_split_leaf_by_leaf_into_mappings_of_its_type() -> None:
    batch = batchkit.pad(ITEMS)
    out = ModelOutputLike(
        last_hidden_state=np.zeros((3, 5, 8)), pooler_output=np.ones((3, 8)), attentions=None
    )
    first, second, _ = batch.split(out)
    assert type(first) is ModelOutputLike and list(first) == list(out)
    assert first["last_hidden_state"].shape == (5, 8) and second["pooler_output"].shape == (8,)
    assert second["last_hidden_state"].shape == (1, 8) and second["attentions"] is None


def test_a_tuple_of_leaves_is_split_into_tuples() -> None:
    batch = batchkit.pack_varlen(ITEMS)
    per_item = batch.split((batch.values, np.arange(3)))
    assert [(t.tolist(), int(r)) for t, r in per_item] == [
        ([1, 2, 3, 4, 5], 0),
        ([7], 1),
        ([8, 9], 2),
    ]


def test_a_pooled_width_equal_to_the_padded_length_is_refused_undeclared() -> None:
    batch = batchkit.pad(ITEMS)  # L = 5
    out = {"hidden": np.zeros((3, 5, 5)), "pooled": np.ones((3, 5))}
    with pytest.raises(ValueError, match=r"outputs\['pooled'\] of shape \(3, 5\).*per_token="):
        batch.split(out)
    declared = batch.split(out, per_token={"hidden"})
    assert declared[1]["hidden"].shape == (1, 5) and declared[1]["pooled"].shape == (5,)
    assert batch.split(out["pooled"], per_token=False)[1].shape == (5,)
    assert batch.split(out["pooled"], per_token=True)[1].shape == (1,)


def test_a_varlen_batch_with_as_many_tokens_as_items_is_refused_undeclared() -> None:
    batch = batchkit.pack_varlen([[1], [2]])  # T = N = 2
    with pytest.raises(
        ValueError, match=r"leaf outputs of shape \(2, 4\).*as many tokens as items"
    ):
        batch.split(np.zeros((2, 4)))
    assert [r.shape for r in batch.split(np.zeros((2, 4)), per_token=True)] == [(1, 4), (1, 4)]
    assert [r.shape for r in batch.split(np.zeros((2, 4)), per_token=False)] == [(4,), (4,)]


def test_a_leaf_that_fits_no_reading_names_its_shape() -> None:
    batch = batchkit.pad(ITEMS)
    with pytest.raises(ValueError, match=r"shape \(4, 5\) starts neither with .*\(3, 5\)"):
        batch.split(np.zeros((4, 5)))
    with pytest.raises(ValueError, match=r"read per token but does not start with"):
        batch.split(np.zeros((3, 2)), per_token=True)
    with pytest.raises(TypeError, match=r"leaf outputs\['loss'\] is a float"):
        batch.split({"loss": 0.5})


def test_per_token_keys_must_name_keys_of_a_mapping() -> None:
    batch = batchkit.pad(ITEMS)
    with pytest.raises(ValueError, match=r"\['logit'\].*do not have"):
        batch.split({"logits": batch.data}, per_token={"logit"})
    with pytest.raises(TypeError, match="not a mapping"):
        batch.split(batch.data, per_token={"logits"})
    with pytest.raises(TypeError, match="per_token must be"):
        batch.split(batch.data, per_token="logits")


def test_pad_collator_output_splits_by_its_padded_width() -> None:
    features = [{"input_ids": [1, 2, 3], "label": 0}, {"input_ids": [4], "label": 1}]
    batch = PadCollator()(features)
    assert isinstance(batch, FeatureBatch) and isinstance(batch, dict)
    hidden = batch["input_ids"][..., None] * np.ones(8)
    per_item = batch.split({"hidden": hidden, "logits": np.eye(2)})
    assert per_item[1]["hidden"].shape == (1, 8) and per_item[1]["logits"].tolist() == [0, 1]
    moved = to_device(batch, "cpu")
    assert isinstance(moved, FeatureBatch) and moved.split(hidden)[0].shape == (3, 8)
    again = pickle.loads(pickle.dumps(batch))
    assert again.keys() == batch.keys() and again.split(hidden)[1].shape == (1, 8)
    with pytest.raises(ValueError, match="carries no layout"):
        FeatureBatch(batch).split(hidden)


def test_pad_collator_output_without_a_padded_key_splits_by_row() -> None:
    batch = PadCollator()([{"x": 1.0}, {"x": 2.0}])
    assert [float(r) for r in batch.split(batch["x"] * 2)] == [2.0, 4.0]


def test_varlen_collator_output_splits_its_flat_row_and_skips_empty_items() -> None:
    features = [{"input_ids": [1, 2, 3]}, {"input_ids": []}, {"input_ids": [4]}]
    batch = VarlenCollator()(features)
    per_token = batch.split(batch["input_ids"] * 10)  # [1, T]
    assert as_lists(per_token) == [[10, 20, 30], [], [40]]
    with pytest.raises(ValueError, match="item 1 has no row"):
        batch.split(np.zeros((2, 8)))


def test_torch_outputs_split_the_same_way() -> None:
    torch = pytest.importorskip("torch")
    batch = batchkit.pad([torch.tensor([1, 2, 3]), torch.tensor([4])], side="left")
    out = {"tokens": batch.data * 2, "pooled": (batch.data * batch.mask).sum(1)}
    per_item = batch.split(out)
    assert per_item[1]["tokens"].tolist() == [8] and per_item[0]["pooled"].item() == 6
    packed = batchkit.pack([torch.tensor([1, 2, 3]), torch.tensor([4])], 4)
    assert [t.tolist() for t in packed.split(packed.data + 1)] == [[2, 3, 4], [5]]
