"""Packing: several items per fixed-length row, with segment ids for the attention mask.

Strategies trade padding for order:

- ``"best_fit"`` (best-fit decreasing): longest items first, each into the row it
  fills most tightly. Fewest rows in practice; items land far from input order.
- ``"first_fit"`` (first-fit decreasing): longest first, each into the earliest row
  with room. Nearly as tight; earlier rows fill first.
- ``"in_order"`` (next-fit): items in input order, a new row when one does not fit.
  Rows hold consecutive items (useful when neighbours should share a row, or for
  streaming); more padding.

Every strategy is exact: ``Packed.unpack`` returns each input item's slice.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple

import numpy as np

from batchkit._backend import (
    ReturnTensors,
    check_leading_axes,
    check_pin_memory,
    concat,
    copy_rows,
    from_host,
    full,
    gather_rows,
    is_generic,
    namespace,
)
from batchkit.collate.device import pinned_batch
from batchkit.collate.inverse import Inverse, Layout
from batchkit.collate.pad import check_max_length, is_positive_int
from batchkit.collate.ragged import to_ragged
from batchkit.collate.varlen import fixed_segments, positions_restarting

Strategy = Literal["best_fit", "first_fit", "in_order"]


class Placement(NamedTuple):
    """Where one item (or one piece of a split item) lies: ``data[row, start:start+length]``."""

    row: int
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class Packed(Layout):
    """Items bin-packed into ``R`` rows of ``max_length``.

    [`pack`][batchkit.collate.pack.pack] returns it; it is not constructed directly.

    Attributes:
        data: ``[R, max_length, *feat]``, the items' steps, padding after them.
        position_ids: Int64 ``[R, max_length]``, each step's position in its item
            (restarting at 0 for every item, and for every piece of a split one).
        segment_ids: Int32 ``[R, max_length]``: 0 = padding, k >= 1 = the k-th item
            in its row.
        cu_seqlens: Int32 cumulative segment lengths over the flattened rows, where
            each row's padding tail is a segment of its own (with ``num_segments``,
            exactly ``num_segments + 1`` entries, the last ones repeating the total:
            empty segments).
        max_seqlen: The longest of those segments.
        pieces: Per input item, the [`Placement`][batchkit.collate.Placement] of each
            of its pieces (one, unless ``split=True`` cut it).
    """

    data: Any
    position_ids: Any
    segment_ids: Any
    cu_seqlens: Any
    max_seqlen: int
    pieces: tuple[tuple[Placement, ...], ...]

    @property
    def num_rows(self) -> int:
        """R, the number of rows."""
        return int(self.data.shape[0])

    @property
    def max_length(self) -> int:
        """The row length."""
        return int(self.data.shape[1])

    @property
    def placements(self) -> list[Placement]:
        """``(row, start, length)`` of each input item, in input order.

        Raises ``ValueError`` if an item was split (``split=True``): use ``pieces``.
        """
        out = []
        for i, parts in enumerate(self.pieces):
            if len(parts) != 1:
                raise ValueError(f"item {i} was split into {len(parts)} pieces; use .pieces")
            out.append(parts[0])
        return out

    def pin_memory(self) -> Packed:
        """A copy with every host tensor in page-locked memory (numpy arrays as they are).

        ``DataLoader(pin_memory=True)`` calls it on each batch, so a ``collate_fn`` run
        in worker processes may return a ``Packed`` and still have it pinned.
        """
        return pinned_batch(self, "Packed.pin_memory()")

    def unpack(self, outputs: Any) -> list[Any]:
        """Each input item's slice of any output whose first two axes are ``[R, max_length]``.

        Args:
            outputs: An array or tensor computed from the batch, ``[R, max_length, ...]``.

        Returns:
            One slice per input item, in input order: unsplit items as views, a split
            item's pieces concatenated.

        Raises:
            ValueError: ``outputs`` does not start with ``[R, max_length]``.
        """
        check_leading_axes(outputs, (self.num_rows, self.max_length), "unpack")
        return placed_steps(outputs, self.pieces)

    def inverse(self) -> Inverse:
        """Where each item went (see `split`): a per-token leaf
        is ``[R, max_length, ...]``, a by-row leaf ``[N, ...]`` (one row per input item,
        as a model that pools each segment returns it)."""
        return Inverse(
            who="Packed.split",
            token_axes=(self.num_rows, self.max_length),
            num_rows=len(self.pieces),
            rows=tuple(range(len(self.pieces))),
            cut_tokens=partial(placed_steps, pieces=self.pieces),
        )


def placed_steps(outputs: Any, pieces: tuple[tuple[Placement, ...], ...]) -> list[Any]:
    """Each item's steps of an ``[R, max_length, ...]`` output: a view for an item in
    one piece, its pieces concatenated for a split one.

    Args:
        outputs: The output, already checked to start with ``[R, max_length]``.
        pieces: Per item, the placement of each of its pieces.
    """
    result = []
    for parts in pieces:
        slices = [outputs[p.row, p.start : p.start + p.length, ...] for p in parts]
        result.append(slices[0] if len(slices) == 1 else concat(slices))
    return result


def _pieces_of(lengths: np.ndarray, max_length: int) -> list[tuple[int, int, int]]:
    """(item, offset, length) pieces: each item cut into chunks of at most ``max_length``."""
    pieces = []
    for item, n in enumerate(lengths.tolist()):
        if n == 0:
            pieces.append((item, 0, 0))
        for offset in range(0, n, max_length):
            pieces.append((item, offset, min(max_length, n - offset)))
    return pieces


def _assign_rows(sizes: list[int], order: list[int], max_length: int, strategy: str) -> list[int]:
    """Row of each piece (indexed like ``sizes``), placing pieces in ``order``."""
    rows = [0] * len(sizes)
    if strategy == "best_fit":
        free: list[tuple[int, int]] = []  # sorted (room left, row)
        num_rows = 0
        for p in order:
            k = bisect.bisect_left(free, (sizes[p], -1))
            if k == len(free):
                row, room = num_rows, max_length
                num_rows += 1
            else:
                room, row = free.pop(k)
            rows[p] = row
            bisect.insort(free, (room - sizes[p], row))
    elif strategy == "first_fit":
        room_left = np.empty(0, dtype=np.int64)
        for p in order:
            fits = np.flatnonzero(room_left >= sizes[p])
            if fits.size:
                row = int(fits[0])
            else:
                row = len(room_left)
                room_left = np.append(room_left, max_length)
            room_left[row] -= sizes[p]
            rows[p] = row
    elif strategy == "in_order":
        row, used = 0, 0
        for p in order:
            if used + sizes[p] > max_length:
                row, used = row + 1, 0
            used += sizes[p]
            rows[p] = row
    else:
        raise ValueError(
            f'strategy must be "best_fit", "first_fit" or "in_order", got {strategy!r}'
        )
    return rows


def pack(
    seqs: Sequence[Any],
    max_length: int,
    *,
    pad_value: Any = 0,
    strategy: Strategy = "best_fit",
    split: bool = False,
    num_segments: int | None = None,
    return_tensors: ReturnTensors = None,
    pin_memory: bool = False,
) -> Packed:
    """Bin-pack items (first axis = sequence) into rows of ``max_length`` steps.

    Args:
        seqs: The items: Python lists, numpy arrays, torch tensors or any Array API
            library's arrays, all with the same trailing (feature) shape.
        max_length: The row length, in steps (a positive int).
        pad_value: The value the padding at the end of each row holds.
        strategy: ``"best_fit"``, ``"first_fit"`` or ``"in_order"`` (see the module
            description above: fewer rows, or input order kept).
        split: Cut an item longer than ``max_length`` into ``max_length`` chunks,
            each its own segment (positions restart at 0 in each chunk;
            [`unpack`][batchkit.Packed.unpack] joins them back), instead of raising.
        num_segments: Give ``cu_seqlens`` exactly ``num_segments + 1`` entries, empty
            segments after the real ones (``None``: as many as there are), so that its
            shape, like the rows', does not change from batch to batch (one compile of
            a ``jax.jit`` or ``torch.compile`` function).
        return_tensors: The output's library: a name (``"np"``, ``"pt"``, ``"jax"``,
            ``"cupy"``, ...) or an Array API namespace; ``None`` follows the input
            (each library's arrays give its own, on their device; lists and numpy
            arrays give numpy).
        pin_memory: Allocate every output array in page-locked memory (torch output,
            CUDA available), so [`to_device`][batchkit.collate.to_device] with
            ``non_blocking`` overlaps the copy to the GPU.

    Raises:
        ValueError: ``max_length`` is not a positive int, ``strategy`` is unknown, or
            an item is longer than ``max_length`` without ``split`` (the message names
            its index), or the batch has more segments than ``num_segments``.
        ValueError: ``pin_memory=True`` for numpy output or items already on a GPU.
        RuntimeError: ``pin_memory=True`` without CUDA, or in a ``DataLoader`` worker.
    """
    if not is_positive_int(max_length):
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    max_length = int(max_length)
    if not split:
        check_max_length(seqs, max_length, hint="pass split=True to cut it into pieces")
    ragged = to_ragged(seqs, return_tensors=return_tensors)
    kind, device, values = ragged.kind, ragged.device, ragged.values
    check_pin_memory(pin_memory, "pack", kind, device)
    pieces = _pieces_of(ragged.lengths, max_length)
    sizes = [n for _, _, n in pieces]
    order = list(range(len(pieces)))
    if strategy != "in_order":
        order.sort(key=lambda p: -sizes[p])  # stable: ties keep input order
    rows = _assign_rows(sizes, order, max_length, strategy)
    num_rows = max(rows) + 1

    # Lay pieces out left to right in each row, in placement order.
    fill = [0] * num_rows
    count = [0] * num_rows
    starts = [0] * len(pieces)
    segment = [0] * len(pieces)
    for p in order:
        r = rows[p]
        starts[p] = fill[r]
        fill[r] += sizes[p]
        if sizes[p]:
            count[r] += 1
            segment[p] = count[r]

    # Vectorised scatter: one gather/scatter index pair for every real token.
    offsets = ragged.offsets()
    size_arr = np.asarray(sizes, dtype=np.int64)
    dest_start = np.asarray(rows, dtype=np.int64) * max_length + np.asarray(starts)
    src_start = offsets[[i for i, _, _ in pieces]] + np.asarray([o for _, o, _ in pieces])
    within = positions_restarting(size_arr)
    dest = np.repeat(dest_start, size_arr) + within
    src = np.repeat(src_start, size_arr) + within

    feat = ragged.feature_shape
    if is_generic(kind):  # one gather, no write into an array
        index = np.full(num_rows * max_length, values.shape[0], dtype=np.int64)
        index[dest] = src
        flat = gather_rows(kind, values, index, pad_value, device)
        data = namespace(kind).reshape(flat, (num_rows, max_length, *feat))
    else:
        flat = full(kind, (num_rows * max_length, *feat), pad_value, like=values, pin=pin_memory)
        if dest.size:
            copy_rows(flat, dest, values, src, kind, device)
        data = flat.reshape(num_rows, max_length, *feat)
    seg_flat = np.zeros(num_rows * max_length, dtype=np.int32)
    seg_flat[dest] = np.repeat(np.asarray(segment, dtype=np.int32), size_arr)

    ends = (dest_start + size_arr)[size_arr > 0]
    row_ends = (np.arange(num_rows, dtype=np.int64) + 1) * max_length
    cu = np.unique(np.concatenate([[0], ends, row_ends]))
    seg_lengths = np.diff(cu)
    cu = fixed_segments(cu, num_segments, "pack")

    per_item: list[list[Placement]] = [[] for _ in range(ragged.num_items)]
    for p, (item, _, n) in enumerate(pieces):
        per_item[item].append(Placement(rows[p], starts[p], n))
    positions = positions_restarting(seg_lengths).reshape(num_rows, max_length)
    return Packed(
        data=data,
        position_ids=from_host(kind, positions, device, pin=pin_memory),
        segment_ids=from_host(kind, seg_flat.reshape(num_rows, max_length), device, pin=pin_memory),
        cu_seqlens=from_host(kind, cu.astype(np.int32), device, pin=pin_memory),
        max_seqlen=int(seg_lengths.max(initial=0)),
        pieces=tuple(tuple(parts) for parts in per_item),
    )
