"""Dict collators for data pipelines: ``DataLoader(collate_fn=...)``, HF datasets.

Drop-in, faster equivalents of ``transformers.DataCollatorWithPadding`` and
``transformers.DataCollatorWithFlattening`` that need no tokenizer, work on numpy
alone, and build a batch of JAX, CuPy or torch arrays on those arrays' device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, Literal

import numpy as np

from batchkit._backend import (
    ReturnTensors,
    array_kind,
    check_pin_memory,
    device_of,
    from_host,
    is_array,
    is_generic,
    is_tensor,
    namespace,
    resolve_return_tensors,
    to_kind,
    to_numpy,
)
from batchkit.collate.inverse import FeatureBatch, Inverse
from batchkit.collate.pad import (
    check_side,
    pad_ragged,
    padded_inverse,
    real_token_mask,
    with_dummy_rows,
)
from batchkit.collate.ragged import Ragged, to_ragged
from batchkit.collate.shapes import ShapeBuckets
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


def _flat_row_segments(
    outputs: Any, offsets: tuple[int, ...], kept: tuple[int | None, ...]
) -> list[Any]:
    """Each item's steps of a ``[1, T, ...]`` output; none for an item left out."""
    return [
        outputs[0, 0:0, ...] if k is None else outputs[0, offsets[k] : offsets[k + 1], ...]
        for k in kept
    ]


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


def _seq_length(value: Any) -> int | None:
    """The length of ``value``'s first (sequence) axis; None when it has none."""
    if isinstance(value, (list, tuple)):
        return len(value)
    # Numbers and strings have no shape: only what has one is asked is_array.
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) == 0 or not is_array(value):
        return None
    return int(shape[0])


def _features_kind(first: Mapping[str, Any], requested: str | None) -> tuple[str, Any]:
    """The library and device a batch of features comes out in: ``requested`` (on its
    default device), else those of item 0's first array value (numpy when it holds
    only lists and numbers)."""
    if requested is not None:
        return requested, None
    leader = next((v for v in first.values() if is_array(v)), None)
    if leader is None:
        return "np", None
    return array_kind(leader), device_of(leader)


def _requested_kind(return_tensors: ReturnTensors, pin_memory: object) -> str | None:
    """A collator's output library as asked (None: follow the input); pinning exists
    for torch tensors alone, so ``pin_memory=True`` with None asks for torch."""
    requested = resolve_return_tensors(return_tensors)
    return "pt" if requested is None and pin_memory is True else requested


# Keys PadCollator returns int64 when they hold integers or bools, whatever width came
# in: the dtype transformers' DataCollatorWithPadding gives them once it pads.
_HF_INT64 = frozenset({"input_ids", "attention_mask", "token_type_ids", "special_tokens_mask"})


def _as_int64(data: Any) -> Any:
    """Integer or bool ``data`` (any width) as int64, floats as they are; in a namespace
    other than numpy's and torch's, as its default integer dtype (int64, or int32 for
    JAX without ``jax_enable_x64``)."""
    if not isinstance(data, np.ndarray) and not is_tensor(data):
        xp = namespace(array_kind(data))
        if xp.isdtype(data.dtype, ("real floating", "complex floating")):
            return data
        wide = xp.__array_namespace_info__().default_dtypes()["integral"]
        return data if data.dtype == wide else xp.astype(data, wide)
    if is_tensor(data):
        dtype = data.dtype
        if dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.int64":
            return data
        import torch

        return data.to(torch.int64)
    if data.dtype.kind in "biu" and data.dtype != np.int64:
        return data.astype(np.int64)
    return data


def _ragged_for_key(values: list[Any], key: str, who: str, kind: str | None = None) -> Ragged:
    try:
        # kind: numbers from lists take that backend's default dtypes (float32 for torch)
        return to_ragged(values, return_tensors=kind)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{who}: key {key!r}: {exc}") from None


def _out_key(key: str) -> str:
    return "labels" if key in _LABEL_ALIASES else key


