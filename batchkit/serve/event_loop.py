"""The driver for async functions: everything on one event loop, no threads.

Arrivals in the same loop iteration coalesce into one scheduling pass (scheduled
with `call_soon`), so a burst of concurrent callers forms one batch; the max-wait
expiry is a single `call_later` timer. Batches run as tasks, at most
`max_concurrent_batches` at a time. An async function serves one loop at a time
(its callers'); a batcher idle on a finished loop moves to the next one.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from batchkit.errors import BatcherClosed
from batchkit.loops import on_loop_thread, schedule_on_loop
from batchkit.serve.core import ServingCore
from batchkit.serve.execute import BatchRun, Outcome, run_steps
from batchkit.serve.options import Options
from batchkit.serve.request import deliver
from batchkit.serve.scheduler import FormedBatch
from batchkit.serve.streaming import run_stream_async
from batchkit.usercode import arun

# The driver whose batch the current task runs (the function's own code, and tasks it
# starts, inherit it): a call or a close from inside the function is told apart.
_RUNNING_BATCH_OF: contextvars.ContextVar[LoopDriver | None] = contextvars.ContextVar(
    "batchkit_running_batch_of", default=None
)


async def call_async_within(
    fn: Callable[[Any], Awaitable[Any]],
    argument: Any,
    timeout: float,
    expired: BaseException,
    name: str,
) -> Outcome:
    """Await `fn(argument)`, cancelled after `timeout` seconds; what it raises is
    handled as `batchkit.usercode.arun` does.

    Args:
        fn: The async batch function.
        argument: The batch, as collated.
        timeout: Seconds the call may run.
        expired: The outcome's error when it ran past `timeout`.
        name: The function's name, for errors.

    Returns:
        `(True, output)`, `(False, the error its requests get)`, or `(False,
        expired)` once it is cancelled.

    Raises:
        asyncio.CancelledError: This task was cancelled (or the function raised it).
    """
    call = asyncio.ensure_future(arun(fn, argument, name, "the batch function"))
    try:
        done, _ = await asyncio.wait({call}, timeout=timeout)
    except asyncio.CancelledError:
        call.cancel()
        raise
    if not done:
        call.cancel()  # its batch is given up now; the call unwinds on its own
        return False, expired
    return call.result()  # (a CancelledError it raised is taken as this task's: see arun)


class LoopDriver:
    """Runs an async batch function on the event loop of its callers.

    One loop at a time: the first caller's loop is bound. A caller on another loop
    is refused while the bound loop runs, or is stopped with work left; otherwise
    the driver moves to the caller's loop (a closed loop's leftovers are answered
    with `BatcherClosed`).

    Args:
        fn: The async batch function (or async generator function).
        options: The function's validated options.
        name: The function's qualified name, for errors and events.
    """

    def __init__(self, fn: Callable[[Any], Awaitable[Any]], options: Options, name: str) -> None:
        self.fn = fn
        self.core = ServingCore(options, name, self)
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop it serves
        # A pump is scheduled, or every slot is busy (the batch that ends next pumps):
        # an arrival need not schedule one, and a burst of callers shares one pass.
        self._pump_due = False
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._drained: asyncio.Event | None = None

    # -- which loop ------------------------------------------------------------
    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve callers on `loop`; called on the thread running it.

        Leftovers of a closed previous loop are answered with `BatcherClosed` first.
        It moves only when the previous loop is closed, or stopped with nothing left:
        while a loop runs, its callers may call again at any moment.

        Args:
            loop: The caller's running loop.

        Raises:
            RuntimeError: The driver serves another loop that still runs, or has
                work on one that is stopped.
        """
        if self.loop is loop:
            return
        core = self.core
        with core.lock:
            old = self.loop
            if old is not None and old.is_closed() and not core.drained:
                # Its batches will never finish: answer their callers, free their slots.
                core.fail_all_locked(core.answers.closed_error())
                core.answers.abandon_running_locked(core.answers.closed_error())
            if old is not None and not old.is_closed():
                busy = "serves another event loop, which is still running"
                if not old.is_running():
                    busy = "is busy on another event loop" if not core.drained else ""
                if busy:
                    raise RuntimeError(
                        f"{core.name} {busy}; an async batched function serves one loop at a time"
                    )
            self.loop = loop
            self._pump_due = False
            self._timer = None
            self._drained = None

    def forked_locked(self) -> None:
        """In a child process just forked, under the lock: the loop it served is the
        parent's (its thread is not here; asyncio itself does not carry a running loop
        across a fork). What waited or ran there fails with `BatcherClosed`, and the
        next caller's loop is bound afresh."""
        if self.loop is None:
            return
        core = self.core
        error = BatcherClosed(
            f"{core.name}: the process forked; the event loop this request was served on "
            "runs on in the parent process only"
        )
        core.fail_all_locked(error)
        deliver(core.answers.abandon_running_locked(error))
        self.loop = None
        self._pump_due = False
        self._timer = None
        self._tasks = set()
        self._drained = None

    def check_loop_locked(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Before an enqueue: refuse a thread caller, and a call from inside the
        function when its batch holds the only slot (it would wait for itself); move
        to the caller's loop if `bind` allows."""
        if _RUNNING_BATCH_OF.get() is self and self.core.max_concurrent_batches == 1:
            raise RuntimeError(
                f"{self.core.name} was called from inside its own batch function with "
                "max_concurrent_batches=1: the call would wait for the batch it is made "
                "from, forever (call the model directly, or allow more batches at once)"
            )
        if loop is not self.loop:
            if loop is None:
                raise RuntimeError(f"{self.core.name} is async: call it from an event loop")
            self.bind(loop)

    def settings_changed_locked(self) -> None:
        """Under the lock: `configure` changed the settings."""
        self._pump_due = False  # the slots may have changed: the next wake pumps

    # -- scheduling passes --------------------------------------------------------
    def wake_locked(self) -> None:
        """Under the lock: something changed; schedule a pump unless one is due. With
        every slot busy the pump finds nothing to start, and sets `_pump_due` until a
        slot frees."""
        if self._pump_due or self.loop is None:
            return
        schedule_on_loop(self.loop, self._pump, self.loop)
        self._pump_due = True  # (only once the pump is surely scheduled)

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start every batch that is ready; arm the timer for the next max-wait expiry.

        Args:
            loop: The loop this pass runs on (every pass runs on the loop it was
                scheduled on); a pass of a loop this batcher no longer serves does
                nothing.
        """
        core = self.core
        if loop is not self.loop:
            return  # a stale pump or timer of a loop this batcher no longer serves
        ready: list[FormedBatch] = []
        try:
            with core.lock:
                wake_at, busy = None, False
                try:
                    while True:
                        batch, wake_at, busy = core.next_batch_locked()
                        if batch is None:
                            break
                        ready.append(batch)
                finally:
                    # Busy slots stay busy until a batch ends, and its task polls then;
                    # under a latency target an arrival polls while busy unless a timer
                    # will (it arms one for when its request could become too late).
                    # (Set even if polling raised: a stuck flag would silence arrivals.)
                    self._pump_due = busy and (wake_at is not None or not core.drops_while_busy)
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                if wake_at is not None:
                    self._timer = loop.call_later(
                        max(wake_at - core.clock(), 0.0), self._pump, loop
                    )
                if core.closed and self._drained is not None and core.drained:
                    self._drained.set()
        finally:
            # Started outside the lock: with an eager task factory (Python 3.12+) the
            # function's first step runs inside create_task, and must not run under
            # it. (Also when a later poll raised: these hold their slots already.)
            self._start_all(loop, ready)

    # -- batch tasks -----------------------------------------------------------------
    def _start_all(self, loop: asyncio.AbstractEventLoop, ready: list[FormedBatch]) -> None:
        """A task for each batch: it runs the batch (and the batches ready as it ends).
        `holding` names the batch a task owns, so that a task that ends early still
        settles it (see _ended)."""
        failure: BaseException | None = None
        for batch in ready:
            holding: list[FormedBatch | None] = [batch]
            coro = self._run_batches(holding, loop)
            try:
                task = loop.create_task(coro)
            except BaseException as exc:  # noqa: BLE001 - e.g. a user's task factory
                coro.close()  # never started: no "never awaited" warning
                self._not_started(batch, exc)
                failure = failure or exc
                continue
            self._tasks.add(task)
            task.add_done_callback(functools.partial(self._ended, holding=holding))
        if failure is not None:
            raise failure  # (to the loop's exception handler, once all are settled)

    def _not_started(self, batch: FormedBatch, exc: BaseException) -> None:
        """No task could be made for `batch`: fail its callers, free its slot, and poll
        again (the slot may be what the waiting requests need)."""
        error = BatcherClosed(f"{self.core.name}: could not start a task for this batch: {exc!r}")
        error.__cause__ = exc
        with self.core.lock:
            abandoned = self.core.answers.abandon_locked(batch, error)
            self._pump_due = False
            self.wake_locked()
        deliver(abandoned)

    async def _run_batches(
        self, holding: list[FormedBatch | None], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Run batches back to back in this task while one is ready as the last ends."""
        _RUNNING_BATCH_OF.set(self)  # (this task's own context)
        batch = holding[0]
        while batch is not None:
            run = await self._execute(batch)
            # Take the next batch before answering this one's callers: its call starts in
            # this same step, and finish_locked answers them in a callback that runs
            # after it, so the accelerator is not left idle while they are answered.
            with self.core.lock:
                answered = self.core.answers.finish_locked(batch, run, on_loop=loop)
                batch, _, _ = self.core.next_batch_locked()
                holding[0] = batch
            if answered:  # a batch with failures (one that succeeded is answered later)
                deliver(answered)
        self._pump(loop)  # re-arm the max-wait timer; start batches that became ready

    def _ended(self, task: asyncio.Task[None], holding: list[FormedBatch | None]) -> None:
        """A batch task is done. If it ended holding a batch (cancelled, even before its
        first step, or a bug), answer that batch's callers and free its slot."""
        self._tasks.discard(task)
        batch = holding[0]
        if batch is None:
            return
        holding[0] = None
        core = self.core
        with core.lock:
            if not core.is_running(batch):
                return  # settled already (e.g. by a rebind after its loop closed)
            reason = "was cancelled" if task.cancelled() else f"failed: {task.exception()!r}"
            error = BatcherClosed(f"{core.name}: the task running this batch {reason}")
            abandoned = core.answers.abandon_locked(batch, error)
        deliver(abandoned)
        self._pump(task.get_loop())  # its slot is free: start what waits

    async def _execute(self, batch: FormedBatch) -> BatchRun:
        """Await the function as `run_steps` asks (parts too, if split), each call
        cancelled past `batch_timeout` if there is one.

        A failing call is recorded, never raised; a cancellation of this task is raised
        (its batch is then settled by _ended).
        """
        core, fn = self.core, self.fn
        if core.options.streaming:
            return await run_stream_async(
                fn,  # type: ignore[arg-type]
                batch.requests,
                core.options,
                core.name,
                core.clock,
            )
        timeout = core.options.batch_timeout
        steps = run_steps(batch.requests, core.options, core.name)
        outcome: Outcome | None = None
        try:
            while True:
                argument = steps.send(outcome)  # type: ignore[arg-type]
                outcome = None  # (released before the next call: see ThreadDriver._run)
                # (A cancellation raised here is this task's: _ended settles its batch.)
                if timeout is None:
                    outcome = await arun(fn, argument, core.name, "the batch function")
                else:
                    outcome = await self._call_within(argument, timeout)
                del argument
        except StopIteration as done:
            run: BatchRun = done.value
            return run

    async def _call_within(self, argument: Any, timeout: float) -> Outcome:
        """One call of the function, cancelled past `timeout` (`batch_timeout`)."""
        core = self.core
        expired = core.answers.batch_timeout_error()
        outcome = await call_async_within(self.fn, argument, timeout, expired, core.name)
        if not outcome[0] and outcome[1] is expired:  # it ran past the timeout
            with core.lock:
                core.answers.batch_timed_out_locked()
        return outcome

    # -- shutdown ------------------------------------------------------------------
    async def aclose(self, timeout: float | None = None) -> None:
        """Stop accepting, serve what is queued and running; after `timeout`, fail the rest.

        Args:
            timeout: Seconds to wait; then whatever is unanswered fails with
                `BatcherClosed`. None waits for everything.

        Awaited from inside the function (in a task running one of its batches), it
        returns at once: what is queued and running, the calling batch too, is
        served after it returns.

        Raises:
            RuntimeError: Called on another loop than the one it serves (while that
                one is open).
        """
        loop = asyncio.get_running_loop()
        core = self.core
        with core.lock:
            if self.loop is not None and self.loop is not loop and not self.loop.is_closed():
                raise RuntimeError(f"{core.name}: aclose() must run on the loop it serves")
            self.bind(loop)  # a closed previous loop's leftovers are answered here
            core.close_locked()
            if _RUNNING_BATCH_OF.get() is self:
                self.wake_locked()  # what waits leaves now; the batch ends as this returns
                return  # waiting here would wait for this very call
            if self._drained is None:  # shared by concurrent aclose() calls
                self._drained = asyncio.Event()
            drained = self._drained
            if core.drained:
                drained.set()
                return
            self.wake_locked()
        try:
            await asyncio.wait_for(drained.wait(), timeout)
        except asyncio.TimeoutError:
            with core.lock:
                core.fail_all_locked(core.answers.closed_error())

    def close_nowait(self) -> None:
        """Stop accepting and return at once: what is queued and running is served on
        its loop; with no loop running it, it fails with `BatcherClosed` now."""
        loop, core = self.loop, self.core
        with core.lock:
            core.close_locked()
            if loop is None or loop.is_closed() or not loop.is_running():
                core.fail_all_locked(core.answers.closed_error())
            else:
                self.wake_locked()  # a pass on the loop sends what waits

    def close(self, timeout: float | None = None) -> None:
        """Close from a thread. From inside the loop, use `await aclose()` instead.

        When the loop no longer runs, whatever is left fails at once with
        `BatcherClosed` (no loop will ever run it).

        Args:
            timeout: Seconds to wait; then whatever is unanswered fails with
                `BatcherClosed`. None waits for everything.

        Raises:
            RuntimeError: Called on the loop's own thread.
        """
        loop, core = self.loop, self.core
        if loop is None or loop.is_closed() or not loop.is_running():
            with core.lock:  # no loop will ever run what is left: answer it now
                core.close_locked()
                core.fail_all_locked(core.answers.closed_error())
            return
        if on_loop_thread(loop):
            raise RuntimeError(f"{core.name}: use 'await aclose()' inside the event loop")
        asyncio.run_coroutine_threadsafe(self.aclose(timeout), loop).result()
