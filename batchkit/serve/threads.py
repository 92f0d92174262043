"""The driver for sync functions: `max_concurrent_batches` worker threads.

Each idle worker sleeps on one condition variable until an arrival, a finished
batch or the oldest request's max-wait expiry; there is no polling loop. Batches
run outside the lock, so callers keep enqueuing (and batches keep forming) while
the function runs. Thread callers block on their request; asyncio callers await a
future resolved on their own loop, so the event loop is never blocked.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from batchkit.errors import BatcherClosed
from batchkit.serve.core import ServingCore
from batchkit.serve.execute import BatchRun, Outcome, run_steps
from batchkit.serve.options import Options
from batchkit.serve.request import deliver
from batchkit.serve.scheduler import FormedBatch
from batchkit.serve.streaming import run_stream_sync
from batchkit.serve.timer import Alarm, Timer
from batchkit.serve.watchdog import Watchdog
from batchkit.usercode import run

log = logging.getLogger("batchkit")


class Worker:
    """One worker thread, and the batch it runs now (for the watchdog)."""

    __slots__ = ("thread", "batch", "abandoned", "expired")

    def __init__(self, expired: Callable[[Worker], None]) -> None:
        self.thread: threading.Thread | None = None
        self.batch: FormedBatch | None = None
        self.abandoned = False  # given up in a timed-out call: its late result is dropped
        # The watchdog's alarm for its call (`batch_timeout`): `expired(self)`.
        self.expired = Alarm(functools.partial(expired, self))


class ThreadDriver:
    """Runs a sync batch function on worker threads (started on first use).

    One worker per concurrent batch (`max_concurrent_batches`). With
    `batch_timeout`, a call that runs past it has its batch given up (its callers
    get `BatchTimeout`, its slot is freed) and its stuck thread abandoned and
    replaced, while at most `max_concurrent_batches` threads are stuck at once;
    past that bound nothing more is spawned and the function reports itself
    unhealthy (`stats().healthy`) until a stuck call returns (its thread then
    serves again).

    Args:
        fn: The sync batch function (or generator function).
        options: The function's validated options.
        name: The function's qualified name, for errors and thread names.
    """

    def __init__(self, fn: Callable[[Any], Any], options: Options, name: str) -> None:
        self.fn = fn
        self.core = core = ServingCore(options, name, self)
        self.cond = threading.Condition(core.lock)
        # Set on this driver's worker threads: a call or a close from inside the
        # function is told apart from one of another thread.
        self._on_worker = threading.local()
        self.workers: list[Worker] = []  # live workers (not stuck in a timed-out call)
        self.idle_workers = 0
        # Calls back while every worker runs a batch: the watchdog's deadlines, and a
        # latency target's pass when a waiting request becomes too late.
        self.timer = Timer(core.lock, core.clock, name)
        self.drop_pass = Alarm(self._drop_while_busy)
        self.watchdog: Watchdog | None = None
        timeout = options.batch_timeout
        if timeout is not None and not options.streaming:
            self.watchdog = Watchdog(self.timer, timeout)

    def check_loop_locked(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Before an enqueue: a call from inside the function, on its only worker,
        would wait for the batch it is part of: refuse it (any caller, thread or
        asyncio, on that thread)."""
        if getattr(self._on_worker, "serving", False) and self.core.max_concurrent_batches == 1:
            raise RuntimeError(
                f"{self.core.name} was called from inside its own batch function with "
                "max_concurrent_batches=1: the call would wait for the batch it is made "
                "from, forever (call the model directly, or allow more batches at once)"
            )

    def wake_locked(self) -> None:
        """Under the lock: something changed; wake an idle worker (starting the
        workers on first use)."""
        if not self.workers:
            self._start_workers_locked()
        if self.idle_workers:
            self.cond.notify()
        elif self.core.drops_while_busy and not self.timer.is_set(self.drop_pass):
            self._drop_while_busy()  # every worker may be running a batch

    def _drop_while_busy(self) -> None:
        """Under the lock, under a latency target, when every worker may be running a
        batch: answer the waiting requests that became too late, and have the timer
        look again when the next one does (nobody else passes before a batch ends, and
        a caller behind a long batch would hear only then, or at the next arrival)."""
        at = self.core.drop_while_busy_locked()
        if at is not None:
            self.timer.set_locked(self.drop_pass, at)

    def _start_workers_locked(self) -> None:
        """Start workers up to one per concurrent batch (none while unhealthy).

        A thread that cannot start (`can't start new thread`) is not counted: with no
        worker at all, what waits fails with `BatcherClosed` (caused by the error),
        and the next call tries again."""
        while self.core.readings.healthy and len(self.workers) < self.core.max_concurrent_batches:
            worker = Worker(self._expired)
            name = f"batchkit-{self.core.name}-{len(self.workers)}"
            worker.thread = threading.Thread(target=self._work, args=(worker,), name=name)
            worker.thread.daemon = True
            try:
                worker.thread.start()  # (it waits for the lock held here)
            except RuntimeError as exc:
                self._no_worker_started_locked(exc)
                return
            self.workers.append(worker)

    def _no_worker_started_locked(self, exc: RuntimeError) -> None:
        """A worker thread could not start: the running workers serve on; with none,
        nobody would ever serve what waits, so it fails now."""
        if self.workers:
            log.warning("batchkit: %s serves on fewer workers: %r", self.core.name, exc)
            return
        error = BatcherClosed(f"{self.core.name}: could not start a worker thread: {exc!r}")
        error.__cause__ = exc
        self.core.fail_all_locked(error)

    def settings_changed_locked(self) -> None:
        """Under the lock: `configure` changed the settings."""
        if self.workers:  # (none yet: the first call starts them)
            self._start_workers_locked()
        self.cond.notify_all()  # a larger size or limit may make a batch ready now

    def forked_locked(self) -> None:
        """In a child process just forked, under the lock: the parent's worker and
        watchdog threads are not here. The batches they ran fail (they run on in the
        parent only) and free their slots; the next call starts fresh workers."""
        core = self.core
        # The condition's waiters are the parent's idle workers: a notify would go to
        # them, and wake nobody here.
        self.cond = threading.Condition(core.lock)
        self.workers = []
        self.idle_workers = 0
        core.readings.abandoned_workers = 0
        core.readings.healthy = True
        self.timer.forked_locked()
        error = BatcherClosed(
            f"{core.name}: the process forked while this request's batch ran; it runs on "
            "in the parent process only"
        )
        deliver(core.answers.abandon_running_locked(error))

    def _work(self, worker: Worker) -> None:
        """One worker: take a batch, run and settle it, repeat; sleep when there is none."""
        core, cond, clock = self.core, self.cond, self.core.clock
        batch: FormedBatch | None = None
        self._on_worker.serving = True
        with cond:
            while True:
                if batch is None:
                    batch, wake_at, busy = core.next_batch_locked()
                    if busy and batch is not None and core.drops_while_busy:
                        self._drop_while_busy()
                if batch is None:
                    if core.closed and core.num_waiting == 0:
                        if core.drained:  # (a close from inside the function left it)
                            self.timer.stop_locked()
                        cond.notify_all()  # wake close() and the other workers
                        return
                    self.idle_workers += 1
                    cond.wait(None if wake_at is None else max(wake_at - clock(), 0.0))
                    self.idle_workers -= 1
                    continue
                batch, wake_at = self._serve(worker, batch)
                if worker.abandoned and not self._rejoin_locked(worker):
                    return

    def _serve(self, worker: Worker, batch: FormedBatch) -> tuple[FormedBatch | None, float | None]:
        """With the lock held: run `batch` outside it, settle it, answer its callers;
        the next batch, if one is ready. (A method of its own so that nothing of a
        finished batch, its outputs included, stays referenced while the worker idles.)"""
        cond, core = self.cond, self.core
        worker.batch = batch
        cond.release()
        try:
            run = self._run(batch, worker)
        finally:
            cond.acquire()
            worker.batch = None
        if worker.abandoned:
            return None, None  # its callers had their BatchTimeout: the late result is dropped
        done = core.answers.finish_locked(batch, run)
        # Take the next batch before waking this one's callers, and wake them outside
        # the lock: they call again at once and must not queue on it.
        following, wake_at, busy = core.next_batch_locked()
        if busy and following is not None and core.drops_while_busy:
            self._drop_while_busy()
        # Wake close(), the workers' exit, or an idle worker that can take a batch.
        if core.closed or (self.idle_workers and core.num_waiting):
            cond.notify_all()
        cond.release()
        try:
            deliver(done)
        finally:
            cond.acquire()
        return following, wake_at

    # -- the watchdog (batch_timeout) ----------------------------------------------
    def _expired(self, worker: Worker) -> None:
        """The watchdog's alarm, under the lock: `worker`'s call ran past the timeout."""
        batch, core = worker.batch, self.core
        if batch is None or worker.abandoned:
            return
        worker.abandoned = True
        self.workers.remove(worker)
        readings = core.readings
        readings.abandoned_workers += 1
        core.answers.batch_timed_out_locked()
        readings.healthy = readings.abandoned_workers <= core.max_concurrent_batches
        if core.is_running(batch):
            deliver(core.answers.abandon_locked(batch, core.answers.batch_timeout_error()))
        self._start_workers_locked()  # a replacement (none while unhealthy)
        self.cond.notify_all()  # the freed slot may start what waits

    def _rejoin_locked(self, worker: Worker) -> bool:
        """A stuck call returned: serve again if a worker is missing, else exit."""
        core, readings = self.core, self.core.readings
        readings.abandoned_workers -= 1
        readings.healthy = readings.abandoned_workers <= core.max_concurrent_batches
        worker.abandoned = False
        if core.closed or len(self.workers) >= core.max_concurrent_batches:
            return False
        self.workers.append(worker)
        return True

    def _run(self, batch: FormedBatch, worker: Worker) -> BatchRun:
        """Call the function as `run_steps` asks (parts too, if split); never raises.

        The worker survives anything a call raises (see `batchkit.usercode`: a
        `SystemExit` or `KeyboardInterrupt` reaches the callers as a
        `BatchInterrupted`). A call is watched when there is a `batch_timeout`; a worker
        abandoned by the watchdog stops after its late call returns.
        """
        core, fn, watchdog = self.core, self.fn, self.watchdog
        if core.options.streaming:
            return run_stream_sync(fn, batch.requests, core.options, core.name, core.clock)
        steps = run_steps(batch.requests, core.options, core.name)
        outcome: Outcome | None = None
        try:
            while True:
                argument = steps.send(outcome)  # type: ignore[arg-type]
                # Neither the last call's outcome nor its argument is kept while the
                # steps decide on a retry or the next call runs (see execute.py).
                outcome = None
                if watchdog is not None:
                    with self.cond:
                        watchdog.call_started_locked(worker.expired)
                outcome = run(fn, argument, core.name, "the batch function")  # never raises
                if watchdog is not None:
                    with self.cond:
                        watchdog.call_ended_locked(worker.expired)
                del argument
                if worker.abandoned:
                    steps.close()
                    return BatchRun(batch.requests, core.options)  # (dropped unread)
        except StopIteration as done:
            finished: BatchRun = done.value
            return finished

    # -- shutdown ------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Stop accepting, serve what is queued and running; after `timeout`, fail the rest.

        Waits for the worker threads to exit when everything was served. Called from
        inside the function (on one of its workers), it returns at once: what is
        queued and running, the calling batch too, is served after it returns.

        Args:
            timeout: Seconds to wait; then whatever is unanswered fails with
                `BatcherClosed`. None waits for everything. (Unused from inside the
                function.)
        """
        core = self.core
        with self.cond:
            core.close_locked()
            self.cond.notify_all()
            if getattr(self._on_worker, "serving", False):
                return  # waiting here would wait for this very call
            finished = self.cond.wait_for(lambda: core.drained, timeout)
            if not finished:
                core.fail_all_locked(core.answers.closed_error())
                self.cond.notify_all()
            self.timer.stop_locked()
        if finished:
            for worker in list(self.workers):
                if worker.thread is not None and worker.thread is not threading.current_thread():
                    worker.thread.join()
        self.timer.join()

    def close_nowait(self) -> None:
        """Stop accepting and return at once: what is queued and running is served,
        then the workers exit (and the timer, once nothing runs)."""
        with self.cond:
            self.core.close_locked()
            if not self.workers:  # none started: nothing to serve, nobody to stop it
                self.timer.stop_locked()
            self.cond.notify_all()

    async def aclose(self, timeout: float | None = None) -> None:
        """`close` without blocking the event loop (it runs in the loop's executor).

        Args:
            timeout: Seconds to wait; then whatever is unanswered fails with
                `BatcherClosed`. None waits for everything.
        """
        await asyncio.get_running_loop().run_in_executor(None, self.close, timeout)
