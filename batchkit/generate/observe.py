"""Events for observers of a continuous batcher (metrics exporters, tracing).

Listeners are called by the batcher's driver right after the fact, under the
batcher's lock: keep them fast, and do not call back into the batcher (``stats()``
would wait for that lock). With no listener attached, the driver builds no event.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from batchkit.generate.sequence import Sequence, StepBatch

log = logging.getLogger("batchkit")


@dataclass(frozen=True, slots=True)
class StepEvent:
    """One step that ended (its tokens applied, or its failure)."""

    name: str  # the batcher
    tokens: int  # tokens computed in the step, all sequences together
    # Seconds since arrival of the requests the step started, and of those whose first
    # token it produced; seconds since the previous token of the other tokens it produced.
    queue_times: tuple[float, ...]
    first_token_times: tuple[float, ...]
    inter_token_times: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class FinishEvent:
    """One request that got its answer."""

    name: str
    reason: str  # "stop", "length", "cancelled", "timeout" or "error"
    latency: float  # seconds from submit to the answer


class GenerationListener(Protocol):
    """What :meth:`ContinuousBatcher.add_listener <batchkit.ContinuousBatcher.add_listener>`
    accepts."""

    def on_step(self, event: StepEvent) -> None:
        """A step ended."""

    def on_finish(self, event: FinishEvent) -> None:
        """A request was answered (finished, cancelled, timed out or failed)."""


class StepObserver:
    """A batcher's listeners, and the events the driver tells them (under its lock)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.listeners: tuple[GenerationListener, ...] = ()
        self._queue_times: list[float] = []  # of the step running now, told when it ends

    @property
    def active(self) -> bool:
        """Whether anyone listens (else the driver skips every call below)."""
        return bool(self.listeners)

    def add(self, listener: GenerationListener) -> None:
        """Attach ``listener`` (once; hold the batcher's lock)."""
        if listener not in self.listeners:
            self.listeners = (*self.listeners, listener)

    def remove(self, listener: GenerationListener) -> None:
        """Detach ``listener`` (hold the batcher's lock); ``ValueError`` if not attached."""
        if listener not in self.listeners:
            raise ValueError(f"{listener!r} is not a listener of {self.name}")
        self.listeners = tuple(x for x in self.listeners if x is not listener)

    def scheduled(self, started: Iterable[Sequence], now: float) -> None:
        """A step was scheduled; ``started`` are the requests it runs for the first time."""
        self._queue_times = [now - seq.arrival_time for seq in started]

    def stepped(self, batch: StepBatch, produced: list[Sequence], now: float) -> None:
        """``batch``'s step ended; ``produced`` got a token each."""
        first = tuple(now - s.arrival_time for s in produced if s.num_generated == 1)
        gaps = tuple(s.last_token_gap for s in produced if s.num_generated > 1)
        event = StepEvent(self.name, batch.num_tokens, tuple(self._queue_times), first, gaps)
        self._queue_times = []
        for listener in self.listeners:
            try:
                listener.on_step(event)
            except Exception:  # noqa: BLE001 - observers must not take the driver down
                log.exception("batchkit listener %r failed on on_step", listener)

    def finished(self, seq: Sequence, now: float) -> None:
        """``seq``'s request was answered."""
        event = FinishEvent(self.name, seq.finish_reason or "error", now - seq.arrival_time)
        for listener in self.listeners:
            try:
                listener.on_finish(event)
            except Exception:  # noqa: BLE001 - observers must not take the driver down
                log.exception("batchkit listener %r failed on on_finish", listener)
