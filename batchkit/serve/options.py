"""How a batched function is run: the settings ``@batched`` validated, in one record,
and what counts as running out of memory."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from batchkit.batchers.base import Batcher

Clock = Callable[[], float]


def empty_cuda_cache() -> None:
    """Return the failed attempt's cached blocks to the CUDA driver, if torch uses CUDA.

    The default ``on_oom`` hook: does nothing unless torch is imported and has already
    initialised CUDA (it never initialises CUDA itself).
    """
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        cuda.empty_cache()


@dataclass(frozen=True)
class OomRecovery:
    """Out-of-memory handling: whether a batch that ran out of memory is split and
    retried, which exceptions mean that, and what runs before each retry."""

    enabled: bool = True
    extra_types: tuple[type[BaseException], ...] = ()  # beyond MemoryError and CUDA's
    on_oom: Callable[[], None] | None = empty_cuda_cache

    def is_oom(self, exc: BaseException) -> bool:
        """Whether ``exc`` means "this batch did not fit in memory" (and splitting is on)."""
        if not self.enabled:
            return False
        if isinstance(exc, (MemoryError, *self.extra_types)):
            return True
        torch = sys.modules.get("torch")  # only if the process uses torch at all
        oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
        return isinstance(oom_type, type) and isinstance(exc, oom_type)


@dataclass(frozen=True)
class Options:
    """How a batched function is run (see :func:`batchkit.batched`)."""

    policy: Batcher
    collate: Callable[[list[Any]], Any] | None = None
    split: Callable[[Any], Sequence[Any]] | None = None
    max_queue_size: int | None = None
    max_concurrent_batches: int = 1
    clock: Clock = time.monotonic
    oom: OomRecovery = field(default_factory=OomRecovery)
    isolate_errors: bool = False
    when_full: Literal["reject", "block"] = "reject"
    streaming: bool = False  # the function is a generator (or async generator) function
    batch_timeout: float | None = None  # seconds one call of the function may run
