"""Waiting for queue room (`when_full="block"`): callers blocked on a full queue,
woken first-come-first-served as requests leave it.

Thread callers wait on a lock, asyncio callers on a future of their own loop; a
waiter that is woken retries its enqueue (and waits again if it lost a race). The
serving core holds one `Backpressure` and hands itself to it as the `Queue` it
fills: a way to try an enqueue under the core's lock, and to count a caller that
gave up.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol, TypeAlias

from batchkit.errors import RequestTimeout
from batchkit.serve.request import Request

Waiter: TypeAlias = "threading.Lock | asyncio.Future[None]"  # a string: Lock is a factory


class Queue(Protocol):
    """What backpressure asks of the serving core; each method is called under its
    lock."""

    def enqueue_if_room_locked(self, req: Request) -> bool:
        """Enqueue the request and return True, or return False (no room); may raise
        (e.g. `BatcherClosed`)."""

    def gave_up_waiting_locked(self, timeout: float) -> RequestTimeout:
        """Count a caller that gave up waiting, and make its error from its `timeout`."""


class RoomWaiters:
    """A FIFO of blocked callers. Not thread-safe: used under the core's lock."""

    def __init__(self) -> None:
        self._waiters: deque[Waiter] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def add_thread(self) -> threading.Lock:
        """A lock that is released when room may be free."""
        lock = threading.Lock()
        lock.acquire()
        self._waiters.append(lock)
        return lock

    def add_async(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future resolved (on `loop`) when room may be free.

        Args:
            loop: The waiting caller's running loop.
        """
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        return fut

    def discard(self, waiter: Waiter) -> bool:
        """Withdraw a waiter that gave up.

        Args:
            waiter: A lock or future this FIFO handed out.

        Returns:
            True if it was still waiting; False if it was already woken.
        """
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return False
        return True

    def wake(self, count: int) -> None:
        """Wake waiters, oldest first (skipping any whose loop is gone).

        Args:
            count: How many to wake at most.
        """
        while count > 0 and self._waiters:
            if _wake(self._waiters.popleft()):
                count -= 1

    def wake_all(self) -> None:
        """Wake everyone (on close: they will see `BatcherClosed`)."""
        self.wake(len(self._waiters))


def _wake(waiter: Waiter) -> bool:
    """Wake one waiter; False if nobody can be woken (its event loop is closed)."""
    if isinstance(waiter, asyncio.Future):
        try:
            waiter.get_loop().call_soon_threadsafe(_resolve, waiter)
        except RuntimeError:  # a closed loop: nobody is waiting there any more
            return False
        return True
    waiter.release()
    return True


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Backpressure:
    """Callers wait for queue room (within their timeout) instead of getting `QueueFull`.

    Args:
        lock: The serving core's lock, taken around every enqueue attempt.
        queue: Where requests are enqueued (the serving core).
        clock: The batcher's clock (seconds), for the callers' deadlines.
    """

    def __init__(
        self,
        lock: threading.RLock,
        queue: Queue,
        clock: Callable[[], float],
    ) -> None:
        self.lock = lock
        self.queue = queue
        self.clock = clock  # deadlines are read on the batcher's clock (real waits)
        self.waiters = RoomWaiters()

    def room_freed(self, free: int | None) -> None:
        """Under the lock: requests left the queue; wake as many waiters as fit.

        Args:
            free: Places open in the queue now; None for an unbounded queue (wake
                everyone).
        """
        if self.waiters:
            self.waiters.wake(len(self.waiters) if free is None else free)

    def submit(self, req: Request, timeout: float | None) -> None:
        """A thread caller's enqueue: wait for room, then enqueue.

        Args:
            req: The request to enqueue.
            timeout: Seconds to wait for room at most; None for no bound.

        Raises:
            RequestTimeout: No room within `timeout`.
            BatcherClosed: The function is closed.
        """
        deadline = None if timeout is None else self.clock() + timeout
        while True:
            with self.lock:
                if self.queue.enqueue_if_room_locked(req):
                    return
                waiter = self.waiters.add_thread()
            left = -1.0 if deadline is None else max(deadline - self.clock(), 0.0)
            if not waiter.acquire(timeout=left):
                with self.lock:
                    if self.waiters.discard(waiter):
                        raise self.queue.gave_up_waiting_locked(timeout or 0.0)
                # Woken just as the timeout passed: try once more.

    async def asubmit(self, req: Request, timeout: float | None) -> None:
        """`submit` for asyncio callers (the loop is never blocked).

        A cancelled caller passes its wake-up on to the next waiter.

        Args:
            req: The request to enqueue.
            timeout: Seconds to wait for room at most; None for no bound.

        Raises:
            RequestTimeout: No room within `timeout`.
            BatcherClosed: The function is closed.
        """
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else self.clock() + timeout
        while True:
            with self.lock:
                if self.queue.enqueue_if_room_locked(req):
                    return
                fut = self.waiters.add_async(loop)
            left = None if deadline is None else max(deadline - self.clock(), 0.0)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                with self.lock:
                    if self.waiters.discard(fut):
                        raise self.queue.gave_up_waiting_locked(timeout or 0.0) from None
            except asyncio.CancelledError:
                with self.lock:
                    if not self.waiters.discard(fut):
                        self.waiters.wake(1)  # pass the wake-up on to the next waiter
                raise
