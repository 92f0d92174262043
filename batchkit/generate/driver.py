"""The drivers of `ContinuousBatcher`: the loops that run its steps.

A sync step function runs on one worker thread (`StepThreadDriver`, started by the
first submit), an async one as a task on the event loop of the first submit
(`StepLoopDriver`). Between steps, under the batcher's lock, a driver drops
timed-out requests, schedules, and after the step applies its tokens and wakes the
callers whose requests moved. What both share (applying a step, answering callers,
draining on close) is `StepDriver`'s. The batcher
(`batchkit.generate.batcher`) is the callers' side and holds one driver.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from batchkit.errors import BatcherClosed, RequestTimeout
from batchkit.generate.observe import StepObserver
from batchkit.generate.scheduler import StepScheduler
from batchkit.generate.sequence import SeqStatus, Sequence, StepBatch
from batchkit.generate.waiters import Waiters
from batchkit.loops import call_on_loop, on_loop_thread
from batchkit.usercode import arun, contained, run

StepFn = Callable[[StepBatch], Any]


class StepDriver:
    """Applies steps and answers callers; the thread and event-loop drivers add the loop.

    Every method named ``*_locked`` expects the caller to hold ``lock`` (the
    ``waiters``' lock, which guards the scheduler too).

    Args:
        step_fn: The batcher's step function.
        sched: The batcher's scheduler.
        waiters: The batcher's lock and waiting callers.
        name: The batcher's name, for errors and thread names.
        clock: Seconds, monotonic (timeouts, latencies).
        observer: The batcher's listeners.
    """

    def __init__(
        self,
        step_fn: StepFn,
        sched: StepScheduler,
        waiters: Waiters,
        *,
        name: str,
        clock: Callable[[], float],
        observer: StepObserver,
    ) -> None:
        self.step_fn = step_fn
        self.sched = sched
        self.waiters = waiters
        self.name = name
        self.clock = clock
        self.observer = observer
        self.lock = waiters.lock
        # The driver waits here for requests, close() for the drain.
        self.work = threading.Condition(self.lock)
        self.closed = False

    # -- what each driver does its own way -------------------------------------------
    def start_locked(self) -> None:
        """Start the driver on first use, or wake it: there is a new request."""
        raise NotImplementedError

    def _wake_locked(self) -> None:
        """Wake the driver (closing: it drains, then stops)."""
        raise NotImplementedError

    def _started(self) -> bool:
        """Whether a driver was started (close() then waits for it to drain)."""
        raise NotImplementedError

    def close(self, timeout: float | None) -> None:
        """What `ContinuousBatcher.close` does.

        Args:
            timeout: Seconds to wait for the requests to finish; then the unfinished
                ones fail with `BatcherClosed`. None: wait for all of them.
        """
        self._drain(timeout)

    async def aclose(self, timeout: float | None) -> None:
        """What `ContinuousBatcher.aclose` does.

        Args:
            timeout: Seconds to wait for the requests to finish; then the unfinished
                ones fail with `BatcherClosed`. None: wait for all of them.
        """
        await asyncio.get_running_loop().run_in_executor(None, self.close, timeout)

    # -- shared: closing, cancelling ---------------------------------------------------
    def _drain(self, timeout: float | None) -> None:
        """Close; wait until every request is answered, failing what is left after
        ``timeout`` seconds (at once if no driver runs) with BatcherClosed."""
        with self.lock:
            self.closed = True
            self._wake_locked()
            idle = not self._started()
            finished = idle or self.work.wait_for(lambda: not self.sched.has_work, timeout)
            if not finished or (idle and self.sched.has_work):
                self.abort_all_locked()

    def _stop_if_closed_locked(self) -> bool:
        """Nothing to do: True if closed (the driver stops; close() is woken)."""
        if self.closed:
            self.work.notify_all()
        return self.closed

    def cancel(self, seq: Sequence) -> bool:
        """Cancel ``seq``'s request (any thread); False if it had finished already.

        Args:
            seq: The request's sequence.
        """
        with self.lock:
            if not self.sched.abort(seq, "cancelled"):
                return False
            self.finish_locked(seq, None)
            self.work.notify()
            return True

    # -- one step: schedule, then apply its outcome and answer the callers --------
    def next_batch_locked(self) -> StepBatch | None:
        """Expire, then schedule; None when there is nothing to do.

        Should scheduling itself fail (a bug), every request fails with that error
        rather than wait for a driver that stopped.
        """
        try:
            for seq in self.sched.expire(self.clock()):
                self.finish_locked(
                    seq,
                    RequestTimeout(
                        f"{self.name}: request {seq.request_id} did not start within its timeout"
                    ),
                )
            if not self.sched.has_work:
                return None
            batch = self.sched.schedule()
        except Exception as exc:  # noqa: BLE001 - the driver must answer, not die
            self.abort_all_locked(exc)
            return None
        if self.observer.active:
            self.observer.scheduled(self.sched.started_now, self.clock())
        return batch

    def fail_step_locked(self, batch: StepBatch, error: BaseException) -> None:
        """The step of ``batch`` will never report: fail its sequences with ``error``.

        Args:
            batch: The step's batch.
            error: What their callers get raised.
        """
        self.apply_locked(batch, None, error)

    def apply_locked(self, batch: StepBatch, output: Any, error: BaseException | None) -> None:
        """Apply a step's outcome and wake whoever waits on the sequences it moved.

        Args:
            batch: The step's batch.
            output: What the step function returned (ignored when ``error`` is given).
            error: What the step function raised (as `contained` hands it on), or None.
        """
        sched = self.sched
        now = self.clock()
        if error is None:
            try:
                tokens = output if isinstance(output, list) else list(output)
                produced = sched.update(batch, tokens, now)
            except BaseException as exc:  # noqa: BLE001 - a bad result fails its step, not the driver
                error, produced = contained(exc, self.name, "the step function's result"), []
                if sched.in_flight is batch:
                    sched.fail_step(batch)
        else:
            produced = []
            sched.fail_step(batch)
        if error is not None:
            for s in batch.requests:
                if s.seq.finish_reason == "error":
                    self.finish_locked(s.seq, error)
        for seq in sched.take_errored():  # bad results of single sequences: only theirs fail
            self.finish_locked(seq, seq.error)
        if self.observer.active:
            self.observer.stepped(batch, produced, now)
        finished = SeqStatus.FINISHED
        for seq in produced:
            if seq.status is finished:
                self.finish_locked(seq, None)
        waiters = self.waiters
        if waiters.subscribers:
            waiters.wake_subscribers(
                s.outcome for s in produced if s.status is not finished and s.outcome is not None
            )
        waiters.wake_streamers()

    def finish_locked(self, seq: Sequence, error: BaseException | None) -> None:
        """Answer ``seq``'s caller (``error``, or its tokens) unless it has its answer.

        Args:
            seq: A finished sequence.
            error: What its caller gets raised; None: its tokens.
        """
        outcome = seq.outcome
        if outcome is not None and outcome.settle(error) and self.observer.active:
            self.observer.finished(seq, self.clock())

    def abort_all_locked(self, error: BaseException | None = None) -> None:
        """Fail every waiting and running request.

        Args:
            error: What their callers get raised; None: `BatcherClosed`.
        """
        if error is None:
            error = BatcherClosed(f"{self.name} closed before this request finished")
        for seq in self.sched.abort_all("error"):
            self.finish_locked(seq, error)
        self.work.notify_all()


class StepThreadDriver(StepDriver):
    """A sync step function's driver: one worker thread, started by the first request.

    Args:
        *args: `StepDriver`'s arguments.
        **kwargs: `StepDriver`'s keyword arguments.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._thread: threading.Thread | None = None

    def start_locked(self) -> None:
        """Start the worker thread on first use, or wake it."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"batchkit-{self.name}", daemon=True
            )
            self._thread.start()
        else:
            self.work.notify()

    def _wake_locked(self) -> None:
        self.work.notify_all()

    def _started(self) -> bool:
        return self._thread is not None

    def close(self, timeout: float | None) -> None:
        """Drain and stop; from the step function itself (the worker thread), only mark
        the batcher closed: the worker drains after this step.

        Args:
            timeout: Seconds to wait for the requests to finish; then the unfinished
                ones fail with `BatcherClosed`. None: wait for all of them.
        """
        thread = self._thread
        if thread is threading.current_thread():
            with self.lock:
                self.closed = True
            return
        self._drain(timeout)
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        """The worker thread: schedule, step (outside the lock), apply, repeat."""
        step_fn, lock = self.step_fn, self.lock
        with lock:
            while True:
                batch = self.next_batch_locked()
                if batch is None:
                    if self._stop_if_closed_locked():
                        return
                    self.work.wait()
                    continue
                lock.release()
                ok, value = run(step_fn, batch, self.name, "the step function")  # never raises
                lock.acquire()
                if ok:
                    self.apply_locked(batch, value, None)
                else:
                    self.apply_locked(batch, None, value)


class StepLoopDriver(StepDriver):
    """An async step function's driver: a task on the event loop of the first request
    (a new one on the caller's loop if that loop closed or cancelled it).

    Args:
        *args: `StepDriver`'s arguments.
        **kwargs: `StepDriver`'s keyword arguments.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None

    def start_locked(self) -> None:
        """Start the driver task on first use (or after its loop went), or wake it."""
        task, loop = self._task, self._loop
        if task is None or task.done() or loop is None or loop.is_closed():
            # No driver, or one that will never run again (its loop closed or it was
            # cancelled): start one on this caller's loop.
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError(
                    f"{self.name}: an async step function runs on an event loop; "
                    "submit the first request from a coroutine"
                ) from None
            cut_off = self.sched.in_flight  # a step cut off with its old loop
            if cut_off is not None:
                self.fail_step_locked(cut_off, self._driver_gone())
            self._loop, self._wakeup = loop, asyncio.Event()
            self._task = loop.create_task(self._run())
        self._wake_locked()

    def _wake_locked(self) -> None:
        loop, event = self._loop, self._wakeup
        if loop is not None and event is not None:
            call_on_loop(loop, event.set)  # (a closed loop: no driver left to wake)

    def _started(self) -> bool:
        return self._task is not None

    def close(self, timeout: float | None) -> None:
        """Drain and stop, from outside the driver's loop (blocking it would deadlock).

        Args:
            timeout: Seconds to wait for the requests to finish; then the unfinished
                ones fail with `BatcherClosed`. None: wait for all of them.
        """
        if on_loop_thread(self._loop):
            raise RuntimeError(f"{self.name}: use 'await aclose()' inside the event loop")
        self._drain(timeout)

    async def aclose(self, timeout: float | None) -> None:
        """Drain and stop without blocking the loop; from the step function itself, only
        mark the batcher closed (the driver drains after this step).

        Args:
            timeout: Seconds to wait for the requests to finish; then the unfinished
                ones fail with `BatcherClosed`. None: wait for all of them.
        """
        task = self._task
        if task is None:
            await super().aclose(timeout)
            return
        with self.lock:
            self.closed = True
            self._wake_locked()
        if asyncio.current_task() is task:
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            with self.lock:
                self.abort_all_locked()

    async def _run(self) -> None:
        """The driver task: the thread's cycle, awaiting the step function.

        Cancelled (its loop shutting down), it answers every request with
        `BatcherClosed` instead of leaving them waiting; a later
        submit starts a new driver.
        """
        wakeup = self._wakeup
        assert wakeup is not None
        try:
            while True:
                with self.lock:
                    batch = self.next_batch_locked()
                    if batch is None:
                        if self._stop_if_closed_locked():
                            return
                        wakeup.clear()
                if batch is None:
                    await wakeup.wait()
                    continue
                # (raises only this task's own cancellation)
                ok, value = await arun(self.step_fn, batch, self.name, "the step function")
                with self.lock:
                    if ok:
                        self.apply_locked(batch, value, None)
                    else:
                        self.apply_locked(batch, None, value)
                await asyncio.sleep(0)  # let callers and submitters on this loop run
        except asyncio.CancelledError:
            with self.lock:
                gone = self._driver_gone()
                cut_off = self.sched.in_flight
                if cut_off is not None:
                    self.fail_step_locked(cut_off, gone)
                self.abort_all_locked(gone)
            raise

    def _driver_gone(self) -> BatcherClosed:
        return BatcherClosed(
            f"{self.name}: the driver task was cancelled (its event loop shut down) before "
            "this request finished"
        )
