"""``ContinuousBatcher``: the driver that runs the scheduler's steps through a step function.

A sync step function runs on one worker thread (started by the first submit), an
async one as a task on the event loop of the first submit. Between steps, under one
lock, the driver drops timed-out requests, schedules, and after the step applies its
tokens and wakes the callers whose requests moved. Callers stream or wait through a
:class:`~batchkit.generate.handle.GenerationHandle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import operator
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from batchkit.generate.handle import GenerationHandle
from batchkit.generate.scheduler import Scheduler
from batchkit.generate.sequence import SeqStatus, Sequence, StepBatch
from batchkit.generate.stats import GenerationStats
from batchkit.generate.tokens import is_index, token_ids
from batchkit.kv.allocator import BlockAllocator
from batchkit.serve.errors import BatcherClosed, QueueFull, RequestTimeout

StepFn = Callable[[StepBatch], Any]


class ContinuousBatcher:
    """Iteration-level batching of autoregressive generation around a step function.

    ``step_fn(batch)`` computes ``seq.token_ids[seq.start : seq.start + seq.num_tokens]``
    for every ``seq`` in ``batch.seqs`` and returns one entry per sequence, in order:
    the next token id, or ``None`` for a prefill chunk that does not reach the last
    token (``seq.sample`` is False). Keep per-sequence state by ``seq.slot`` (a row
    in ``[0, max_num_seqs)``, stable while the sequence runs) or, in paged mode (pass an
    ``allocator``), in the KV blocks ``seq.block_ids`` / ``batch.layout``; drop state
    of ``batch.released`` ids. A sequence with ``start == 0`` starts from scratch (new,
    or preempted and recomputed).

    Generation ends at ``eos_token_id`` or a request's ``stop_token_ids`` (included in
    its output), at ``max_new_tokens``, or at ``max_model_len`` total tokens.
    """

    def __init__(
        self,
        step_fn: StepFn,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        allocator: BlockAllocator | None = None,
        eos_token_id: int | None = None,
        max_model_len: int | None = None,
        max_queue_size: int | None = None,
        name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.step_fn = step_fn
        self.is_async = inspect.iscoroutinefunction(step_fn)
        self.name = name or getattr(step_fn, "__name__", "ContinuousBatcher")
        self.eos_token_id = eos_token_id
        self.max_queue_size = max_queue_size
        self.clock = clock
        self.sched = Scheduler(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            allocator=allocator,
            max_model_len=max_model_len,
        )
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the driver waits here for requests
        self._progress = threading.Condition(self._lock)  # streaming threads wait here
        # Under the lock: threads iterating a handle, asyncio events handles hold. While both
        # are 0, a step wakes nobody and touches no handle but those of finished requests.
        self._streamers = 0
        self._subscribers = 0
        self._next_id = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup: asyncio.Event | None = None

    @property
    def allocator(self) -> BlockAllocator | None:
        """The KV-block pool (paged mode), or None (slotted mode)."""
        return self.sched.allocator

    # -- submitting ------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Iterable[int],
        *,
        max_new_tokens: int,
        stop_token_ids: Iterable[int] = (),
        priority: int = 0,
        timeout: float | None = None,
    ) -> GenerationHandle:
        """Queue one prompt; returns its handle at once.

        Lower ``priority`` values are served first. ``timeout``: seconds the request may
        wait before it first runs (then it fails with :class:`~batchkit.RequestTimeout`).
        Raises ``ValueError`` for a request that can never fit, :class:`~batchkit.QueueFull`
        past ``max_queue_size`` waiting, :class:`~batchkit.BatcherClosed` after close.
        """
        if priority.__class__ is not int:
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if max_new_tokens.__class__ is not int and is_index(max_new_tokens):
            max_new_tokens = operator.index(max_new_tokens)  # numpy / torch integers
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            # (NaN fails ">= 0" too: a NaN deadline would disable every later one)
            raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
        stops = frozenset(token_ids(stop_token_ids, "stop_token_ids"))
        if self.eos_token_id is not None:
            stops |= {self.eos_token_id}
        prompt = token_ids(prompt_ids, "prompt_ids")
        with self._lock:
            if self._closed:
                raise BatcherClosed(f"{self.name} is closed")
            limit = self.max_queue_size
            if limit is not None and self.sched.num_waiting >= limit:
                raise QueueFull(f"{self.name}: {limit} requests are already waiting")
            now = self.clock()
            self._next_id += 1  # a refused request uses its id up too: errors name it
            seq = Sequence(
                self._next_id - 1,
                prompt,
                max_new_tokens=max_new_tokens,
                stop_token_ids=stops,
                priority=priority,
                arrival_time=now,
                deadline=None if timeout is None else now + timeout,
            )
            self.sched.add(seq)  # ValueError here if it can never fit
            handle = GenerationHandle(self, seq)
            seq.handle = handle
            self._start_locked()
        return handle

    def generate(self, prompts: Iterable[Iterable[int]], *, max_new_tokens: int) -> list[list[int]]:
        """Offline: generate for every prompt; the generated ids per prompt, in order."""
        if self.is_async:
            raise RuntimeError(f"{self.name}: an async step function; use 'await agenerate()'")
        return [h.result() for h in self._submit_all(prompts, max_new_tokens)]

    async def agenerate(
        self, prompts: Iterable[Iterable[int]], *, max_new_tokens: int
    ) -> list[list[int]]:
        """:meth:`generate` from asyncio."""
        return [await h for h in self._submit_all(prompts, max_new_tokens)]

    def _submit_all(
        self, prompts: Iterable[Iterable[int]], max_new_tokens: int
    ) -> list[GenerationHandle]:
        """Submit every prompt, or none: a refused one cancels those submitted before it
        (nobody would read them) and its error names the prompt's position."""
        handles: list[GenerationHandle] = []
        for i, prompt in enumerate(prompts):
            try:
                handles.append(self.submit(prompt, max_new_tokens=max_new_tokens))
            except BaseException as exc:
                for h in handles:
                    h.cancel()
                if isinstance(exc, (TypeError, ValueError)):
                    raise type(exc)(f"prompt {i}: {exc}") from exc
                raise
        return handles

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

    # -- the driver ---------------------------------------------------------------
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
        handle: GenerationHandle | None = seq.handle
        if handle is None or handle.done():
            return
        handle._error = error
        handle._done.release()
        if handle._events:
            _set_events(handle._events)
        if handle._streaming:
            self._progress.notify_all()

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

    def _cancel(self, handle: GenerationHandle) -> bool:
        with self._lock:
            if not self.sched.abort(handle._seq, "cancelled"):
                return False
            self._finish_locked(handle._seq, None)
            self._work.notify()
            return True

    # -- stats and shutdown ---------------------------------------------------------
    def stats(self) -> GenerationStats:
        """A snapshot of the counters."""
        with self._lock:
            alloc = self.sched.allocator
            a = alloc.stats() if alloc is not None else None
            return self.sched.stats.snapshot(
                running=len(self.sched.running),
                waiting=self.sched.num_waiting,
                kv_usage=a.usage if a is not None else 0.0,
                prefix_hit_rate=a.prefix_hit_rate if a is not None else 0.0,
            )

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting; finish every queued and running request. After ``timeout``
        seconds, the unfinished ones fail with :class:`~batchkit.BatcherClosed`.

        Called from the step function itself, it returns at once (a driver cannot wait
        for itself); the driver drains the rest after that step.
        """
        if self.is_async and self._loop is not None and asyncio._get_running_loop() is self._loop:
            raise RuntimeError(f"{self.name}: use 'await aclose()' inside the event loop")
        if self._thread is not None and self._thread is threading.current_thread():
            with self._lock:  # from the step function: the driver drains after this step
                self._closed = True
            return
        with self._lock:
            self._closed = True
            if self.is_async:
                self._wake_loop()
            else:
                self._work.notify_all()
            idle = self._thread is None and self._task is None
            finished = idle or self._work.wait_for(lambda: not self.sched.has_work, timeout)
            if not finished or (idle and self.sched.has_work):
                self._abort_all_locked()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close` from asyncio (never blocks the loop)."""
        if not self.is_async or self._task is None:
            await asyncio.get_running_loop().run_in_executor(None, self.close, timeout)
            return
        with self._lock:
            self._closed = True
            self._wake_loop()
        if asyncio.current_task() is self._task:
            return  # from the step function: the driver drains after this step
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        except asyncio.TimeoutError:
            with self._lock:
                self._abort_all_locked()

    def _abort_all_locked(self, error: BaseException | None = None) -> None:
        if error is None:
            error = BatcherClosed(f"{self.name} closed before this request finished")
        for seq in self.sched.abort_all("error"):
            self._finish_locked(seq, error)
        self._work.notify_all()

    def __enter__(self) -> ContinuousBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> ContinuousBatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _set_events(events: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    """Set asyncio events, each on its own loop (directly when already there)."""
    here = asyncio._get_running_loop()
    for loop, event in events:
        if loop is here:
            event.set()
        else:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits there
                loop.call_soon_threadsafe(event.set)
