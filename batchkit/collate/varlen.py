"""The FlashAttention "varlen" layout: items concatenated, boundaries in ``cu_seqlens``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from batchkit._backend import (
    ReturnTensors,
    array_kind,
    check_leading_axes,
    check_pin_memory,
    concat,
    device_of,
    from_host,
    full,
    to_kind,
)
from batchkit.collate.device import pinned_batch
from batchkit.collate.inverse import Inverse, Layout
from batchkit.collate.pad import is_positive_int, round_up, with_dummy_rows
from batchkit.collate.ragged import Ragged, to_ragged
from batchkit.collate.shapes import ShapeBuckets


def positions_restarting(lengths: np.ndarray) -> np.ndarray:
    """Host int64 ``[sum(lengths)]``: 0, 1, ... restarting at 0 at every item.

    Args:
        lengths: Host int ``[N]``, the items' lengths.
    """
    total = int(lengths.sum())
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


def fixed_segments(cu: np.ndarray, num_segments: int | None, who: str) -> np.ndarray:
    """Host ``cu`` (``[S+1]`` segment boundaries) extended to ``num_segments + 1``
    entries by empty segments at the end (unchanged when ``num_segments`` is None).

    Args:
        cu: Host int boundaries, 0 first.
        num_segments: How many segments the result describes, or None.
        who: The caller, named in the errors.

    Raises:
        ValueError: ``num_segments`` is not a positive int, or fewer than ``S``.
    """
    if num_segments is None:
        return cu
    if not is_positive_int(num_segments):
        raise ValueError(f"{who}: num_segments must be a positive int, got {num_segments!r}")
    have = len(cu) - 1
    if have > num_segments:
        raise ValueError(
            f"{who}: the batch has {have} segments but num_segments={num_segments} "
            "(make the batch smaller or num_segments larger)"
        )
    return np.concatenate([cu, np.full(int(num_segments) - have, cu[-1], dtype=cu.dtype)])


@dataclass(frozen=True, slots=True)
class Varlen(Layout):
    """Items packed end to end for varlen attention kernels.

    [`pack_varlen`][batchkit.pack_varlen] returns it; it is not constructed directly.

    Every array is in the items' library and on their device; ``max_seqlen`` and the
    offsets `unpack` slices by are host integers, so nothing here reads the device.

    Attributes:
        values: ``[T, *feat]``, the items' steps one after another.
        cu_seqlens: Int32, 0 first and ``T`` last, with ``N+1`` entries, plus one
            when ``pad_to_multiple_of`` added a trailing padding segment (with
            ``num_segments``, exactly ``num_segments + 1``: empty segments, ``T``
            repeated, after the real ones).
        max_seqlen: The longest segment (the padding segment included, since a
            kernel sizes its tiles by it); under a shape grid, the cell's length.
        position_ids: Int64 ``[T]``, restarting at 0 in every segment.
        seq_lens: Int64 ``[N]``, the items' lengths (under a shape grid, ``[B]``:
            the dummy segments' too).
    """

    values: Any
    cu_seqlens: Any
    max_seqlen: int
    position_ids: Any
    seq_lens: Any
    _offsets: tuple[int, ...]  # the items' boundaries (dummy segments left out)
    _num_rows: int | None = None  # rows of a by-row leaf, when padding segments add some

    @property
    def num_items(self) -> int:
        """N, the number of real items (the padding segment is not one)."""
        return len(self._offsets) - 1

    @property
    def total_length(self) -> int:
        """T, rows in ``values`` including any trailing padding."""
        return int(self.values.shape[0])

    @property
    def segment_ids(self) -> Any:
        """Int32 ``[T]``: ``k`` for the steps of item ``k - 1`` (1-based, as
        ``Packed.segment_ids``), 0 for the padding segment; built on request, in
        ``values``'s library and on its device. ``segment_ids[:, None] ==
        segment_ids[None, :]`` is the block-diagonal attention mask of the pack."""
        offsets = np.asarray(self._offsets, dtype=np.int64)
        lengths = np.diff(offsets)
        ids = np.zeros(self.total_length, dtype=np.int32)
        ids[: offsets[-1]] = np.repeat(np.arange(1, len(lengths) + 1, dtype=np.int32), lengths)
        return from_host(array_kind(self.values), ids, device_of(self.values))

    def pin_memory(self) -> Varlen:
        """A copy with every host tensor in page-locked memory (numpy arrays as they are).

        ``DataLoader(pin_memory=True)`` calls it on each batch, so a ``collate_fn`` run
        in worker processes may return a ``Varlen`` and still have it pinned.
        """
        return pinned_batch(self, "Varlen.pin_memory()")

    def unpack(self, outputs: Any) -> list[Any]:
        """The N items' slices (views) of any output whose leading axis is ``T``.

        Args:
            outputs: An array or tensor computed from the batch, ``[T, ...]``.

        Returns:
            One view per item, in input order (the padding segment left out).

        Raises:
            ValueError: ``outputs``'s leading axis is not ``T``.
        """
        check_leading_axes(outputs, (self.total_length,), "unpack")
        return segments(outputs, self._offsets)

    def inverse(self) -> Inverse:
        """Where each item went (see `split`): a per-token leaf
        is ``[T, ...]``, a by-row leaf ``[N, ...]``."""
        return Inverse(
            who="Varlen.split",
            token_axes=(self.total_length,),
            num_rows=self.num_items if self._num_rows is None else self._num_rows,
            rows=tuple(range(self.num_items)),
            cut_tokens=partial(segments, offsets=self._offsets),
        )


def segments(outputs: Any, offsets: tuple[int, ...]) -> list[Any]:
    """Each item's rows ``outputs[offsets[i]:offsets[i + 1]]`` of a ``[T, ...]`` output
    (views; rows past ``offsets[-1]``, a padding segment, left out).

    Args:
        outputs: The output, already checked to start with ``[T]``.
        offsets: Host item boundaries, 0 first (``N + 1`` entries).
    """
    return [outputs[offsets[i] : offsets[i + 1], ...] for i in range(len(offsets) - 1)]


_INT32_MAX = 2**31 - 1


def varlen_from_ragged(
    ragged: Ragged,
    *,
    pad_to_multiple_of: int | None = None,
    pad_value: Any = 0,
    num_segments: int | None = None,
    pin_memory: bool = False,
    cell: tuple[int, int] | None = None,
    num_items: int | None = None,
) -> Varlen:
    """Build the varlen layout from validated items (shared with the dict collators).

    With a shape grid's ``cell`` ``(B, L)`` (``ragged`` holding ``B`` segments, the
    last ``B - num_items`` of them dummies) ``T`` is ``B * L``: the padding after
    the segments is cut into segments of at most ``L`` steps, ``cu_seqlens`` has
    exactly ``2 * B + 1`` entries (empty segments last) and ``max_seqlen`` is ``L``,
    so every array's shape and every int depend on the cell alone.

    ``ragged.values`` is the output when no padding tail is appended: allocate it
    pinned up front (``to_ragged(..., pin_memory=True)``), or it is copied to pinned
    memory here.

    Args:
        ragged: The items, validated and concatenated.
        pad_to_multiple_of: Round ``T`` up to a multiple of this with one trailing
            padding segment (None: no padding).
        pad_value: The value the padding segment holds.
        num_segments: Give ``cu_seqlens`` exactly ``num_segments + 1`` entries
            (None: as many as there are segments).
        pin_memory: Allocate every output array in page-locked memory.
        cell: The shape grid's ``(batch size, length)`` cell (not with
            ``pad_to_multiple_of`` or ``num_segments``).
        num_items: How many of the segments are items (None: all).

    Raises:
        ValueError: More tokens than an int32 ``cu_seqlens`` can count, or more
            segments than ``num_segments``.
    """
    kind, device = ragged.kind, ragged.device
    check_pin_memory(pin_memory, "pack_varlen", kind, device)
    lengths = ragged.lengths
    offsets = ragged.offsets()
    real_total = int(offsets[-1])
    total = round_up(real_total, pad_to_multiple_of) if cell is None else cell[0] * cell[1]
    if total > _INT32_MAX:  # int32 cu_seqlens (what the kernels take) would wrap silently
        raise ValueError(
            f"pack_varlen: {total} tokens in one pack; cu_seqlens is int32, so at most "
            f"{_INT32_MAX} fit (split the batch)"
        )
    tail = total - real_total
    values = ragged.values
    seg_lengths = lengths
    if tail:
        padding = full(kind, (tail, *ragged.feature_shape), pad_value, like=values)
        values = concat([values, padding], pin=pin_memory)
        # one padding segment; in a cell, segments of at most its length, so that
        # max_seqlen is the cell's
        step = tail if cell is None else cell[1]
        pieces = np.full(-(-tail // step), step, dtype=np.int64)
        pieces[-1] = tail - step * (len(pieces) - 1)
        offsets = np.append(offsets, real_total + np.cumsum(pieces))
        seg_lengths = np.append(lengths, pieces)
    elif pin_memory:
        values = to_kind(values, kind, pin=True)  # a no-op when to_ragged pinned it
    if cell is not None:
        num_segments = 2 * cell[0]  # B segments, then at most B of padding
    item_offsets = ragged.offsets().tolist()
    return Varlen(
        values=values,
        cu_seqlens=from_host(
            kind,
            fixed_segments(offsets.astype(np.int32), num_segments, "pack_varlen"),
            device,
            pin=pin_memory,
        ),
        max_seqlen=int(seg_lengths.max(initial=0)) if cell is None else cell[1],
        position_ids=from_host(kind, positions_restarting(seg_lengths), device, pin=pin_memory),
        seq_lens=from_host(kind, lengths.copy(), device, pin=pin_memory),
        _offsets=tuple(item_offsets if num_items is None else item_offsets[: num_items + 1]),
        # under a cell, a by-row leaf has one row per segment of cu_seqlens
        _num_rows=None if cell is None else num_segments,
    )


def pack_varlen(
    seqs: Sequence[Any],
    *,
    pad_to_multiple_of: int | None = None,
    pad_value: Any = 0,
    num_segments: int | None = None,
    return_tensors: ReturnTensors = None,
    pin_memory: bool = False,
    shapes: ShapeBuckets | None = None,
) -> Varlen:
    """Concatenate items (first axis = sequence) into the FlashAttention varlen layout.

    With ``pad_to_multiple_of``, ``T`` is rounded up by one trailing padding segment
    (filled with ``pad_value``) that ``cu_seqlens`` covers, so kernels leave no rows
    uncovered; ``unpack`` never returns it.

    With ``shapes`` the layout is that of the grid's cell ``(B, L)`` the items fall
    in (``B`` its smallest batch size >= the items, ``L`` its smallest length >=
    the longest): ``B`` segments (dummy copies of the last item after the items),
    a fixed token count ``T = B * L`` whose padding is cut into segments of at most
    ``L`` steps, ``cu_seqlens`` of exactly ``2 * B + 1`` entries and
    ``max_seqlen == L``, a Python int; all of it computed on the host from the
    items' shapes. `unpack` and `split` give the items alone back; a by-row output
    has one row per segment of ``cu_seqlens`` (``2 * B``), the items' first.

    Args:
        seqs: The items: Python lists, numpy arrays, torch tensors or any Array API
            library's arrays, all with the same trailing (feature) shape.
        pad_to_multiple_of: Round ``T`` up to a multiple of this with one trailing
            padding segment (``None``: no padding).
        pad_value: The value the padding segment holds.
        num_segments: Give ``cu_seqlens`` exactly ``num_segments + 1`` entries, empty
            segments after the real ones (``None``: as many as there are). With a
            ``pad_to_multiple_of`` that every batch fits in, every array then has
            one shape from batch to batch (one compile of a ``jax.jit`` function).
        return_tensors: The output's library: a name (``"np"``, ``"pt"``, ``"jax"``,
            ``"cupy"``, ...) or an Array API namespace; ``None`` follows the input
            (each library's arrays give its own, on their device; lists and numpy
            arrays give numpy).
        pin_memory: Allocate every output array in page-locked memory (torch output,
            CUDA available), so [`to_device`][batchkit.collate.to_device] with
            ``non_blocking`` overlaps the copy to the GPU.
        shapes: A [`ShapeBuckets`][batchkit.ShapeBuckets] grid the layout's sizes
            are taken from (not with ``pad_to_multiple_of`` or ``num_segments``).

    Raises:
        ValueError: Items differ in feature shape, the pack holds more tokens
            than an int32 ``cu_seqlens`` can count, or more segments than
            ``num_segments``; with ``shapes``, an item is longer than its largest
            length or there are more items than its largest batch size.
        ValueError: ``pin_memory=True`` for numpy output or items already on a GPU.
        RuntimeError: ``pin_memory=True`` without CUDA, or in a ``DataLoader`` worker.
    """
    if shapes is not None:
        if pad_to_multiple_of is not None or num_segments is not None:
            raise ValueError(
                "pack_varlen: shapes sets the token count and the segments; pass "
                "pad_to_multiple_of and num_segments only without it"
            )
        return _pack_varlen_in_grid(seqs, shapes, pad_value, return_tensors, pin_memory)
    # Without a padding tail the concatenated items are the output: allocate them pinned.
    ragged = to_ragged(
        seqs,
        return_tensors=return_tensors,
        pin_memory=pin_memory and pad_to_multiple_of is None,
        who="pack_varlen",
    )
    return varlen_from_ragged(
        ragged,
        pad_to_multiple_of=pad_to_multiple_of,
        pad_value=pad_value,
        num_segments=num_segments,
        pin_memory=pin_memory,
    )


def _pack_varlen_in_grid(
    seqs: Sequence[Any],
    shapes: ShapeBuckets,
    pad_value: Any,
    return_tensors: ReturnTensors,
    pin_memory: bool,
) -> Varlen:
    """`pack_varlen` into the cell of ``shapes`` the items fall in (see `pack_varlen`)."""
    if not isinstance(shapes, ShapeBuckets):
        raise TypeError(f"pack_varlen: shapes must be a ShapeBuckets, got {type(shapes).__name__}")
    rows = with_dummy_rows(seqs, shapes, "pack_varlen")
    ragged = to_ragged(rows, return_tensors=return_tensors, who="pack_varlen")
    length = shapes.check_lengths(ragged.lengths[: len(seqs)].tolist(), "pack_varlen")
    return varlen_from_ragged(
        ragged,
        pad_value=pad_value,
        pin_memory=pin_memory,
        cell=(len(rows), length),
        num_items=len(seqs),
    )
