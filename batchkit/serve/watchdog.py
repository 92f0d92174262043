"""A bound on how long one call of a sync batch function may run (`batch_timeout`).

A call cannot be interrupted from outside its thread, so the watchdog does not try: a
call past its deadline is reported (its alarm, under the lock), and the driver gives
its batch up and replaces the stuck thread. The function's one timer thread (see
`batchkit.serve.timer`) watches every worker's call.
"""

from __future__ import annotations

from batchkit.serve.timer import Alarm, Timer


class Watchdog:
    """Deadlines of the calls running now, reported late by the function's timer.

    Args:
        timer: The function's timer (the serving core's lock and clock); every
            method named `..._locked` is called under that lock.
        timeout: Seconds one call may run (`batch_timeout`).
    """

    def __init__(self, timer: Timer, timeout: float) -> None:
        self.timer = timer
        self.timeout = timeout

    def call_started_locked(self, expired: Alarm) -> None:
        """Under the lock: a call starts now and must end within the timeout.

        Args:
            expired: The call's alarm (of `timer`): called, once, if the call runs
                past its deadline.
        """
        self.timer.set_locked(expired, self.timer.clock() + self.timeout)

    def call_ended_locked(self, expired: Alarm) -> None:
        """Under the lock: the call returned (in time or not).

        Args:
            expired: What `call_started_locked` was given.
        """
        self.timer.cancel_locked(expired)
