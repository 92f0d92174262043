"""The runtime for async functions: everything on one event loop, no threads.

Arrivals in the same loop iteration coalesce into one scheduling pass (scheduled
with ``call_soon``), so a burst of concurrent callers forms one batch; the max-wait
expiry is a single ``call_later`` timer. Batches run as tasks, at most
``max_concurrent_batches`` at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from batchkit.errors import BatcherClosed
from batchkit.serve.recovery import BatchRun
from batchkit.serve.request import deliver
from batchkit.serve.runtime import Options, Runtime, closed_error
from batchkit.serve.scheduler import FormedBatch


class LoopRuntime(Runtime):
    """Runs an async batch function on the event loop of its callers."""

    def __init__(self, fn: Callable[[Any], Any], options: Options, name: str) -> None:
        super().__init__(fn, options, name)
        self.serves_one_loop = True
        # _poll_due (see Runtime) is set here while a pump is scheduled, or while every
        # slot is busy (the batch that ends next polls): arrivals then skip _wake_locked.
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._drained: asyncio.Event | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve callers on ``loop`` (refused while busy on another loop)."""
        if self.loop is loop:
            return
        with self.lock:
            old = self.loop
            if old is not None and old.is_closed() and not self.sched.drained:
                # Its batches will never finish: answer their callers, free their slots.
                self.fail_all_locked(closed_error(self.name))
                for batch in list(self.sched.running.values()):
                    self.abandon_locked(batch, closed_error(self.name))
            # While the old loop runs, its callers are admitted without the lock (see
            # _owner_loop), so it is never left then, even when idle.
            if old is not None and not old.is_closed():
                if old.is_running():
                    raise RuntimeError(
                        f"{self.name} serves another event loop, which is still running; an "
                        "async batched function serves one loop at a time"
                    )
                if not self.sched.drained:
                    raise RuntimeError(
                        f"{self.name} is busy on another event loop; an async batched "
                        "function serves one loop at a time"
                    )
            self.loop = loop
            self._owner_loop = loop if self._arrive is not None and not self.closed else None
            self._poll_due = False
            self._timer = None
            self._drained = None

    def _wake_locked(self) -> None:
        if self._poll_due or self.loop is None:  # the common case: one attribute read
            return
        if self.sched.in_flight >= self.sched.max_concurrent_batches and not self.closed:
            return  # every slot is busy: the batch that ends next polls the scheduler
        if asyncio._get_running_loop() is self.loop:
            self.loop.call_soon(self._pump)  # no self-pipe write from the loop's own thread
        else:
            self.loop.call_soon_threadsafe(self._pump)
        self._poll_due = True  # (only once the pump is surely scheduled)

    def _pump(self) -> None:
        """Start every batch that is ready; arm the timer for the next max-wait expiry."""
        ready: list[FormedBatch] = []
        try:
            with self.lock:
                loop = self.loop
                if loop is None or asyncio._get_running_loop() is not loop:
                    return  # a stale pump or timer of a loop this batcher no longer serves
                try:
                    while True:
                        batch, wake_at = self.sched.poll(self.clock())
                        if batch is None:
                            break
                        ready.append(batch)
                finally:
                    # Busy slots stay busy until a batch ends, and its _run polls then;
                    # that holds at every await, since only the loop's own thread
                    # enqueues here. (Set even if polling raised: a stuck flag would
                    # silence every arrival.)
                    self._poll_due = self.sched.in_flight >= self.sched.max_concurrent_batches
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                if wake_at is not None:
                    self._timer = loop.call_later(max(wake_at - self.clock(), 0.0), self._pump)
                self._check_drained_locked()
        finally:
            # Started outside the lock: with an eager task factory (Python 3.12+) the
            # function's first step runs inside create_task, and must not run under
            # it. (Also when a later poll raised: these hold their slots already.)
            failure: BaseException | None = None
            for batch in ready:
                assert loop is not None  # (a batch was polled: the loop was checked)
                try:
                    self._start(loop, batch)
                except BaseException as exc:  # noqa: BLE001 - e.g. a user's task factory
                    self._not_started(batch, exc)
                    failure = failure or exc
            if failure is not None:
                raise failure  # (to the loop's exception handler, once all are settled)

    def _start(self, loop: asyncio.AbstractEventLoop, batch: FormedBatch) -> None:
        """A task runs ``batch`` (and the batches ready as it ends). ``holding`` names the
        batch it owns, so that a task that ends early still settles it (see _ended)."""
        holding: list[FormedBatch | None] = [batch]
        coro = self._run(holding, loop)
        try:
            task = loop.create_task(coro)
        except BaseException:
            coro.close()  # never started: no "never awaited" warning
            raise
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._ended(t, holding))

    def _not_started(self, batch: FormedBatch, exc: BaseException) -> None:
        """No task could be made for ``batch``: fail its callers, free its slot, and poll
        again (the slot may be what the waiting requests need)."""
        error = BatcherClosed(f"{self.name}: could not start a task for this batch: {exc!r}")
        error.__cause__ = exc
        with self.lock:
            abandoned = self.abandon_locked(batch, error)
            self._poll_due = False
            self._wake_locked()
        deliver(abandoned)

    async def _run(
        self, holding: list[FormedBatch | None], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Run batches back to back in this task while one is ready as the last ends."""
        batch = holding[0]
        while batch is not None:
            run = await self._execute(batch)
            # Take the next batch before waking this one's callers: its call starts in this
            # same step, so the accelerator is not left idle while the callers resume.
            with self.lock:
                answered = self.finish_locked(batch, run, on_loop=loop)
                batch, _ = self.sched.poll(self.clock())
                holding[0] = batch
            if answered:  # those not resolved already (failed, or another loop's)
                deliver(answered)
        self._pump()  # re-arm the max-wait timer; start batches that became ready

    def _ended(self, task: asyncio.Task[None], holding: list[FormedBatch | None]) -> None:
        """A batch task is done. If it ended holding a batch (cancelled, even before its
        first step, or a bug), answer that batch's callers and free its slot."""
        self._tasks.discard(task)
        batch = holding[0]
        if batch is None:
            return
        holding[0] = None
        with self.lock:
            if id(batch) not in self.sched.running:
                return  # settled already (e.g. by a rebind after its loop closed)
            reason = "was cancelled" if task.cancelled() else f"failed: {task.exception()!r}"
            error = BatcherClosed(f"{self.name}: the task running this batch {reason}")
            abandoned = self.abandon_locked(batch, error)
        deliver(abandoned)
        self._pump()  # its slot is free: start what waits (a no-op off the loop)

    async def _execute(self, batch: FormedBatch) -> BatchRun:
        """Await the function as :meth:`run_steps` asks (parts too, if split).

        A failing call is recorded, never raised; a cancellation of this task is raised
        (its batch is then settled by _ended).
        """
        steps = self.run_steps(batch)
        try:
            argument = next(steps)
            while True:
                try:
                    reply: tuple[bool, Any] = (True, await self.fn(argument))
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:  # noqa: BLE001 - a failing batch must not kill the loop
                    reply = (False, exc)
                argument = steps.send(reply)
        except StopIteration as done:
            run: BatchRun = done.value
            return run

    def _check_drained_locked(self) -> None:
        if self.closed and self.sched.drained and self._drained is not None:
            self._drained.set()

    # -- shutdown ------------------------------------------------------------
    async def aclose(self, timeout: float | None = None) -> None:
        """Stop accepting, serve what is queued and running; after ``timeout``, fail the rest."""
        loop = asyncio.get_running_loop()
        with self.lock:
            if self.loop is not None and self.loop is not loop and not self.loop.is_closed():
                raise RuntimeError(f"{self.name}: aclose() must run on the loop it serves")
            self.bind(loop)  # a closed previous loop's leftovers are answered here
            self.closed = self.sched.closing = True
            self._owner_loop = None  # later callers take the checked path: BatcherClosed
            self.room.wake_all()  # blocked callers see BatcherClosed
            if self._drained is None:  # shared by concurrent aclose() calls
                self._drained = asyncio.Event()
            drained = self._drained
            if self.sched.drained:
                drained.set()
                return
            self._wake_locked()
        try:
            await asyncio.wait_for(drained.wait(), timeout)
        except asyncio.TimeoutError:
            with self.lock:
                self.fail_all_locked(closed_error(self.name))

    def close(self, timeout: float | None = None) -> None:
        """Close from a thread. From inside the loop, use ``await aclose()`` instead."""
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running():
            with self.lock:  # no loop will ever run what is left: answer it now
                self.closed = self.sched.closing = True
                self._owner_loop = None
                self.fail_all_locked(closed_error(self.name))
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError(f"{self.name}: use 'await aclose()' inside the event loop")
        asyncio.run_coroutine_threadsafe(self.aclose(timeout), loop).result()
