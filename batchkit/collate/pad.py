"""Padding: ragged items -> one ``[B, L, *feat]`` block with a mask, and back."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import numpy as np

from batchkit._backend import (
    ReturnTensors,
    check_leading_axes,
    check_pin_memory,
    from_host,
    full,
    gather_rows,
    is_generic,
    namespace,
    scatter_rows,
)
from batchkit.collate.device import pinned_batch
from batchkit.collate.inverse import Inverse, Layout
from batchkit.collate.ragged import Ragged, to_ragged
from batchkit.collate.shapes import ShapeBuckets

Side = Literal["left", "right"]


def round_up(n: int, multiple: int | None) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (unchanged when None).

    Args:
        n: A length.
        multiple: A positive int, or None.

    Raises:
        ValueError: ``multiple`` is not a positive int (named ``pad_to_multiple_of``).
    """
    if multiple is None:
        return n
    if not is_positive_int(multiple):
        raise ValueError(f"pad_to_multiple_of must be a positive int, got {multiple!r}")
    return -(-n // int(multiple)) * int(multiple)


def is_positive_int(x: object) -> bool:
    """True for a positive python or numpy integer (bools excluded).

    Args:
        x: Any value.
    """
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)) and int(x) >= 1


def check_side(side: str) -> None:
    """Reject anything but "left" or "right".

    Args:
        side: The padding side given.

    Raises:
        ValueError: It is neither.
    """
    if side not in ("left", "right"):
        raise ValueError(f'side must be "left" or "right", got {side!r}')


def check_max_length(seqs: Sequence[Any], max_length: int, *, hint: str) -> None:
    """Raise a ValueError naming the first item longer than ``max_length``.

    Args:
        seqs: The items (lists, tuples, arrays or tensors; others are not checked).
        max_length: The most steps an item may have.
        hint: What the caller can do about it, appended to the message.
    """
    for i, s in enumerate(seqs):
        n = getattr(s, "shape", (len(s),) if isinstance(s, (list, tuple)) else ())
        if n and n[0] > max_length:
            raise ValueError(f"item {i}: length {n[0]} exceeds max_length={max_length} ({hint})")


def real_token_mask(lengths: np.ndarray, width: int, side: str) -> np.ndarray:
    """Host bool ``[B, width]``: True where a row holds a real (non-padding) step.

    Args:
        lengths: Host int ``[B]``, each row's real steps.
        width: The padded length.
        side: ``"right"`` (real steps first) or ``"left"`` (real steps last).
    """
    steps = np.arange(width)
    if side == "right":
        return steps[None, :] < lengths[:, None]
    return steps[None, :] >= (width - lengths)[:, None]


@dataclass(frozen=True, slots=True)
class Padded(Layout):
    """A padded batch, as [`pad`][batchkit.collate.pad.pad] returns it (not constructed directly).

    ``data``, ``mask`` and ``lengths`` are in the same backend (and on the same device);
    the lengths are also kept on the host, so `unpad` never reads the device.

    Under a shape grid (``pad(..., shapes=...)``) ``B`` may exceed the number of
    items: the dummy rows after the items repeat the last item, and `unpad` and
    `split` leave them out.

    Attributes:
        data: ``[B, L, *feat]``, each item's steps followed (or, on the left side,
            preceded) by padding.
        mask: Bool ``[B, L]``, True where a step is real.
        lengths: Int64 ``[B]``, each row's number of real steps.
        side: ``"right"`` or ``"left"``: where the padding is.
    """

    data: Any
    mask: Any
    lengths: Any
    side: Side
    _host_lengths: tuple[int, ...]  # every row's, dummy rows included
    _num_items: int | None = None  # None: every row is an item

    @property
    def batch_size(self) -> int:
        """B, the rows of ``data``: the items, and any dummy rows after them."""
        return len(self._host_lengths)

    @property
    def num_items(self) -> int:
        """The items of the batch: its first `num_items` rows (B without a shape grid)."""
        return len(self._host_lengths) if self._num_items is None else self._num_items

    @property
    def max_length(self) -> int:
        """L, the padded length."""
        return int(self.data.shape[1])

    def pin_memory(self) -> Padded:
        """A copy with every host tensor in page-locked memory (numpy arrays as they are).

        ``DataLoader(pin_memory=True)`` calls it on each batch, so a ``collate_fn`` run
        in worker processes may return a ``Padded`` and still have it pinned.
        """
        return pinned_batch(self, "Padded.pin_memory()")

    def unpad(self, outputs: Any) -> list[Any]:
        """Per-item real slices of any output whose first two axes are ``[B, L]``.

        Args:
            outputs: An array or tensor computed from the batch, ``[B, L, ...]``
                (e.g. hidden states or logits).

        Returns:
            Views (no copies) into ``outputs``, in item order, honouring the padding
            side: item ``i`` is its ``lengths[i]`` real steps (dummy rows left out).

        Raises:
            ValueError: ``outputs`` does not start with ``[B, L]`` (both shapes named).
        """
        check_leading_axes(outputs, (self.batch_size, self.max_length), "unpad")
        return real_steps(outputs, self._host_lengths[: self.num_items], self.side)

    def inverse(self) -> Inverse:
        """Where each item went (see `split`): a per-token leaf
        is ``[B, L, ...]``, a by-row leaf ``[B, ...]``."""
        return padded_inverse(
            self._host_lengths[: self.num_items], self.max_length, self.side, rows=self.batch_size
        )


