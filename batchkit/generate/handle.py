"""A caller's handle on one generation: stream its tokens, wait for it, or cancel it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any

from batchkit.generate.sequence import Sequence
from batchkit.generate.waiters import Outcome, Waiters


class GenerationHandle:
    """One submitted request: stream its tokens, wait for them, or cancel it.

    Iterate (``for`` / ``async for``) to stream its tokens,
    [`result`][batchkit.GenerationHandle.result] (or ``await handle``) for all of
    them, [`cancel`][batchkit.GenerationHandle.cancel] to stop it.

    The generated ids include the stop token that ended the sequence, if one did. A
    cancelled request's result is what it generated before the cancel; a request that
    timed out before it started, failed in the step function, or was cut by a
    [`close`][batchkit.ContinuousBatcher.close] timeout raises that error instead.

    Args:
        seq: The request's sequence.
        outcome: Its final answer, once settled.
        waiters: Its batcher's lock and waiting callers.
        cancel: The batcher's driver's ``cancel``.
    """

    __slots__ = ("_seq", "_outcome", "_waiters", "_cancel")

    def __init__(
        self,
        seq: Sequence,
        outcome: Outcome,
        waiters: Waiters,
        cancel: Callable[[Sequence], bool],
    ) -> None:
        self._seq = seq
        self._outcome = outcome
        self._waiters = waiters  # its batcher's lock: the sequence's tokens grow under it
        self._cancel = cancel

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
        return self._outcome.done()

    def cancel(self) -> bool:
        """Stop generating (thread-safe); False if it had already finished.

        If a step is computing this request right now, that step's token is dropped.
        """
        return self._cancel(self._seq)

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until done; the generated ids.

        Args:
            timeout: Seconds to wait; ``None``: as long as it takes.

        Returns:
            The generated token ids (the stop token included, if one ended it).

        Raises:
            TimeoutError: ``timeout`` passed first; the request goes on
                ([`cancel`][batchkit.GenerationHandle.cancel] it if it is no longer
                wanted).
            RequestTimeout: It timed out before it started.
            BatcherClosed: A ``close`` timeout cut it.
            Exception: Whatever the step function raised for its step.
        """
        if not self._outcome.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not done within {timeout}s")
        return self._result()

    def _result(self) -> list[int]:
        error = self._outcome.error
        if error is not None:
            raise error
        return self._seq.generated_ids

    def __iter__(self) -> Iterator[int]:
        """Stream the generated tokens from a thread, as they are produced."""
        cond = self._waiters.progress
        ids = self._seq.token_ids
        pos = self._seq.num_prompt_tokens
        self._outcome.start_streaming()
        try:
            while True:
                with cond:
                    while len(ids) <= pos and not self.done():
                        cond.wait()
                    new = ids[pos:]
                    finished = self.done()
                yield from new
                pos += len(new)
                if finished and pos >= len(ids):
                    self._result()  # raises the request's error, if it failed
                    return
        finally:
            self._outcome.stop_streaming()

    async def __aiter__(self) -> AsyncIterator[int]:
        """Stream the generated tokens in asyncio, as they are produced."""
        event = self._outcome.subscribe()
        ids = self._seq.token_ids
        pos = self._seq.num_prompt_tokens
        try:
            while True:
                event.clear()
                with self._waiters.lock:
                    new = ids[pos:]
                    finished = self.done()
                for tok in new:
                    yield tok
                pos += len(new)
                if finished and pos >= len(ids):
                    self._result()  # raises the request's error, if it failed
                    return
                if not new:
                    await event.wait()
        finally:
            self._outcome.unsubscribe(event)

    def __await__(self) -> Generator[Any, None, list[int]]:
        return self._aresult().__await__()

    async def _aresult(self) -> list[int]:
        event = self._outcome.subscribe()
        try:
            while not self.done():
                await event.wait()
                event.clear()
        finally:
            self._outcome.unsubscribe(event)
        return self._result()

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return f"GenerationHandle(request_id={self.request_id}, {state})"
