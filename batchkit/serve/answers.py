"""Where a caller is answered: every request's outcome set exactly once, and the
listeners told.

`Answers` settles what the serving core hands it under its lock: a finished batch's
results, the errors of a batch that will never report, of waiting requests the
scheduler dropped, of everything left when a close times out. It counts each outcome
and tells the listeners (`on_batch`, `on_drop`). It returns the requests it settled;
the caller wakes them (`batchkit.serve.request.deliver`), outside the lock where it
can.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from batchkit.errors import BatcherClosed, BatchTimeout, Overloaded, RequestTimeout
from batchkit.serve.caps import SizeCaps
from batchkit.serve.events import BatchEvent, DropEvent, DropReason, Listener, notify
from batchkit.serve.execute import BatchRun
from batchkit.serve.options import Clock, Options
from batchkit.serve.request import DONE, RUNNING, Request, deliver, resolve_on_loop
from batchkit.serve.scheduler import FormedBatch, Scheduler


class Answers:
    """The outcomes of one batched function's requests, each set once.

    Every method named `..._locked` is called under the serving core's lock, and so
    is every listener.

    Args:
        lock: The serving core's lock.
        sched: The function's scheduler (its slots, counters and running batches).
        caps: The buckets' size caps, taught after each batch.
        options: The function's validated options.
        name: The function's qualified name, for errors and events.
        clock: The function's clock, in seconds.
    """

    def __init__(
        self,
        lock: threading.RLock,
        sched: Scheduler,
        caps: SizeCaps,
        options: Options,
        name: str,
        clock: Clock,
    ) -> None:
        self.lock = lock
        self.sched = sched
        self.caps = caps
        self.options = options
        self.name = name
        self.clock = clock
        self.listeners: list[Listener] = []

    # -- a batch's end -------------------------------------------------------------
    def finish_locked(
        self,
        batch: FormedBatch,
        run: BatchRun,
        *,
        on_loop: asyncio.AbstractEventLoop | None = None,
    ) -> list[Request]:
        """Under the lock: free the slot and settle each still-running request once.

        Also counts the run's calls and splits, learns (or probes) the bucket's size
        cap, and tells the listeners.

        Args:
            batch: The batch that ended.
            run: Its outcomes.
            on_loop: The event loop this runs on; when every item succeeded, the
                requests are answered by a callback on it (none are returned): it
                runs once the current step yields, which lets the driver start the
                next batch's call first. None from a worker thread.

        Returns:
            The settled requests, for the caller to `deliver` (outside the lock).
        """
        now = self.clock()
        clean = run.calls == 1 and not run.errors and not batch.answered
        self.sched.finish(batch, now, clean=clean)
        self._learn(batch, run)
        if self.listeners:
            self._report_batch(batch, run, now)
        if not run.errors and not batch.answered:  # the usual case: every item succeeded
            if on_loop is not None:
                on_loop.call_soon(resolve_on_loop, batch.requests, run.values, on_loop)
                return []
            for req, value in zip(batch.requests, run.values):
                req.state = DONE
                req.value = value
            return batch.requests
        done = []
        for i, req in enumerate(batch.requests):
            if req.state is not RUNNING:
                continue  # already answered (a close that timed out)
            req.state = DONE
            error = run.errors.get(i)
            if error is None:
                req.value = run.values[i]
            else:
                req.error = error
                self.sched.stats.failed += 1
            done.append(req)
        return done

    def _learn(self, batch: FormedBatch, run: BatchRun) -> None:
        """Count the run's calls and splits; learn (or probe upwards) its bucket's cap."""
        stats, policy = self.sched.stats, self.sched.policy
        stats.calls += run.calls
        stats.isolated += run.isolated
        if run.first_output_at is not None:
            stats.first_chunk.append(run.first_output_at - batch.dispatched_at)
        if run.oom_splits:
            stats.oom_splits += run.oom_splits
            self.caps.learn(batch.requests[0].bucket, max(run.largest_ok, 1), policy)
        elif self.caps.active:
            self.caps.succeeded(batch.requests[0].bucket, batch.padded_size, policy)

    def abandon_locked(self, batch: FormedBatch, error: BaseException) -> list[Request]:
        """Under the lock: `batch` will never report (its task or loop is gone, or its
        call timed out). Fail its unanswered requests, tell listeners, free its slot.

        Args:
            batch: The running batch.
            error: What its unanswered callers get.

        Returns:
            The requests failed here, to deliver.
        """
        abandoned = self._fail_running(batch, error)
        now = self.clock()
        self.sched.finish(batch, now, clean=False)
        if self.listeners:  # every request failed (answered here or by a close before)
            self._report_batch(batch, BatchRun(batch.requests, self.options), now)
        return abandoned

    def abandon_running_locked(self, error: BaseException) -> list[Request]:
        """Under the lock: `abandon_locked` every running batch (their thread or loop is
        gone: a fork, a closed loop).

        Args:
            error: What their unanswered callers get.

        Returns:
            The requests failed here, to deliver.
        """
        abandoned: list[Request] = []
        for batch in list(self.sched.running.values()):
            abandoned += self.abandon_locked(batch, error)
        return abandoned

    def fail_all_locked(self, error: BaseException) -> None:
        """Under the lock: answer every waiting and running request with `error`.

        Running batches go on; their results are discarded when they end.

        Args:
            error: What every unanswered caller gets.
        """
        failed = self.sched.waiting.withdraw_all()
        self.sched.stats.closed += len(failed)
        self.report_drop("closed", len(failed))
        for req in failed:
            req.error = error
        for batch in self.sched.running.values():
            failed += self._fail_running(batch, error)
        deliver(failed)

    def _fail_running(self, batch: FormedBatch, error: BaseException) -> list[Request]:
        """Fail `batch`'s still-running requests with `error` (counted); its end must
        not answer them again. Returns them, to deliver."""
        answered = [r for r in batch.requests if r.state is RUNNING]
        for req in answered:
            req.state, req.error = DONE, error
        self.sched.stats.failed += len(answered)
        batch.answered = True
        return answered

    def dropped_locked(self, dropped: Sequence[Request]) -> None:
        """Under the lock: answer waiting requests the scheduler dropped (their error
        set): too late for a latency target (reported as overloaded), or a failing
        `select`'s candidates."""
        late = sum(1 for req in dropped if isinstance(req.error, Overloaded))
        self.report_drop("overloaded", late)
        deliver(dropped)

    def batch_timed_out_locked(self) -> None:
        """Under the lock: a call ran past `batch_timeout` (counted in `stats()`)."""
        self.sched.stats.batch_timeouts += 1

    # -- the errors callers get ----------------------------------------------------
    def timeout_error(self, timeout: float) -> RequestTimeout:
        """The error for a request whose `timeout` passed before it ran.

        Args:
            timeout: The caller's `timeout`, in seconds (named in the message).
        """
        return RequestTimeout(f"{self.name}: request did not start within timeout={timeout}s")

    def closed_error(self) -> BatcherClosed:
        """The error for requests still unanswered when a close times out."""
        return BatcherClosed(f"{self.name} closed before this request was served")

    def batch_timeout_error(self) -> BatchTimeout:
        """The error for the callers of a batch whose call ran past `batch_timeout`."""
        return BatchTimeout(
            f"{self.name}: the batch function ran longer than "
            f"batch_timeout={self.options.batch_timeout}s on this request's batch"
        )

    # -- listeners -----------------------------------------------------------------
    def add_listener(self, listener: Listener) -> None:
        """Observe every batch and every dropped request.

        Args:
            listener: Its `on_batch` and `on_drop` are called under the lock.
        """
        with self.lock:
            self.listeners = [*self.listeners, listener]

    def remove_listener(self, listener: Listener) -> None:
        """Stop observing.

        Args:
            listener: A listener added before (by identity).
        """
        with self.lock:
            self.listeners = [x for x in self.listeners if x is not listener]

    def report_drop(self, reason: DropReason, count: int) -> None:
        """Tell listeners that requests ended without running.

        Args:
            reason: Why they did not run.
            count: How many (nothing is reported for 0).
        """
        if self.listeners and count:
            notify(self.listeners, "on_drop", DropEvent(self.name, reason, count))

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
            first_chunk=(
                None if run.first_output_at is None else run.first_output_at - batch.dispatched_at
            ),
        )
        notify(self.listeners, "on_batch", event)
