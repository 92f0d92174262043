"""One thread per sync function that calls back, under the serving core's lock, at
the times it was set to: the deadline of a running call (`batch_timeout`, see
`batchkit.serve.watchdog`) and, under a latency target while every worker runs a
batch, the moment the next waiting request becomes hopeless (see `ThreadDriver`).

Nothing else runs then: every worker is inside the function, so without this thread
a waiting caller would hear only when a batch ends or someone arrives. The thread
starts with the first time set, sleeps until the earliest one, and exits on
`stop_locked`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

from batchkit.serve.options import Clock

log = logging.getLogger("batchkit")


class Timer:
    """Callbacks due at given times, each under a key; one thread calls them.

    Args:
        lock: The serving core's lock; every method named `..._locked` is called
            under it, and so is every callback.
        clock: The batcher's clock, in seconds (the times set are on it).
        name: The function's name, for the thread's name.
    """

    def __init__(self, lock: threading.RLock, clock: Clock, name: str) -> None:
        self._lock = lock
        self.cond = threading.Condition(lock)
        self.clock = clock
        self._name = name
        self._due: dict[Hashable, tuple[float, Callable[[], None]]] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False

    def set_locked(self, key: Hashable, at: float, callback: Callable[[], None]) -> None:
        """Under the lock: call `callback` at `at` (once), replacing what `key` had.

        Args:
            key: What the callback is for (a worker's call, a pass of the driver).
            at: When, on the clock.
            callback: Called under the lock, on the timer's thread. Nothing is
                set once the timer is stopped. When the thread cannot start
                (`can't start new thread`) it is logged, and nothing is called back
                until a later `set_locked` starts it (a batch runs unwatched meanwhile).
        """
        if self._stopped:
            return  # (closed: nothing is called any more)
        self._due[key] = (at, callback)
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

    def cancel_locked(self, key: Hashable) -> None:
        """Under the lock: `key`'s callback is no longer due (if it was)."""
        self._due.pop(key, None)

    def is_set(self, key: Hashable) -> bool:
        """Whether a callback is due under `key` (read under the lock)."""
        return key in self._due

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
        with self.cond:
            while not self._stopped:
                now = self.clock()
                for key, entry in list(self._due.items()):
                    # (a callback may have set or cancelled another key meanwhile)
                    if entry[0] <= now and self._due.get(key) is entry:
                        del self._due[key]
                        entry[1]()
                upcoming = min((at for at, _ in self._due.values()), default=None)
                self.cond.wait(None if upcoming is None else max(upcoming - self.clock(), 0.0))