def padded_inverse(
    lengths: tuple[int, ...],
    width: int,
    side: Side,
    who: str = "Padded.split",
    rows: int | None = None,
) -> Inverse:
    """The `Inverse` of a padded batch: per-token leaves ``[B, width, ...]`` give each
    item its real steps, by-row leaves ``[B, ...]`` row ``i`` to item ``i``.

    Args:
        lengths: Each item's number of real steps (host ints).
        width: The padded length.
        side: Where the padding is.
        who: The split named in errors.
        rows: B, when dummy rows follow the items (None: one row per item).
    """
    num_rows = len(lengths) if rows is None else rows
    return Inverse(
        who=who,
        token_axes=(num_rows, width),
        num_rows=num_rows,
        rows=tuple(range(len(lengths))),
        cut_tokens=partial(real_steps, lengths=lengths, side=side),
    )


def real_steps(outputs: Any, lengths: tuple[int, ...], side: Side) -> list[Any]:
    """Each row's real steps of a ``[B, L, ...]`` output (views), honouring the side.

    Args:
        outputs: The output, already checked to start with ``[B, L]``.
        lengths: Each row's number of real steps.
        side: Where the padding is.
    """
    if side == "right":
        return [outputs[i, :n, ...] for i, n in enumerate(lengths)]
    width = int(outputs.shape[1])
    return [outputs[i, width - n :, ...] for i, n in enumerate(lengths)]


def pad_ragged(
    ragged: Ragged,
    *,
    pad_value: Any = 0,
    side: Side = "right",
    pad_to_multiple_of: int | None = None,
    min_length: int = 0,
    pin_memory: bool = False,
    who: str = "pad",
    num_items: int | None = None,
) -> Padded:
    """Pad an already-validated `Ragged` (shared by `pad` and the dict collators).

    Args:
        ragged: The items, validated and concatenated.
        pad_value: The value padding steps hold.
        side: ``"right"`` or ``"left"``.
        pad_to_multiple_of: Round the width up to a multiple of this (None: no
            rounding).
        min_length: The least width, before rounding.
        pin_memory: Allocate every output array in page-locked memory.
        who: The caller, named in the refusal when the batch cannot be pinned.
        num_items: How many of the rows are items, the rest dummy rows (None: all).
    """
    check_side(side)
    kind, device = ragged.kind, ragged.device
    check_pin_memory(pin_memory, who, kind, device)
    lengths = ragged.lengths
    width = round_up(max(int(lengths.max(initial=0)), min_length), pad_to_multiple_of)
    batch = ragged.num_items
    values = ragged.values
    shape = (batch, width, *ragged.feature_shape)
    if is_generic(kind):
        host_mask = real_token_mask(lengths, width, side)
        mask = from_host(kind, host_mask, device)
        # Real steps in row-major order are exactly concatenation order; one gather
        # builds the block (the standard has no boolean-mask assignment).
        index = np.full(batch * width, values.shape[0], dtype=np.int64)
        index[host_mask.reshape(-1)] = np.arange(values.shape[0])
        data = namespace(kind).reshape(gather_rows(kind, values, index, pad_value, device), shape)
    else:
        data = full(kind, shape, pad_value, like=values, pin=pin_memory)
        host_mask = real_token_mask(lengths, width, side)
        mask = from_host(kind, host_mask, device, pin=pin_memory)
        if values.shape[0]:
            # Boolean-mask assignment fills row-major, which is exactly concatenation order.
            scatter_rows(data, host_mask, mask, values)
    return Padded(
        data=data,
        mask=mask,
        lengths=from_host(kind, lengths.copy(), device, pin=pin_memory),
        side=side,
        _host_lengths=tuple(lengths.tolist()),
        _num_items=num_items,
    )


