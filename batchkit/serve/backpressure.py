"""Callers waiting for queue room (``when_full="block"``), woken first-come-first-served.

Thread callers wait on a lock, asyncio callers on a future of their own loop; a
waiter that is woken retries its enqueue (and waits again if it lost a race).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import TypeAlias

Waiter: TypeAlias = "threading.Lock | asyncio.Future[None]"  # a string: Lock is a factory


class RoomWaiters:
    """A FIFO of blocked callers. Not thread-safe: used under the runtime's lock."""

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
        """A future resolved (on ``loop``) when room may be free."""
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        return fut

    def discard(self, waiter: Waiter) -> bool:
        """Withdraw a waiter that gave up; False if it was already woken."""
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return False
        return True

    def wake(self, count: int) -> None:
        """Wake up to ``count`` waiters, oldest first."""
        for _ in range(min(count, len(self._waiters))):
            _wake(self._waiters.popleft())

    def wake_all(self) -> None:
        """Wake everyone (on close: they will see ``BatcherClosed``)."""
        self.wake(len(self._waiters))


def _wake(waiter: Waiter) -> None:
    if isinstance(waiter, asyncio.Future):
        loop = waiter.get_loop()
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting there
            loop.call_soon_threadsafe(_resolve, waiter)
    else:
        waiter.release()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
