"""Live settings: what `f.configure()` reads and changes while a function serves.

A change is validated whole before anything moves (a bad value changes nothing), and
applies to batches formed from then on. The policy is never changed in place (it may
be shared, e.g. by every instance of a class whose method is batched): the function
gets a changed copy.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from batchkit.batchers.base import Batcher
from batchkit.batchers.checks import positive_count


@dataclass(frozen=True)
class Settings:
    """The settings in force for one batched function (see
    [`configure`][batchkit.BatchedFunction.configure]).

    Attributes:
        max_batch_size: The largest batch the policy forms.
        max_wait_ms: How long a batch may wait to fill, in milliseconds; None for a
            policy without one ([`StaticBatcher`][batchkit.StaticBatcher] waits until
            full).
        max_concurrent_batches: Batches that may run at once.
        max_queue_size: Requests that may wait; None for no bound.
        max_latency_ms: Each request's latency target, in milliseconds; None for
            none.
    """

    max_batch_size: int
    max_wait_ms: float | None
    max_concurrent_batches: int
    max_queue_size: int | None
    max_latency_ms: float | None = None


def read_settings(
    policy: Batcher,
    max_concurrent_batches: int,
    max_queue_size: int | None,
    max_latency_s: float | None = None,
) -> Settings:
    """The settings of `policy` and the queue, as [`Settings`][batchkit.Settings].

    Args:
        policy: The policy in force.
        max_concurrent_batches: Batches that may run at once.
        max_queue_size: Requests that may wait; None for no bound.
        max_latency_s: The latency target, in seconds; None for none.
    """
    wait = policy.max_wait_s
    return Settings(
        max_batch_size=policy.max_batch_size,
        max_wait_ms=None if wait is None else wait * 1000.0,
        max_concurrent_batches=max_concurrent_batches,
        max_queue_size=max_queue_size,
        max_latency_ms=None if max_latency_s is None else max_latency_s * 1000.0,
    )


def check_settings(
    max_batch_size: int | None,
    max_wait_ms: float | None,
    max_concurrent_batches: int | None,
    max_queue_size: int | None,
    max_latency_ms: float | None = None,
) -> tuple[int | None, float | None, int | None, int | None, float | None]:
    """Raise ValueError, naming the setting, for a value no policy could take.

    Args:
        max_batch_size: A positive int (or a whole-number float such as `8.0`, as a
            YAML or JSON config gives it: `reconfigured` stores it as an int), or
            None (not changed).
        max_wait_ms: A finite number of milliseconds >= 0, or None.
        max_concurrent_batches: A positive int, or None.
        max_queue_size: A positive int, or None.
        max_latency_ms: A finite number of milliseconds > 0, or None.

    Returns:
        The settings in the order given, the counts as ints (`8.0` becomes `8`):
        the values to store.
    """
    batch = positive_count("max_batch_size", max_batch_size, allow_none=True)
    concurrent = positive_count("max_concurrent_batches", max_concurrent_batches, allow_none=True)
    queue = positive_count("max_queue_size", max_queue_size, allow_none=True)
    if max_wait_ms is not None and (
        isinstance(max_wait_ms, bool)
        or not isinstance(max_wait_ms, (int, float))
        or not (max_wait_ms >= 0 and math.isfinite(max_wait_ms))
    ):
        raise ValueError(f"max_wait_ms must be a finite number >= 0, got {max_wait_ms!r}")
    check_latency_target(max_latency_ms)
    return batch, max_wait_ms, concurrent, queue, max_latency_ms


def check_latency_target(max_latency_ms: float | None) -> None:
    """Raise ValueError unless `max_latency_ms` is None or a number in (0, inf).

    Args:
        max_latency_ms: A latency target in milliseconds, or None.
    """
    if max_latency_ms is not None and not is_positive_finite(max_latency_ms):
        raise ValueError(
            f"max_latency_ms must be a finite number of milliseconds > 0, got {max_latency_ms!r}"
        )


def is_positive_finite(value: object) -> bool:
    """Whether `value` is a real number (not a bool) in (0, inf).

    Args:
        value: Any value.
    """
    return (
        not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < math.inf
    )


def check_has_wait(policy: Batcher, max_wait_ms: float | None) -> None:
    """Raise ValueError, naming the policy, when a wait is given to one that has none.

    Args:
        policy: The policy the wait is for.
        max_wait_ms: The wait given, in milliseconds; None (none given) always passes.

    Raises:
        ValueError: `max_wait_ms` is given and the policy waits until a batch is full
            ([`StaticBatcher`][batchkit.StaticBatcher]): silently ignoring it would
            leave the user believing in a bound that does not exist.
    """
    if max_wait_ms is not None and policy.max_wait_s is None:
        raise ValueError(
            f"{type(policy).__name__} has no max_wait_ms: it waits until a batch is full"
        )


def reconfigured(policy: Batcher, max_batch_size: int | None, max_wait_ms: float | None) -> Batcher:
    """A copy of `policy` with the given settings (the same object if none is given).

    Args:
        policy: The policy in force (never changed in place: it may be shared).
        max_batch_size: Its new largest batch (a whole-number float is stored as an
            int); None leaves it.
        max_wait_ms: Its new longest wait, in milliseconds; None leaves it.

    Raises:
        ValueError: The policy has no `max_wait_ms` (it waits until full), or
            `max_batch_size` exceeds its largest preferred batch size.
    """
    if max_batch_size is None and max_wait_ms is None:
        return policy
    max_batch_size = positive_count("max_batch_size", max_batch_size, allow_none=True)
    kind = type(policy).__name__
    check_has_wait(policy, max_wait_ms)
    sizes: tuple[int, ...] = getattr(policy, "preferred_batch_sizes", ())
    if max_batch_size is not None and sizes and max_batch_size > sizes[-1]:
        raise ValueError(
            f"max_batch_size={max_batch_size} exceeds the largest of {kind}'s "
            f"preferred_batch_sizes {list(sizes)}"
        )
    changed = copy.copy(policy)
    if max_batch_size is not None:
        changed.max_batch_size = max_batch_size
    if max_wait_ms is not None:
        changed.max_wait_s = max_wait_ms / 1000.0
    return changed
