"""A bound on how long one call of a sync batch function may run (`batch_timeout`).

A call cannot be interrupted from outside its thread, so the watchdog does not try: a
call past its deadline is reported (`expired`, under the lock), and the driver gives
its batch up and replaces the stuck thread. One watchdog thread serves every worker of
a function; it sleeps until the earliest deadline, and exits on `stop_locked`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

from batchkit.serve.options import Clock


class Watchdog:
    """Deadlines of the calls running now, and a thread that reports the late ones.

    The thread starts with the first watched call.

    Args:
        lock: The serving core's lock; every method named `..._locked` is called
            under it, and so is `expired`.
        clock: The batcher's clock, in seconds.
        timeout: Seconds one call may run (`batch_timeout`).
        expired: Called under the lock with a call that ran past its deadline (once;
            it is then no longer watched).
        name: The function's name, for the thread's name.
    """

    def __init__(
        self,
        lock: threading.RLock,
        clock: Clock,
        timeout: float,
        expired: Callable[[Hashable], None],
        name: str,
    ) -> None:
        self.cond = threading.Condition(lock)
        self.clock = clock
        self.timeout = timeout
        self._expired = expired
        self._name = name
        self._deadlines: dict[Hashable, float] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False

    def call_started_locked(self, call: Hashable) -> None:
        """Under the lock: `call` starts now and must end within the timeout.

        Args:
            call: What identifies the call (the worker running it).
        """
        self._deadlines[call] = self.clock() + self.timeout
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name=f"batchkit-{self._name}-watchdog", daemon=True
            )
            self._thread.start()
        self.cond.notify()

    def call_ended_locked(self, call: Hashable) -> None:
        """Under the lock: `call` returned (in time or not).

        Args:
            call: What `call_started_locked` was given.
        """
        self._deadlines.pop(call, None)

    def stop_locked(self) -> None:
        """Under the lock: the function is closed; the watchdog thread exits."""
        self._stopped = True
        self.cond.notify()

    def forked_locked(self) -> None:
        """Under the lock, in a child process just forked: the watchdog thread is not
        here, nor the calls it watched; the next watched call starts a new thread."""
        self._thread = None
        self._deadlines.clear()

    def join(self) -> None:
        """Wait for the watchdog thread to exit (after `stop_locked`)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        with self.cond:
            while not self._stopped:
                now = self.clock()
                for call, deadline in list(self._deadlines.items()):
                    if deadline <= now:
                        del self._deadlines[call]
                        self._expired(call)
                upcoming = min(self._deadlines.values(), default=None)
                self.cond.wait(None if upcoming is None else max(upcoming - self.clock(), 0.0))
