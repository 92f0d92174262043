"""The arrival lane: the usual requests, admitted with one append and placed in bulk.

A keyless policy's requests at the default priority all go to one bucket, in arrival
order, so admitting one needs no bucket lookup, no sequence number, no limit check
(an unbounded queue, no latency target): it is appended to the lane's `arrivals`,
and the scheduler places them all at its next pass (`Scheduler.ingest`). Under the
serving lock any caller may append. While the lane is *open* on an event loop, that
loop's own callers append without the lock: only the thread running the loop then
changes the scheduler, so nothing else can be placing the arrivals at the same time,
except a call from another thread (a close, a `configure`, a withdrawn request) that
holds the lock; `move_into` then takes exactly the requests it counted, so an append
racing it waits for the next pass instead of being lost.

Why it is kept: measured in docs/performance.md ("What the hot path keeps"), the lane
against every asyncio call taking the lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable

from batchkit.serve.request import Request


def _nothing() -> None:
    pass


class ArrivalLane:
    """Admitted requests of the default lane not yet placed, and who may append unlocked.

    Args:
        wake: Called by a lock-free caller, on the open loop, when `poll_due` is not
            set: schedule a scheduling pass (the event loop driver's `wake`).
    """

    __slots__ = ("arrivals", "loop", "poll_due", "wake", "_thread")

    def __init__(self, wake: Callable[[], None] = _nothing) -> None:
        self.arrivals: deque[Request] = deque()
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop whose default-priority callers append without the lock; None
        while the lane is shut (every caller takes the lock)."""
        self.poll_due = False
        """A scheduling pass is scheduled, or every slot is busy (the batch that ends
        next polls): an arrival need not wake the driver."""
        self.wake = wake
        # The thread that may append without the lock: the open loop's, kept after the
        # lane shuts (an append may still be under way); None while every append
        # holds the lock.
        self._thread: int | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Let `loop`'s callers append without the lock; called on the thread running it.

        Args:
            loop: The running loop the event loop driver now serves.
        """
        self.loop = loop
        self._thread = threading.get_ident()

    def shut(self) -> None:
        """Every caller takes the lock from now on (a close, a bounded queue, a target)."""
        self.loop = None

    def forget_thread(self) -> None:
        """In a child process just forked: the loop and its thread are the parent's."""
        self.loop = None
        self._thread = None
        self.poll_due = False

    def move_into(self, queue: deque[Request]) -> int:
        """Append every arrival to `queue`, in order; called under the serving lock.

        Args:
            queue: The default bucket's deque.

        Returns:
            How many were moved.
        """
        arrivals = self.arrivals
        count = len(arrivals)
        if self._thread is None or self._thread == threading.get_ident():
            # No append can run meanwhile: the others hold the lock, as this call does,
            # and lock-free ones run on this thread (the lane's thread changes only when
            # its loop stops: see LoopDriver.bind).
            queue.extend(arrivals)
            arrivals.clear()
        else:
            # Exactly `count` popped: a lock-free caller's append racing this call, on
            # the lane's thread, is kept for the next pass (a clear could drop it).
            for _ in range(count):
                queue.append(arrivals.popleft())
        return count
