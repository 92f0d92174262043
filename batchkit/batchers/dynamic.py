"""Dynamic batching (Triton-style): up to `max_batch_size`, waiting at most `max_wait_ms`."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from batchkit.batchers.base import Batcher, C, KeyFn, take_within_budget
from batchkit.batchers.checks import check_flag, positive_count
from batchkit.batchers.cost import BatchCost, CostLike
from batchkit.batchers.groups import GroupFn
from batchkit.collate.shapes import ShapeBuckets


class DynamicBatcher(Batcher):
    """Arrival-order batches of up to `max_batch_size` items.

    A batch leaves when it is full, when its oldest request has waited
    `max_wait_ms`, or, with `eager=True` (the default), at once when no batch is
    running (no idle waiting at low load). `eager=False` waits for a full batch or
    `max_wait_ms` even when the device is idle, as Triton and Ray Serve do: for a
    function with a large per-call cost, or a device shared with other work, where a
    fuller batch is worth the wait.

    `preferred_batch_sizes` (e.g. `(1, 2, 4, 8)`): batches leave at the largest
    preferred size that is available. With `strict_sizes=True` the function is
    only ever called with one of those sizes: a batch of 5 is padded up to 8 by
    repeating its last item, and the extra results are discarded (for CUDA graphs
    or TensorRT profiles built for fixed sizes). Under a token budget the padded-up
    batch, repeated items included, must fit it; if it does not, the batch is cut
    down to a preferred size instead.

    Args:
        max_batch_size: the most items in one batch (lowered to the largest
            preferred size, if any).
        max_wait_ms: how long the oldest waiting request may wait, in milliseconds.
        preferred_batch_sizes: the batch sizes to leave at; None: any size.
        strict_sizes: only ever call the function with a preferred size (padding up).
        max_tokens: the most a batch of more than one item may cost (see `cost`);
            None: no budget.
        key: an item's key; defaults to `len` when `max_tokens` is set.
        eager: an idle device takes a partial batch at once.
        cost: what `max_tokens` bounds: `"padded"` (`len(batch) * max(key)`, the
            default), `"sum"` (`sum(key)`, for `pack_varlen` or graphs) or a
            callable `cost(keys) -> number`
            ([`as_batch_cost`][batchkit.batchers.cost.as_batch_cost]).
        group: an item's group (its model, adapter, task...), any hashable value;
            a batch holds items of at most `max_groups_per_batch` groups. None: no
            groups.
        max_groups_per_batch: the most groups in one batch (default 1 with `group`;
            needs `group`).
        shapes: a [`ShapeBuckets`][batchkit.ShapeBuckets] grid: its batch sizes
            are the preferred sizes, strictly (not with `preferred_batch_sizes` or
            `strict_sizes`), and an item's key (`len` by default) picks its grid
            length, which is its bucket; see [`Batcher`][batchkit.Batcher].
    """

    def __init__(
        self,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        *,
        preferred_batch_sizes: Iterable[int] | None = None,
        strict_sizes: bool = False,
        max_tokens: int | None = None,
        key: KeyFn | None = None,
        eager: bool = True,
        cost: CostLike | BatchCost = "padded",
        group: GroupFn | None = None,
        max_groups_per_batch: int | None = None,
        shapes: ShapeBuckets | None = None,
    ) -> None:
        max_batch_size = positive_count("max_batch_size", max_batch_size)  # used below
        eager = check_flag("eager", eager)
        strict_sizes = check_flag("strict_sizes", strict_sizes)
        if isinstance(shapes, ShapeBuckets):
            if preferred_batch_sizes is not None or strict_sizes:
                raise ValueError(
                    "shapes sets the batch sizes (strictly): pass preferred_batch_sizes "
                    "and strict_sizes only without it"
                )
            preferred_batch_sizes, strict_sizes = shapes.batch_sizes, True
        if preferred_batch_sizes is not None and not isinstance(preferred_batch_sizes, Iterable):
            raise TypeError(
                "preferred_batch_sizes must be an iterable of ints, got "
                f"{type(preferred_batch_sizes).__name__}"
            )
        given = [
            positive_count(f"preferred_batch_sizes[{i}]", size)
            for i, size in enumerate(preferred_batch_sizes or ())
        ]
        sizes = sorted(set(given))
        if sizes and sizes[-1] > max_batch_size:
            # A size above the maximum is unreachable, or worse, with strict sizes a pad-up
            # target that would call the function with more than max_batch_size items.
            raise ValueError(
                f"preferred_batch_sizes {[s for s in sizes if s > max_batch_size]} exceed "
                f"max_batch_size={max_batch_size}"
            )
        if strict_sizes and not sizes:
            raise ValueError("strict_sizes=True needs preferred_batch_sizes")
        if sizes:
            max_batch_size = min(max_batch_size, sizes[-1])
        super().__init__(
            max_batch_size=max_batch_size,
            max_wait_ms=max_wait_ms,
            max_tokens=max_tokens,
            key=key,
            cost=cost,
            group=group,
            max_groups_per_batch=max_groups_per_batch,
            shapes=shapes,
        )
        self.preferred_batch_sizes = tuple(sizes)
        self.strict_sizes = strict_sizes
        self.eager = eager

    @property
    def dispatch_when_idle(self) -> bool:
        """Whether waiting requests leave at once when no batch is running: only when
        `eager` (the scheduler otherwise waits for a full batch or `max_wait_ms`)."""
        return self.eager and super().dispatch_when_idle

    def select(self, candidates: Sequence[C]) -> list[C]:
        """The oldest requests, cut to the largest preferred size available.

        Args:
            candidates: the waiting requests, in service order.
        """
        sizes = self.preferred_batch_sizes
        if not sizes and self.max_tokens is None:
            return list(candidates[: self.max_batch_size])  # the default policy's fast path
        n = take_within_budget(
            (c.key for c in candidates), self.max_batch_size, self.max_tokens, self.cost
        )
        if sizes and (not self.strict_sizes or self._padded_over_budget(candidates, n)):
            k = bisect.bisect_right(sizes, n)
            if k:
                n = sizes[k - 1]  # a preferred size: no padding needed
        return list(candidates[:n])

    def _padded_over_budget(self, candidates: Sequence[C], n: int) -> bool:
        """Whether `n` items padded up to an allowed size (their last one repeated, as
        the function is called) would cost more than `max_tokens`."""
        if self.max_tokens is None or n == 0:
            return False
        keys = [c.key for c in candidates[:n]]
        keys += [keys[-1]] * (self.padded_size(n) - n)
        return len(keys) > 1 and self.cost.of(keys) > self.max_tokens

    def padded_size(self, size: int) -> int:
        """With `strict_sizes`, the smallest preferred size >= `size`.

        Args:
            size: the real items in the batch.
        """
        if not self.strict_sizes:
            return size
        sizes = self.preferred_batch_sizes
        return sizes[min(bisect.bisect_left(sizes, size), len(sizes) - 1)]
