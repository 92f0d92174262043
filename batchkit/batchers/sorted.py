"""Sorted batching: items of similar key (length) together, order restored by indices."""

from __future__ import annotations

from collections.abc import Sequence

from batchkit.batchers.base import Batcher, C, KeyFn
from batchkit.batchers.checks import positive_count
from batchkit.batchers.cost import BatchCost, CostLike
from batchkit.batchers.groups import GroupFn


class SortedBatcher(Batcher):
    """Batches of items with similar keys, for the least padding.

    Offline, items are sorted by key (stable) globally, or within consecutive
    windows of `window` items to keep some of the input order, and cut into
    batches of `batch_size` (and `max_tokens`) in ascending key order.
    Online, the oldest waiting request is joined by the waiting requests whose
    keys are nearest to its own; timing is as for
    [`DynamicBatcher`][batchkit.DynamicBatcher] (`max_wait_ms`).

    Args:
        key: an item's key (default `len`).
        batch_size: the most items in one batch.
        max_tokens: the most a batch of more than one item may cost (see `cost`);
            None: no budget.
        window: sort within consecutive windows of this many items (offline);
            None: one global sort.
        max_wait_ms: how long the oldest waiting request may wait, in milliseconds.
        cost: what `max_tokens` bounds: `"padded"` (`len(batch) * max(key)`, the
            default), `"sum"` (`sum(key)`) or a callable `cost(keys) -> number`
            ([`as_batch_cost`][batchkit.batchers.cost.as_batch_cost]).
        group: an item's group (its model, adapter, task...), any hashable value;
            a batch holds items of at most `max_groups_per_batch` groups. None: no
            groups.
        max_groups_per_batch: the most groups in one batch (default 1 with `group`;
            needs `group`).
    """

    def __init__(
        self,
        *,
        key: KeyFn = len,
        batch_size: int = 32,
        max_tokens: int | None = None,
        window: int | None = None,
        max_wait_ms: float = 5.0,
        cost: CostLike | BatchCost = "padded",
        group: GroupFn | None = None,
        max_groups_per_batch: int | None = None,
    ) -> None:
        window = positive_count("window", window, allow_none=True)
        super().__init__(
            max_batch_size=batch_size,
            max_wait_ms=max_wait_ms,
            max_tokens=max_tokens,
            key=key,
            cost=cost,
            group=group,
            max_groups_per_batch=max_groups_per_batch,
        )
        self.window = window

    @property
    def batch_size(self) -> int:
        """The largest batch."""
        return self.max_batch_size

    @property
    def candidate_limit(self) -> int | None:
        """Sorted selection looks at every waiting request."""
        return None

    def offline_order(self, keys: Sequence[float]) -> list[list[int]]:
        """Stable key order, globally or per window.

        Args:
            keys: every item's key, in input order.
        """
        n = len(keys)
        step = self.window or max(n, 1)
        return [
            sorted(range(lo, min(lo + step, n)), key=keys.__getitem__) for lo in range(0, n, step)
        ]

    def select(self, candidates: Sequence[C]) -> list[C]:
        """The first (oldest, highest-priority) candidate plus its nearest-key neighbours.

        The window grows one neighbour at a time, on the side whose key is nearer the
        first candidate's, while the batch's cost stays within `max_tokens`; the
        first neighbour over the budget ends it.

        Args:
            candidates: the waiting requests, in service order.
        """
        ranked = sorted(range(len(candidates)), key=lambda i: candidates[i].key)
        keys = [candidates[i].key for i in ranked]
        seed = candidates[0].key
        lo = hi = ranked.index(0)  # the chosen window is ranked[lo:hi+1]
        budget = self.max_tokens
        running = self.cost.running()
        if budget is not None:
            running.add(seed)
        while hi - lo + 1 < self.max_batch_size:
            can_left, can_right = lo > 0, hi + 1 < len(ranked)
            if not (can_left or can_right):
                break
            go_left = can_left and (not can_right or seed - keys[lo - 1] <= keys[hi + 1] - seed)
            joining = keys[lo - 1] if go_left else keys[hi + 1]
            if budget is not None and running.add(joining) > budget:
                break
            if go_left:
                lo -= 1
            else:
                hi += 1
        return [candidates[i] for i in sorted(ranked[lo : hi + 1])]
