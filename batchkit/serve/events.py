"""Events for observers (metrics exporters, tracing): what happened to each batch and
to each request that never ran. Listeners are called on the runtime's worker (or
loop) right after the fact, under its lock: keep them fast and non-blocking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal, Protocol

log = logging.getLogger("batchkit")

DropReason = Literal["rejected", "timeout", "cancelled", "closed"]


@dataclass(frozen=True, slots=True)
class BatchEvent:
    """One batch that ended (successfully or not)."""

    name: str  # the batched function
    size: int  # real items
    padded_size: int  # the size the function was called with (strict sizes pad up)
    reason: str  # why it left: "full", "max_wait", "idle", "closing"
    queue_waits: tuple[float, ...]  # seconds each item waited before the batch left
    latency: float  # seconds from dispatch to results
    failed: int  # items that ended with an error
    tokens: float  # sum of the items' keys (0 when the policy has no key)
    padded_tokens: float  # padded_size * max key: the area a padded batch occupies


@dataclass(frozen=True, slots=True)
class DropEvent:
    """Requests that ended without running."""

    name: str
    reason: DropReason
    count: int = 1


class Listener(Protocol):
    """What ``f.add_listener`` accepts."""

    def on_batch(self, event: BatchEvent) -> None:
        """A batch ended."""

    def on_drop(self, event: DropEvent) -> None:
        """Requests were rejected, timed out, cancelled or failed by close without running."""


def notify(listeners: list[Listener], method: str, event: BatchEvent | DropEvent) -> None:
    """Call every listener; a failing listener is logged, never allowed to break a batch."""
    for listener in listeners:
        try:
            getattr(listener, method)(event)
        except Exception:  # noqa: BLE001 - observers must not take the runtime down
            log.exception("batchkit listener %r failed on %s", listener, method)
