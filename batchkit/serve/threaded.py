"""The runtime for sync functions: ``max_concurrent_batches`` worker threads.

Each idle worker sleeps on one condition variable until an arrival, a finished
batch or the oldest request's max-wait expiry; there is no polling loop. Batches
run outside the lock, so callers keep enqueuing (and batches keep forming) while
the function runs. Thread callers block on their request; asyncio callers await a
future resolved on their own loop, so the event loop is never blocked.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from batchkit.serve.recovery import BatchRun
from batchkit.serve.request import deliver
from batchkit.serve.runtime import Options, Runtime, closed_error
from batchkit.serve.scheduler import FormedBatch


class ThreadRuntime(Runtime):
    """Runs a sync batch function on worker threads (started on first use)."""

    def __init__(self, fn: Callable[[Any], Any], options: Options, name: str) -> None:
        super().__init__(fn, options, name)
        self.cond = threading.Condition(self.lock)
        self.workers: list[threading.Thread] = []
        self.idle_workers = 0

    def _wake_locked(self) -> None:
        if not self.workers:
            self._start_workers_locked()
        if self.idle_workers:
            self.cond.notify()

    def _start_workers_locked(self) -> None:
        for i in range(self.options.max_concurrent_batches):
            worker = threading.Thread(
                target=self._work, name=f"batchkit-{self.name}-{i}", daemon=True
            )
            self.workers.append(worker)
            worker.start()

    def _work(self) -> None:
        sched, cond, clock = self.sched, self.cond, self.clock
        batch: FormedBatch | None = None
        with cond:
            while True:
                if batch is None:
                    batch, wake_at = sched.poll(clock())
                if batch is None:
                    if self.closed and sched.num_waiting == 0:
                        cond.notify_all()  # wake close() and the other workers
                        return
                    self.idle_workers += 1
                    cond.wait(None if wake_at is None else max(wake_at - clock(), 0.0))
                    self.idle_workers -= 1
                    continue
                cond.release()
                try:
                    run = self._run(batch)
                finally:
                    cond.acquire()
                done = self.finish_locked(batch, run)
                # Take the next batch before waking this one's callers, and wake them
                # outside the lock: they call again at once and must not queue on it.
                batch, wake_at = sched.poll(clock())
                if sched.drained or (self.idle_workers and sched.num_waiting):
                    cond.notify_all()
                cond.release()
                try:
                    deliver(done)
                finally:
                    cond.acquire()

    def _run(self, batch: FormedBatch) -> BatchRun:
        """Call the function as :meth:`run_steps` asks (parts too, if split); never raises."""
        steps = self.run_steps(batch)
        try:
            argument = next(steps)
            while True:
                try:
                    reply: tuple[bool, Any] = (True, self.fn(argument))
                except BaseException as exc:  # noqa: BLE001 - the worker must survive anything
                    reply = (False, exc)
                argument = steps.send(reply)
        except StopIteration as done:
            run: BatchRun = done.value
            return run

    # -- callers -----------------------------------------------------------
    def call(self, item: Any, priority: int, timeout: float | None) -> Any:
        """One item from a thread: block until its result (or error)."""
        req = self.make_request(item, priority, None)
        if self.room_mode_block:
            started = time.monotonic()
            self.submit_blocking(req, timeout)
            left = None if timeout is None else max(timeout - (time.monotonic() - started), 0.0)
        else:
            self.submit(req)
            left = timeout
        if not req.wait(left):
            assert timeout is not None
            if self.give_up(req, self.timeout_error(timeout), timed_out=True):
                raise req.error  # type: ignore[misc]
            req.wait(None)  # it started running: its result is on the way
        return req.outcome()

    # -- shutdown ------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Stop accepting, serve what is queued and running; after ``timeout``, fail the rest."""
        with self.cond:
            self.closed = self.sched.closing = True
            self.room.wake_all()  # blocked callers see BatcherClosed
            self.cond.notify_all()
            finished = self.cond.wait_for(lambda: self.sched.drained, timeout)
            if not finished:
                self.fail_all_locked(closed_error(self.name))
                self.cond.notify_all()
        if finished:
            for worker in self.workers:
                if worker is not threading.current_thread():
                    worker.join()

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close` without blocking the event loop."""
        await asyncio.get_running_loop().run_in_executor(None, self.close, timeout)