class PadCollator:
    """Pad the keys of dict features that are aligned with ``input_ids``; stack the rest.

    The collator pads *by* one key, the reference: ``input_ids`` when the features
    have it, else the first key (in item 0's order, labels excluded) that has a
    sequence axis and a pad value. Another key is *aligned* with it when, in every
    item, its value has a first axis exactly as long as that item's reference value
    (token-level ``labels``, ``token_type_ids``, an ``attention_mask``). Aligned keys
    with a pad value (``pad_values``, then
    [`DEFAULT_PAD_VALUES`][batchkit.collate.DEFAULT_PAD_VALUES]) are padded to the same
    width: the longest reference, rounded up to ``pad_to_multiple_of``, on
    ``padding_side``. Every other key is stacked as it is, so a fixed-length vector
    (multi-label targets ``[num_labels]``) stays ``[B, num_labels]``; a ragged key
    that cannot be padded raises ``ValueError`` naming it and why. A pad value of
    ``None`` means "do not pad this key" (``None`` for the reference: pad nothing).

    An ``attention_mask`` (int64, 1 = real) is created from the reference unless the
    features carry one. ``input_ids``, ``attention_mask``, ``token_type_ids`` and
    ``special_tokens_mask`` come out int64 when they hold integers or bools, whatever
    width came in, as ``transformers.DataCollatorWithPadding`` gives them; for those
    keys the output equals it with the same pad id, side and ``pad_to_multiple_of``.

    Args:
        pad_values: Pad value per output key, over
            [`DEFAULT_PAD_VALUES`][batchkit.collate.DEFAULT_PAD_VALUES] (``label`` and
            ``label_ids`` count as ``labels``). ``None`` as a value: do not pad that key.
        padding_side: ``"right"`` (pad after the real steps) or ``"left"``.
        pad_to_multiple_of: Round the padded width up to a multiple of this (``None``:
            the longest reference, exactly).
        return_tensors: The output's library: a name (``"np"``, ``"pt"``, ``"jax"``,
            ``"cupy"``, ...) or an Array API namespace. ``None`` follows the features:
            the library of item 0's first array value, on its device (numpy when
            the features hold lists and numbers), or torch with ``pin_memory=True``.
        pin_memory: Allocate every output tensor in page-locked memory (torch output,
            CUDA available), for a ``non_blocking`` copy to the GPU (see
            [`to_device`][batchkit.collate.to_device]).
        shapes: A [`ShapeBuckets`][batchkit.ShapeBuckets] grid: the batch is
            padded to the cell the features fall in, its smallest length >= the
            longest reference and its smallest batch size >= the features (dummy
            rows, copies of the last feature, after them; `split` leaves them
            out). Not with ``pad_to_multiple_of``.

    Raises:
        TypeError: ``shapes`` is not a ``ShapeBuckets``.
        ValueError: ``padding_side`` or ``return_tensors`` is not one of its values,
            ``pin_memory=True`` with an output other than torch, or ``shapes``
            with ``pad_to_multiple_of``.
        RuntimeError: ``pin_memory=True`` without CUDA (raised here, not per batch).
    """

    def __init__(
        self,
        pad_values: Mapping[str, Any] | None = None,
        padding_side: Literal["left", "right"] = "right",
        pad_to_multiple_of: int | None = None,
        return_tensors: ReturnTensors = None,
        pin_memory: bool = False,
        shapes: ShapeBuckets | None = None,
    ) -> None:
        check_side(padding_side)
        check_shapes(shapes, type(self).__name__, pad_to_multiple_of=pad_to_multiple_of)
        self._requested = _requested_kind(return_tensors, pin_memory)
        check_pin_memory(pin_memory, type(self).__name__, self._requested or "np")
        self.pad_values = {**DEFAULT_PAD_VALUES, **(pad_values or {})}
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of
        self.return_tensors = return_tensors
        self.pin_memory = pin_memory
        self.shapes = shapes

    def length_of(self, feature: Mapping[str, Any]) -> int:
        """The length one feature dict pads by: that of its reference key (see the
        class docstring); a policy's length key, so the batch a request joins and
        the width it is padded to are read from the same value.

        Args:
            feature: One item, as given to the collator.

        Raises:
            TypeError: ``feature`` is not a dict.
            ValueError: It has no key to pad by.
        """
        who = type(self).__name__
        if not isinstance(feature, Mapping):
            raise TypeError(f"{who}: an item is a {type(feature).__name__}, expected a dict")
        reference = self._reference_key(list(feature), feature)
        length = None if reference is None else _seq_length(feature[reference])
        if length is None:
            raise ValueError(
                f"{who}: the item has no key to pad by (no 'input_ids', and no other key "
                f"with a sequence axis and a pad value); its keys: {sorted(map(str, feature))}"
            )
        return length

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> FeatureBatch:
        """Collate a list of feature dicts into one dict of batched arrays.

        Args:
            features: One dict per item, every item with the same keys (token ids,
                masks, labels as lists, arrays or tensors).

        Returns:
            A [`FeatureBatch`][batchkit.collate.FeatureBatch] (a ``dict``): one batched
            value per key (``label``/``label_ids`` renamed ``labels``), plus an
            ``attention_mask`` when the features carry none and a key was padded.

        Raises:
            TypeError: ``features`` is not a list of dicts.
            ValueError: The batch is empty, the items' keys differ, or a ragged key
                cannot be padded (the message names the key and why).
        """
        who = type(self).__name__
        keys = _check_features(features, who)
        kind, device = _features_kind(features[0], self._requested)
        reference = self._reference_key(keys, features[0])
        num_items = len(features)
        min_length = 0
        if self.shapes is not None:
            features = with_dummy_rows(features, self.shapes, who)
        reference_lengths = [_seq_length(f[reference]) for f in features] if reference else []
        if self.shapes is not None and reference is not None:
            real = [n or 0 for n in reference_lengths[:num_items]]
            # (an item without a length: the alignment check below says why)
            min_length = self.shapes.check_lengths(real, f"{who}: key {reference!r}")
        batch = FeatureBatch()
        mask_source: Ragged | None = None  # the reference, once padded to ``width``
        width = 0
        for key in keys:
            values = [f[key] for f in features]
            out_key = _out_key(key)
            # each key's lengths read once, for the alignment check and the stacking
            lengths = reference_lengths if key == reference else list(map(_seq_length, values))
            unpadded = self._why_not_padded(key, lengths, reference, reference_lengths)
            if unpadded is not None:
                batch[out_key] = _stack_key(
                    values, lengths, key, who, kind, device, unpadded, self.pin_memory
                )
                continue
            ragged = _ragged_for_key(values, key, who, kind)
            if out_key in _HF_INT64:  # widened before padding, so the output is allocated so
                ragged = Ragged(_as_int64(ragged.values), ragged.lengths, ragged.kind)
            try:
                padded = pad_ragged(
                    ragged,
                    pad_value=self.pad_values[out_key],
                    side=self.padding_side,
                    pad_to_multiple_of=self.pad_to_multiple_of,
                    min_length=min_length,
                    pin_memory=self.pin_memory,
                    who=f"{who}: key {key!r}",
                )
            except ValueError as exc:  # e.g. a pad value the key's dtype cannot hold
                if str(exc).startswith(who):
                    raise
                raise ValueError(f"{who}: key {key!r}: {exc}") from None
            batch[out_key] = padded.data
            if key == reference:
                mask_source, width = ragged, padded.max_length
        if mask_source is not None and "attention_mask" not in batch:
            mask = real_token_mask(mask_source.lengths, width, self.padding_side)
            batch["attention_mask"] = from_host(
                kind, mask.astype(np.int64), mask_source.device, pin=self.pin_memory
            )
        # Built when split asks for it: most batches go to a model and never need it.
        if mask_source is None:  # nothing padded: no token axes, every leaf by row
            batch._inverse = partial(_rows_only_inverse, num_items, len(features))
        else:
            lengths_on_host = tuple(mask_source.lengths[:num_items].tolist())
            batch._inverse = partial(
                padded_inverse,
                lengths_on_host,
                width,
                self.padding_side,
                "FeatureBatch.split",
                len(features),
            )
        return batch

    def _reference_key(self, keys: list[str], first: Mapping[str, Any]) -> str | None:
        """The key the collator pads by (see the class docstring); None if there is none."""
        if "input_ids" in keys:
            return "input_ids"
        for key in keys:
            out_key = _out_key(key)
            has_pad_value = self.pad_values.get(out_key) is not None
            if out_key != "labels" and has_pad_value and _seq_length(first[key]) is not None:
                return key
        return None

    def _why_not_padded(
        self,
        key: str,
        lengths: list[int | None],
        reference: str | None,
        reference_lengths: list[int | None],
    ) -> str | None:
        """None when ``key`` is padded; else why it is stacked (for a ragged key's error)."""
        if reference is None:
            return (
                "there is no key to pad by (no 'input_ids', and no other key with a "
                "sequence axis and a pad value)"
            )
        if self.pad_values.get(_out_key(reference)) is None:
            return f"{reference!r}, the key padded by, has pad value None: nothing is padded"
        for i, (got, want) in enumerate(zip(lengths, reference_lengths, strict=True)):
            if got != want:
                return (
                    f"it is not aligned with {reference!r} (item {i}: length {got}, its "
                    f"{reference!r} {want}); only keys as long as {reference!r} in every "
                    "item are padded"
                )
        out_key = _out_key(key)
        if out_key not in self.pad_values:
            return "it has no pad value; add it to pad_values"
        if self.pad_values[out_key] is None:
            return "its pad value is None (do not pad)"
        return None


