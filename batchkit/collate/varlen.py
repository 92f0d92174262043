"""The FlashAttention "varlen" layout: items concatenated, boundaries in ``cu_seqlens``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchkit._backend import (
    ReturnTensors,
    check_leading_axes,
    check_pin_memory,
    concat,
    from_host,
    full,
    to_kind,
)
from batchkit.collate.device import pinned_batch
from batchkit.collate.pad import round_up
from batchkit.collate.ragged import Ragged, to_ragged


def positions_restarting(lengths: np.ndarray) -> np.ndarray:
    """Host int64 ``[sum(lengths)]``: 0, 1, ... restarting at 0 at every item.

    Args:
        lengths: Host int ``[N]``, the items' lengths.
    """
    total = int(lengths.sum())
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


@dataclass(frozen=True, slots=True)
class Varlen:
    """Items packed end to end for varlen attention kernels.

    [`pack_varlen`][batchkit.pack_varlen] returns it; it is not constructed directly.

    Attributes:
        values: ``[T, *feat]``, the items' steps one after another.
        cu_seqlens: Int32, 0 first and ``T`` last, with ``N+1`` entries, plus one
            when ``pad_to_multiple_of`` added a trailing padding segment.
        max_seqlen: The longest segment (the padding segment included, since a
            kernel sizes its tiles by it).
        position_ids: Int64 ``[T]``, restarting at 0 in every segment.
        seq_lens: Int64 ``[N]``, the items' lengths.
    """

    values: Any
    cu_seqlens: Any
    max_seqlen: int
    position_ids: Any
    seq_lens: Any
    _offsets: tuple[int, ...]

    @property
    def num_items(self) -> int:
        """N, the number of real items (the padding segment is not one)."""
        return len(self._offsets) - 1

    @property
    def total_length(self) -> int:
        """T, rows in ``values`` including any trailing padding."""
        return int(self.values.shape[0])

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
        offs = self._offsets
        return [outputs[offs[i] : offs[i + 1]] for i in range(self.num_items)]


_INT32_MAX = 2**31 - 1


def varlen_from_ragged(
    ragged: Ragged,
    *,
    pad_to_multiple_of: int | None = None,
    pad_value: Any = 0,
    pin_memory: bool = False,
) -> Varlen:
    """Build the varlen layout from validated items (shared with the dict collators).

    ``ragged.values`` is the output when no padding tail is appended: allocate it
    pinned up front (``to_ragged(..., pin_memory=True)``), or it is copied to pinned
    memory here.

    Args:
        ragged: The items, validated and concatenated.
        pad_to_multiple_of: Round ``T`` up to a multiple of this with one trailing
            padding segment (None: no padding).
        pad_value: The value the padding segment holds.
        pin_memory: Allocate every output array in page-locked memory.

    Raises:
        ValueError: More tokens than an int32 ``cu_seqlens`` can count.
    """
    kind, device = ragged.kind, ragged.device
    check_pin_memory(pin_memory, "pack_varlen", kind, device)
    lengths = ragged.lengths
    offsets = ragged.offsets()
    real_total = int(offsets[-1])
    total = round_up(real_total, pad_to_multiple_of)
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
        offsets = np.append(offsets, total)
        seg_lengths = np.append(lengths, tail)
    elif pin_memory:
        values = to_kind(values, kind, pin=True)  # a no-op when to_ragged pinned it
    return Varlen(
        values=values,
        cu_seqlens=from_host(kind, offsets.astype(np.int32), device, pin=pin_memory),
        max_seqlen=int(seg_lengths.max(initial=0)),
        position_ids=from_host(kind, positions_restarting(seg_lengths), device, pin=pin_memory),
        seq_lens=from_host(kind, lengths.copy(), device, pin=pin_memory),
        _offsets=tuple(ragged.offsets().tolist()),
    )


def pack_varlen(
    seqs: Sequence[Any],
    *,
    pad_to_multiple_of: int | None = None,
    pad_value: Any = 0,
    return_tensors: ReturnTensors = None,
    pin_memory: bool = False,
) -> Varlen:
    """Concatenate items (first axis = sequence) into the FlashAttention varlen layout.

    With ``pad_to_multiple_of``, ``T`` is rounded up by one trailing padding segment
    (filled with ``pad_value``) that ``cu_seqlens`` covers, so kernels leave no rows
    uncovered; ``unpack`` never returns it.

    Args:
        seqs: The items: Python lists, numpy arrays or torch tensors, all with the
            same trailing (feature) shape.
        pad_to_multiple_of: Round ``T`` up to a multiple of this with one trailing
            padding segment (``None``: no padding).
        pad_value: The value the padding segment holds.
        return_tensors: ``"np"`` for numpy output, ``"pt"`` for torch, ``None`` to follow
            the input (torch in, torch out; lists and numpy arrays give numpy).
        pin_memory: Allocate every output array in page-locked memory (torch output,
            CUDA available), so [`to_device`][batchkit.collate.to_device] with
            ``non_blocking`` overlaps the copy to the GPU.

    Raises:
        ValueError: Items differ in feature shape, or the pack holds more tokens
            than an int32 ``cu_seqlens`` can count.
        ValueError: ``pin_memory=True`` for numpy output or items already on a GPU.
        RuntimeError: ``pin_memory=True`` without CUDA, or in a ``DataLoader`` worker.
    """
    # Without a padding tail the concatenated items are the output: allocate them pinned.
    ragged = to_ragged(
        seqs,
        return_tensors=return_tensors,
        pin_memory=pin_memory and pad_to_multiple_of is None,
        who="pack_varlen",
    )
    return varlen_from_ragged(
        ragged, pad_to_multiple_of=pad_to_multiple_of, pad_value=pad_value, pin_memory=pin_memory
    )
