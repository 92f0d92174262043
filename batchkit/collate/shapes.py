"""Static shapes: the grid of (batch size, length) cells a compiled model is called with.

One `ShapeBuckets` is given to the policy (which batch size a batch is padded up
to, which length bucket a request joins) and to the collator (which length the
batch is padded to), so both read their sizes from the same object and every call
of the function sees a shape in the grid.
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Iterable, Sequence
from typing import Any


def _grid_axis(name: str, values: object) -> tuple[int, ...]:
    """``values`` as a sorted tuple of distinct positive ints; a clear error otherwise."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"ShapeBuckets: {name} must be an iterable of ints, got {values!r}")
    found = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(
                f"ShapeBuckets: {name}[{i}] must be an int, got {type(value).__name__} {value!r}"
            )
        if int(value) < 1:
            raise ValueError(f"ShapeBuckets: {name}[{i}] must be >= 1, got {value!r}")
        found.append(int(value))
    if not found:
        raise ValueError(f"ShapeBuckets: {name} must name at least one size")
    return tuple(sorted(set(found)))


class ShapeBuckets:
    """The static shapes a batch function is called with: every batch size of
    ``batch_sizes`` crossed with every length of ``lengths``.

    A batch of ``n`` items whose longest is ``m`` steps long is called as the cell
    (`batch_size_for(n)`, `length_for(m)`): the smallest batch size >= ``n`` (dummy
    rows added) and the smallest length >= ``m`` (padding added). Given to
    ``@batched(shapes=...)`` it sets both the policy (batches leave at, and are
    padded up to, a grid batch size; a request joins the bucket of its length's
    cell, so a batch never spans two lengths) and the collator (`pad`,
    `PadCollator`, `pack_varlen`, `VarlenCollator` pad to the cell), and the dummy
    rows and padding are removed before any caller sees a result. An item longer
    than the largest length is refused, naming its length.

    Args:
        batch_sizes: The batch sizes (positive ints, any order; duplicates ignored).
        lengths: The padded lengths (positive ints, any order; duplicates ignored).

    Raises:
        TypeError: ``batch_sizes`` or ``lengths`` is not an iterable of ints.
        ValueError: One of them is empty or holds a size below 1.
    """

    __slots__ = ("batch_sizes", "lengths")

    def __init__(self, batch_sizes: Iterable[int], lengths: Iterable[int]) -> None:
        self.batch_sizes: tuple[int, ...] = _grid_axis("batch_sizes", batch_sizes)
        self.lengths: tuple[int, ...] = _grid_axis("lengths", lengths)

    @property
    def max_batch_size(self) -> int:
        """The largest batch size of the grid."""
        return self.batch_sizes[-1]

    @property
    def max_length(self) -> int:
        """The largest length of the grid: no item may be longer."""
        return self.lengths[-1]

    @property
    def cells(self) -> list[tuple[int, int]]:
        """Every ``(batch size, length)`` cell, batch size first then length, ascending."""
        return [(b, n) for b in self.batch_sizes for n in self.lengths]

    def batch_size_for(self, size: int) -> int:
        """The smallest batch size of the grid >= ``size``.

        Args:
            size: The real items in a batch (>= 1).

        Raises:
            ValueError: ``size`` is above the largest batch size.
        """
        k = bisect.bisect_left(self.batch_sizes, size)
        if k == len(self.batch_sizes):
            raise ValueError(
                f"ShapeBuckets: a batch of {size} items is larger than the largest batch "
                f"size of the grid ({self.max_batch_size})"
            )
        return self.batch_sizes[k]

    def length_for(self, length: int, *, item: str = "an item") -> int:
        """The smallest length of the grid >= ``length``: the length a batch whose
        longest item has ``length`` steps is padded to.

        Args:
            length: A number of steps (>= 0).
            item: How to name the item in the error (``"item 3"``).

        Raises:
            ValueError: ``length`` is above the largest length (the message names
                ``item`` and both lengths).
        """
        k = bisect.bisect_left(self.lengths, length)
        if k == len(self.lengths):
            raise ValueError(
                f"{item} has length {length}, longer than the largest length of the "
                f"shape grid ({self.max_length}): shorten it or add a length to "
                f"ShapeBuckets(lengths={list(self.lengths)})"
            )
        return self.lengths[k]

    def bucket_of(self, length: float) -> int:
        """The index of the length a request of ``length`` steps is padded to: the
        length bucket it joins (a batch never spans two).

        Args:
            length: The request's length.

        Raises:
            ValueError: ``length`` is above the largest length.
        """
        k = bisect.bisect_left(self.lengths, length)
        if k == len(self.lengths):
            self.length_for(int(length))  # raises, naming the length
        return k

    def check_lengths(self, lengths: Sequence[int], who: str) -> int:
        """The length a batch of items of these ``lengths`` is padded to.

        Args:
            lengths: Each item's number of steps.
            who: The collator, named in the error (``"pad"``).

        Raises:
            ValueError: An item is longer than the largest length (named by its
                position in the batch).
        """
        longest = 0
        for i, n in enumerate(lengths):
            if n > self.max_length:
                self.length_for(int(n), item=f"{who}: item {i}")
            longest = max(longest, int(n))
        return self.length_for(longest)

    def padded_tokens(self, lengths: Sequence[int]) -> int:
        """How many token slots a batch of items of these ``lengths`` occupies in its
        cell (batch size times length): what the function computes over.

        Args:
            lengths: The batch's items' lengths.
        """
        return self.batch_size_for(len(lengths)) * self.length_for(max(lengths, default=0))

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, ShapeBuckets):
            return NotImplemented
        return (self.batch_sizes, self.lengths) == (other.batch_sizes, other.lengths)

    def __hash__(self) -> int:
        return hash((self.batch_sizes, self.lengths))

    def __repr__(self) -> str:
        return f"ShapeBuckets(batch_sizes={list(self.batch_sizes)}, lengths={list(self.lengths)})"

    def __reduce__(self) -> Any:
        return (ShapeBuckets, (self.batch_sizes, self.lengths))