def _rows_only_inverse(num_items: int, num_rows: int) -> Inverse:
    """The `Inverse` of a batch in which nothing was padded: every leaf is by row."""
    return Inverse(
        who="FeatureBatch.split",
        token_axes=None,
        num_rows=num_rows,
        rows=tuple(range(num_items)),
        cut_tokens=list,
    )


def check_shapes(shapes: object, who: str, **exclusive: object) -> None:
    """Refuse a ``shapes`` that is not a `ShapeBuckets`, or one given beside options
    that would set the same sizes (``exclusive``: each such option's value).

    Args:
        shapes: The grid given, or None.
        who: The collator, named in the errors.
        **exclusive: Options that must be None when ``shapes`` is given.

    Raises:
        TypeError: ``shapes`` is neither None nor a ``ShapeBuckets``.
        ValueError: ``shapes`` beside one of ``exclusive``.
    """
    if shapes is None:
        return
    if not isinstance(shapes, ShapeBuckets):
        raise TypeError(f"{who}: shapes must be a ShapeBuckets, got {type(shapes).__name__}")
    given = sorted(name for name, value in exclusive.items() if value is not None)
    if given:
        raise ValueError(f"{who}: shapes sets the padded sizes; pass {given} only without it")


def _stack_key(
    values: list[Any],
    lengths: list[int | None],
    key: str,
    who: str,
    kind: str,
    device: Any,
    why: str,
    pin: bool,
) -> Any:
    """A key that is not padded (its values' ``lengths``, as `_seq_length` gives them),
    stacked per item into ``kind`` on ``device`` (None: where the values are, numbers
    on the default device); a ragged one is refused, naming it and ``why`` it is not
    padded."""
    if lengths[0] is not None and len(set(lengths)) > 1:
        j = next(i for i, n in enumerate(lengths) if n != lengths[0])
        raise ValueError(
            f"{who}: key {key!r} is ragged (item 0 has length {lengths[0]}, item {j} "
            f"has {lengths[j]}) and is not padded: {why}"
        )
    if isinstance(values[0], (list, tuple)):
        values = [np.asarray(v) for v in values]
        if kind == "pt" and values[0].dtype == np.float64:
            values = [v.astype(np.float32) for v in values]  # torch's default float
    try:
        stacked = stack(values, return_tensors=kind, pin_memory=pin)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{who}: key {key!r}: {exc}") from None
    if device is not None and is_array(stacked) and device_of(stacked) != device:
        return to_kind(stacked, kind, device)  # numbers join the batch on its device
    return stacked


