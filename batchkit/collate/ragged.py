"""Variable-length items as one flat buffer (`Ragged`), the layout every
sequence collator starts from, and `to_ragged`, which validates the items (lists,
numpy arrays, tensors or any Array API library's arrays) and concatenates them, with
fast paths for the common inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from batchkit._backend import (
    ReturnTensors,
    _torch,
    check_pin_memory,
    check_return_tensors,
    device_of,
    is_array,
    is_generic,
    is_tensor,
    join_tensors,
    kind_of,
    namespace,
    output_kind,
    pinned_numpy_out,
    to_kind,
)

_SCALAR_TYPES = (bool, int, float, np.generic)


@dataclass(frozen=True, slots=True)
class Ragged:
    """Variable-length items as one flat buffer: the layout every collator starts from.

    Attributes:
        values: ``[T, *feat]`` (numpy, torch or another Array API library), the items
            concatenated along their first (sequence) axis.
        lengths: Host int64 ``[N]``, each item's length.
        kind: The backend of ``values``: ``"np"``, ``"pt"`` or its namespace's name.
    """

    values: Any
    lengths: np.ndarray
    kind: str

    @property
    def num_items(self) -> int:
        """N, the number of items."""
        return int(self.lengths.shape[0])

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Trailing axes shared by every item."""
        return tuple(self.values.shape[1:])

    @property
    def device(self) -> Any:
        """The device of ``values`` (None for numpy)."""
        return None if self.kind == "np" else device_of(self.values)

    def offsets(self) -> np.ndarray:
        """Host int64 ``[N+1]``: item ``i`` is ``values[offsets[i]:offsets[i+1]]``."""
        out = np.zeros(self.num_items + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out


def _describe(x: Any) -> str:
    shape = tuple(getattr(x, "shape", ()))
    return f"{type(x).__name__} of shape {shape} and dtype {getattr(x, 'dtype', '?')}"


def _check_numeric(arr: Any, index: int) -> None:
    dtype = arr.dtype
    if isinstance(arr, np.ndarray) and dtype.kind not in "biufc":
        raise TypeError(f"item {index}: expected numbers, got dtype {dtype}")


def _item_array(item: Any, index: int, kind: str) -> Any:
    """One item as an array with a sequence axis, with errors naming the item."""
    if item is None:
        raise TypeError(f"item {index}: got None, expected a sequence")
    try:
        item_kind = kind_of(item)
    except TypeError as exc:
        raise TypeError(f"item {index}: {exc}") from None
    if item_kind != kind:
        raise TypeError(
            f"item {index}: mixed input types; item 0 is a {kind} item but item {index} is a "
            f"{item_kind} item (convert them to one type first)"
        )
    if kind == "list":
        try:
            arr = np.asarray(item)
        except ValueError as exc:
            raise ValueError(f"item {index}: ragged nested list ({exc})") from None
        if arr.dtype == object:
            raise ValueError(f"item {index}: ragged or non-numeric nested list")
    else:
        arr = item
    if arr.ndim == 0:
        raise ValueError(f"item {index}: a scalar has no sequence axis; got {_describe(arr)}")
    _check_numeric(arr, index)
    return arr


def _fast_flat_list(items: Sequence[Any]) -> np.ndarray | None:
    """Flat python lists of scalars in one conversion; None when the fast path doesn't apply."""
    first = next((s for s in items if len(s)), None)
    if first is None or not isinstance(first[0], _SCALAR_TYPES):
        return None
    try:
        flat = np.array(list(chain.from_iterable(items)))
    except (ValueError, TypeError):
        return None
    if flat.ndim != 1 or flat.dtype.kind not in "biuf":
        return None
    return flat


def _check_list_items(items: Sequence[Any]) -> None:
    """Every item of a python-list batch must itself be a list or tuple (errors name the item)."""
    for i, item in enumerate(items):
        if not isinstance(item, (list, tuple)):
            _item_array(item, i, "list")  # raises the precise TypeError for this item


def _fast_tensors(
    items: Sequence[Any], return_tensors: ReturnTensors, max_length: int | None, pin: bool
) -> Ragged | None:
    """Tensors of one device and feature shape in a single check pass; None otherwise
    (the general path then names the offending item)."""
    torch = _torch()
    first = items[0]
    device, feat, tensor_type = first.device, first.shape[1:], torch.Tensor
    for s in items:
        if not isinstance(s, tensor_type) or s.ndim == 0:
            return None
        if s.shape[1:] != feat or s.device != device:
            return None
    if max_length is not None:
        items = [s[:max_length] for s in items]
    lengths = np.fromiter((s.shape[0] for s in items), dtype=np.int64, count=len(items))
    out_kind = output_kind("pt", return_tensors)
    values = join_tensors(torch, torch.cat, list(items), pin=pin and out_kind == "pt")
    return Ragged(to_kind(values, out_kind), lengths, out_kind)


def to_ragged(
    items: Sequence[Any],
    *,
    return_tensors: ReturnTensors = None,
    max_length: int | None = None,
    pin_memory: bool = False,
    who: str = "to_ragged",
) -> Ragged:
    """Validate and concatenate items (lists, arrays or tensors) into a `Ragged`.

    Items longer than ``max_length`` are cut to their first ``max_length`` steps
    (callers decide beforehand whether that is allowed). Inputs are never mutated:
    the flat buffer is always a fresh copy. Python lists holding no numbers at all
    (every item empty) give int64, the dtype of token ids.

    Args:
        items: The items: Python lists, numpy arrays, torch tensors or another Array
            API library's arrays (one kind for all), or a 2-D array taken as a batch
            of rows.
        return_tensors: A library (see `ReturnTensors`), or ``None`` to follow the input.
        max_length: Cut longer items to their first ``max_length`` steps; ``None``:
            keep them whole.
        pin_memory: Allocate the flat buffer in page-locked memory (for a layout
            that returns it as it is).
        who: The caller, named in the refusal when it cannot be pinned.

    Raises:
        TypeError: ``items`` is not a sequence, or an item is not a sequence of
            numbers, or its kind differs from item 0's (the message names it).
        ValueError: No items, or an item is a scalar, ragged inside, differs in
            feature shape, or is on another device than item 0.
    """
    check_return_tensors(return_tensors)
    if isinstance(items, np.ndarray) or is_tensor(items):
        items = list(items)  # a padded 2-D array given as a batch of rows
    elif is_array(items) and getattr(items, "ndim", 0) >= 1:
        rows: Any = items
        items = [rows[i] for i in range(rows.shape[0])]  # the standard has no __iter__
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise TypeError(f"expected a sequence of items, got {type(items).__name__}")
    if len(items) == 0:
        raise ValueError("expected at least one item, got an empty batch")
    if items[0] is None:
        raise TypeError("item 0: got None, expected a sequence")
    try:
        kind = kind_of(items[0])
    except TypeError as exc:
        raise TypeError(f"item 0: {exc}") from None
    if pin_memory:
        device = None if kind == "list" else device_of(items[0])
        check_pin_memory(pin_memory, who, output_kind(kind, return_tensors), device)

    if kind == "list":
        _check_list_items(items)
        # Cut to 0 after conversion, below: an emptied list would lose its feature axis.
        if max_length:
            items = [s[:max_length] if len(s) > max_length else s for s in items]
        lengths = np.fromiter((len(s) for s in items), dtype=np.int64, count=len(items))
        flat = _fast_flat_list(items) if max_length != 0 else None
        if flat is not None:
            out_kind = output_kind("list", return_tensors)
            if out_kind == "pt" and flat.dtype.kind == "f":
                flat = flat.astype(np.float32)  # torch's default float, as torch.tensor() gives
            return Ragged(to_kind(flat, out_kind, pin=pin_memory), lengths, out_kind)
        arrays = [_item_array(s, i, "list") for i, s in enumerate(items)]
    else:
        if kind == "pt":
            fast = _fast_tensors(items, return_tensors, max_length, pin_memory)
            if fast is not None:
                return fast
        arrays = [_item_array(s, i, kind) for i, s in enumerate(items)]
    if max_length is not None:
        arrays = [a[:max_length] for a in arrays]

    # Feature axes must agree; an empty item may come without them (``[]``).
    feat = next((tuple(a.shape[1:]) for a in arrays if a.shape[0] or a.ndim > 1), ())
    for i, a in enumerate(arrays):
        if tuple(a.shape[1:]) != feat:
            if a.shape[0] == 0 and a.ndim == 1:
                arrays[i] = namespace(kind).reshape(a, (0, *feat)) if is_generic(kind) else (
                    a.reshape((0, *feat))
                )
                continue
            raise ValueError(
                f"item {i}: feature shape {tuple(a.shape[1:])} differs from the batch's "
                f"{feat} (item shapes are [length, *features])"
            )
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    if 0 < np.count_nonzero(lengths) < len(arrays):
        # An empty item has no values to give a dtype (``[]`` is float64, ``torch.tensor([])``
        # float32): it must not promote the others' (int64 ids would lose precision).
        arrays = _empties_as_values(arrays, lengths, kind)

    if is_generic(kind):
        return _concat_standard(arrays, lengths, kind, return_tensors)
    if kind == "pt":
        torch = _torch()
        device = arrays[0].device
        for i, a in enumerate(arrays):
            if a.device != device:
                raise ValueError(f"item {i}: on device {a.device}, but item 0 is on {device}")
        out_kind = output_kind("pt", return_tensors)
        values = join_tensors(torch, torch.cat, arrays, pin=pin_memory and out_kind == "pt")
        return Ragged(to_kind(values, out_kind), lengths, out_kind)

    out_kind = output_kind(kind, return_tensors)
    dtype = np.result_type(*arrays)
    if kind == "list" and sum(a.size for a in arrays) == 0:
        dtype = np.dtype(np.int64)  # no numbers to infer from: token ids, as HF gives
    elif out_kind == "pt" and kind == "list" and dtype == np.float64:
        dtype = np.dtype(np.float32)  # torch's default float, as torch.tensor() gives
    if pin_memory:
        shape = (int(lengths.sum()), *feat)
        pinned, out = pinned_numpy_out(shape, dtype)
        np.concatenate(arrays, axis=0, out=out, casting="unsafe")
        return Ragged(pinned, lengths, out_kind)
    values = np.concatenate(arrays, axis=0).astype(dtype, copy=False)
    return Ragged(to_kind(values, out_kind), lengths, out_kind)


def _concat_standard(
    arrays: list[Any], lengths: np.ndarray, kind: str, return_tensors: ReturnTensors
) -> Ragged:
    """Items of an Array API library (not numpy or torch), concatenated on their device
    with the standard's functions: no host copy, no write into any array."""
    xp = namespace(kind)
    device = device_of(arrays[0])
    for i, a in enumerate(arrays):
        if device_of(a) != device:
            raise ValueError(f"item {i}: on device {device_of(a)}, but item 0 is on {device}")
    try:
        dtype = xp.result_type(*arrays) if len(arrays) > 1 else arrays[0].dtype
    except (TypeError, ValueError) as exc:
        dtypes = sorted({str(a.dtype) for a in arrays})
        raise TypeError(f"items of dtypes {dtypes} do not promote to one dtype ({exc})") from None
    values = xp.concat([a if a.dtype == dtype else xp.astype(a, dtype) for a in arrays], axis=0)
    out_kind = output_kind(kind, return_tensors)
    return Ragged(to_kind(values, out_kind), lengths, out_kind)


def _empties_as_values(arrays: list[Any], lengths: np.ndarray, kind: str) -> list[Any]:
    """``arrays`` with the empty ones cast to the dtype the non-empty ones promote to."""
    filled = [a for a, n in zip(arrays, lengths) if n]
    if is_generic(kind):
        xp = namespace(kind)
        dtype = xp.result_type(*filled) if len(filled) > 1 else filled[0].dtype
        return [a if n else xp.astype(a, dtype) for a, n in zip(arrays, lengths)]
    if kind == "pt":
        torch = _torch()
        dtype = filled[0].dtype
        for a in filled[1:]:
            dtype = torch.promote_types(dtype, a.dtype)
        return [a if n else a.to(dtype) for a, n in zip(arrays, lengths)]
    dtype = np.result_type(*filled)
    return [a if n else a.astype(dtype) for a, n in zip(arrays, lengths)]
