"""Bucketed batching: items grouped by key (length) bucket; a batch never mixes buckets."""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import numpy as np
from typing_extensions import Self

from batchkit.batchers.base import Batcher, KeyFn
from batchkit.batchers.checks import is_real_number, positive_count
from batchkit.batchers.cost import BatchCost, CostLike
from batchkit.batchers.groups import GroupFn
from batchkit.batchers.sampler import check_lengths
from batchkit.collate.shapes import ShapeBuckets


class BucketedBatcher(Batcher):
    """Dynamic batching within length buckets.

    An item goes to the first bucket whose boundary is >= `key(item)`; items above
    the last boundary form a bucket of their own. Online, each bucket batches like
    [`DynamicBatcher`][batchkit.DynamicBatcher] (full, waited `max_wait_ms`, or idle).
    Offline, a bucket's items are batched in key order (least padding), buckets in
    ascending order; for training, [`sampler`][batchkit.Batcher.sampler] shuffles
    within buckets. [`from_lengths`][batchkit.BucketedBatcher.from_lengths] estimates
    boundaries from a sample of lengths.

    Args:
        boundaries: strictly increasing bucket boundaries (keys, e.g. lengths).
        key: an item's key (default `len`).
        max_batch_size: the most items in one batch.
        max_wait_ms: how long the oldest waiting request may wait, in milliseconds.
        max_tokens: the most a batch of more than one item may cost (see `cost`);
            None: no budget.
        cost: what `max_tokens` bounds: `"padded"` (`len(batch) * max(key)`, the
            default), `"sum"` (`sum(key)`) or a callable `cost(keys) -> number`
            ([`as_batch_cost`][batchkit.batchers.cost.as_batch_cost]).
        group: an item's group (its model, adapter, task...), any hashable value;
            a batch holds items of at most `max_groups_per_batch` groups. None: no
            groups.
        max_groups_per_batch: the most groups in one batch (default 1 with `group`;
            needs `group`).
        shapes: a [`ShapeBuckets`][batchkit.ShapeBuckets] grid: the boundaries
            are its lengths (give one or the other), an item above the last is
            refused, and a batch is padded up to the grid's smallest batch size
            that holds it (by repeating its last item).

    Raises:
        ValueError: empty, non-numeric or not strictly increasing `boundaries`, or
            both or neither of `boundaries` and `shapes`.
        TypeError: `boundaries` is not iterable.
    """

    def __init__(
        self,
        boundaries: Iterable[float] | None = None,
        *,
        key: KeyFn | None = None,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        max_tokens: int | None = None,
        cost: CostLike | BatchCost = "padded",
        group: GroupFn | None = None,
        max_groups_per_batch: int | None = None,
        shapes: ShapeBuckets | None = None,
    ) -> None:
        if shapes is not None and not isinstance(shapes, ShapeBuckets):
            raise TypeError(f"shapes must be a ShapeBuckets, got {type(shapes).__name__}")
        if (boundaries is None) == (shapes is None):
            raise ValueError(
                "BucketedBatcher needs boundaries or shapes (whose lengths are the "
                "boundaries), not both"
                if shapes is not None
                else "BucketedBatcher needs boundaries (or shapes)"
            )
        given = shapes.lengths if shapes is not None else boundaries
        assert given is not None  # (one of the two, checked above)
        try:
            bounds = list(given)
        except TypeError:
            raise TypeError(
                f"boundaries must be an iterable of numbers, got {type(boundaries).__name__}"
            ) from None
        if not bounds:
            raise ValueError("boundaries must name at least one bucket boundary")
        for i, b in enumerate(bounds):
            # (NaN would pass the ordering check below: every comparison with it is False)
            if not is_real_number(b):
                raise TypeError(f"boundaries[{i}] must be a number, got {type(b).__name__} {b!r}")
            if b != b:
                raise ValueError(f"boundaries[{i}] must be a number, got {b!r}")
        if any(nxt <= prev for prev, nxt in zip(bounds, bounds[1:])):
            raise ValueError(f"boundaries must be strictly increasing, got {bounds}")
        super().__init__(
            max_batch_size=max_batch_size,
            max_wait_ms=max_wait_ms,
            max_tokens=max_tokens,
            key=len if key is None else key,
            cost=cost,
            group=group,
            max_groups_per_batch=max_groups_per_batch,
            shapes=shapes,
        )
        self.key_given = key is not None
        self.boundaries = tuple(bounds)

    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int] | np.ndarray, *, num_buckets: int, **options: Any
    ) -> Self:
        """A policy whose `num_buckets` boundaries split a sample's tokens equally.

        Each bucket holds about the same total of `lengths` (tokens), so the dense
        short lengths get narrow buckets and the long tail wide ones; the last
        boundary is the sample's maximum.

        Args:
            lengths: a sample of the keys (ints >= 0).
            num_buckets: how many boundaries (at most the sample's distinct lengths).
            **options: the constructor's other arguments (`max_tokens`, `cost`, ...).
        """
        num_buckets = positive_count("num_buckets", num_buckets)
        return cls(equal_token_boundaries(lengths, num_buckets), **options)

    @classmethod
    def from_sample(
        cls,
        sample_lengths: Sequence[int] | np.ndarray,
        *,
        num_buckets: int,
        max_tokens: int | None = None,
        **options: Any,
    ) -> Self:
        """A policy whose `num_buckets` boundaries are a sample's quantiles.

        Each bucket holds about the same number of the sample's items (Lhotse's
        duration buckets balance the same way), which suits a stream: every bucket
        fills at about the same rate, so a bounded buffer holds batches of every
        bucket. The last boundary is the sample's maximum; a longer item later forms a
        bucket of its own. ([`from_lengths`][batchkit.BucketedBatcher.from_lengths]
        balances the buckets' tokens instead.)

        Args:
            sample_lengths: a sample of the keys (ints >= 0), e.g. the first
                thousands of a stream's lengths.
            num_buckets: how many boundaries (at most the sample's distinct lengths).
            max_tokens: the budget of each batch (by `cost`); None: no budget.
            **options: the constructor's other arguments (`max_batch_size`, `cost`, ...).

        Raises:
            ValueError: `num_buckets` not a positive int or above the sample's
                distinct lengths, or bad lengths.
        """
        num_buckets = positive_count("num_buckets", num_buckets)
        bounds = _boundaries(sample_lengths, num_buckets, by_tokens=False)
        return cls(bounds, max_tokens=max_tokens, **options)

    def bucket_of(self, key: float) -> Hashable:
        """Index of the first boundary >= `key` (`len(boundaries)` above the last).

        Args:
            key: the item's key.
        """
        return bisect.bisect_left(self.boundaries, key)

    def offline_order(self, keys: Sequence[float]) -> list[list[int]]:
        """One group per non-empty bucket, ascending; each in stable key order.

        Args:
            keys: every item's key, in input order.
        """
        return [sorted(group, key=keys.__getitem__) for group in self.sampler_order(keys)]

    def sampler_order(self, keys: Sequence[float]) -> list[list[int]]:
        """One group per non-empty bucket, ascending; each in the given (random) order.

        Args:
            keys: every item's key, in the sampler's order.
        """
        buckets: dict[int, list[int]] = {}
        for i, k in enumerate(keys):
            buckets.setdefault(bisect.bisect_left(self.boundaries, k), []).append(i)
        return [buckets[b] for b in sorted(buckets)]


