"""Callers waiting for queue room (``when_full="block"``), woken first-come-first-served.

Thread callers wait on a lock, asyncio callers on a future of their own loop; a
waiter that is woken retries its enqueue (and waits again if it lost a race).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias, TypeVar

from batchkit.errors import RequestTimeout
from batchkit.serve.events import DropReason
from batchkit.serve.request import Request

if TYPE_CHECKING:
    from batchkit.serve.scheduler import Scheduler

Waiter: TypeAlias = "threading.Lock | asyncio.Future[None]"  # a string: Lock is a factory
W = TypeVar("W", threading.Lock, "asyncio.Future[None]")


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
        """Wake up to ``count`` waiters, oldest first (skipping any whose loop is gone)."""
        while count > 0 and self._waiters:
            if _wake(self._waiters.popleft()):
                count -= 1

    def wake_all(self) -> None:
        """Wake everyone (on close: they will see ``BatcherClosed``)."""
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


class BlockingAdmission:
    """The ``when_full="block"`` half of :class:`~batchkit.serve.runtime.Runtime`:
    callers wait for queue room (within their timeout) instead of getting ``QueueFull``."""

    # Provided by Runtime:
    lock: threading.RLock
    closed: bool
    room: RoomWaiters
    sched: Scheduler
    name: str

    def _admit_locked(self, req: Request) -> None:
        raise NotImplementedError

    def _dropped(self, reason: DropReason, count: int) -> None:
        raise NotImplementedError

    def timeout_error(self, timeout: float) -> RequestTimeout:
        raise NotImplementedError

    def give_up(self, req: Request, error: BaseException, *, timed_out: bool) -> bool:
        raise NotImplementedError

    def _has_room_locked(self) -> bool:
        limit = self.sched.max_queue_size
        return limit is None or self.sched.num_waiting < limit

    def _room_freed(self) -> None:
        """Scheduler callback (under the lock): requests left the queue."""
        if self.room:
            limit = self.sched.max_queue_size
            self.room.wake(len(self.room) if limit is None else limit - self.sched.num_waiting)

    def _gave_up_waiting_for_room(self, timeout: float) -> RequestTimeout:
        self.sched.stats.timeouts += 1
        self._dropped("timeout", 1)
        return self.timeout_error(timeout)

    def _admit_or_wait_locked(self, req: Request, add_waiter: Callable[[], W]) -> W | None:
        """Enqueue ``req`` if there is room (or raise, if closed); else a new room waiter."""
        if self.closed or self._has_room_locked():
            self._admit_locked(req)  # raises BatcherClosed when closed
            return None
        return add_waiter()

    def submit_blocking(self, req: Request, timeout: float | None) -> None:
        """A thread caller's enqueue with ``when_full="block"``: wait for room up to ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                waiter = self._admit_or_wait_locked(req, self.room.add_thread)
            if waiter is None:
                return
            left = -1.0 if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not waiter.acquire(timeout=left):
                with self.lock:
                    if self.room.discard(waiter):
                        raise self._gave_up_waiting_for_room(timeout or 0.0)
                # Woken just as the timeout passed: try once more.

    async def asubmit_blocking(self, req: Request, timeout: float | None) -> None:
        """:meth:`submit_blocking` for asyncio callers (the loop is never blocked)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self.lock:
                fut = self._admit_or_wait_locked(req, lambda: self.room.add_async(loop))
            if fut is None:
                return
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                await asyncio.wait_for(fut, left)
            except asyncio.TimeoutError:
                with self.lock:
                    if self.room.discard(fut):
                        raise self._gave_up_waiting_for_room(timeout or 0.0) from None
            except asyncio.CancelledError:
                with self.lock:
                    if not self.room.discard(fut):
                        self._room_freed()  # pass the wake-up on to the next waiter
                raise

    def submit_all_blocking(self, reqs: list[Request], timeout: float | None) -> None:
        """Block-mode ``map``: enqueue item by item; on failure withdraw what has not run."""
        start = time.monotonic()
        for i, req in enumerate(reqs):
            left = None if timeout is None else timeout - (time.monotonic() - start)
            try:
                self.submit_blocking(req, left)
            except BaseException as exc:
                error = self._withdraw(reqs[:i], exc, timeout)
                if error is exc:
                    raise
                raise error from None

    async def asubmit_all_blocking(self, reqs: list[Request], timeout: float | None) -> None:
        """:meth:`submit_all_blocking` for asyncio callers."""
        start = time.monotonic()
        for i, req in enumerate(reqs):
            left = None if timeout is None else timeout - (time.monotonic() - start)
            try:
                await self.asubmit_blocking(req, left)
            except BaseException as exc:
                error = self._withdraw(reqs[:i], exc, timeout)
                if error is exc:
                    raise
                raise error from None

    def _withdraw(
        self, reqs: list[Request], error: BaseException, timeout: float | None
    ) -> BaseException:
        """Withdraw the items of a ``map`` admitted before ``error`` stopped it; the error
        for the caller (a timeout names the caller's ``timeout``, not what was left)."""
        timed_out = isinstance(error, RequestTimeout)
        for req in reqs:
            self.give_up(req, error, timed_out=timed_out)
        if timed_out and timeout is not None:
            return self.timeout_error(timeout)
        return error
