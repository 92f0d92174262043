"""What both runtimes share: admitting requests and handing every caller its own
outcome exactly once (the recipe for running a batch is
:class:`~batchkit.serve.recovery.BatchSteps`).

Two runtimes drive the one :class:`~batchkit.serve.scheduler.Scheduler`:
:class:`~batchkit.serve.threaded.ThreadRuntime` (sync functions; worker threads)
and :class:`~batchkit.serve.looped.LoopRuntime` (async functions; one event loop).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from batchkit.batchers.base import Batcher
from batchkit.errors import BatcherClosed, QueueFull, RequestTimeout
from batchkit.serve.backpressure import BlockingAdmission, RoomWaiters
from batchkit.serve.events import BatchEvent, DropEvent, DropReason, Listener, notify
from batchkit.serve.recovery import BatchRun, BatchSteps
from batchkit.serve.request import Request, State, await_request, deliver, resolve_on_loop
from batchkit.serve.scheduler import FormedBatch, Scheduler
from batchkit.serve.stats import Stats

Clock = Callable[[], float]
DONE, RUNNING, WAITING = State.DONE, State.RUNNING, State.WAITING
_new = object.__new__
_set_result: Callable[[Any, Any], None] = asyncio.Future.set_result  # (C: in one map)
_consume: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend  # (in C)
# Compared by identity on the hot path: CPython keeps one 0 object (a bool, a numpy
# int or any other look-alike fails the check and takes the checked path).
_DEFAULT_PRIORITY = 0


@dataclass(frozen=True)
class Options:
    """How a batched function is run (see :func:`batchkit.batched`)."""

    policy: Batcher
    collate: Callable[[list[Any]], Any] | None = None
    split: Callable[[Any], Sequence[Any]] | None = None
    max_queue_size: int | None = None
    max_concurrent_batches: int = 1
    clock: Clock = time.monotonic
    oom_errors: tuple[type[BaseException], ...] | None = ()  # None: no out-of-memory splitting
    isolate_errors: bool = False
    when_full: Literal["reject", "block"] = "reject"


class Runtime(BlockingAdmission, BatchSteps):
    """Admission, outcome assignment and delivery; subclasses run batches and wake up."""

    def __init__(self, fn: Callable[[Any], Any], options: Options, name: str) -> None:
        self.fn = fn
        self.options = options
        self.name = name
        self.clock = options.clock
        self.sched = Scheduler(
            options.policy,
            max_queue_size=options.max_queue_size,
            max_concurrent_batches=options.max_concurrent_batches,
        )
        # Re-entrant: listeners run under it and may call f.stats() or remove themselves.
        self.lock = threading.RLock()
        self.closed = False
        self.listeners: list[Listener] = []
        self.room = RoomWaiters()  # callers blocked on a full queue (when_full="block")
        self.room_mode_block = options.when_full == "block"
        self.keyless = options.policy.key is None  # one bucket, no key to compute
        self.loop: asyncio.AbstractEventLoop | None = None  # the loop asyncio callers use
        # An async function runs on its callers' loop: one loop at a time. bind() is
        # checked again under the lock at admission, so that two threads with two loops
        # cannot both pass it while the batcher is idle and enqueue on both.
        self.serves_one_loop = False
        # The loop of the last asyncio caller, already bound: acall checks it instead of
        # calling bind() every time (a thread runtime's self.loop stays None).
        self._caller_loop: asyncio.AbstractEventLoop | None = None
        # Set by a runtime whose scheduler only the thread running this loop changes
        # (see LoopRuntime.bind): default-lane callers on it are admitted without the lock.
        self._owner_loop: asyncio.AbstractEventLoop | None = None
        # True when a poll is due anyway (a runtime sets it when it knows): an
        # admission then skips _wake_locked.
        self._poll_due = False
        if self.room_mode_block:
            self.sched.on_room = self._room_freed
        # A keyless policy's default-priority requests skip Scheduler.add: they are
        # appended to its arrivals and placed in bulk at the next scheduling step. Not
        # with a bounded queue, which must refuse at once (QueueFull).
        self._arrive = (
            self.sched.arrivals.append if self.keyless and options.max_queue_size is None else None
        )

    # -- admission ---------------------------------------------------------
    def make_request(
        self, item: Any, priority: int, loop: asyncio.AbstractEventLoop | None
    ) -> Request:
        """A request for ``item``; the policy's key runs here, so its errors reach this caller."""
        if priority.__class__ is not int:  # bool and other look-alikes are refused too
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if self.keyless:
            return Request(item, 0.0, None, priority, loop)
        policy = self.options.policy
        key = policy.key_of(item)
        return Request(item, key, policy.bucket_of(key), priority, loop)

    def submit(self, req: Request) -> None:
        """Enqueue, or raise ``BatcherClosed``/``QueueFull`` without enqueuing."""
        # acquire/release instead of ``with``: about half the cost, on every call.
        lock = self.lock
        lock.acquire()
        try:
            self._admit_locked(req)
        finally:
            lock.release()

    def _admit_locked(self, req: Request) -> None:
        if self.closed:
            raise BatcherClosed(f"{self.name} is closed")
        if req.loop is not self.loop:  # rare on a loop runtime: no call on the hot path
            self._rebind_locked(req.loop)
        req.enqueued_at = self.clock()
        if self._arrive is not None and req.priority == 0:
            self._arrive(req)
        else:
            try:
                self.sched.add(req)
            except QueueFull:
                self._dropped("rejected", 1)
                raise
        if not self._poll_due:
            self._wake_locked()

    def _rebind_locked(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """For a runtime that serves one loop: (re)bind to ``loop`` or raise if busy, in
        the same locked step as the enqueue that follows."""
        if self.serves_one_loop and loop is not self.loop:
            self.bind(loop)  # type: ignore[arg-type]

    def submit_many(self, reqs: list[Request]) -> None:
        """Enqueue several requests atomically: all of them, or none (``QueueFull``)."""
        with self.lock:
            if self.closed:
                raise BatcherClosed(f"{self.name} is closed")
            if reqs:
                self._rebind_locked(reqs[0].loop)  # one call's requests share a loop
            limit = self.sched.max_queue_size
            if limit is not None and self.sched.num_waiting + len(reqs) > limit:
                self.sched.stats.rejected += len(reqs)
                self._dropped("rejected", len(reqs))
                raise QueueFull(
                    f"{len(reqs)} items do not fit: {self.sched.num_waiting} requests are "
                    f"waiting (max_queue_size={limit})"
                )
            now = self.clock()
            for req in reqs:
                req.enqueued_at = now
                self.sched.add(req)
            if reqs:
                self._wake_locked()

    def _wake_locked(self) -> None:
        """Something changed: make sure a batch leaves if one is ready."""
        raise NotImplementedError

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Prepare to serve asyncio callers on ``loop`` (nothing to do for threads)."""

    def bind_caller(self, loop: asyncio.AbstractEventLoop) -> None:
        """:meth:`bind` for an asyncio caller on ``loop``; skipped while it stays the same."""
        self.bind(loop)
        self._caller_loop = loop

    async def acall(self, item: Any, *, priority: int = 0, timeout: float | None = None) -> Any:
        """One item from asyncio: await its result, honouring timeout and cancellation."""
        loop = asyncio.get_running_loop()
        if loop is self._owner_loop and priority is _DEFAULT_PRIORITY:
            # The hot path: this thread alone changes the scheduler, so no lock; one
            # C-level append, placed in bulk at the next scheduling step.
            # Request(item, 0.0, None, 0, loop, now) without the class call's overhead
            # (about 1k instructions on 3.11): every slot, as Request.__init__ sets them.
            req = _new(Request)
            req.item = item
            req.key = 0.0
            req.bucket = None
            req.priority = 0
            req.seq = 0
            req.enqueued_at = self.clock()
            req.state = WAITING
            req.value = None
            req.error = None
            req.future = loop.create_future()
            req.loop = loop
            req._done = None
            self._arrive(req)  # type: ignore[misc]
            if not self._poll_due:
                self._wake_locked()
        else:
            if loop is not self._caller_loop:
                self.bind_caller(loop)
            if self.keyless and priority.__class__ is int:
                req = Request(item, 0.0, None, priority, loop)
            else:
                req = self.make_request(item, priority, loop)
            if self.room_mode_block:
                started = time.monotonic()
                await self.asubmit_blocking(req, timeout)
                if timeout is not None:
                    timeout = max(timeout - (time.monotonic() - started), 0.0)
            else:
                self.submit(req)
        if timeout is None:  # the hot path: no timer, a single await
            try:
                return await req.future  # type: ignore[misc]
            except asyncio.CancelledError:
                self.give_up(req, asyncio.CancelledError(), timed_out=False)
                raise
        return await await_request(self, req, timeout)

    def give_up(self, req: Request, error: BaseException, *, timed_out: bool) -> bool:
        """Withdraw a request its caller no longer waits for; False if it already started."""
        with self.lock:
            if not self.sched.drop(req):
                return False
            if timed_out:
                self.sched.stats.timeouts += 1
            else:
                self.sched.stats.cancelled += 1
            self._dropped("timeout" if timed_out else "cancelled", 1)
            req.error = error
            deliver([req])  # wakes a thread caller; a cancelled future is left alone
            self._wake_locked()
        return True

    def timeout_error(self, timeout: float) -> RequestTimeout:
        """The error for a request whose ``timeout`` passed before it ran."""
        return RequestTimeout(f"{self.name}: request did not start within timeout={timeout}s")

    def finish_locked(
        self,
        batch: FormedBatch,
        run: BatchRun,
        *,
        on_loop: asyncio.AbstractEventLoop | None = None,
    ) -> list[Request]:
        """Under the lock: free the slot and settle each still-running request once.

        Returns the settled requests, for the caller to :func:`deliver` (outside the
        lock). ``on_loop``: the event loop this runs on (a loop runtime); when every item
        succeeded, the futures of the requests awaiting on it are resolved here, in the
        same pass, and only the others are returned.
        """
        now = self.clock()
        sched = self.sched
        sched.finish(batch, now)
        stats = sched.stats
        stats.calls += run.calls
        if run.hit_oom:
            stats.oom_splits += run.oom_splits
            sched.learn_cap(batch.requests[0].bucket, max(run.largest_ok, 1))
        elif sched.caps:
            sched.note_success(batch.requests[0].bucket, batch.padded_size)
        stats.isolated += run.isolated
        if self.listeners:
            self._report_batch(batch, run, now)
        requests, values, errors = batch.requests, run.values, run.errors
        if not errors and not batch.answered:  # the hot path: every item succeeded
            if on_loop is not None:
                for req in requests:
                    req.state = DONE
                futures = [req.future for req in requests if req.loop is on_loop]
                if len(futures) == len(requests):  # all await on this loop: the usual case
                    # (set_result only schedules the callers' wake-ups: no code of theirs
                    # runs under this lock.) One C-level pass; a cancelled caller's future
                    # refuses its result, and the rest are then resolved one by one.
                    try:
                        _consume(map(_set_result, futures, values))
                    except (asyncio.InvalidStateError, TypeError):  # (TypeError: a loop's
                        # own future type, not asyncio's): the checked per-future pass
                        return resolve_on_loop(requests, values, on_loop)
                    return []
                return resolve_on_loop(requests, values, on_loop)
            for req, value in zip(requests, values):
                req.state = DONE
                req.value = value
            return requests
        done = []
        for i, req in enumerate(requests):
            if req.state is not RUNNING:
                continue  # already answered (a close that timed out)
            req.state = DONE
            error = errors.get(i)
            if error is None:
                req.value = values[i]
            else:
                req.error = error
                stats.failed += 1
            done.append(req)
        return done

    def abandon_locked(self, batch: FormedBatch, error: BaseException) -> list[Request]:
        """Under the lock: ``batch`` will never report (its task or loop is gone). Fail
        its unanswered requests with ``error``, tell listeners, free its slot; returns
        the requests failed here (to deliver)."""
        abandoned = self._answer_running_locked(batch, error)
        now = self.clock()
        self.sched.finish(batch, now)
        if self.listeners:  # every request failed (answered here or by a close before)
            self._report_batch(batch, self.start_run(batch), now)
        return abandoned

    def _report_batch(self, batch: FormedBatch, run: BatchRun, now: float) -> None:
        keys = [r.key for r in batch.requests]
        event = BatchEvent(
            name=self.name,
            size=len(batch.requests),
            padded_size=batch.padded_size,
            reason=batch.reason.value,
            queue_waits=tuple(batch.dispatched_at - r.enqueued_at for r in batch.requests),
            latency=now - batch.dispatched_at,
            # Requests a timed-out close already answered with BatcherClosed failed too.
            failed=sum(
                1
                for i, req in enumerate(batch.requests)
                if i in run.errors or req.state is not RUNNING
            ),
            tokens=float(sum(keys)),
            padded_tokens=float(batch.padded_size * max(keys, default=0.0)),
        )
        notify(self.listeners, "on_batch", event)

    def _dropped(self, reason: DropReason, count: int) -> None:
        if self.listeners and count:
            notify(self.listeners, "on_drop", DropEvent(self.name, reason, count))

    def fail_all_locked(self, error: BaseException) -> None:
        """Under the lock: answer every waiting and running request with ``error``.

        Running batches go on; their results are discarded when they end.
        """
        failed = self.sched.drop_all()
        self.room.wake_all()
        self.sched.stats.closed += len(failed)
        self._dropped("closed", len(failed))
        for req in failed:
            req.error = error
        for batch in self.sched.running.values():
            failed += self._answer_running_locked(batch, error)
        deliver(failed)

    def _answer_running_locked(self, batch: FormedBatch, error: BaseException) -> list[Request]:
        """Fail ``batch``'s still-running requests with ``error`` (counted); its end must
        not answer them again. Returns them, to deliver."""
        answered = [r for r in batch.requests if r.state is RUNNING]
        for req in answered:
            req.state, req.error = DONE, error
        self.sched.stats.failed += len(answered)
        batch.answered = True
        return answered

    def load(self) -> tuple[int, int]:
        """``(queue depth, batches in flight)`` now: what :meth:`stats` reports, without
        its percentiles (a metrics scrape reads this for every function)."""
        with self.lock:
            return self.sched.num_waiting, self.sched.in_flight

    def stats(self) -> Stats:
        """A snapshot of the counters."""
        with self.lock:
            # Arrivals are counted, not placed: a loop runtime's callers append to them
            # without the lock, so only the scheduling thread may move them.
            return self.sched.stats.snapshot(
                unplaced=len(self.sched.arrivals),
                queue_depth=self.sched.num_waiting,
                in_flight=self.sched.in_flight,
                caps={
                    "default" if b is None else str(b): cap for b, cap in self.sched.caps.items()
                },
            )


def closed_error(name: str) -> BatcherClosed:
    """The error for requests still unanswered when a close times out."""
    return BatcherClosed(f"{name} closed before this request was served")
