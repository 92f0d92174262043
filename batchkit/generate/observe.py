"""Events for observers of a continuous batcher (metrics exporters, tracing).

Listeners are called by the batcher's driver right after the fact, under the
batcher's lock: keep them fast, and do not call back into the batcher (``stats()``
would wait for that lock). Whatever a listener raises, a ``SystemExit`` too, is
logged and never passed on (see `batchkit.usercode`). With no listener attached,
the driver builds no event.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from batchkit.generate.sequence import Sequence, StepBatch
from batchkit.usercode import run_hook


@dataclass(frozen=True, slots=True)
class StepEvent:
    """One step that ended (its tokens applied, or its failure).

    Attributes:
        name: The batcher's name.
        tokens: Tokens computed in the step, all sequences together.
        queue_times: Seconds from arrival to this step, of each request the step ran
            for the first time.
        first_token_times: Seconds from arrival to now, of each request whose first
            token the step produced.
        inter_token_times: Seconds since the previous token, of each other token the
            step produced.
    """

    name: str
    tokens: int
    queue_times: tuple[float, ...]
    first_token_times: tuple[float, ...]
    inter_token_times: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class FinishEvent:
    """One request that got its answer.

    Attributes:
        name: The batcher's name.
        reason: Its finish reason: ``"stop"``, ``"length"``, ``"cancelled"``,
            ``"timeout"`` or ``"error"``.
        latency: Seconds from submit to the answer.
    """

    name: str
    reason: str
    latency: float


class GenerationListener(Protocol):
    """What [`ContinuousBatcher.add_listener`][batchkit.ContinuousBatcher.add_listener]
    accepts."""

    def on_step(self, event: StepEvent) -> None:
        """A step ended.

        Args:
            event: What the step did.
        """

    def on_finish(self, event: FinishEvent) -> None:
        """A request was answered (finished, cancelled, timed out or failed).

        Args:
            event: Which request's batcher, why it ended, and its latency.
        """


class StepObserver:
    """A batcher's listeners, and the events the driver tells them (under its lock).

    Args:
        name: The batcher's name, carried by every event.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.listeners: tuple[GenerationListener, ...] = ()
        self._queue_times: list[float] = []  # of the step running now, told when it ends

    @property
    def active(self) -> bool:
        """Whether anyone listens (else the driver skips every call below)."""
        return bool(self.listeners)

    def add(self, listener: GenerationListener) -> None:
        """Attach ``listener`` (once; hold the batcher's lock).

        Args:
            listener: The listener.
        """
        if listener not in self.listeners:
            self.listeners = (*self.listeners, listener)

    def remove(self, listener: GenerationListener) -> None:
        """Detach ``listener`` (hold the batcher's lock); ``ValueError`` if not attached.

        Args:
            listener: The listener.
        """
        if listener not in self.listeners:
            raise ValueError(f"{listener!r} is not a listener of {self.name}")
        self.listeners = tuple(x for x in self.listeners if x is not listener)

    def scheduled(self, started: Iterable[Sequence], now: float) -> None:
        """A step was scheduled.

        Args:
            started: The requests it runs for the first time.
            now: The time, on the batcher's clock.
        """
        self._queue_times = [now - seq.arrival_time for seq in started]

    def stepped(self, batch: StepBatch, produced: list[Sequence], now: float) -> None:
        """``batch``'s step ended: tell every listener's ``on_step``.

        Args:
            batch: The step's batch.
            produced: The sequences that got a token in it.
            now: The time, on the batcher's clock.
        """
        first = tuple(now - s.arrival_time for s in produced if s.num_generated == 1)
        gaps = tuple(s.last_token_gap for s in produced if s.num_generated > 1)
        event = StepEvent(self.name, batch.num_tokens, tuple(self._queue_times), first, gaps)
        self._queue_times = []
        for listener in self.listeners:  # (observers must not take the driver down)
            run_hook(listener.on_step, event, what=f"listener {listener!r} on on_step")

    def finished(self, seq: Sequence, now: float) -> None:
        """``seq``'s request was answered: tell every listener's ``on_finish``.

        Args:
            seq: The request's sequence.
            now: The time, on the batcher's clock.
        """
        event = FinishEvent(self.name, seq.finish_reason or "error", now - seq.arrival_time)
        for listener in self.listeners:
            run_hook(listener.on_finish, event, what=f"listener {listener!r} on on_finish")
