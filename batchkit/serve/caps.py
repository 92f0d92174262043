"""Batch-size caps learned after out-of-memory, one per bucket, probed upward again.

When a batch runs out of memory, `execute` splits it until the parts fit and reports
the largest padded size that ran (`BatchRun.largest_ok`). The serving core then caps
that bucket's batches at that size (`SizeCaps.learn`); the scheduler cuts every batch
it forms there to the cap (`SizeCaps.cut`). A cap is not forever: after
`PROBE_AFTER` batches at the cap that fit, it is raised by a quarter
(`SizeCaps.succeeded`), and dropped once it reaches the policy's `max_batch_size`.
"""

from __future__ import annotations

from collections.abc import Hashable, ItemsView

from batchkit.batchers.base import Batcher
from batchkit.serve.request import Request

PROBE_AFTER = 32  # successful batches at a learned cap before trying a larger one


class SizeCaps:
    """Each bucket's learned largest batch (padded size).

    Sizes come from the policy each call is given (the one in force: settings change
    live).

    Attributes:
        active: Whether any bucket is capped. False until a batch runs out of memory:
            the scheduler then asks nothing else of it on its usual path (an
            attribute, not `__bool__`: no call per scheduling pass).
    """

    def __init__(self) -> None:
        self._caps: dict[Hashable, int] = {}
        self._successes: dict[Hashable, int] = {}
        self.active = False

    def items(self) -> ItemsView[Hashable, int]:
        """Each capped bucket and its cap."""
        return self._caps.items()

    def limit(self, bucket: Hashable, policy: Batcher) -> int:
        """The most requests a batch of `bucket` may take now.

        Args:
            bucket: The bucket (as `bucket_of` named it).
            policy: The policy in force (its `max_batch_size`).
        """
        # (A cap learned before the maximum was lowered live does not lift it.)
        maximum = policy.max_batch_size
        return min(self._caps.get(bucket, maximum), maximum)

    def learn(self, bucket: Hashable, size: int, policy: Batcher) -> None:
        """A batch of this bucket ran out of memory: cap the bucket's batches.

        Args:
            bucket: The bucket (as `bucket_of` named it).
            size: The largest batch (padded size) known to fit; the cap becomes the
                smaller of it and the cap so far.
            policy: The policy in force (its `max_batch_size`).
        """
        self._caps[bucket] = min(size, self._caps.get(bucket, policy.max_batch_size))
        self._successes[bucket] = 0
        self.active = True

    def succeeded(self, bucket: Hashable, size: int, policy: Batcher) -> None:
        """A batch ran without running out of memory: probe upward after enough of them.

        After `PROBE_AFTER` successful batches at a bucket's cap, the cap is raised by
        a quarter (at least to the next size the policy allows), and dropped once it
        reaches the policy's `max_batch_size`.

        Args:
            bucket: The batch's bucket.
            size: The batch's padded size; a batch below the cap does not count.
            policy: The policy in force (its `max_batch_size` and `padded_size`).
        """
        cap = self._caps.get(bucket)
        if cap is None or size < cap:
            return
        self._successes[bucket] = done = self._successes.get(bucket, 0) + 1
        if done >= PROBE_AFTER:
            # A quarter more, or the next size the policy allows (strict sizes pad up).
            raised = max(cap + max(1, cap // 4), policy.padded_size(cap + 1))
            self._successes[bucket] = 0
            if raised >= policy.max_batch_size:
                del self._caps[bucket]
                self.active = bool(self._caps)
            else:
                self._caps[bucket] = raised

    def cut(self, chosen: list[Request], bucket: Hashable, policy: Batcher) -> None:
        """Cut a batch of `bucket` to its cap, its padded size too (in place).

        Args:
            chosen: The requests the policy chose, in batch order.
            bucket: Their bucket.
            policy: The policy in force (its `padded_size`).
        """
        cap = self._caps.get(bucket)
        if cap is None:
            return
        del chosen[cap:]
        while len(chosen) > 1 and policy.padded_size(len(chosen)) > cap:
            chosen.pop()
