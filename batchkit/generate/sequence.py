"""One generation request's state, and the per-step views the step function sees."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from batchkit.generate.sampling import Sampling, TokenSampler, sampler_for
from batchkit.generate.waiters import Outcome
from batchkit.kv.block_table import BlockTable
from batchkit.kv.layout import StepLayout, build_decode_layout, build_layout


class SeqStatus(IntEnum):
    """waiting -> running -> finished; a preempted sequence goes back to waiting."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    """A request being generated: its tokens, progress, and the resources it holds.

    ``prompt_ids`` becomes ``token_ids`` as it is (no copy): generated tokens are
    appended to it. ``ContinuousBatcher.submit`` passes its own copy; code driving the
    [`StepScheduler`][batchkit.generate.StepScheduler] directly should do the same if it
    keeps the prompt list.

    Args:
        request_id: The request's id, as the step function sees it.
        prompt_ids: The prompt's token ids (kept, not copied).
        max_new_tokens: The most tokens to generate.
        stop_token_ids: Tokens that end the request (included in its output).
        priority: Lower values are served first.
        arrival_time: When it arrived, in seconds (for the latency statistics).
        deadline: The time by which it must have started, or it times out (see
            [`StepScheduler.expire`][batchkit.generate.StepScheduler.expire]); ``None``: never.
        sampling: How it picks its tokens; ``None``: greedy.
        group: The group it belongs to (an adapter, a task): any hashable; ``None``
            is the one default group. See ``StepScheduler``'s ``max_groups_per_step``.
    """

    __slots__ = (
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "max_new_tokens",
        "stop_token_ids",
        "priority",
        "order",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "slot",
        "block_table",
        "finish_reason",
        "in_step",
        "started",
        "recomputing",
        "arrival_time",
        "last_token_time",
        "last_token_gap",
        "deadline",
        "handle",
        "outcome",
        "error",
        "sampling",
        "sampler",
        "group",
    )

    def __init__(
        self,
        request_id: int,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        stop_token_ids: frozenset[int] = frozenset(),
        priority: int = 0,
        arrival_time: float = 0.0,
        deadline: float | None = None,
        sampling: Sampling | None = None,
        group: Hashable = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = prompt_ids  # prompt, then every generated token
        self.num_prompt_tokens = len(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = stop_token_ids
        self.priority = priority
        self.order = 0  # arrival rank, set by the scheduler: ties go first-come
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose keys/values (or state) exist
        self.num_cached_tokens = 0  # of which came from the prefix cache, over its life
        self.slot: int | None = None
        self.block_table: BlockTable | None = None
        self.finish_reason: str | None = None  # "stop", "length", "cancelled", "timeout", "error"
        self.in_step = False  # part of the batch the step function is computing now
        self.started = False  # scheduled at least once (a timeout no longer applies)
        # Preempted, and no token since: no sequence of its own priority may preempt it.
        self.recomputing = False
        self.arrival_time = arrival_time
        self.last_token_time = 0.0
        self.last_token_gap = 0.0  # seconds between its last two tokens
        self.deadline = deadline
        self.handle: Any = None  # the driver's GenerationHandle, if any
        self.outcome: Outcome | None = None  # the driver's: who waits for this request
        self.error: BaseException | None = None  # why it failed alone (a bad step result)
        self.sampling = sampling
        # Its own generator, kept for its whole life: a preempted sequence recomputes
        # its tokens, it does not draw them again.
        self.sampler: TokenSampler | None = sampler_for(sampling)
        self.group = group  # kept through preemption: a recomputed sequence stays in it

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        """Whether the sequence left for good."""
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(request_id={self.request_id}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


class ScheduledSeq:
    """One sequence's share of a step, as the step function sees it.

    Compute tokens ``token_ids[start : start + num_tokens]`` (the earlier ``start``
    are computed already); if ``sample``, return its next token, else ``None``.
    ``token_ids`` is the live list: read it, do not change it. The scheduler builds
    it; ``slot`` and ``block_ids`` are the sequence's row and (paged mode) KV blocks;
    ``sampling`` is the request's [`Sampling`][batchkit.generate.Sampling] (``None``:
    greedy) and ``sampler`` its [`TokenSampler`][batchkit.generate.TokenSampler]
    (``None`` when greedy), for [`next_tokens`][batchkit.generate.next_tokens];
    ``group`` is the request's group (``submit(..., group=...)``; ``None``: the
    default group), so that a step function can pick the adapter or task per row.

    Args:
        seq: The scheduled sequence.
        start: Its first token computed this step (the earlier ones are computed).
        num_tokens: Tokens it computes this step.
    """

    __slots__ = (
        "request_id",
        "token_ids",
        "start",
        "num_tokens",
        "slot",
        "block_ids",
        "seq",
        "sampling",
        "sampler",
        "group",
    )

    def __init__(self, seq: Sequence, start: int, num_tokens: int) -> None:
        self.seq = seq
        self.request_id = seq.request_id
        self.token_ids = seq.token_ids
        self.start = start
        self.num_tokens = num_tokens
        self.slot = seq.slot
        table = seq.block_table
        self.block_ids: list[int] | None = None if table is None else table.block_ids
        self.sampling = seq.sampling
        self.sampler = seq.sampler
        self.group = seq.group

    @property
    def sample(self) -> bool:
        """Whether this step reaches the sequence's last token (so it samples the next)."""
        return self.start + self.num_tokens == len(self.token_ids)

    @property
    def is_prefill(self) -> bool:
        """Whether this chunk computes prompt (or recomputed) tokens rather than one decode."""
        return self.start + 1 < len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"ScheduledSeq(request_id={self.request_id}, start={self.start}, "
            f"num_tokens={self.num_tokens}, slot={self.slot})"
        )


@dataclass(eq=False)
class StepBatch:
    """What one step computes: ``seqs`` (in row order), plus who left since the last step.

    ``released`` lists request ids that finished, were cancelled or preempted since the
    previous step: drop their state (a preempted one comes back later with ``start=0``).
    ``layout`` (paged mode only) is built on first access.

    Attributes:
        seqs: The sequences computed, in row order.
        released: Request ids that left since the previous step.
        step: The step's number, from 0.
        block_size: Tokens per KV block (paged mode), or None.
        block_tables: Int32 ``[B, max blocks]``, ``-1`` padded (paged mode), or None.
    """

    seqs: list[ScheduledSeq]
    released: list[int]
    step: int
    block_size: int | None = None
    block_tables: np.ndarray | None = None  # [B, max blocks] int32, -1 padded (paged mode)
    _layout: StepLayout | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step, all sequences together."""
        return sum(s.num_tokens for s in self.seqs)

    @property
    def layout(self) -> StepLayout:
        """The paged-attention layout of this step (``ValueError`` in slotted mode)."""
        if self._layout is None:
            if self.block_size is None:
                raise ValueError("no layout in slotted mode: pass allocator= for paged mode")
            seqs, tables = self.seqs, self.block_tables
            if tables is not None and [s.num_tokens for s in seqs].count(1) == len(seqs):
                # decode-only, most steps: the cheaper layout
                self._layout = build_decode_layout(
                    [s.token_ids[s.start] for s in seqs],
                    [s.start for s in seqs],
                    [s.block_ids or [] for s in seqs],
                    self.block_size,
                    block_tables=tables,
                )
            else:
                self._layout = build_layout(
                    [s.token_ids for s in seqs],
                    [s.start for s in seqs],
                    [s.num_tokens for s in seqs],
                    [s.block_ids or [] for s in seqs],
                    self.block_size,
                    block_tables=tables,
                )
        return self._layout

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Any:
        return iter(self.seqs)
