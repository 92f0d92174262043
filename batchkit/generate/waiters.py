"""Who waits on a continuous batcher's requests, and how they are woken.

`Waiters` is one batcher's lock (it guards the scheduler too) and the callers
waiting under it: threads streaming a handle wait on one condition; asyncio tasks
(awaiting or iterating a handle) each wait on an event of their own loop, set on that
loop. `Outcome` is one request's final answer (its error, if any) and the
events of the tasks waiting for it. The driver settles outcomes and wakes waiters;
the handle waits on them. Neither knows the other.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable

from batchkit.loops import call_on_loop

LoopEvent = tuple[asyncio.AbstractEventLoop, asyncio.Event]


class Waiters:
    """One batcher's lock and the callers waiting under it.

    ``streamers`` (threads iterating a handle) and ``subscribers`` (asyncio events held
    by handles) are counted under ``lock``: while both are 0, a step wakes nobody.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.progress = threading.Condition(self.lock)  # streaming threads wait here
        self.streamers = 0
        self.subscribers = 0

    def wake_streamers(self) -> None:
        """Wake the threads iterating handles, if any (hold ``lock``)."""
        if self.streamers:
            self.progress.notify_all()

    def wake_subscribers(self, outcomes: Iterable[Outcome]) -> None:
        """Tell the asyncio tasks waiting on ``outcomes`` that their requests moved (hold
        ``lock``; threads: `wake_streamers`).

        Args:
            outcomes: The outcomes of the requests that moved.
        """
        if self.subscribers:
            set_events([e for outcome in outcomes for e in outcome.events])


class Outcome:
    """One request's final answer, and the asyncio events of the tasks waiting for it.

    Settled once, by `settle` (under the batcher's lock): ``error`` is None for a
    request that ended with its tokens.

    Args:
        waiters: Its batcher's lock and waiting callers.
    """

    __slots__ = ("_final", "_waiters", "error", "events", "streaming")

    def __init__(self, waiters: Waiters) -> None:
        self._waiters = waiters
        self._final = threading.Lock()  # held until the outcome is final (lock-as-event)
        self._final.acquire()
        self.error: BaseException | None = None
        self.events: list[LoopEvent] = []
        self.streaming = 0  # threads iterating this request

    def done(self) -> bool:
        """Whether the outcome is final."""
        return not self._final.locked()

    def wait(self, timeout: float | None) -> bool:
        """Block until final (False if ``timeout`` seconds pass first).

        Args:
            timeout: Seconds to wait (a negative one counts as 0); None: no limit.
        """
        if not self._final.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return False
        self._final.release()
        return True

    def settle(self, error: BaseException | None) -> bool:
        """Make the outcome final and wake its waiters (hold the batcher's lock); False
        if it was final already.

        Args:
            error: What the request's callers get raised; None: it ended with its tokens.
        """
        if self.done():
            return False
        self.error = error
        self._final.release()
        if self.events:
            set_events(self.events)
        if self.streaming:
            self._waiters.progress.notify_all()
        return True

    # -- waiting from asyncio and from threads (each takes the batcher's lock) -------
    def subscribe(self) -> asyncio.Event:
        """An event of the running loop, set whenever this request moves."""
        event = asyncio.Event()
        with self._waiters.lock:
            self.events.append((asyncio.get_running_loop(), event))
            self._waiters.subscribers += 1
        return event

    def unsubscribe(self, event: asyncio.Event) -> None:
        """Forget an event `subscribe` returned.

        Args:
            event: The event.
        """
        with self._waiters.lock:
            self.events = [(lp, e) for lp, e in self.events if e is not event]
            self._waiters.subscribers -= 1

    def start_streaming(self) -> None:
        """A thread starts iterating this request: steps now wake it."""
        with self._waiters.lock:
            self.streaming += 1
            self._waiters.streamers += 1

    def stop_streaming(self) -> None:
        """The thread `start_streaming` counted stopped iterating."""
        with self._waiters.lock:
            self.streaming -= 1
            self._waiters.streamers -= 1


def set_events(events: Iterable[LoopEvent]) -> None:
    """Set asyncio events, each on its own loop (at once when already there; an event
    of a closed loop is skipped: nobody waits there).

    Args:
        events: ``(loop, event)`` pairs.
    """
    for loop, event in events:
        call_on_loop(loop, event.set)
