"""Dict collators for data pipelines: ``DataLoader(collate_fn=...)``, HF datasets.

Drop-in, faster equivalents of ``transformers.DataCollatorWithPadding`` and
``transformers.DataCollatorWithFlattening`` that need no tokenizer and work on
numpy alone (``return_tensors="np"``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from batchkit._backend import (
    ReturnTensors,
    check_return_tensors,
    is_tensor,
    to_kind,
    to_numpy,
)
from batchkit.collate.pad import Padded, check_side, pad_ragged
from batchkit.collate.ragged import Ragged, to_ragged
from batchkit.collate.stack import stack
from batchkit.collate.varlen import varlen_from_ragged

DEFAULT_PAD_VALUES: dict[str, Any] = {
    "input_ids": 0,
    "attention_mask": 0,
    "token_type_ids": 0,
    "special_tokens_mask": 1,
    "labels": -100,
    "position_ids": 0,
}
"""Pad values used for keys that ``pad_values`` does not name (HF's conventions)."""

_LABEL_ALIASES = ("label", "label_ids")  # renamed to "labels", as HF's collators do


def _check_features(features: Sequence[Mapping[str, Any]], who: str) -> list[str]:
    if isinstance(features, Mapping) or not isinstance(features, Sequence):
        raise TypeError(f"{who} expects a list of feature dicts, got {type(features).__name__}")
    if len(features) == 0:
        raise ValueError(f"{who} received an empty batch")
    keys = None
    for i, feature in enumerate(features):
        if not isinstance(feature, Mapping):
            raise TypeError(f"{who}: item {i} is a {type(feature).__name__}, expected a dict")
        if keys is None:
            keys = list(feature.keys())
        elif feature.keys() != set(keys):
            diff = sorted(map(str, set(keys) ^ set(feature.keys())))
            raise ValueError(f"{who}: item {i} has different keys from item 0: {diff}")
    return keys or []


def _has_sequence_axis(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return True
    return (isinstance(value, np.ndarray) or is_tensor(value)) and value.ndim >= 1


_HF_INT64 = frozenset({"input_ids", "attention_mask", "token_type_ids"})
_NOT_WIDENED = ("torch.bool", "torch.int64")


def _as_int64(data: Any) -> Any:
    """Integer ``data`` (numpy or torch, any width) as int64; anything else as it is."""
    if is_tensor(data):
        dtype = data.dtype
        if dtype.is_floating_point or dtype.is_complex or str(dtype) in _NOT_WIDENED:
            return data
        import torch

        return data.to(torch.int64)
    if data.dtype.kind in "iu" and data.dtype != np.int64:
        return data.astype(np.int64)
    return data


def _ragged_for_key(
    values: list[Any], key: str, who: str, kind: ReturnTensors = None
) -> Ragged:
    try:
        # kind: numbers from lists take that backend's default dtypes (float32 for torch)
        return to_ragged(values, return_tensors=kind)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{who}: key {key!r}: {exc}") from None


class PadCollator:
    """Pad ragged keys of dict features; stack the rest.

    Keys whose values have a sequence axis and a pad value (``pad_values``, then
    :data:`DEFAULT_PAD_VALUES`) are padded to the longest in the batch (rounded up to
    ``pad_to_multiple_of``) on ``padding_side``. An ``attention_mask`` (int64, 1 =
    real) is created from ``input_ids`` (or the first padded key) unless the features
    carry one, which is then padded with 0. Other keys must be fixed-shape and are
    stacked; a ragged key without a pad value raises ``ValueError`` naming it.

    For ``input_ids``/``attention_mask``/``token_type_ids`` the output equals
    ``transformers.DataCollatorWithPadding`` with the same pad id, side and
    ``pad_to_multiple_of``.
    """

    def __init__(
        self,
        pad_values: Mapping[str, Any] | None = None,
        padding_side: Literal["left", "right"] = "right",
        pad_to_multiple_of: int | None = None,
        return_tensors: Literal["pt", "np"] = "pt",
    ) -> None:
        check_side(padding_side)
        check_return_tensors(return_tensors)
        self.pad_values = {**DEFAULT_PAD_VALUES, **(pad_values or {})}
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of
        self.return_tensors = return_tensors

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Collate a list of feature dicts into one dict of batched arrays."""
        who = type(self).__name__
        keys = _check_features(features, who)
        kind = self.return_tensors or "np"
        batch: dict[str, Any] = {}
        mask_source: Padded | None = None
        for key in keys:
            values = [f[key] for f in features]
            out_key = "labels" if key in _LABEL_ALIASES else key
            if out_key in self.pad_values and _has_sequence_axis(values[0]):
                try:
                    padded = pad_ragged(
                        _ragged_for_key(values, key, who, kind),
                        pad_value=self.pad_values[out_key],
                        side=self.padding_side,
                        pad_to_multiple_of=self.pad_to_multiple_of,
                    )
                except ValueError as exc:  # e.g. a pad value the key's dtype cannot hold
                    if str(exc).startswith(who):
                        raise
                    raise ValueError(f"{who}: key {key!r}: {exc}") from None
                data = padded.data
                if out_key in _HF_INT64:
                    data = _as_int64(data)  # as DataCollatorWithPadding gives, whatever came
                batch[out_key] = to_kind(data, kind)
                if key == "input_ids" or mask_source is None:
                    mask_source = padded
            else:
                batch[out_key] = self._stack_fixed(values, key, who, kind)
        if mask_source is not None and "attention_mask" not in batch:
            mask = to_numpy(mask_source.mask).astype(np.int64)
            batch["attention_mask"] = to_kind(mask, kind)
        return batch

    @staticmethod
    def _stack_fixed(values: list[Any], key: str, who: str, kind: str) -> Any:
        if _has_sequence_axis(values[0]):
            lengths = [len(v) for v in values]
            if len(set(lengths)) > 1:
                j = next(i for i, n in enumerate(lengths) if n != lengths[0])
                raise ValueError(
                    f"{who}: key {key!r} is ragged (item 0 has length {lengths[0]}, item {j} "
                    f"has {lengths[j]}) and has no pad value; add it to pad_values"
                )
            if isinstance(values[0], (list, tuple)):
                values = [np.asarray(v) for v in values]
                if kind == "pt" and values[0].dtype == np.float64:
                    values = [v.astype(np.float32) for v in values]  # torch's default float
        try:
            return stack(values, return_tensors=kind)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{who}: key {key!r}: {exc}") from None


class VarlenCollator:
    """Flatten a batch into one padding-free row for varlen (FlashAttention) kernels.

    Output equals ``transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=
    True, return_position_ids=True)``: ``input_ids``, ``labels`` and ``position_ids``
    of shape ``[1, T]`` (int64), ``cu_seq_lens_q``/``cu_seq_lens_k`` int32 ``[N+1]``,
    ``max_length_q``/``max_length_k`` Python ints, never an ``attention_mask``.
    ``labels`` are the features' labels (or a copy of ``input_ids``) with
    ``separator_id`` at the first token of every sequence. Like HF, empty sequences
    are dropped; with ``return_sample_index=True`` an int64 ``sample_index`` ``[N]``
    says which input each sequence came from (a feature's own ``sample_index`` when
    it has one, e.g. its dataset index, else its position in the batch), so outputs
    split by ``cu_seq_lens_q`` can be put back in order.
    """

    def __init__(
        self,
        separator_id: int = -100,
        return_tensors: Literal["pt", "np"] = "pt",
        return_sample_index: bool = False,
    ) -> None:
        check_return_tensors(return_tensors)
        self.separator_id = separator_id
        self.return_tensors = return_tensors
        self.return_sample_index = return_sample_index

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Collate a list of feature dicts (each with ``input_ids``) into one flat row."""
        who = type(self).__name__
        keys = _check_features(features, who)
        if "input_ids" not in keys:
            raise ValueError(f"{who}: features need an 'input_ids' key; got {keys}")
        kept = [i for i, f in enumerate(features) if _seq_len(f["input_ids"], i, who) > 0]
        if not kept:
            raise ValueError(f"{who}: every sequence in the batch is empty")
        kept_features = [features[i] for i in kept]
        tokens = _ragged_for_key([f["input_ids"] for f in kept_features], "input_ids", who)
        if tokens.feature_shape:  # nested lists: one flat row needs 1-D token ids
            raise ValueError(
                f"{who}: input_ids must be 1-D sequences of token ids, got items of shape "
                f"[length, {', '.join(map(str, tokens.feature_shape))}]"
            )
        layout = varlen_from_ragged(tokens)
        starts = tokens.offsets()[:-1]

        if "labels" in keys:
            labels = _ragged_for_key([f["labels"] for f in kept_features], "labels", who)
            bad = np.flatnonzero(labels.lengths != tokens.lengths)
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"{who}: item {kept[i]}: labels length {labels.lengths[i]} != input_ids "
                    f"length {tokens.lengths[i]}"
                )
            label_values = to_numpy(labels.values).astype(np.int64)
        else:
            label_values = to_numpy(tokens.values).astype(np.int64)
        label_values[starts] = self.separator_id

        kind = self.return_tensors

        def row(x: Any) -> Any:  # HF's [1, T] int64 layout
            return to_kind(to_numpy(x).astype(np.int64)[None, :], kind)

        cu = to_numpy(layout.cu_seqlens)
        batch: dict[str, Any] = {
            "input_ids": row(tokens.values),
            "labels": row(label_values),
            "position_ids": row(layout.position_ids),
            "cu_seq_lens_q": to_kind(cu.copy(), kind),
            "cu_seq_lens_k": to_kind(cu.copy(), kind),
            "max_length_q": layout.max_seqlen,
            "max_length_k": layout.max_seqlen,
        }
        if self.return_sample_index:
            if "sample_index" in keys:
                index = np.asarray([int(f["sample_index"]) for f in kept_features], dtype=np.int64)
            else:
                index = np.asarray(kept, dtype=np.int64)
            batch["sample_index"] = to_kind(index, kind)
        return batch


def _seq_len(ids: Any, i: int, who: str) -> int:
    """The length of item ``i``'s ``input_ids``: a 1-D sequence of token ids."""
    shape = getattr(ids, "shape", None)
    if shape is not None and len(shape) != 1:
        raise ValueError(
            f"{who}: item {i}: input_ids must be a 1-D sequence of token ids, got shape "
            f"{tuple(shape)}"
        )
    try:
        return len(ids)
    except TypeError:
        raise TypeError(
            f"{who}: item {i}: input_ids must be a sequence of token ids, got "
            f"{type(ids).__name__}"
        ) from None