# VarlenCollator's own output keys: a feature key of one of these names is refused
# rather than overwritten.
_VARLEN_OUTPUT_KEYS = frozenset(
    {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
)


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

    Other keys are carried, never dropped: a key as long as ``input_ids`` in every
    kept sequence (``token_type_ids``, per-token weights) is flattened the same way
    to ``[1, T, *feat]``; any other (an ``idx``, a sequence-level ``label``) is
    stacked over the kept sequences, ``[N, ...]``, in ``cu_seq_lens_q`` order. Two
    exceptions: ``attention_mask`` is left out (the layout has no padding for it to
    mark, as in HF), and a key named like an output key (``position_ids``,
    ``cu_seq_lens_q``, ...) is refused rather than overwritten.

    The output is in the features' library and on their device (that of item 0's
    first array value; numpy for lists), unless ``return_tensors`` says otherwise;
    the lengths and ``max_length_*`` are computed on the host, from shapes.

    Args:
        separator_id: The label written at the first token of every sequence (``-100``,
            ignored by the loss, as HF's default).
        return_tensors: The output's library: a name (``"np"``, ``"pt"``, ``"jax"``,
            ``"cupy"``, ...) or an Array API namespace; ``None`` follows the features
            (torch with ``pin_memory=True``).
        return_sample_index: Also return ``sample_index``, the input each sequence
            came from.
        pin_memory: Allocate the output tensors in page-locked memory (torch output,
            CUDA available), for a ``non_blocking`` copy to the GPU.

    Raises:
        ValueError: ``return_tensors`` is not a known library, or ``pin_memory=True``
            with an output other than torch.
        RuntimeError: ``pin_memory=True`` without CUDA (raised here, not per batch).
    """

    def __init__(
        self,
        separator_id: int = -100,
        return_tensors: ReturnTensors = None,
        return_sample_index: bool = False,
        pin_memory: bool = False,
    ) -> None:
        self._requested = _requested_kind(return_tensors, pin_memory)
        check_pin_memory(pin_memory, type(self).__name__, self._requested or "np")
        self.separator_id = separator_id
        self.return_tensors = return_tensors
        self.return_sample_index = return_sample_index
        self.pin_memory = pin_memory

    def length_of(self, feature: Mapping[str, Any]) -> int:
        """The length of one feature dict: its ``input_ids``' (a policy's length key,
        so dict features need no ``key=``).

        Args:
            feature: One item, as given to the collator.

        Raises:
            TypeError: ``feature`` is not a dict, or its ``input_ids`` have no length.
            ValueError: It has no ``input_ids``, or they are not 1-D.
        """
        who = type(self).__name__
        if not isinstance(feature, Mapping):
            raise TypeError(f"{who}: an item is a {type(feature).__name__}, expected a dict")
        if "input_ids" not in feature:
            raise ValueError(
                f"{who}: the item has no 'input_ids'; its keys: {sorted(map(str, feature))}"
            )
        return _seq_len(feature["input_ids"], 0, who)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> FeatureBatch:
        """Collate a list of feature dicts (each with ``input_ids``) into one flat row.

        Args:
            features: One dict per item, each with 1-D ``input_ids`` and optionally
                ``labels`` (as long as its ``input_ids``), ``sample_index`` and any
                other keys (carried, see the class docstring).

        Returns:
            A [`FeatureBatch`][batchkit.collate.FeatureBatch] (a ``dict``) of the keys
            listed in the class docstring, ``[1, T]`` rows and ``[N+1]`` cumulative
            lengths over the ``N`` non-empty sequences, and the carried keys.

        Raises:
            ValueError: The batch is empty or its items' keys differ, a feature lacks
                ``input_ids``, its ``input_ids`` are not 1-D, its ``labels`` differ
                in length, a carried key is ragged but not as long as ``input_ids``
                or is named like an output key, or every sequence is empty.
        """
        who = type(self).__name__
        keys = _check_features(features, who)
        kind, _ = _features_kind(features[0], self._requested)
        pin = self.pin_memory
        check_pin_memory(pin, who, kind)  # again here: a DataLoader worker cannot pin
        if "input_ids" not in keys:
            raise ValueError(f"{who}: features need an 'input_ids' key; got {keys}")
        clashing = sorted(_VARLEN_OUTPUT_KEYS.intersection(keys))
        if clashing:
            raise ValueError(
                f"{who}: feature keys {clashing} are names of the layout's own outputs; "
                "rename or remove them"
            )
        kept = [i for i, f in enumerate(features) if _seq_len(f["input_ids"], i, who) > 0]
        if not kept:
            raise ValueError(f"{who}: every sequence in the batch is empty")
        kept_features = [features[i] for i in kept]
        # numpy or CPU torch out, from host items: built with numpy, converted at the end
        in_kind, in_device = _features_kind(features[0], None)
        on_host = kind == "np" or (
            kind == "pt" and (in_kind == "np" or (in_kind == "pt" and in_device.type == "cpu"))
        )
        build = None if on_host else kind
        tokens = _ragged_for_key([f["input_ids"] for f in kept_features], "input_ids", who, build)
        if tokens.feature_shape:  # nested lists: one flat row needs 1-D token ids
            raise ValueError(
                f"{who}: input_ids must be 1-D sequences of token ids, got items of shape "
                f"[length, {', '.join(map(str, tokens.feature_shape))}]"
            )
        labels = None
        if "labels" in keys:
            labels = _ragged_for_key([f["labels"] for f in kept_features], "labels", who, build)
            bad = np.flatnonzero(labels.lengths != tokens.lengths)
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"{who}: item {kept[i]}: labels length {labels.lengths[i]} != input_ids "
                    f"length {tokens.lengths[i]}"
                )
        layout = varlen_from_ragged(tokens)
        device = None if on_host else tokens.device
        rows = _host_rows if on_host else _device_rows
        batch = rows(tokens, labels, layout, self.separator_id, kind, pin)
        batch["max_length_q"] = batch["max_length_k"] = layout.max_seqlen
        if self.return_sample_index:
            if "sample_index" in keys:
                index = np.asarray([int(f["sample_index"]) for f in kept_features], dtype=np.int64)
            else:
                index = np.asarray(kept, dtype=np.int64)
            batch["sample_index"] = from_host(kind, index, device, pin=pin)
        for key in keys:
            if key in ("input_ids", "labels", "attention_mask") or key in batch:
                continue
            batch[key] = _carried(kept_features, key, tokens, who, kind, device, pin)
        out = FeatureBatch(batch)
        slot: list[int | None] = [None] * len(features)
        for k, i in enumerate(kept):
            slot[i] = k
        offsets = tuple(tokens.offsets().tolist())
        out._inverse = Inverse(
            who="FeatureBatch.split",
            token_axes=(1, offsets[-1]),
            num_rows=len(kept),
            rows=tuple(slot),
            cut_tokens=partial(_flat_row_segments, offsets=offsets, kept=tuple(slot)),
        )
        return out


def _host_rows(
    tokens: Ragged, labels: Ragged | None, layout: Any, separator_id: int, kind: str, pin: bool
) -> dict[str, Any]:
    """VarlenCollator's rows built with numpy on the host (numpy or CPU torch output)."""
    starts = tokens.offsets()[:-1]
    source = tokens if labels is None else labels
    label_values = to_numpy(source.values).astype(np.int64)
    label_values[starts] = separator_id

    def row(x: Any) -> Any:  # HF's [1, T] int64 layout
        return to_kind(to_numpy(x).astype(np.int64)[None, :], kind, pin=pin)

    cu = to_numpy(layout.cu_seqlens)
    return {
        "input_ids": row(tokens.values),
        "labels": row(label_values),
        "position_ids": row(layout.position_ids),
        "cu_seq_lens_q": to_kind(cu.copy(), kind, pin=pin),
        "cu_seq_lens_k": to_kind(cu.copy(), kind, pin=pin),
    }


