"""Where a streaming caller's chunks wait for it: one channel per request, fed by the
batch's generator (on a worker thread or the event loop) and read by its caller (a
thread, or a task on its own loop).

Buffers are unbounded: the batch's generator never waits for a slow consumer (that
would stall every other caller of the batch), so a consumer that falls behind keeps
its chunks in memory until it reads them or leaves. A channel ends once: with
[`END`][batchkit.END], or with an error; anything put after that is dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, Final, Literal

from batchkit.loops import call_on_loop


class _End:
    """The type of [`END`][batchkit.END]: one instance, kept by pickling."""

    _instance: _End | None = None

    def __new__(cls) -> _End:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "batchkit.END"

    def __reduce__(self) -> str:
        return "END"


END: Final = _End()
"""Yielded by a streaming batch function as an item's entry: that item's stream ends
(later entries for it are ignored)."""

Kind = Literal["chunk", "end"]
Message = tuple[Kind, Any]  # ("chunk", value) or ("end", None or the stream's error)


class _ChannelEnds:
    """What both channels share: a stream ends once, and its consumer may leave.

    A message is sent under `guard`, so that a chunk never follows the end (the
    producer and a close may end a stream at once). A channel sends its messages
    its own way (`_send`).

    Args:
        guard: Held while a message is sent.
    """

    def __init__(self, guard: threading.Lock | threading.Condition) -> None:
        self._guard = guard
        self._finished = False
        self.left = False  # the consumer stopped reading: the producer may stop

    @property
    def done(self) -> bool:
        """Nothing more will be read: the stream ended, or its consumer left."""
        return self._finished or self.left

    def put(self, chunk: Any) -> None:
        """One chunk for the consumer (dropped once the stream has ended).

        Args:
            chunk: What the generator yielded for this item.
        """
        with self._guard:
            if not self._finished:
                self._send(("chunk", chunk))

    def finish(self, error: BaseException | None) -> None:
        """End the stream; later calls change nothing.

        Args:
            error: What the consumer raises at the end; None for a plain end.
        """
        with self._guard:
            if not self._finished:
                self._finished = True
                self._send(("end", error))

    def _send(self, message: Message) -> None:
        raise NotImplementedError


class ThreadChannel(_ChannelEnds):
    """A stream read by a thread: messages in a deque, a condition to wait on."""

    def __init__(self) -> None:
        self._items: deque[Message] = deque()
        self._cond = threading.Condition()
        super().__init__(self._cond)

    def _send(self, message: Message) -> None:
        self._items.append(message)
        self._cond.notify()

    def get(self, timeout: float | None) -> Message | None:
        """The next message, waiting for it.

        Args:
            timeout: Seconds to wait at most; None for no bound.

        Returns:
            `("chunk", value)` or `("end", error or None)`; None if `timeout` passed
            first.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                return None
            return self._items.popleft()


class LoopChannel(_ChannelEnds):
    """A stream read by a task on `loop`: messages reach it on that loop, from any thread.

    Args:
        loop: The consumer's event loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(threading.Lock())
        self.loop = loop
        self._queue: asyncio.Queue[Message] = asyncio.Queue()

    def _send(self, message: Message) -> None:
        call_on_loop(self.loop, self._queue.put_nowait, message)

    async def get(self) -> Message:
        """The next message (on the consumer's loop)."""
        return await self._queue.get()


Channel = ThreadChannel | LoopChannel
