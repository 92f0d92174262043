"""A bound on how long one call of a sync batch function may run (`batch_timeout`).

A call cannot be interrupted from outside its thread, so the watchdog does not try: a
call past its deadline is reported (`expired`, under the lock), and the driver gives
its batch up and replaces the stuck thread. The function's one timer thread (see
`batchkit.serve.timer`) watches every worker's call.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from batchkit.serve.timer import Timer


class Watchdog:
    """Deadlines of the calls running now, reported late by the function's timer.

    Args:
        timer: The function's timer (the serving core's lock and clock); every
            method named `..._locked` is called under that lock, and so is `expired`.
        timeout: Seconds one call may run (`batch_timeout`).
        expired: Called under the lock with a call that ran past its deadline (once;
            it is then no longer watched).
    """

    def __init__(self, timer: Timer, timeout: float, expired: Callable[[Hashable], None]) -> None:
        self.timer = timer
        self.timeout = timeout
        self._expired = expired

    def call_started_locked(self, call: Hashable) -> None:
        """Under the lock: `call` starts now and must end within the timeout.

        Args:
            call: What identifies the call (the worker running it).
        """
        timer = self.timer
        timer.set_locked(call, timer.clock() + self.timeout, lambda: self._expired(call))

    def call_ended_locked(self, call: Hashable) -> None:
        """Under the lock: `call` returned (in time or not).

        Args:
            call: What `call_started_locked` was given.
        """
        self.timer.cancel_locked(call)
