"""The continuous-batching scheduler: a pure, synchronous core (no threads, no clock).

Every step, `StepScheduler.schedule` picks the sequences to compute: running ones
first (a decode token each, or their next prefill chunk), then waiting ones,
first-come-first-served within a priority (lower values first), while there are
free rows (``max_num_seqs``), tokens in the step's budget
(``max_num_batched_tokens``; long prompts are split into chunks of at most
``max_prefill_chunk`` tokens) and, in paged mode, free KV blocks.

Priorities reach running sequences: a waiting request more urgent than a running
sequence goes first, and takes the row and blocks of the least urgent running ones
(newest among equals), which are preempted. When a running sequence needs a block
and none is free, the victim is likewise the least urgent running sequence, never
one more urgent than the sequence that needs the block. A preempted sequence's
blocks are freed and it waits again, to be recomputed from its tokens (prompt and
generated so far) when it is readmitted; until it has produced a token again, no
sequence of its own priority may preempt it (only a more urgent one), so two equals
cannot evict each other forever.

With ``max_groups_per_step``, the running set holds sequences of at most that many
groups (``Sequence.group``: adapters, tasks), so every step does; waiting sequences
of other groups join as running groups drain, oldest first, with backfilling behind
the first one the limit stops (`batchkit.generate.groups` states the rule and its
bound).

With ``step_sizes``, each batch is padded with padding rows up to the smallest size
of the set that holds its sequences (for a model captured per batch size); their
results are ignored.

`StepScheduler.update` takes the step's sampled tokens and retires sequences that
hit a stop token or their length limit. The rows and blocks themselves are taken and
given back by its `SeqResources`; the drivers
(`batchkit.generate.driver`) add threads, handles and time.
"""

from __future__ import annotations

import bisect
import heapq
import numbers
import operator
from collections import deque
from collections.abc import Iterable

from batchkit.batchers.checks import positive_count
from batchkit.collate.shapes import ShapeBuckets
from batchkit.generate.groups import GroupGate, blocked_by_limit, group_to_free
from batchkit.generate.resources import SeqResources
from batchkit.generate.sequence import ScheduledSeq, SeqStatus, Sequence, StepBatch
from batchkit.generate.stats import GenerationStatsRecorder
from batchkit.generate.tokens import check_step_tokens
from batchkit.kv.allocator import BlockAllocator
from batchkit.usercode import contained