def equal_token_boundaries(lengths: Sequence[int] | np.ndarray, num_buckets: int) -> list[int]:
    """`num_buckets` strictly increasing boundaries, each bucket about equal in tokens.

    Boundary `j` is the smallest length at which the running token total of the
    sorted sample reaches `j / num_buckets` of the whole, moved up or down only as
    far as needed to keep the boundaries distinct; the last is the maximum.

    Args:
        lengths: a sample of lengths (ints >= 0).
        num_buckets: how many boundaries.

    Raises:
        ValueError: fewer distinct lengths than `num_buckets`.
    """
    num_buckets = positive_count("num_buckets", num_buckets)
    return _boundaries(lengths, num_buckets, by_tokens=True)


def _boundaries(
    lengths: Sequence[int] | np.ndarray, num_buckets: int, *, by_tokens: bool
) -> list[int]:
    """Boundaries where the sorted sample's running mass (tokens, or items) reaches
    each `j / num_buckets` of the whole, kept distinct; the last is the maximum."""
    values, counts = np.unique(
        np.asarray(check_lengths(lengths), dtype=np.int64), return_counts=True
    )
    if len(values) < num_buckets:
        raise ValueError(
            f"num_buckets={num_buckets} needs at least that many distinct lengths; "
            f"the sample has {len(values)}"
        )
    cumulative = np.cumsum(values * counts if by_tokens else counts)
    targets = cumulative[-1] * np.arange(1, num_buckets) / num_buckets
    picks = np.searchsorted(cumulative, targets, side="left").tolist()
    # keep the k-1 inner boundaries distinct and below the maximum: each at least one
    # past the previous, and leaving room for the ones still to come
    chosen: list[int] = []
    for j, pick in enumerate(picks):
        lowest = chosen[-1] + 1 if chosen else 0
        highest = len(values) - num_buckets + j
        chosen.append(min(max(pick, lowest), highest))
    chosen.append(len(values) - 1)
    return [int(values[i]) for i in chosen]
