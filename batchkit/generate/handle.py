"""A caller's handle on one generation: stream its tokens, wait for it, or cancel it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Generator, Iterator
from typing import TYPE_CHECKING, Any

from batchkit.generate.sequence import Sequence

if TYPE_CHECKING:
    from batchkit.generate.batcher import ContinuousBatcher


class GenerationHandle:
    """One submitted request. Iterate (``for`` / ``async for``) to stream its tokens,
    :meth:`result` (or ``await handle``) for all of them, :meth:`cancel` to stop it.

    The generated ids include the stop token that ended the sequence, if one did. A
    cancelled request's result is what it generated before the cancel; a request that
    timed out before it started, failed in the step function, or was cut by a
    :meth:`~batchkit.ContinuousBatcher.close` timeout raises that error instead.
    """

    __slots__ = ("_batcher", "_seq", "_done", "_error", "_events", "_streaming")

    def __init__(self, batcher: ContinuousBatcher, seq: Sequence) -> None:
        self._batcher = batcher
        self._seq = seq
        self._done = threading.Lock()  # held until the outcome is final (lock-as-event)
        self._done.acquire()
        self._error: BaseException | None = None
        self._events: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._streaming = 0  # threads iterating: the driver wakes them every step

    @property
    def request_id(self) -> int:
        """This request's id (as the step function sees it)."""
        return self._seq.request_id

    @property
    def finish_reason(self) -> str | None:
        """Why it ended: stop, length, cancelled, timeout, error; None while running."""
        return self._seq.finish_reason if self.done() else None

    def done(self) -> bool:
        """Whether the outcome is final."""
        return not self._done.locked()

    def cancel(self) -> bool:
        """Stop generating (thread-safe); False if it had already finished.

        If a step is computing this request right now, that step's token is dropped.
        """
        return self._batcher._cancel(self)

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until done; the generated ids. ``TimeoutError`` if ``timeout`` passes first
        (the request goes on; :meth:`cancel` it if it is no longer wanted)."""
        if not self._done.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise TimeoutError(f"request {self.request_id} not done within {timeout}s")
        self._done.release()
        return self._outcome()

    def _outcome(self) -> list[int]:
        if self._error is not None:
            raise self._error
        return self._seq.generated_ids

    def __iter__(self) -> Iterator[int]:
        """Stream the generated tokens from a thread, as they are produced."""
        cond = self._batcher._progress
        pos = self._seq.num_prompt_tokens
        with cond:
            self._streaming += 1
            self._batcher._streamers += 1
        try:
            while True:
                with cond:
                    while len(self._seq.token_ids) <= pos and not self.done():
                        cond.wait()
                    new = self._seq.token_ids[pos:]
                    finished = self.done()
                yield from new
                pos += len(new)
                if finished and pos >= len(self._seq.token_ids):
                    if self._error is not None:
                        raise self._error
                    return
        finally:
            with cond:
                self._streaming -= 1
                self._batcher._streamers -= 1

    async def __aiter__(self) -> AsyncIterator[int]:
        """Stream the generated tokens in asyncio, as they are produced."""
        event = self._subscribe()
        pos = self._seq.num_prompt_tokens
        try:
            while True:
                event.clear()
                with self._batcher._lock:
                    new = self._seq.token_ids[pos:]
                    finished = self.done()
                for tok in new:
                    yield tok
                pos += len(new)
                if finished and pos >= len(self._seq.token_ids):
                    if self._error is not None:
                        raise self._error
                    return
                if not new:
                    await event.wait()
        finally:
            self._unsubscribe(event)

    def __await__(self) -> Generator[Any, None, list[int]]:
        return self._aresult().__await__()

    async def _aresult(self) -> list[int]:
        event = self._subscribe()
        try:
            while not self.done():
                await event.wait()
                event.clear()
        finally:
            self._unsubscribe(event)
        return self._outcome()

    def _subscribe(self) -> asyncio.Event:
        event = asyncio.Event()
        with self._batcher._lock:
            self._events.append((asyncio.get_running_loop(), event))
            self._batcher._subscribers += 1
        return event

    def _unsubscribe(self, event: asyncio.Event) -> None:
        with self._batcher._lock:
            self._events = [(lp, e) for lp, e in self._events if e is not event]
            self._batcher._subscribers -= 1

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return f"GenerationHandle(request_id={self.request_id}, {state})"
