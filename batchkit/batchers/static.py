"""Static batching: fixed-size batches, in arrival order."""

from __future__ import annotations

from collections.abc import Sequence

from batchkit.batchers.base import Batcher
from batchkit.batchers.checks import check_flag
from batchkit.batchers.groups import GroupFn


class StaticBatcher(Batcher):
    """Batches of exactly `batch_size` items, in order.

    Offline, the last partial batch is yielded unless `drop_last`. Online, a
    batch leaves only when full (no timer), so use it where traffic is steady or
    the model only accepts one size; at close, a partial batch is still served
    (accepted requests are never dropped) and `drop_last` has no effect.

    With `group`, each pool of `max_groups_per_batch` groups is cut on its own, so
    every pool's last batch may be short (and is dropped with `drop_last`).

    Args:
        batch_size: the items in every batch (a positive int).
        drop_last: offline, drop the short last batch.
        group: an item's group (its model, adapter, task...), any hashable value;
            a batch holds items of at most `max_groups_per_batch` groups. None: no
            groups.
        max_groups_per_batch: the most groups in one batch (default 1 with `group`;
            needs `group`).
    """

    def __init__(
        self,
        batch_size: int,
        *,
        drop_last: bool = False,
        group: GroupFn | None = None,
        max_groups_per_batch: int | None = None,
    ) -> None:
        super().__init__(
            max_batch_size=batch_size,
            max_wait_ms=None,
            group=group,
            max_groups_per_batch=max_groups_per_batch,
        )
        self.drop_last = check_flag("drop_last", drop_last)

    @property
    def batch_size(self) -> int:
        """The fixed batch size."""
        return self.max_batch_size

    def index_batches(self, keys: Sequence[float], *, shuffled: bool = False) -> list[list[int]]:
        """Consecutive batches of `batch_size` (the short tail dropped if `drop_last`).

        Args:
            keys: every item's key (unused: static batches ignore keys).
            shuffled: the keys come in a random order (a training sampler).
        """
        batches = super().index_batches(keys, shuffled=shuffled)
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches
