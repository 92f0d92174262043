"""Static batching: fixed-size batches, in arrival order."""

from __future__ import annotations

from collections.abc import Sequence

from batchkit.batchers.base import Batcher


class StaticBatcher(Batcher):
    """Batches of exactly `batch_size` items, in order.

    Offline, the last partial batch is yielded unless `drop_last`. Online, a
    batch leaves only when full (no timer), so use it where traffic is steady or
    the model only accepts one size; at close, a partial batch is still served
    (accepted requests are never dropped) and `drop_last` has no effect.

    Args:
        batch_size: the items in every batch (a positive int).
        drop_last: offline, drop the short last batch.
    """

    def __init__(self, batch_size: int, *, drop_last: bool = False) -> None:
        super().__init__(max_batch_size=batch_size, max_wait_ms=None)
        self.drop_last = drop_last

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