def pad(
    seqs: Sequence[Any],
    *,
    pad_value: Any = 0,
    side: Side = "right",
    pad_to_multiple_of: int | None = None,
    max_length: int | None = None,
    truncate: bool = False,
    return_tensors: ReturnTensors = None,
    pin_memory: bool = False,
    shapes: ShapeBuckets | None = None,
) -> Padded:
    """Pad variable-length items (first axis = sequence) into one ``[B, L, *feat]`` block.

    ``L`` is the longest item, rounded up to ``pad_to_multiple_of``. With ``shapes``
    the block is a cell of that grid: ``B`` its smallest batch size >= the items
    (dummy rows repeating the last item after them) and ``L`` its smallest length
    >= the longest item; `unpad` and `split` give the items alone back.

    Args:
        seqs: The items: Python lists, numpy arrays, torch tensors or any Array API
            library's arrays (JAX, CuPy, ...), all with the same trailing (feature)
            shape.
        pad_value: The value padding steps hold (must fit the items' dtype).
        side: ``"right"`` pads after each item's steps, ``"left"`` before them.
        pad_to_multiple_of: Round ``L`` up to a multiple of this (``None``: the
            longest item, exactly).
        max_length: The most steps an item may have (``None``: no limit).
        truncate: With ``max_length``, cut longer items to their first
            ``max_length`` steps instead of raising.
        return_tensors: The output's library: a name (``"np"``, ``"pt"``, ``"jax"``,
            ``"cupy"``, ...) or an Array API namespace; ``None`` follows the input
            (each library's arrays give its own, on their device; lists and numpy
            arrays give numpy).
        pin_memory: Allocate every output array in page-locked memory (torch output,
            CUDA available), so [`to_device`][batchkit.collate.to_device] with
            ``non_blocking`` overlaps the copy to the GPU.
        shapes: A [`ShapeBuckets`][batchkit.ShapeBuckets] grid the block's shape
            is taken from (not with ``pad_to_multiple_of``, ``max_length`` or
            ``truncate``).

    Returns:
        The batch; [`Padded.unpad`][batchkit.Padded.unpad] gives each item its real
        steps of an output back.

    Raises:
        ValueError: An item is longer than ``max_length`` (without ``truncate``; the
            message names its index) or than the largest length of ``shapes``, there
            are more items than its largest batch size, items differ in feature
            shape, or an option is out of range.
        ValueError: ``pin_memory=True`` for numpy output or items already on a GPU.
        RuntimeError: ``pin_memory=True`` without CUDA, or in a ``DataLoader`` worker.
    """
    check_side(side)
    if shapes is not None:
        if pad_to_multiple_of is not None or max_length is not None or truncate:
            raise ValueError(
                "pad: shapes sets the padded length; pass pad_to_multiple_of, max_length "
                "and truncate only without it"
            )
        return _pad_in_grid(seqs, shapes, pad_value, side, return_tensors, pin_memory)
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 0:
            raise ValueError(f"max_length must be an int >= 0, got {max_length!r}")
        if not truncate:
            check_max_length(seqs, max_length, hint="pass truncate=True to cut it")
    ragged = to_ragged(
        seqs, return_tensors=return_tensors, max_length=max_length if truncate else None
    )
    return pad_ragged(
        ragged,
        pad_value=pad_value,
        side=side,
        pad_to_multiple_of=pad_to_multiple_of,
        pin_memory=pin_memory,
    )


def _pad_in_grid(
    seqs: Sequence[Any],
    shapes: ShapeBuckets,
    pad_value: Any,
    side: Side,
    return_tensors: ReturnTensors,
    pin_memory: bool,
) -> Padded:
    """`pad` into the cell of ``shapes`` the items fall in (see `pad`)."""
    if not isinstance(shapes, ShapeBuckets):
        raise TypeError(f"pad: shapes must be a ShapeBuckets, got {type(shapes).__name__}")
    ragged = to_ragged(with_dummy_rows(seqs, shapes, "pad"), return_tensors=return_tensors)
    width = shapes.check_lengths(ragged.lengths[: len(seqs)].tolist(), "pad")
    return pad_ragged(
        ragged,
        pad_value=pad_value,
        side=side,
        min_length=width,
        pin_memory=pin_memory,
        num_items=len(seqs),
    )


def with_dummy_rows(items: Sequence[Any], shapes: ShapeBuckets, who: str) -> list[Any]:
    """``items`` and, after them, copies of the last one up to the smallest batch size
    of ``shapes`` that holds them (a copy of a real item: no row the model sees is
    empty, so none can turn to NaN).

    Args:
        items: The batch's items.
        shapes: The grid.
        who: The collator, named in the error.

    Raises:
        ValueError: More items than the largest batch size.
    """
    items = list(items)
    if not items:
        return items
    try:
        rows = shapes.batch_size_for(len(items))
    except ValueError as exc:
        raise ValueError(f"{who}: {exc}") from None
    return items + [items[-1]] * (rows - len(items))
