"""The serving core: admitting requests and handing out the batches they form.

One `ServingCore` per batched function holds the lock, the scheduler
(`batchkit.serve.scheduler`: where a batch is formed), the closed flag, where callers
are answered (`batchkit.serve.answers`) and what the function reports about itself
(`batchkit.serve.readings`). A driver (`batchkit.serve.threads` or
`batchkit.serve.event_loop`) runs the batches it forms (`batchkit.serve.execute` and
`batchkit.serve.streaming`: how a batch runs) and reports back through `answers`. The
core knows nothing of threads or event loops: the driver is handed to it as a
`Driver`. Every request is submitted under the lock, whichever caller makes it
(`submit`). A driver asks the core for the next batch (`next_batch_locked`), never
the scheduler itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from batchkit.errors import BatcherClosed, Overloaded, QueueFull, RequestTimeout
from batchkit.serve.answers import Answers
from batchkit.serve.backpressure import Backpressure
from batchkit.serve.caps import SizeCaps
from batchkit.serve.channels import Channel
from batchkit.serve.events import DropReason
from batchkit.serve.options import Options, Settings, SettingsChange, check_settings, reconfigured
from batchkit.serve.readings import Readings
from batchkit.serve.request import Request, deliver, new_request
from batchkit.serve.scheduler import Admission, FormedBatch, Scheduler, group_bucket
from batchkit.usercode import contained


class Driver(Protocol):
    """What the serving core asks of the driver that runs its batches; each method is
    called under the core's lock."""

    def wake_locked(self) -> None:
        """Something changed: make sure a batch leaves if one is ready."""

    def check_loop_locked(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Before an enqueue: refuse (raise) a caller's loop the driver cannot serve
        (None: a thread caller)."""

    def settings_changed_locked(self) -> None:
        """`configure` changed the settings."""

    def forked_locked(self) -> None:
        """In a child process just forked: the driver's threads are not here."""


# -- os.fork() ---------------------------------------------------------------------
# A child process has only the thread that forked. Every core's lock is taken around
# the fork, so that no lock is left held by a thread the child does not have, and the
# child's drivers are told (`Driver.forked_locked`) that their threads are gone.
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
            core.driver.forked_locked()
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
    """Admission and batch forming for one batched function.

    Args:
        options: The function's validated options.
        name: The function's qualified name, for errors, events and thread names.
        driver: The driver that runs the batches (see `Driver`).

    Attributes:
        answers: Where each request's outcome is set, and listeners told.
        readings: The settings, counters, load and health, read under the lock.
        drops_while_busy: Under a latency target a pass is due while every slot is
            busy too: it answers the waiting requests that became too late (see
            `Scheduler.decide`).
    """

    def __init__(self, options: Options, name: str, driver: Driver) -> None:
        self.options = options
        self.name = name
        self.clock = options.clock
        self.driver = driver
        # Re-entrant: listeners run under it and may call f.stats() or remove themselves.
        self.lock = threading.RLock()
        self.backpressure: Backpressure | None = None  # when_full="block"
        if options.when_full == "block":
            self.backpressure = Backpressure(self.lock, self, self.clock)
        self.caps = SizeCaps()  # taught after each batch (answers), read by the scheduler
        self.sched = Scheduler(
            options.policy,
            max_queue_size=options.max_queue_size,
            max_concurrent_batches=options.max_concurrent_batches,
            max_latency_s=options.max_latency_s,
            caps=self.caps,
            on_room=None if self.backpressure is None else self._room_freed_locked,
        )
        self.answers = Answers(self.lock, self.sched, self.caps, options, name, self.clock)
        self.readings = Readings(self.lock, self.sched, self.caps)
        self.closed = False
        self.group = options.policy.group  # the policy's group, if any
        # One bucket, no key or group to compute.
        self.keyless = options.policy.key is None and self.group is None
        self.drops_while_busy = self.sched.target is not None
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
        (re-entrant: backpressure calls it holding the lock already).

        Args:
            req: A request from `make_request`.
            loop_checked: Its caller's thread and loop were checked (`Driver.check_loop_locked`)
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
            if not loop_checked:
                self.driver.check_loop_locked(req.loop)
            req.enqueued_at = self.clock()
            self._admitted_locked(self.sched.add(req), 1)

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
            if not loop_checked:  # one call's requests share a loop
                self.driver.check_loop_locked(reqs[0].loop)
            now = self.clock()
            for req in reqs:
                req.enqueued_at = now
            self._admitted_locked(self.sched.add_all(reqs), len(reqs))

    def _admitted_locked(self, admission: Admission, count: int) -> None:
        """Answer what the admission dropped; raise its refusal, or wake the driver."""
        if admission.dropped:
            self.answers.dropped_locked(admission.dropped)
        if admission.refused is not None:
            self.answers.report_drop(_refusal_reason(admission.refused), count)
            raise admission.refused
        self.driver.wake_locked()

    def enqueue_if_room_locked(self, req: Request) -> bool:
        """Under the lock, for callers blocked on a full queue: `submit` the request
        if there is room (True), else False.

        Raises:
            BatcherClosed: The function is closed.
        """
        limit = self.sched.max_queue_size
        if not self.closed and limit is not None and self.sched.num_waiting >= limit:
            return False
        self.submit(req)  # raises BatcherClosed when closed
        return True

    def _room_freed_locked(self) -> None:
        limit = self.sched.max_queue_size
        if self.backpressure is not None:
            self.backpressure.room_freed(None if limit is None else limit - self.sched.num_waiting)

    def gave_up_waiting_locked(self, timeout: float) -> RequestTimeout:
        """Under the lock: a caller blocked on a full queue gave up after `timeout`
        seconds; it is counted, and gets the returned error."""
        self.sched.stats.timeouts += 1
        self.answers.report_drop("timeout", 1)
        return self.answers.timeout_error(timeout)

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
            if not self.sched.waiting.withdraw(req):
                return False
            if timed_out:
                self.sched.stats.timeouts += 1
            else:
                self.sched.stats.cancelled += 1
            self.answers.report_drop("timeout" if timed_out else "cancelled", 1)
            req.error = error
            deliver([req])  # wakes a thread caller; a cancelled future is left alone
            self.driver.wake_locked()
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

    # -- batches ---------------------------------------------------------------
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
            self.answers.dropped_locked(dropped)
        return batch, wake_at, sched.in_flight >= sched.max_concurrent_batches

    def drop_while_busy_locked(self) -> float | None:
        """Under the lock, while every batch slot may be busy (a driver's timer; no
        batch can leave then): answer the waiting requests that became too late.

        Returns:
            When to look again: when the next waiting request becomes too late, under
            a latency target while every slot is still busy; else None (with a slot
            free the driver's own passes drop them).
        """
        sched = self.sched
        if sched.in_flight < sched.max_concurrent_batches:
            return None
        _, wake_at, dropped = sched.decide(self.clock())  # (busy: it forms no batch)
        if dropped:
            self.answers.dropped_locked(dropped)
        return wake_at

    def is_running(self, batch: FormedBatch) -> bool:
        """Under the lock: whether `batch` still holds its slot (not settled yet)."""
        return id(batch) in self.sched.running

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

    # -- closing -----------------------------------------------------------------
    def close_locked(self) -> None:
        """Under the lock: accept nothing more; serve what waits (batches leave at once)."""
        self.closed = True
        self.sched.close()
        if self.backpressure is not None:
            self.backpressure.waiters.wake_all()  # blocked callers see BatcherClosed

    def fail_all_locked(self, error: BaseException) -> None:
        """Under the lock: answer every waiting and running request with `error`, and
        wake the callers blocked on a full queue.

        Running batches go on; their results are discarded when they end.

        Args:
            error: What every unanswered caller gets.
        """
        self.answers.fail_all_locked(error)
        if self.backpressure is not None:
            self.backpressure.waiters.wake_all()

    # -- live settings ------------------------------------------------------------
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
            self.drops_while_busy = self.sched.target is not None
            self.driver.settings_changed_locked()
            self.driver.wake_locked()
            return self.readings.settings()


def _refusal_reason(refused: QueueFull) -> DropReason:
    """The drop reason of a request refused at admission."""
    return "overloaded" if isinstance(refused, Overloaded) else "rejected"
