"""How a batched function is run: the settings `@batched` validated, in one record,
and what counts as running out of memory."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from batchkit.batchers.base import Batcher
from batchkit.batchers.checks import positive_count

Clock = Callable[[], float]


def empty_cuda_cache() -> None:
    """Return the failed attempt's cached blocks to the CUDA driver, if torch uses CUDA.

    The default `on_oom` hook: does nothing unless torch is imported and has already
    initialised CUDA (it never initialises CUDA itself).
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        cuda.empty_cache()


@dataclass(frozen=True)
class OomRecovery:
    """Out-of-memory handling: whether a batch that ran out of memory is split and
    retried, which exceptions mean that, and what runs before each retry.

    Attributes:
        enabled: Whether out-of-memory errors split the batch (`oom_errors=()`
            turns it off).
        extra_types: Exception types that count as out of memory beyond
            `MemoryError` and `torch.cuda.OutOfMemoryError`.
        on_oom: Called with no argument after each out-of-memory failure, before
            the retry; None for nothing.
    """

    enabled: bool = True
    extra_types: tuple[type[BaseException], ...] = ()
    on_oom: Callable[[], None] | None = empty_cuda_cache

    def is_oom(self, exc: BaseException) -> bool:
        """Whether `exc` means "this batch did not fit in memory" (and splitting is on).

        Args:
            exc: What a call of the batch function raised.
        """
        if not self.enabled:
            return False
        if isinstance(exc, (MemoryError, *self.extra_types)):
            return True
        torch = sys.modules.get("torch")  # only if the process uses torch at all
        oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
        return isinstance(oom_type, type) and isinstance(exc, oom_type)


@dataclass(frozen=True)
class Options:
    """How a batched function is run: the options of
    [`batched`][batchkit.serve.batched.batched], validated.

    Attributes:
        policy: The batching policy.
        collate: Builds the function's argument from the list of items (None: the
            list).
        split: Turns the function's output into per-item results (None: the output).
        max_queue_size: How many requests may wait; None for no bound.
        max_concurrent_batches: How many batches may run at once.
        clock: The monotonic clock, in seconds.
        oom: Out-of-memory handling.
        isolate_errors: Re-run a failing batch in halves to find the failing items.
        when_full: What a call does on a full queue: `"reject"` or `"block"`.
        streaming: The function is a generator (or async generator) function.
        batch_timeout: Seconds one call of the function may run; None for no bound.
        max_latency_s: Each request's latency target, from admission to result, in
            seconds (`max_latency_ms` / 1000); None for none.
    """

    policy: Batcher
    collate: Callable[[list[Any]], Any] | None = None
    split: Callable[[Any], Sequence[Any]] | None = None
    max_queue_size: int | None = None
    max_concurrent_batches: int = 1
    clock: Clock = time.monotonic
    oom: OomRecovery = field(default_factory=OomRecovery)
    isolate_errors: bool = False
    when_full: Literal["reject", "block"] = "reject"
    streaming: bool = False
    batch_timeout: float | None = None
    max_latency_s: float | None = None

    def __post_init__(self) -> None:
        # The counts are stored as ints whatever number type they came as (a YAML or
        # JSON config gives 4.0): every later comparison and report sees an int.
        queue = positive_count("max_queue_size", self.max_queue_size, allow_none=True)
        concurrent = positive_count("max_concurrent_batches", self.max_concurrent_batches)
        object.__setattr__(self, "max_queue_size", queue)  # frozen: set once, here
        object.__setattr__(self, "max_concurrent_batches", concurrent)
