"""A collate function bound to a shape grid: what ``@batched(shapes=...)`` calls."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

from batchkit.collate.collators import PadCollator, VarlenCollator
from batchkit.collate.pad import pad
from batchkit.collate.shapes import ShapeBuckets
from batchkit.collate.varlen import pack_varlen


def collate_in_grid(
    collate: Callable[[list[Any]], Any] | None, shapes: ShapeBuckets | None
) -> Callable[[list[Any]], Any] | None:
    """``collate`` padding to the cells of ``shapes``: `pad` and `pack_varlen` (or a
    ``functools.partial`` of them) with ``shapes=`` bound, a `PadCollator` copied
    with ``shapes`` set (one that has them already must have the same). Any other
    ``collate`` is returned as it is: it pads by its own rule
    (`ShapeBuckets.length_for` gives the cell's length).

    Args:
        collate: The function's collate, or None.
        shapes: The grid, or None (``collate`` is returned as it is).

    Raises:
        ValueError: ``collate`` is a collator with other ``shapes``, or with
            ``pad_to_multiple_of``, or a `VarlenCollator` (it has no grid mode).
    """
    if shapes is None or collate is None:
        return collate
    function = collate.func if isinstance(collate, partial) else collate
    if function is pad or function is pack_varlen:  # (a partial: pad with its options)
        bound: Callable[[list[Any]], Any] = partial(collate, shapes=shapes)  # type: ignore[call-arg]
        return bound
    if isinstance(collate, VarlenCollator):
        raise ValueError(
            "VarlenCollator does not pad to a shape grid: under shapes use pack_varlen "
            "(a fixed token count and segment count per cell) or PadCollator"
        )
    if isinstance(collate, PadCollator):
        if collate.pad_to_multiple_of is not None:
            raise ValueError(
                "collate is a PadCollator with pad_to_multiple_of: under shapes the "
                "grid sets the padded length; leave pad_to_multiple_of out"
            )
        if collate.shapes is None:
            copied = copy.copy(collate)
            copied.shapes = shapes
            return copied
        if collate.shapes != shapes:
            raise ValueError(
                f"collate has shapes={collate.shapes!r} but the function's are {shapes!r}: "
                "give the grid once, to @batched"
            )
    return collate
