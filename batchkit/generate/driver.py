"""The driver of :class:`~batchkit.generate.ContinuousBatcher`: the loop that runs its steps.

A sync step function runs on one worker thread (started by the first submit), an
async one as a task on the event loop of the first submit. Between steps, under one
lock, the driver drops timed-out requests, schedules, and after the step applies its
tokens and wakes the callers whose requests moved. The batcher itself
(:mod:`batchkit.generate.batcher`) is the callers' side: submit, cancel, stats, close.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from batchkit.errors import BatcherClosed, RequestTimeout
from batchkit.generate.handle import GenerationHandle
from batchkit.generate.scheduler import Scheduler
from batchkit.generate.sequence import SeqStatus, Sequence, StepBatch

StepFn = Callable[[StepBatch], Any]


class StepDriver:
    """Runs the step function and applies its steps (a mixin of
    :class:`~batchkit.generate.batcher.ContinuousBatcher`, whose ``__init__`` sets the
    state below and says what each piece is for).

    Every method named ``*_locked`` expects the caller to hold ``_lock``.
    """

    step_fn: StepFn
    is_async: bool
    name: str
    clock: Callable[[], float]
    sched: Scheduler
    _lock: threading.Lock
    _work: threading.Condition
    _progress: threading.Condition
    _streamers: int
    _subscribers: int
    _closed: bool
    _thread: threading.Thread | None
    _loop: asyncio.AbstractEventLoop | None
    _task: asyncio.Task[None] | None
    _wakeup: asyncio.Event | None

    # -- starting and waking ------------------------------------------------------
    def _start_locked(self) -> None:
        """Start the driver on first use, or wake it."""
        if self.is_async:
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
                if self.sched._in_flight is not None:  # a step cut off with its old loop
                    self._fail_step_locked(self.sched._in_flight, self._driver_gone())
                self._loop, self._wakeup = loop, asyncio.Event()
                self._task = loop.create_task(self._arun())
            self._wake_loop()
        elif self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"batchkit-{self.name}", daemon=True
            )
            self._thread.start()
        else:
            self._work.notify()

    def _wake_loop(self) -> None:
        loop, event = self._loop, self._wakeup
        if loop is None or event is None or loop.is_closed():
            return
        if asyncio._get_running_loop() is loop:
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)

    # -- one step: schedule, then apply its outcome and answer the callers --------
    def _next_batch_locked(self) -> StepBatch | None:
        """Expire, then schedule; None when there is nothing to do.

        Should scheduling itself fail (a bug), every request fails with that error
        rather than wait for a driver that stopped.
        """
        try:
            for seq in self.sched.expire(self.clock()):
                self._finish_locked(
                    seq,
                    RequestTimeout(
                        f"{self.name}: request {seq.request_id} did not start within its timeout"
                    ),
                )
            if not self.sched.has_work:
                return None
            return self.sched.schedule()
        except Exception as exc:  # noqa: BLE001 - the driver must answer, not die
            self._abort_all_locked(exc)
            return None

    def _fail_step_locked(self, batch: StepBatch, error: BaseException) -> None:
        """The step of ``batch`` will never report: fail its sequences with ``error``."""
        self._apply_locked(batch, None, error)

    def _apply_locked(self, batch: StepBatch, output: Any, error: BaseException | None) -> None:
        """Apply a step's outcome and wake whoever waits on the sequences it moved."""
        if error is None:
            try:
                tokens = output if isinstance(output, list) else list(output)
                produced = self.sched.update(batch, tokens, self.clock())
            except Exception as exc:  # noqa: BLE001 - a bad result fails its step, not the driver
                error, produced = exc, []
                if self.sched._in_flight is batch:
                    self.sched.fail_step(batch)
        else:
            produced = []
            self.sched.fail_step(batch)
        if error is not None:
            for s in batch.seqs:
                if s.seq.finish_reason == "error":
                    self._finish_locked(s.seq, error)
        errored = self.sched.errored
        if errored:  # bad results of single sequences: only their callers fail
            for seq in errored:
                self._finish_locked(seq, seq.error)
            errored.clear()
        events: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        watch, finished = self._subscribers > 0, SeqStatus.FINISHED
        for seq in produced:
            if seq.status is finished:
                self._finish_locked(seq, None)
            elif watch and seq.handle._events:
                events.extend(seq.handle._events)
        if events:
            _set_events(events)
        if self._streamers:
            self._progress.notify_all()

    def _finish_locked(self, seq: Sequence, error: BaseException | None) -> None:
        """Answer ``seq``'s caller (``error``, or its tokens) unless it has its answer."""
        handle: GenerationHandle | None = seq.handle
        if handle is None or handle.done():
            return
        handle._error = error
        handle._done.release()
        if handle._events:
            _set_events(handle._events)
        if handle._streaming:
            self._progress.notify_all()

    def _abort_all_locked(self, error: BaseException | None = None) -> None:
        """Fail every waiting and running request (default: :class:`~batchkit.BatcherClosed`)."""
        if error is None:
            error = BatcherClosed(f"{self.name} closed before this request finished")
        for seq in self.sched.abort_all("error"):
            self._finish_locked(seq, error)
        self._work.notify_all()

    # -- the loops: a worker thread, or a task on the event loop ------------------
    def _run(self) -> None:
        """The worker thread: schedule, step (outside the lock), apply, repeat."""
        step_fn, lock = self.step_fn, self._lock
        with lock:
            while True:
                batch = self._next_batch_locked()
                if batch is None:
                    if self._closed:
                        self._work.notify_all()  # wake close()
                        return
                    self._work.wait()
                    continue
                lock.release()
                output: Any = None
                error: BaseException | None = None
                try:
                    output = step_fn(batch)
                except BaseException as exc:  # noqa: BLE001 - the worker must survive anything
                    error = exc
                finally:
                    lock.acquire()
                self._apply_locked(batch, output, error)

    async def _arun(self) -> None:
        """The event-loop task: the same cycle, awaiting the step function.

        Cancelled (its loop shutting down), it answers every request with
        :class:`~batchkit.BatcherClosed` instead of leaving them waiting; a later
        submit starts a new driver.
        """
        wakeup = self._wakeup
        assert wakeup is not None
        try:
            while True:
                with self._lock:
                    batch = self._next_batch_locked()
                    if batch is None:
                        if self._closed:
                            self._work.notify_all()
                            return
                        wakeup.clear()
                if batch is None:
                    await wakeup.wait()
                    continue
                output: Any = None
                error: BaseException | None = None
                try:
                    output = await self.step_fn(batch)
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:  # noqa: BLE001 - the loop task must survive anything
                    error = exc
                with self._lock:
                    self._apply_locked(batch, output, error)
                await asyncio.sleep(0)  # let callers and submitters on this loop run
        except asyncio.CancelledError:
            with self._lock:
                gone = self._driver_gone()
                if self.sched._in_flight is not None:
                    self._fail_step_locked(self.sched._in_flight, gone)
                self._abort_all_locked(gone)
            raise

    def _driver_gone(self) -> BatcherClosed:
        return BatcherClosed(
            f"{self.name}: the driver task was cancelled (its event loop shut down) before "
            "this request finished"
        )


def _set_events(events: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    """Set asyncio events, each on its own loop (directly when already there)."""
    here = asyncio._get_running_loop()
    for loop, event in events:
        if loop is here:
            event.set()
        else:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits there
                loop.call_soon_threadsafe(event.set)
