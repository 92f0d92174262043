"""The serving core: admitting requests, and handing every caller its own outcome
exactly once ("where a caller is answered").

One `ServingCore` per batched function holds the lock, the scheduler
(`batchkit.serve.scheduler`: where a batch is formed), the closed flag, the
listeners and the counters. A driver (`batchkit.serve.threads` or
`batchkit.serve.event_loop`) runs the batches it forms (`batchkit.serve.execute` and
`batchkit.serve.streaming`: how a batch runs) and reports back here. The core knows
nothing of threads or event loops: a driver gives it its callbacks, `wake`,
`check_loop`, `settings_changed` and `forked`. Every request is submitted under the
lock, whichever caller makes it (`submit`). A driver asks the core for the next
batch (`next_batch_locked`), never the scheduler itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from batchkit.errors import BatcherClosed, BatchTimeout, Overloaded, QueueFull, RequestTimeout
from batchkit.serve.admission import BlockingAdmission
from batchkit.serve.caps import SizeCaps
from batchkit.serve.channels import Channel
from batchkit.serve.events import BatchEvent, DropEvent, DropReason, Listener, notify
from batchkit.serve.execute import BatchRun
from batchkit.serve.options import (
    Options,
    Settings,
    SettingsChange,
    check_settings,
    read_settings,
    reconfigured,
)
from batchkit.serve.request import DONE, RUNNING, Request, deliver, new_request, resolve_on_loop
from batchkit.serve.scheduler import FormedBatch, Scheduler, group_bucket
from batchkit.serve.stats import Stats
from batchkit.usercode import contained

LoopCheck = Callable[["asyncio.AbstractEventLoop | None"], None]


def _nothing() -> None:
    pass


# -- os.fork() ---------------------------------------------------------------------
# A child process has only the thread that forked. Every core's lock is taken around
# the fork, so that no lock is left held by a thread the child does not have, and the
# child's drivers are told (`ServingCore.forked`) that their threads are gone.
_cores: weakref.WeakSet[ServingCore] = weakref.WeakSet()
_held_at_fork: list[ServingCore] = []


def _before_fork() -> None:
    held = sorted(_cores, key=id)  # one order for every fork: no two forks cross
    for core in held:
        core.lock.acquire()
    _held_at_fork[:] = held


def _after_fork_in_parent() -> None:
    for core in reversed(_held_at_fork):
        core.lock.release()
    _held_at_fork.clear()


def _after_fork_in_child() -> None:
    for core in reversed(_held_at_fork):
        try:
            core.forked()
        finally:
            core.lock.release()
    _held_at_fork.clear()


if hasattr(os, "register_at_fork"):  # (POSIX only)
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


class ServingCore:
    """Admission, outcome assignment and delivery for one batched function.

    Args:
        options: The function's validated options.
        name: The function's qualified name, for errors, events and thread names.
        wake: Under the lock: something changed; make sure a batch leaves if one
            is ready.
        settings_changed: Under the lock: `configure` changed something.
        forked: Under the lock, in a child process just forked (see `_before_fork`).
        check_loop: Under the lock, before an enqueue: refuse (raise) a caller's
            loop the driver cannot serve.
    """

    def __init__(
        self,
        options: Options,
        name: str,
        *,
        wake: Callable[[], None],
        settings_changed: Callable[[], None] = _nothing,
        forked: Callable[[], None] = _nothing,
        check_loop: LoopCheck | None = None,
    ) -> None:
        self.options = options
        self.name = name
        self.clock = options.clock
        # Re-entrant: listeners run under it and may call f.stats() or remove themselves.
        self.lock = threading.RLock()
        self.admission: BlockingAdmission | None = None  # when_full="block"
        if options.when_full == "block":
            self.admission = BlockingAdmission(
                self.lock, self._admit_if_room_locked, self._gave_up_waiting_locked, self.clock
            )
        self.caps = SizeCaps()  # taught here (after each batch), read by the scheduler
        self.sched = Scheduler(
            options.policy,
            max_queue_size=options.max_queue_size,
            max_concurrent_batches=options.max_concurrent_batches,
            max_latency_s=options.max_latency_s,
            caps=self.caps,
            on_room=None if self.admission is None else self._room_freed_locked,
        )
        self.closed = False
        self.listeners: list[Listener] = []
        self.group = options.policy.group  # the policy's group, if any
        # One bucket, no key or group to compute.
        self.keyless = options.policy.key is None and self.group is None
        # Under a latency target a pass is due while every slot is busy too: it tells
        # the waiting requests that became hopeless (see Scheduler.decide).
        self.sheds_while_busy = self.sched.target is not None
        self.wake = wake
        self.check_loop = check_loop
        self.settings_changed = settings_changed
        self.forked = forked
        # Kept by the driver: worker threads stuck in a timed-out call, and whether
        # they are still replaced (see ThreadDriver).
        self.abandoned_workers = 0
        self.healthy = True
        _cores.add(self)

    # -- admission -----------------------------------------------------------
    def make_request(
        self,
        item: Any,
        priority: int,
        loop: asyncio.AbstractEventLoop | None,
        *,
        channel: Channel | None = None,
    ) -> Request:
        """A request for `item`; the policy's key and group run here, so their errors
        reach this caller.

        Args:
            item: The caller's item.
            priority: Lower values are served first; an `int` (not a `bool`).
            loop: An asyncio caller's running loop; None for a thread caller.
            channel: A streaming caller's channel; None for a plain call.

        Raises:
            TypeError: `priority` is not an `int`.
            BatchInterrupted: `key` or `group` raised `SystemExit` or
                `KeyboardInterrupt` (its `__cause__`); anything else they raise is
                raised as it is.
        """
        if type(priority) is not int:  # bool and other look-alikes are refused too
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if self.keyless:
            return new_request(item, 0.0, None, priority, loop, channel)
        policy = self.options.policy
        # Raised in the caller's frame: a SystemExit from `key` would stop an asyncio
        # caller's loop, so it is contained as any user code's is.
        source = "key"
        try:
            key = policy.key_of(item)
            if self.group is None:
                return new_request(item, key, policy.bucket_of(key), priority, loop, channel)
            source = "group"
            group = policy.group_of(item)
        except BaseException as exc:
            raise contained(exc, self.name, source)  # noqa: B904 - its cause is set if new
        bucket = group_bucket(policy, key, group)
        return new_request(item, key, bucket, priority, loop, channel, 0.0, group)

    def submit(self, req: Request, *, loop_checked: bool = False) -> None:
        """Enqueue a request, under the lock, from a thread or an event loop alike
        (re-entrant: a blocked admission calls it holding the lock already).

        Args:
            req: A request from `make_request`.
            loop_checked: Its caller's thread and loop were checked (`check_loop`)
                when it was made: it is submitted later from another thread (a
                session's next request, from the previous one's settling).

        Raises:
            BatcherClosed: The function is closed; nothing was enqueued.
            QueueFull: `max_queue_size` requests wait; nothing was enqueued.
            Overloaded: It is predicted to miss `max_latency_ms`; nothing was enqueued.
        """
        with self.lock:
            if self.closed:
                raise BatcherClosed(f"{self.name} is closed")
            if self.check_loop is not None and not loop_checked:
                self.check_loop(req.loop)
            req.enqueued_at = self.clock()
            self._shed_too_late_locked(req.enqueued_at)
            try:
                self.sched.add(req)
            except QueueFull as refused:
                self.dropped(_refusal_reason(refused), 1)
                raise
            self.wake()

    def submit_many(self, reqs: Sequence[Request], *, loop_checked: bool = False) -> None:
        """Enqueue several requests atomically: all of them, or none.

        Args:
            reqs: Requests from `make_request`, all of one caller (one loop); with
                `loop_checked`, they may be of several callers (the next requests
                of a batch's sessions).
            loop_checked: Their callers were checked when they were made (see
                `submit`).

        Raises:
            BatcherClosed: The function is closed.
            QueueFull: They do not all fit under `max_queue_size`.
            Overloaded: The last of them is predicted to miss `max_latency_ms`.
        """
        with self.lock:
            if self.closed:
                raise BatcherClosed(f"{self.name} is closed")
            if not reqs:
                return
            if self.check_loop is not None and not loop_checked:
                self.check_loop(reqs[0].loop)  # one call's requests share a loop
            now = self.clock()
            for req in reqs:
                req.enqueued_at = now
            self._shed_too_late_locked(now)
            try:
                self.sched.add_all(reqs)
            except QueueFull as refused:
                self.dropped(_refusal_reason(refused), len(reqs))
                raise
            self.wake()

    def _admit_if_room_locked(self, req: Request) -> bool:
        limit = self.sched.max_queue_size
        if not self.closed and limit is not None and self.sched.num_waiting >= limit:
            return False
        self.submit(req)  # raises BatcherClosed when closed
        return True

    def _room_freed_locked(self) -> None:
        limit = self.sched.max_queue_size
        if self.admission is not None:
            self.admission.room_freed(None if limit is None else limit - self.sched.num_waiting)

    def next_batch_locked(self) -> tuple[FormedBatch | None, float | None, bool]:
        """Under the lock: the scheduler's next batch to run now, if any.

        The waiting requests it dropped on the way (too late for a latency target, or
        the candidates of a policy `select` that raised) are answered here, their
        error set by the scheduler.

        Returns:
            `(batch, wake_at, busy)`: the batch that leaves now, or None; when to ask
            again if nothing changes (None: only an event can make a batch ready);
            whether every batch slot is busy now (the batch that ends next asks).
        """
        sched = self.sched
        batch, wake_at, dropped = sched.decide(self.clock())
        if dropped:
            self._answer_dropped_locked(dropped)
        return batch, wake_at, sched.in_flight >= sched.max_concurrent_batches

    def shed_while_busy_locked(self) -> float | None:
        """Under the lock, while every batch slot may be busy (a driver's timer; no
        batch can leave then): answer the waiting requests that became hopeless.

        Returns:
            When to look again: the next waiting request's hopeless time, under a
            latency target while every slot is still busy; else None (with a slot
            free the driver's own passes shed).
        """
        sched = self.sched
        if sched.in_flight < sched.max_concurrent_batches:
            return None
        _, wake_at, dropped = sched.decide(self.clock())  # (busy: it forms no batch)
        if dropped:
            self._answer_dropped_locked(dropped)
        return wake_at

    def _shed_too_late_locked(self, now: float) -> None:
        """Before an admission: answer what waits and can no longer be in time (no
        scheduling pass runs while every slot is busy, and the new request is then
        planned without them)."""
        shed = self.sched.shed_too_late(now)
        if shed:
            self._answer_dropped_locked(shed)

    def _answer_dropped_locked(self, dropped: Sequence[Request]) -> None:
        """Answer waiting requests the scheduler dropped (their error set): too late
        for a latency target (reported as overloaded), or a failing `select`'s."""
        shed = sum(1 for req in dropped if isinstance(req.error, Overloaded))
        self.dropped("overloaded", shed)
        deliver(dropped)

    def _gave_up_waiting_locked(self, timeout: float) -> RequestTimeout:
        self.sched.stats.timeouts += 1
        self.dropped("timeout", 1)
        return self.timeout_error(timeout)

    def give_up(self, req: Request, error: BaseException, *, timed_out: bool) -> bool:
        """Withdraw a request its caller no longer waits for, and answer it.

        Args:
            req: The request.
            error: Its outcome (what its caller sees).
            timed_out: Count it as a timeout; False counts it as cancelled.

        Returns:
            True if it was withdrawn; False if it already started (it runs on).
        """
        with self.lock:
            if not self.sched.drop(req):
                return False
            if timed_out:
                self.sched.stats.timeouts += 1
            else:
                self.sched.stats.cancelled += 1
            self.dropped("timeout" if timed_out else "cancelled", 1)
            req.error = error
            deliver([req])  # wakes a thread caller; a cancelled future is left alone
            self.wake()
        return True

    def leave(self, req: Request) -> None:
        """A streaming caller stopped reading: withdraw its request if it still waits,
        else drop its later chunks (the batch's generator stops once all have left).

        Args:
            req: The streaming caller's request.
        """
        if self.give_up(req, BatcherClosed(f"{self.name}: the stream was left"), timed_out=False):
            return
        if req.channel is not None:
            req.channel.left = True

    def timeout_error(self, timeout: float) -> RequestTimeout:
        """The error for a request whose `timeout` passed before it ran.

        Args:
            timeout: The caller's `timeout`, in seconds (named in the message).
        """
        return RequestTimeout(f"{self.name}: request did not start within timeout={timeout}s")

    def closed_error(self) -> BatcherClosed:
        """The error for requests still unanswered when a close times out."""
        return BatcherClosed(f"{self.name} closed before this request was served")

    # -- outcomes --------------------------------------------------------------
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
                next batch's call first (answering 32 callers takes longer than
                the next call needs to reach the device). None from a worker thread.

        Returns:
            The settled requests, for the caller to `deliver` (outside the lock).
        """
        now = self.clock()
        clean = run.calls == 1 and not run.errors and not batch.answered
        self.sched.finish(batch, now, clean=clean)
        stats = self.sched.stats
        stats.calls += run.calls
        stats.isolated += run.isolated
        if run.first_output_at is not None:
            stats.first_chunk.append(run.first_output_at - batch.dispatched_at)
        if run.oom_splits:  # the bucket's size cap: learned, or probed upwards once learned
            stats.oom_splits += run.oom_splits
            self.caps.learn(batch.requests[0].bucket, max(run.largest_ok, 1), self.options.policy)
        elif self.caps.active:
            self.caps.succeeded(batch.requests[0].bucket, batch.padded_size, self.options.policy)
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
                stats.failed += 1
            done.append(req)
        return done

    def abandon_locked(self, batch: FormedBatch, error: BaseException) -> list[Request]:
        """Under the lock: `batch` will never report (its task or loop is gone, or its
        call timed out). Fail its unanswered requests, tell listeners, free its slot.

        Args:
            batch: The running batch.
            error: What its unanswered callers get.

        Returns:
            The requests failed here, to deliver.
        """
        abandoned = self._answer_running_locked(batch, error)
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

    def is_running(self, batch: FormedBatch) -> bool:
        """Under the lock: whether `batch` still holds its slot (not settled yet)."""
        return id(batch) in self.sched.running

    def count_batch_timeout_locked(self) -> None:
        """Under the lock: a call ran past `batch_timeout` (counted in `stats()`)."""
        self.sched.stats.batch_timeouts += 1

    @property
    def drained(self) -> bool:
        """Under the lock: nothing waiting and nothing running."""
        return self.sched.drained

    @property
    def num_waiting(self) -> int:
        """Under the lock: how many requests wait to run."""
        return self.sched.num_waiting

    @property
    def max_concurrent_batches(self) -> int:
        """The batch slots in force (`configure` may change them)."""
        return self.sched.max_concurrent_batches

    def fail_all_locked(self, error: BaseException) -> None:
        """Under the lock: answer every waiting and running request with `error`.

        Running batches go on; their results are discarded when they end.

        Args:
            error: What every unanswered caller gets.
        """
        failed = self.sched.drop_all()
        if self.admission is not None:
            self.admission.waiters.wake_all()
        self.sched.stats.closed += len(failed)
        self.dropped("closed", len(failed))
        for req in failed:
            req.error = error
        for batch in self.sched.running.values():
            failed += self._answer_running_locked(batch, error)
        deliver(failed)

    def _answer_running_locked(self, batch: FormedBatch, error: BaseException) -> list[Request]:
        """Fail `batch`'s still-running requests with `error` (counted); its end must
        not answer them again. Returns them, to deliver."""
        answered = [r for r in batch.requests if r.state is RUNNING]
        for req in answered:
            req.state, req.error = DONE, error
        self.sched.stats.failed += len(answered)
        batch.answered = True
        return answered

    def close_locked(self) -> None:
        """Under the lock: accept nothing more; serve what waits (batches leave at once)."""
        self.closed = True
        self.sched.close()
        if self.admission is not None:
            self.admission.waiters.wake_all()  # blocked callers see BatcherClosed

    # -- live settings ------------------------------------------------------------
    def settings(self) -> Settings:
        """The settings in force."""
        with self.lock:
            target = self.sched.target
            return read_settings(
                self.sched.policy,
                self.sched.max_concurrent_batches,
                self.sched.max_queue_size,
                None if target is None else target.target_s,
            )

    def configure(self, changes: SettingsChange) -> Settings:
        """Change the given settings at once for batches formed from now on (a running
        batch is not touched). A bad value changes nothing.

        Args:
            changes: The settings to change (see `BatchedFunction.configure`); a
                field that is None is left as it is.

        Returns:
            The settings in force afterwards.

        Raises:
            ValueError: A value is not valid, or the policy has no such setting.
        """
        # (The counts as ints: a YAML or JSON config's 4.0 is stored as 4.)
        max_batch_size, max_wait_ms, max_concurrent_batches, max_queue_size, max_latency_ms = (
            check_settings(
                changes.max_batch_size,
                changes.max_wait_ms,
                changes.max_concurrent_batches,
                changes.max_queue_size,
                changes.max_latency_ms,
            )
        )
        with self.lock:
            policy = reconfigured(self.sched.policy, max_batch_size, max_wait_ms)
            self.options = dataclasses.replace(self.options, policy=policy)
            self.sched.set_policy(policy)
            if max_concurrent_batches is not None:
                self.sched.max_concurrent_batches = max_concurrent_batches
            if max_queue_size is not None:
                self.sched.set_max_queue_size(max_queue_size)
                self._room_freed_locked()
            if max_latency_ms is not None:
                self.sched.set_max_latency(max_latency_ms / 1e3)
            self.sheds_while_busy = self.sched.target is not None
            self.settings_changed()
            self.wake()
            return self.settings()

    # -- observers and stats ------------------------------------------------------
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

    def dropped(self, reason: DropReason, count: int) -> None:
        """Tell listeners that requests ended without running.

        Args:
            reason: Why they did not run.
            count: How many (nothing is reported for 0).
        """
        if self.listeners and count:
            notify(self.listeners, "on_drop", DropEvent(self.name, reason, count))

    def load(self) -> tuple[int, int]:
        """`(queue depth, batches in flight)` now: what `stats` reports, without its
        percentiles (a metrics scrape reads this for every function)."""
        with self.lock:
            return self.sched.num_waiting, self.sched.in_flight

    def health(self) -> tuple[int, int, bool]:
        """`(abandoned workers, batch timeouts, healthy)` now, cheaply (what a metrics
        scrape reads, without `stats()`'s percentiles)."""
        with self.lock:
            return self.abandoned_workers, self.sched.stats.batch_timeouts, self.healthy

    def stats(self) -> Stats:
        """A snapshot of the counters."""
        with self.lock:
            return self.sched.stats.snapshot(
                queue_depth=self.sched.num_waiting,
                in_flight=self.sched.in_flight,
                caps={"default" if b is None else str(b): cap for b, cap in self.caps.items()},
                abandoned_workers=self.abandoned_workers,
                healthy=self.healthy,
                latency_model=None if self.sched.target is None else self.sched.target.model(),
            )

    def batch_timeout_error(self) -> BatchTimeout:
        """The error for the callers of a batch whose call ran past `batch_timeout`."""
        return BatchTimeout(
            f"{self.name}: the batch function ran longer than "
            f"batch_timeout={self.options.batch_timeout}s on this request's batch"
        )


def _refusal_reason(refused: QueueFull) -> DropReason:
    """The drop reason of a request refused at admission."""
    return "overloaded" if isinstance(refused, Overloaded) else "rejected"