class StepScheduler:
    """Iteration-level scheduling over a waiting queue and a running set.

    Args:
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
        max_groups_per_step: The most groups (``Sequence.group``) running at once, so
            in one step; a whole number >= 1. ``None``: no limit (groups are only
            labels).
        step_sizes: The row counts a step may have (positive ints, or a
            [`ShapeBuckets`][batchkit.ShapeBuckets], whose ``batch_sizes`` are
            taken): every batch is padded with padding rows
            (``ScheduledSeq.is_padding``) up to the smallest size that holds its
            sequences, so that a model captured for those sizes (CUDA graphs,
            ``torch.compile``) serves every step. The largest must be at least
            ``max_num_seqs``. ``None``: no padding.

    Raises:
        ValueError: A limit is not a positive int, ``max_prefill_chunk`` exceeds
            ``max_num_batched_tokens``, or ``step_sizes`` is empty, holds a size below
            1, or has none as large as ``max_num_seqs``.
        TypeError: ``step_sizes`` is not an iterable of ints.
    """

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        allocator: BlockAllocator | None = None,
        max_model_len: int | None = None,
        max_prefill_chunk: int | None = None,
        max_groups_per_step: int | None = None,
        step_sizes: Iterable[int] | ShapeBuckets | None = None,
    ) -> None:
        if type(max_num_seqs) is not int or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
        if type(max_num_batched_tokens) is not int or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be a positive int, got {max_num_batched_tokens!r}"
            )
        if max_prefill_chunk is not None and (
            type(max_prefill_chunk) is not int
            or not 1 <= max_prefill_chunk <= max_num_batched_tokens
        ):
            raise ValueError(
                "max_prefill_chunk must be None or a positive int at most "
                f"max_num_batched_tokens={max_num_batched_tokens}, got {max_prefill_chunk!r}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Prompt (or recomputed) tokens of one sequence per step; no cap: the budget.
        self.max_prefill_chunk = (
            max_num_batched_tokens if max_prefill_chunk is None else max_prefill_chunk
        )
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.max_groups_per_step = positive_count(
            "max_groups_per_step", max_groups_per_step, allow_none=True
        )
        self.step_sizes = _step_sizes(step_sizes, max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.resources = SeqResources(max_num_seqs, allocator)
        self._in_flight: StepBatch | None = None
        self._arrivals = 0
        self._deadlines: list[tuple[float, int, Sequence]] = []
        # Sequences a step's bad result failed alone (seq.error says why); the driver
        # takes them after update() to answer their callers.
        self.errored: list[Sequence] = []
        # The sequences the last schedule() ran for the first time (for queue times).
        self.started_now: list[Sequence] = []
        self.stats = GenerationStatsRecorder()

    # -- admission -----------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Whether any sequence is running or waiting."""
        return bool(self.running or self.waiting)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting (new or preempted)."""
        return len(self.waiting)

    @property
    def num_free_rows(self) -> int:
        """Rows (of ``max_num_seqs``) no sequence holds."""
        return self.resources.num_free_rows

    @property
    def in_flight(self) -> StepBatch | None:
        """The batch of the last step scheduled, until its results are applied.

        Set by [`schedule`][batchkit.generate.StepScheduler.schedule], cleared by
        [`update`][batchkit.generate.StepScheduler.update] (or
        [`fail_step`][batchkit.generate.StepScheduler.fail_step]); None between steps.
        """
        return self._in_flight

    def take_errored(self) -> list[Sequence]:
        """The sequences bad step results failed alone since the last call (see `errored`)."""
        errored = self.errored
        if not errored:
            return errored
        self.errored = []
        return errored

    def check_fits(self, seq: Sequence) -> None:
        """Raise ``ValueError`` if ``seq`` could never run, even alone.

        Args:
            seq: A new sequence.

        Raises:
            ValueError: Its prompt is empty, its ``max_new_tokens`` is not a positive
                int, its prompt leaves no room within ``max_model_len``, or (paged
                mode) the whole pool could not hold it.
        """
        if seq.num_prompt_tokens < 1:
            raise ValueError(f"request {seq.request_id}: the prompt is empty")
        if type(seq.max_new_tokens) is not int or seq.max_new_tokens < 1:
            raise ValueError(
                f"request {seq.request_id}: max_new_tokens must be a positive int, "
                f"got {seq.max_new_tokens!r}"
            )
        longest = seq.num_prompt_tokens + seq.max_new_tokens
        limit = self.max_model_len
        if limit is not None and seq.num_prompt_tokens >= limit:
            raise ValueError(
                f"request {seq.request_id}: prompt of {seq.num_prompt_tokens} tokens leaves no "
                f"room to generate within max_model_len={limit}"
            )
        if limit is not None:
            longest = min(longest, limit)
        self.resources.check_pool_fits(seq, longest)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, in line by (priority, arrival).

        Args:
            seq: A new [`Sequence`][batchkit.generate.Sequence] (not queued before).

        Raises:
            ValueError: It can never fit (see
                [`check_fits`][batchkit.generate.StepScheduler.check_fits]).
            TypeError: Its ``group`` is not hashable.
        """
        try:
            hash(seq.group)
        except TypeError:
            raise TypeError(
                f"request {seq.request_id}: group must be hashable, "
                f"got a {type(seq.group).__name__}"
            ) from None
        self.check_fits(seq)
        self._arrivals += 1
        seq.order = self._arrivals
        seq.status = SeqStatus.WAITING
        self._enqueue(seq)
        if seq.deadline is not None:
            deadlines = self._deadlines
            heapq.heappush(deadlines, (seq.deadline, seq.order, seq))
            if len(deadlines) > 2 * len(self.waiting) + 64:
                # Entries of requests that started stay until their time passes: with
                # long timeouts, drop them now rather than hold their tokens.
                deadlines[:] = [d for d in deadlines if not d[2].started]
                heapq.heapify(deadlines)
        self.stats.requests += 1

    def _enqueue(self, seq: Sequence) -> None:
        """Insert by (priority, arrival): O(1) at either end, the common cases."""
        waiting = self.waiting
        key = (seq.priority, seq.order)
        if not waiting or key > (waiting[-1].priority, waiting[-1].order):
            waiting.append(seq)
        elif key < (waiting[0].priority, waiting[0].order):
            waiting.appendleft(seq)
        else:
            i = next(i for i, s in enumerate(waiting) if key < (s.priority, s.order))
            waiting.insert(i, seq)

    # -- scheduling -----------------------------------------------------------
    def schedule(self) -> StepBatch:
        """The next step's batch (possibly empty).

        Call [`update`][batchkit.generate.StepScheduler.update] with its tokens (or
        [`fail_step`][batchkit.generate.StepScheduler.fail_step]) before the next one.

        Scheduled in this order: waiting requests more urgent than some running
        sequence (preempting less urgent ones for their row and blocks); the running
        sequences; then other waiting ones, unless the step preempted for lack of
        blocks (with ``max_groups_per_step``, those the group limit lets in). The
        batch lists them in row order (by ``slot``), whatever the order they were
        scheduled in.

        Raises:
            RuntimeError: The last step's results were not applied yet.
        """
        if self._in_flight is not None:
            raise RuntimeError("schedule() called again before update() of the last step")
        self.started_now = []
        step = _Step(self.max_num_batched_tokens)
        self._admit_urgent(step)
        self._schedule_running(step)
        if not step.short_of_blocks:  # the memory is short: the preempted go first
            self._admit_waiting(step)

        scheduled, alloc, res = step.scheduled, self.allocator, self.resources
        # Row order, so that the batch depends on which rows run, not on how they came
        # to: a full batch's rows are 0 .. max_num_seqs-1, its per-row state as it is.
        scheduled.sort(key=_slot_of)
        rows = [s.slot for s in scheduled]
        num_padding = self._num_padding(len(scheduled))
        if num_padding:  # after the sequences: the step's rows are a size of the set
            scheduled = scheduled + [ScheduledSeq.padding() for _ in range(num_padding)]
        batch = StepBatch(scheduled, res.take_released(), self.stats.steps)
        batch.num_padding = num_padding
        if alloc is not None:
            batch.block_size = alloc.block_size
            batch.block_tables = res.block_tables(rows)  # type: ignore[arg-type]
        self._in_flight = batch
        tokens = self.max_num_batched_tokens - step.budget
        self.stats.record_step(
            seq_util=len(rows) / self.max_num_seqs,
            token_util=tokens / self.max_num_batched_tokens,
            tokens=tokens,
            requests_waiting=bool(self.waiting),
            allocator=alloc,
        )
        self.stats.record_group_step(batch.requests)
        self.stats.padding_rows += num_padding
        return batch

    def _num_padding(self, num_seqs: int) -> int:
        """Padding rows that bring a step of ``num_seqs`` sequences to a step size."""
        sizes = self.step_sizes
        if sizes is None:
            return 0
        return sizes[bisect.bisect_left(sizes, num_seqs)] - num_seqs

    def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
        """Tokens ``seq`` computes this step from ``start``: all it has left, within the
        budget left and ``max_prefill_chunk``."""
        return min(len(seq.token_ids) - start, budget, self.max_prefill_chunk)

    def _schedule_running(self, step: _Step) -> None:
        """Each running sequence: one decode token, or its next prefill chunk."""
        grow, cap, running_status = self.resources.grow, self.max_prefill_chunk, SeqStatus.RUNNING
        for seq in list(self.running):  # a copy: a preemption may remove any of them
            if step.budget <= 0:
                break
            if seq.in_step or seq.status is not running_status:
                continue  # just admitted, or preempted by an earlier one's need
            start = seq.num_computed_tokens
            n = min(len(seq.token_ids) - start, step.budget, cap)  # (what _chunk says)
            while not grow(seq, n):  # short of blocks
                victim = self._victim_for(seq)
                self._preempt(victim, step)
                step.short_of_blocks = True
                if victim is seq:
                    break
            if seq.status is running_status:  # (else it preempted itself: nobody gave way)
                step.add(seq, start, n)

    def _victim_for(self, needer: Sequence) -> Sequence:
        """The running sequence to preempt when ``needer`` needs a block and none is free:
        the least urgent (newest among equals), never one more urgent than ``needer``,
        and never one of its own priority still recomputing after a preemption (see
        `Sequence.recomputing`). ``needer`` itself when nobody else qualifies."""
        return max(
            (
                s
                for s in self.running
                if s is needer or not (s.recomputing and s.priority == needer.priority)
            ),
            key=_urgency_rank,
        )

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting sequences in line while rows, budget and blocks last (a sequence
        short of blocks stops the line); with a group limit, those it lets in."""
        waiting, running, max_seqs = self.waiting, self.running, self.max_num_seqs
        limit = self.max_groups_per_step
        if limit is None:
            while waiting and step.budget > 0 and len(running) < max_seqs:
                if not self._admit(waiting[0], step):
                    break
            return
        gate = GroupGate(limit, running, self.max_model_len)
        i = 0
        while i < len(waiting) and step.budget > 0 and len(running) < max_seqs:
            seq = waiting[i]
            if not gate.admits(seq):
                i += 1  # the limit (or the reservation) keeps it out: look behind it
                continue
            if not self._admit(seq, step, i):
                break
            gate.joined(seq)

    def _admit_urgent(self, step: _Step) -> None:
        """Admit waiting requests more urgent than a running sequence, preempting the
        least urgent running ones (newest among equals) for their row and blocks, so an
        urgent request starts at the next step instead of waiting for them to finish.
        One the group limit keeps out preempts a whole group too (see `group_to_free`)."""
        waiting, running, limit = self.waiting, self.running, self.max_groups_per_step
        while waiting and running and step.budget > 0:
            head = waiting[0]
            victims = sorted(  # the least urgent first
                (s for s in running if s.priority > head.priority),
                key=_urgency_rank,
                reverse=True,
            )
            at_least = 0
            if victims and limit is not None and blocked_by_limit(limit, running, head):
                group = group_to_free(head, running)
                if group is None:
                    return
                # That group first, so that the fewest preemptions include all of it.
                victims = group + [s for s in victims if s.group != group[0].group]
                at_least = len(group)
            if not victims or not self._free_room(head, victims, step, at_least):
                return
            if not self._admit(head, step):
                return

    def _free_room(
        self, head: Sequence, victims: list[Sequence], step: _Step, at_least: int = 0
    ) -> bool:
        """Preempt the first of ``victims`` (the least urgent first; at least
        ``at_least`` of them) until ``head`` has a row and the blocks to start; False,
        and nobody preempted, if all of them would not be enough. A victim frees only
        the blocks nobody else holds: those it shares with a sequence that stays (a
        prefix-cache hit) are not counted."""
        rows_short = max(len(self.running) + 1 - self.max_num_seqs, at_least)
        shorts = self.resources.blocks_short_after_preempting(
            head, self._blocks_span(head, step), victims
        )
        # The fewest preemptions that give both a row and the blocks.
        k = next((k for k, short in enumerate(shorts) if k >= rows_short and short <= 0), None)
        if k is None:
            return False
        for victim in victims[:k]:
            self._preempt(victim, step)
        return True

    def _admit(self, seq: Sequence, step: _Step, index: int = 0) -> bool:
        """Start (or restart) the waiting sequence at ``waiting[index]``; False if its
        blocks are short."""
        res = self.resources
        if self.allocator is not None and not res.admit_blocks(seq, self._blocks_span(seq, step)):
            return False
        if index:
            del self.waiting[index]
        else:
            self.waiting.popleft()
        start = seq.num_computed_tokens  # a prefix-cache hit computes nothing again
        n = self._chunk(seq, start, step.budget)
        seq.status = SeqStatus.RUNNING
        res.take_row(seq)
        grown = res.grow(seq, n)
        assert grown, "admit_blocks() checked that the blocks are free"
        self.running.append(seq)
        if not seq.started:
            self.started_now.append(seq)
            seq.started = True
            self.stats.group(seq.group).admitted += 1
        step.add(seq, start, n)
        return True

    def _blocks_span(self, seq: Sequence, step: _Step) -> int:
        """Tokens whose blocks must be free for a waiting ``seq`` to start: its first
        chunk; for a preempted one, its whole recompute. Readmitted sooner, with a
        small chunk, it would take blocks it then cannot keep, and two preempted
        sequences could take turns forever without either producing a token."""
        if seq.recomputing:
            return seq.num_tokens
        return min(step.budget, self.max_prefill_chunk)

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        """Back to waiting, in line by (priority, arrival); its blocks are freed and
        recomputed later. Scheduled in ``step`` already, it leaves the step."""
        if seq.in_step:
            step.drop(seq)
        self.running.remove(seq)
        self.resources.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.recomputing = True
        self._enqueue(seq)
        self.stats.preemptions += 1

    # -- results --------------------------------------------------------------
    def update(
        self, batch: StepBatch, tokens: list[int | None], now: float = 0.0
    ) -> list[Sequence]:
        """Apply a step's results: append each sampled token, retire finished sequences.

        A sequence cancelled while the step ran gets nothing (its token is dropped). A
        bad entry (not an integer token id, or None where the sequence must sample)
        fails its own sequence only, and so does an exception instance (with itself,
        e.g. [`next_tokens`][batchkit.generate.next_tokens]'s for logits that are not
        finite): see
        [`take_errored`][batchkit.generate.StepScheduler.take_errored].

        Args:
            batch: The batch of the last
                [`schedule`][batchkit.generate.StepScheduler.schedule].
            tokens: One entry per ``batch.seqs``, in order: the next token id, or
                ``None`` for a sequence that does not sample this step. The entries
                of padding rows are ignored, whatever they are.
            now: The time of the results, in seconds (for the token-latency
                statistics).

        Returns:
            The sequences that got a token.

        Raises:
            RuntimeError: ``batch`` is not the last scheduled one.
            ValueError: ``tokens`` has the wrong length; the whole step failed (as by
                [`fail_step`][batchkit.generate.StepScheduler.fail_step]).
        """
        if batch is not self._in_flight:
            raise RuntimeError("update() expects the batch of the last schedule()")
        if len(tokens) != len(batch.seqs):
            self.fail_step(batch)
            rows = f"{len(batch.seqs)} " + ("rows" if batch.num_padding else "sequences")
            raise ValueError(f"the step function returned {len(tokens)} results for {rows}")
        seqs = batch.requests
        if batch.num_padding:
            tokens = tokens[: len(seqs)]  # (padding rows: no request's, ignored)
        # Check every entry before applying any. A bad one fails only its own sequence:
        # it is aborted here (its token dropped, as for a cancel during the step), and
        # listed in ``errored`` with the reason in ``seq.error``.
        tokens, bad = check_step_tokens(seqs, tokens)
        for i, what in bad.items():
            seq = seqs[i].seq
            if seq.status is not SeqStatus.FINISHED:  # not cancelled during the step
                seq.error = (
                    contained(what, f"request {seq.request_id}", "the step function's entry")
                    if isinstance(what, BaseException)
                    else ValueError(f"request {seq.request_id}: the step function returned {what}")
                )
                self.abort(seq, "error")  # in_step: its blocks are freed below
                self.errored.append(seq)
        self._in_flight = None
        alloc = self.allocator
        prefix = None if alloc is None else alloc.prefix
        produced: list[Sequence] = []
        any_finished = False
        max_len = self.max_model_len
        st = self.stats
        ttft, itl = st.ttft, st.itl
        finished_status, running_status = SeqStatus.FINISHED, SeqStatus.RUNNING
        for sched, token in zip(seqs, tokens):
            seq = sched.seq
            seq.in_step = False
            if seq.status is finished_status:  # cancelled during the step
                self.resources.free(seq)
                any_finished = True
                continue
            computed = sched.start + sched.num_tokens
            seq.num_computed_tokens = computed
            if prefix is not None:
                self.resources.cache_full_blocks(seq, sched.start, computed)
            ids = seq.token_ids
            if computed < len(ids):
                continue  # a prefill chunk: nothing sampled yet
            tok: int = token  # type: ignore[assignment]  # an int: checked above
            ids.append(tok)
            seq.recomputing = False  # progress: it may be preempted again
            generated = len(ids) - seq.num_prompt_tokens
            if generated == 1:
                ttft.append(now - seq.arrival_time)
            else:
                gap = now - seq.last_token_time
                seq.last_token_gap = gap
                itl.append(gap)
            seq.last_token_time = now
            produced.append(seq)
            if tok in seq.stop_token_ids:
                seq.finish_reason = "stop"
            elif generated >= seq.max_new_tokens or (max_len is not None and len(ids) >= max_len):
                seq.finish_reason = "length"
            else:
                continue
            seq.status = finished_status
            self.resources.free(seq)
            st.finished += 1
            any_finished = True
        st.tokens_generated += len(produced)
        st.record_group_tokens(produced)
        if any_finished:
            self.running = [s for s in self.running if s.status is running_status]
        return produced

    # -- leaving early ----------------------------------------------------------
    def abort(self, seq: Sequence, reason: str = "cancelled") -> bool:
        """Finish ``seq`` now; False if it had finished already.

        During a step its resources stay held until
        [`update`][batchkit.generate.StepScheduler.update] (the step may be writing them);
        that step's token is then dropped.

        Args:
            seq: A waiting or running sequence.
            reason: Its finish reason, counted in the statistics: ``"cancelled"``,
                ``"timeout"``, or anything else as a failure (e.g. ``"error"``).
        """
        if seq.status is SeqStatus.FINISHED:
            return False
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if not seq.in_step:
            if self.resources.holds_any(seq):
                self.resources.free(seq)
                self.running = [s for s in self.running if s is not seq]
        else:
            self.running = [s for s in self.running if s is not seq]
        if reason == "cancelled":
            self.stats.cancelled += 1
        elif reason == "timeout":
            self.stats.timeouts += 1
        else:
            self.stats.failed += 1
        return True

    def fail_step(self, batch: StepBatch, reason: str = "error") -> list[Sequence]:
        """The step of ``batch`` failed: abort its sequences (their state is unknown).

        Args:
            batch: The batch of the last
                [`schedule`][batchkit.generate.StepScheduler.schedule].
            reason: The aborted sequences' finish reason.

        Returns:
            The sequences aborted (those not finished already).

        Raises:
            RuntimeError: ``batch`` is not the last scheduled one.
        """
        if batch is not self._in_flight:
            raise RuntimeError("fail_step() expects the batch of the last schedule()")
        self._in_flight = None
        seqs = [s.seq for s in batch.requests]
        for seq in seqs:
            seq.in_step = False
        for seq in seqs:  # cancelled during the step: its resources are still held
            if seq.status is SeqStatus.FINISHED and self.resources.holds_any(seq):
                self.resources.free(seq)
        return self.fail(seqs, reason)

    def fail(self, seqs: list[Sequence], reason: str = "error") -> list[Sequence]:
        """Abort each sequence (e.g. the step function raised).

        Args:
            seqs: Sequences of this scheduler.
            reason: Their finish reason (see [`abort`][batchkit.generate.StepScheduler.abort]).

        Returns:
            Those aborted (those not finished already).
        """
        return [s for s in seqs if self.abort(s, reason)]

    def expire(self, now: float) -> list[Sequence]:
        """Drop waiting sequences whose deadline passed before they first ran.

        Args:
            now: The current time, on the clock of the sequences' deadlines.

        Returns:
            The sequences that timed out (finish reason ``"timeout"``).
        """
        out: list[Sequence] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, _, seq = heapq.heappop(deadlines)
            if not seq.started and seq.status is SeqStatus.WAITING:
                self.abort(seq, "timeout")
                out.append(seq)
        return out

    def abort_all(self, reason: str) -> list[Sequence]:
        """Abort every waiting and running sequence.

        Args:
            reason: Their finish reason (see [`abort`][batchkit.generate.StepScheduler.abort]).

        Returns:
            Those aborted.
        """
        return self.fail(list(self.waiting) + list(self.running), reason)


def _step_sizes(sizes: object, max_num_seqs: int) -> tuple[int, ...] | None:
    """``step_sizes`` as sorted distinct positive ints (a ``ShapeBuckets``' batch
    sizes), the largest at least ``max_num_seqs``; a clear error otherwise."""
    if sizes is None:
        return None
    if isinstance(sizes, ShapeBuckets):
        sizes = sizes.batch_sizes
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise TypeError(f"step_sizes must be None, ShapeBuckets or ints, got {sizes!r}")
    found: set[int] = set()
    for i, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise TypeError(f"step_sizes[{i}] must be an int, got {type(size).__name__} {size!r}")
        if size < 1:
            raise ValueError(f"step_sizes[{i}] must be >= 1, got {size!r}")
        found.add(int(size))
    if not found:
        raise ValueError("step_sizes must name at least one size")
    if max(found) < max_num_seqs:
        raise ValueError(
            f"step_sizes {sorted(found)} has no size for a step of max_num_seqs={max_num_seqs} "
            "sequences: add one, or lower max_num_seqs"
        )
    return tuple(sorted(found))


_slot_of = operator.attrgetter("slot")  # a scheduled sequence's row (a step's sort key)


def _urgency_rank(seq: Sequence) -> tuple[int, int]:
    """Sorts the least urgent last: highest priority value, then the newest arrival."""
    return seq.priority, seq.order


class _Step:
    """The step being scheduled: its sequences so far and the token budget left."""

    __slots__ = ("scheduled", "budget", "short_of_blocks")

    def __init__(self, budget: int) -> None:
        self.scheduled: list[ScheduledSeq] = []
        self.budget = budget
        self.short_of_blocks = False  # a running sequence preempted another for a block

    def add(self, seq: Sequence, start: int, num_tokens: int) -> None:
        """Compute ``num_tokens`` of ``seq`` from ``start`` in this step."""
        seq.in_step = True
        self.scheduled.append(ScheduledSeq(seq, start, num_tokens))
        self.budget -= num_tokens

    def drop(self, seq: Sequence) -> None:
        """``seq`` was preempted after it was scheduled: it leaves, its tokens return."""
        i = next(i for i, s in enumerate(self.scheduled) if s.seq is seq)
        self.budget += self.scheduled.pop(i).num_tokens
        seq.in_step = False
