"""Events for observers (metrics exporters, tracing): what happened to each batch and
to each request that never ran. Listeners are called on the driver's worker thread
(or event loop) right after the fact, under the serving core's lock: keep them fast
and non-blocking.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import methodcaller
from typing import Literal, Protocol

from batchkit.usercode import run_hook

DropReason = Literal["rejected", "timeout", "cancelled", "closed", "overloaded"]


@dataclass(frozen=True, slots=True)
class BatchEvent:
    """One batch that ended (successfully or not), for
    [`Listener.on_batch`][batchkit.serve.Listener.on_batch].

    Attributes:
        name: The batched function's qualified name.
        size: Real items in the batch.
        padded_size: The size the function was called with (a policy with strict
            sizes pads up).
        reason: Why it left the queue: a
            [`DispatchReason`][batchkit.serve.DispatchReason] value (`"full"`,
            `"max_wait"`, `"idle"`, `"closing"`).
        queue_waits: Seconds each item waited before the batch left, in batch order.
        latency: Seconds from the batch leaving the queue to its results.
        failed: Items that ended with an error.
        tokens: The sum of the items' keys (their lengths, in tokens); 0 when the
            policy has no key.
        padded_tokens: `padded_size` times the largest key: the area a padded batch
            occupies.
        first_chunk: For a streaming function, seconds from the batch leaving the
            queue to its first chunk (`latency` runs to its last); None otherwise.
    """

    name: str
    size: int
    padded_size: int
    reason: str
    queue_waits: tuple[float, ...]
    latency: float
    failed: int
    tokens: float
    padded_tokens: float
    first_chunk: float | None = None


@dataclass(frozen=True, slots=True)
class DropEvent:
    """Requests that ended without running, for
    [`Listener.on_drop`][batchkit.serve.Listener.on_drop].

    Attributes:
        name: The batched function's qualified name.
        reason: Why: `"rejected"` (the queue was full: `QueueFull`), `"timeout"`
            (their `timeout` passed first), `"cancelled"` (their caller left),
            `"closed"` (the function closed before they ran: a close timed out, or
            its event loop was gone), or `"overloaded"` (they would have missed
            `max_latency_ms`: refused at once, or dropped while waiting, with
            `Overloaded`).
        count: How many requests, all with this reason (default 1).
    """

    name: str
    reason: DropReason
    count: int = 1


class Listener(Protocol):
    """What [`add_listener`][batchkit.BatchedFunction.add_listener] accepts: any
    object with these two methods.

    Both are called on the worker thread (or event loop) right after the fact, under
    the function's lock: keep them fast and non-blocking. Whatever they raise (a
    `SystemExit` too) is logged, never passed on.
    """

    def on_batch(self, event: BatchEvent) -> None:
        """A batch ended.

        Args:
            event: What the batch was and how it went.
        """

    def on_drop(self, event: DropEvent) -> None:
        """Requests were rejected, timed out, cancelled or failed by close without running.

        Args:
            event: Which requests, and why.
        """


def notify(listeners: list[Listener], method: str, event: BatchEvent | DropEvent) -> None:
    """Call every listener; whatever one raises (a `SystemExit` too) is logged, never
    allowed to break a batch or end the worker (see `batchkit.usercode.run_hook`).

    Args:
        listeners: The listeners to call, in order.
        method: `"on_batch"` or `"on_drop"`.
        event: The event passed to each.
    """
    call = methodcaller(method, event)  # (a listener without the method is logged too)
    for listener in listeners:
        run_hook(call, listener, what=f"listener {listener!r} on {method}")
