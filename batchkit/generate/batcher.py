"""``ContinuousBatcher``: continuous batching of generation around a step function.

This module is the callers' side: submit (or generate) and get a
`GenerationHandle` to stream, wait on or cancel;
stats; listeners; close. The batcher holds a scheduler and a driver
(`batchkit.generate.driver`), which runs the steps on a worker thread or an
event loop.
"""

from __future__ import annotations

import inspect
import operator
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from batchkit.collate.shapes import ShapeBuckets
from batchkit.errors import BatcherClosed, QueueFull
from batchkit.generate.driver import StepDriver, StepFn, StepLoopDriver, StepThreadDriver
from batchkit.generate.handle import GenerationHandle
from batchkit.generate.observe import GenerationListener, StepObserver
from batchkit.generate.sampling import Sampling
from batchkit.generate.scheduler import StepScheduler
from batchkit.generate.sequence import Sequence
from batchkit.generate.stats import GenerationStats
from batchkit.generate.tokens import is_index, token_ids
from batchkit.generate.waiters import Outcome, Waiters
from batchkit.kv.allocator import BlockAllocator


class ContinuousBatcher:
    """Iteration-level batching of autoregressive generation around a step function.

    ``step_fn(batch)`` computes ``seq.token_ids[seq.start : seq.start + seq.num_tokens]``
    for every ``seq`` in ``batch.seqs`` and returns one entry per sequence, in order:
    the next token id, or ``None`` for a prefill chunk that does not reach the last
    token (``seq.sample`` is False), or an exception instance that fails that request
    alone (as [`next_tokens`][batchkit.generate.next_tokens] gives for logits that
    are not finite). Keep per-sequence state by ``seq.slot`` (a row
    in ``[0, max_num_seqs)``, stable while the sequence runs) or, in paged mode (pass an
    ``allocator``), in the KV blocks ``seq.block_ids`` / ``batch.layout``; drop state
    of ``batch.released`` ids. A sequence with ``start == 0`` starts from scratch (new,
    or preempted and recomputed).

    Generation ends at ``eos_token_id`` or a request's ``stop_token_ids`` (included in
    its output), at ``max_new_tokens``, or at ``max_model_len`` total tokens.

    A request's ``priority`` reaches running sequences: a more urgent one (lower
    value) preempts the least urgent running sequences for a row or KV blocks (see
    [`StepScheduler`][batchkit.generate.StepScheduler]).

    A request's ``group`` (an adapter, a task: any hashable) reaches the step function
    as ``seq.group``; with ``max_groups_per_step``, a step holds sequences of at most
    that many groups, and waiting requests of other groups join as running groups
    drain, oldest first, none starving (the rule and its bound: the guide's "Groups"
    section).

    Args:
        step_fn: Computes one step: takes a [`StepBatch`][batchkit.StepBatch] and
            returns one entry per sequence (see above). A sync function runs on a
            worker thread started by the first submit; an ``async def`` one runs as a
            task on the event loop of the first submit.
        max_num_seqs: Sequences one step may compute at most (rows ``0 ..
            max_num_seqs-1``); a positive int.
        max_num_batched_tokens: Tokens one step may compute at most, all sequences
            together (the token budget); a positive int.
        allocator: A [`BlockAllocator`][batchkit.BlockAllocator] for paged mode (KV
            blocks per sequence, preemption when they run out); ``None`` for slotted
            mode (a row per sequence, nothing else limited).
        max_model_len: The most tokens (prompt plus generated) a sequence may reach;
            generation stops there (finish reason ``"length"``). ``None``: no limit
            but ``max_new_tokens``.
        max_prefill_chunk: The most prompt (or recomputed) tokens of one sequence per
            step, so that prefills of several sequences and every decode token share
            each step; a positive int at most ``max_num_batched_tokens``. ``None``:
            the whole token budget.
        max_queue_size: The most requests waiting at once; a submit past it raises
            [`QueueFull`][batchkit.QueueFull]. ``None``: unbounded.
        max_groups_per_step: The most groups (``submit(..., group=...)``) one step
            may hold, all running sequences together; a whole number >= 1. ``None``:
            no limit.
        step_sizes: The row counts a step may have, for a model captured for
            those sizes (CUDA graphs, ``torch.compile``): positive ints, or a
            [`ShapeBuckets`][batchkit.ShapeBuckets] (its ``batch_sizes``), the
            largest at least ``max_num_seqs``. Every ``batch.seqs`` is padded up to
            the smallest size that holds its sequences with padding rows
            (``seq.is_padding``: one token each, no request's; their entries in the
            result are ignored). ``None``: no padding.
        eos_token_id: A token (or several: an iterable of ids, as a Hugging Face
            ``generation_config`` may list) that ends every request, added to each
            request's ``stop_token_ids``; ``None``: none.
        name: The batcher's name in errors, logs and events (default: ``step_fn``'s
            ``__name__``).
        clock: Seconds, monotonic; for timeouts and latencies (inject a fake one in
            tests).

    Raises:
        ValueError: A limit is not a positive int (``max_groups_per_step`` may be a
            whole-number float), ``max_prefill_chunk`` exceeds
            ``max_num_batched_tokens``, an ``eos_token_id`` is outside ``[0, 2**63)``,
            or ``step_sizes`` is empty, holds a size below 1 or none as large as
            ``max_num_seqs``.
        TypeError: An ``eos_token_id`` is not an integer, or ``step_sizes`` is not
            an iterable of ints.
    """

    def __init__(
        self,
        step_fn: StepFn,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        allocator: BlockAllocator | None = None,
        eos_token_id: int | Iterable[int] | None = None,
        max_model_len: int | None = None,
        max_prefill_chunk: int | None = None,
        max_queue_size: int | None = None,
        max_groups_per_step: int | None = None,
        step_sizes: Iterable[int] | ShapeBuckets | None = None,
        name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.step_fn = step_fn
        self.is_async = inspect.iscoroutinefunction(step_fn)
        # (not "name or ...": mypy would type the right side, and so the name, as optional)
        self.name = name if name else getattr(step_fn, "__name__", "ContinuousBatcher")
        self.eos_token_id = eos_token_id
        eos: Any = () if eos_token_id is None else eos_token_id
        self._eos = frozenset(token_ids([eos] if is_index(eos) else eos, "eos_token_id"))
        self.max_queue_size = max_queue_size
        self.clock = clock
        self.sched = StepScheduler(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            allocator=allocator,
            max_model_len=max_model_len,
            max_prefill_chunk=max_prefill_chunk,
            max_groups_per_step=max_groups_per_step,
            step_sizes=step_sizes,
        )
        self._waiters = Waiters()
        self._lock = self._waiters.lock  # guards the scheduler, the driver and the handles
        self._observer = StepObserver(self.name)
        driver = StepLoopDriver if self.is_async else StepThreadDriver
        self._driver: StepDriver = driver(
            step_fn, self.sched, self._waiters, name=self.name, clock=clock, observer=self._observer
        )
        self._next_id = 0

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
        sampling: Sampling | None = None,
        group: Hashable = None,
    ) -> GenerationHandle:
        """Queue one prompt; returns its handle at once.

        Args:
            prompt_ids: The prompt's token ids (ints; a list, array or tensor), not
                empty. The batcher keeps its own copy.
            max_new_tokens: The most tokens to generate (a positive int).
            stop_token_ids: Tokens that end this request (besides ``eos_token_id``);
                the stop token is included in the output.
            priority: Lower values are served first, and may preempt running
                sequences of higher values.
            timeout: Seconds the request may wait before it first runs; then it fails
                with [`RequestTimeout`][batchkit.RequestTimeout]. ``None``: no limit.
                Once running, it is not timed.
            sampling: How its tokens are picked (temperature, top-k, top-p, seed),
                on ``StepBatch.seqs[i].sampling`` / ``.sampler`` for the step
                function; ``None``: greedy.
            group: The request's group (an adapter, a task): any hashable, on
                ``StepBatch.seqs[i].group`` for the step function and counted apart in
                ``stats().groups``; with ``max_groups_per_step``, steps mix at most that
                many groups. ``None``: the one default group.

        Returns:
            The request's [`GenerationHandle`][batchkit.GenerationHandle].

        Raises:
            ValueError: A request that can never fit (an empty prompt, no room within
                ``max_model_len`` or the KV pool), a token id outside ``[0, 2**63)``,
                or a bad ``timeout``.
            TypeError: ``priority`` is not an int, a token id is not an integer,
                ``sampling`` is not a [`Sampling`][batchkit.generate.Sampling], or
                ``group`` is not hashable (nothing is queued).
            QueueFull: ``max_queue_size`` requests are already waiting.
            BatcherClosed: The batcher is closed.
        """
        if type(priority) is not int:
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if sampling is not None and not isinstance(sampling, Sampling):
            raise TypeError(
                f"sampling must be None or a batchkit.generate.Sampling, got {sampling!r}"
            )
        if type(max_new_tokens) is not int and is_index(max_new_tokens):
            max_new_tokens = operator.index(max_new_tokens)  # numpy / torch integers
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):
            # (NaN fails ">= 0" too: a NaN deadline would disable every later one)
            raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
        stops = frozenset(token_ids(stop_token_ids, "stop_token_ids")) | self._eos
        prompt = token_ids(prompt_ids, "prompt_ids")
        driver = self._driver
        with self._lock:
            if driver.closed:
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
                sampling=sampling,
                group=group,
            )
            self.sched.add(seq)  # ValueError here if it can never fit
            seq.outcome = Outcome(self._waiters)
            handle = GenerationHandle(seq, seq.outcome, self._waiters, driver.cancel)
            seq.handle = handle
            driver.start_locked()
        return handle

    def generate(self, prompts: Iterable[Iterable[int]], *, max_new_tokens: int) -> list[list[int]]:
        """Offline: generate for every prompt and wait for all of them.

        Args:
            prompts: The prompts, each a sequence of token ids.
            max_new_tokens: The most tokens to generate per prompt.

        Returns:
            The generated ids per prompt, in order.

        Raises:
            RuntimeError: The step function is async (use
                [`agenerate`][batchkit.ContinuousBatcher.agenerate]).
            ValueError: A prompt is refused (the message names its position); none
                of the prompts is left running.
        """
        if self.is_async:
            raise RuntimeError(f"{self.name}: an async step function; use 'await agenerate()'")
        return [h.result() for h in self._submit_all(prompts, max_new_tokens)]

    async def agenerate(
        self, prompts: Iterable[Iterable[int]], *, max_new_tokens: int
    ) -> list[list[int]]:
        """[`generate`][batchkit.ContinuousBatcher.generate] from asyncio.

        Args:
            prompts: The prompts, each a sequence of token ids.
            max_new_tokens: The most tokens to generate per prompt.

        Returns:
            The generated ids per prompt, in order.
        """
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

    # -- observing ----------------------------------------------------------------
    def add_listener(self, listener: GenerationListener) -> None:
        """Call ``listener.on_step`` after every step and ``listener.on_finish`` for
        every answered request.

        Listeners run under the batcher's lock, right after the fact: keep them fast.

        Args:
            listener: A [`GenerationListener`][batchkit.generate.GenerationListener];
                adding the same one again does nothing.
        """
        with self._lock:
            self._observer.add(listener)

    def remove_listener(self, listener: GenerationListener) -> None:
        """Detach a listener [`add_listener`][batchkit.ContinuousBatcher.add_listener] attached.

        Args:
            listener: The listener.

        Raises:
            ValueError: It is not attached.
        """
        with self._lock:
            self._observer.remove(listener)

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
        """Stop accepting; finish every queued and running request, then return.

        Called from the step function itself, it returns at once (a driver cannot wait
        for itself); the driver drains the rest after that step.

        Args:
            timeout: Seconds to wait for the requests to finish; then the unfinished
                ones fail with [`BatcherClosed`][batchkit.BatcherClosed]. ``None``:
                wait for all of them.
        """
        self._driver.close(timeout)

    async def aclose(self, timeout: float | None = None) -> None:
        """[`close`][batchkit.ContinuousBatcher.close] from asyncio (never blocks the loop).

        Args:
            timeout: Seconds to wait for the requests to finish; then the unfinished
                ones fail with [`BatcherClosed`][batchkit.BatcherClosed]. ``None``:
                wait for all of them.
        """
        await self._driver.aclose(timeout)

    def __enter__(self) -> ContinuousBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> ContinuousBatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