def _device_rows(
    tokens: Ragged, labels: Ragged | None, layout: Any, separator_id: int, kind: str, pin: bool
) -> dict[str, Any]:
    """VarlenCollator's rows built on the tokens' device with the Array API standard:
    no host copy of the tokens, no write into an array."""
    xp = namespace(kind)
    device = tokens.device
    total = int(tokens.values.shape[0])
    is_start = np.zeros(total, dtype=bool)
    is_start[tokens.offsets()[:-1]] = True
    source = _as_int64((tokens if labels is None else labels).values)
    separator = xp.asarray(separator_id, dtype=source.dtype, device=device)
    label_values = xp.where(from_host(kind, is_start, device), separator, source)

    def row(x: Any) -> Any:  # HF's [1, T] layout, in the namespace's widest default int
        return xp.reshape(_as_int64(x), (1, total))

    return {
        "input_ids": row(tokens.values),
        "labels": row(label_values),
        "position_ids": row(layout.position_ids),
        "cu_seq_lens_q": layout.cu_seqlens,
        "cu_seq_lens_k": from_host(kind, tokens.offsets().astype(np.int32), device),
    }


def _carried(
    features: list[Mapping[str, Any]],
    key: str,
    tokens: Ragged,
    who: str,
    kind: str,
    device: Any,
    pin: bool,
) -> Any:
    """A key VarlenCollator does not interpret: flattened like ``input_ids`` when it is as
    long as them in every item, else stacked per item."""
    values = [f[key] for f in features]
    lengths = [_seq_length(v) for v in values]
    if lengths == tokens.lengths.tolist():
        ragged = _ragged_for_key(values, key, who, kind)
        flat = ragged.values
        if is_generic(kind):
            return namespace(kind).expand_dims(flat, axis=0)
        return to_kind(flat[None], kind, pin=pin)
    why = "it is not as long as input_ids in every item, so it is not flattened"
    return _stack_key(values, lengths, key, who, kind, device, why, pin)


def _seq_len(ids: Any, i: int, who: str) -> int:
    """The length of item ``i``'s ``input_ids``: a 1-D sequence of token ids."""
    shape = getattr(ids, "shape", None)
    if shape is not None and len(shape) != 1:
        raise ValueError(
            f"{who}: item {i}: input_ids must be a 1-D sequence of token ids, got shape "
            f"{tuple(shape)}"
        )
    if shape is not None:
        return int(shape[0])  # from the shape: the standard promises no len()
    try:
        return len(ids)
    except TypeError:
        raise TypeError(
            f"{who}: item {i}: input_ids must be a sequence of token ids, got {type(ids).__name__}"
        ) from None
