"""One thread per sync function that calls back, under the serving core's lock, at
the times its alarms were set to: the deadline of a running call (`batch_timeout`,
see `batchkit.serve.watchdog`) and, under a latency target while every worker runs
a batch, the moment the next waiting request becomes too late (see `ThreadDriver`).

Nothing else runs then: every worker is inside the function, so without this thread
a waiting caller would hear only when a batch ends or someone arrives. The thread
starts with the first time set, sleeps until the earliest one, and exits on
`stop_locked`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from batchkit.serve.options import Clock

log = logging.getLogger("batchkit")


class Alarm:
    """One callback of a `Timer`, due at one time at most (set again to move it).

    Args:
        callback: Called under the lock, on the timer's thread, when it is due.
    """

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback


class Timer:
    """Alarms due at given times; one thread calls them.

    Args:
        lock: The serving core's lock; every method named `..._locked` is called
            under it, and so is every alarm's callback.
        clock: The batcher's clock, in seconds (the times set are on it).
        name: The function's name, for the thread's name.
    """

    def __init__(self, lock: threading.RLock, clock: Clock, name: str) -> None:
        self._lock = lock
        self.cond = threading.Condition(lock)
        self.clock = clock
        self._name = name
        self._due: dict[Alarm, float] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False

    def set_locked(self, alarm: Alarm, at: float) -> None:
        """Under the lock: call `alarm` at `at` (once), instead of when it was due.

        Nothing is set once the timer is stopped. When the thread cannot start
        (`can't start new thread`) it is logged, and nothing is called back until a
        later `set_locked` starts it (a batch runs unwatched meanwhile).

        Args:
            alarm: What is called (a worker's call deadline, a pass of the driver).
            at: When, on the clock.
        """
        if self._stopped:
            return  # (closed: nothing is called any more)
        self._due[alarm] = at
        if self._thread is None:
            thread = threading.Thread(
                target=self._run, name=f"batchkit-{self._name}-timer", daemon=True
            )
            try:
                thread.start()
            except RuntimeError:  # can't start new thread: nothing is called back yet
                log.exception("batchkit: %s: the timer thread could not start", self._name)
                return  # (what is set stays due: the next set_locked tries again)
            self._thread = thread
        self.cond.notify()

    def cancel_locked(self, alarm: Alarm) -> None:
        """Under the lock: `alarm` is no longer due (if it was)."""
        self._due.pop(alarm, None)

    def is_set(self, alarm: Alarm) -> bool:
        """Whether `alarm` is due (read under the lock)."""
        return alarm in self._due

    def stop_locked(self) -> None:
        """Under the lock: the function is closed; the thread exits, calling nothing more."""
        self._stopped = True
        self.cond.notify()

    def forked_locked(self) -> None:
        """Under the lock, in a child process just forked: the thread is not here, nor
        what it waited for; the next `set_locked` starts a new thread."""
        # The condition's one waiter is the parent's thread: a notify would go to it,
        # and not wake the new thread.
        self.cond = threading.Condition(self._lock)
        self._thread = None
        self._due.clear()

    def join(self) -> None:
        """Wait for the thread to exit (after `stop_locked`)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        due = self._due
        with self.cond:
            while not self._stopped:
                now = self.clock()
                for alarm, at in list(due.items()):
                    # (a callback may have set or cancelled another alarm meanwhile)
                    if at <= now and due.get(alarm) == at:
                        del due[alarm]
                        alarm.callback()
                upcoming = min(due.values(), default=None)
                self.cond.wait(None if upcoming is None else max(upcoming - self.clock(), 0.0))
