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

    A **padding row** (``is_padding`` True; see ``ContinuousBatcher``'s
    ``step_sizes``) stands for no request: ``request_id`` -1, one token (id 0) at
    ``start`` 0, ``slot`` and ``block_ids`` None, ``sample`` True. Compute it like
    any row (so that the step's shape is the captured one); its result entry is
    ignored, whatever it is.

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
        "is_padding",
    )

    def __init__(self, seq: Sequence, start: int, num_tokens: int) -> None:
        self.is_padding = seq is _PADDING
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

    @classmethod
    def padding(cls) -> ScheduledSeq:
        """A padding row: no request's, its result ignored (see the class)."""
        return cls(_PADDING, 0, 1)

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


# The sequence every padding row points at: no request's, finished from the start (so
# nothing that aborts or frees a step's sequences can act on it), its one token id 0.
_PADDING = Sequence(-1, [0], max_new_tokens=1)
_PADDING.status = SeqStatus.FINISHED


@dataclass(eq=False)
class StepBatch:
    """What one step computes: ``seqs`` (in row order), plus who left since the last step.

    ``released`` lists request ids that finished, were cancelled or preempted since the
    previous step: drop their state (a preempted one comes back later with ``start=0``).
    ``layout`` (paged mode only) is built on first access.

    With ``step_sizes`` (see ``ContinuousBatcher``), ``seqs`` ends with
    ``num_padding`` padding rows (``ScheduledSeq.is_padding``) that bring it to a
    size of the set; ``requests`` are the rows before them.

    Attributes:
        seqs: The rows computed: the sequences in row order, then any padding rows.
        released: Request ids that left since the previous step.
        step: The step's number, from 0.
        block_size: Tokens per KV block (paged mode), or None.
        block_tables: Int32 ``[B, max blocks]``, ``-1`` padded (paged mode), or None;
            the requests' rows only (``layout`` adds the padding rows').
        num_padding: The padding rows at the end of ``seqs``.
    """

    seqs: list[ScheduledSeq]
    released: list[int]
    step: int
    block_size: int | None = None
    block_tables: np.ndarray | None = None  # [B, max blocks] int32, -1 padded (paged mode)
    num_padding: int = 0
    _layout: StepLayout | None = None

    @property
    def requests(self) -> list[ScheduledSeq]:
        """The rows of sequences: ``seqs`` without the padding rows."""
        return self.seqs[: len(self.seqs) - self.num_padding] if self.num_padding else self.seqs

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step, all rows together (padding rows included)."""
        return sum(s.num_tokens for s in self.seqs)

    @property
    def layout(self) -> StepLayout:
        """The paged-attention layout of this step (``ValueError`` in slotted mode).

        Padding rows come last: each computes one token (id 0, position 0) that
        writes nothing (``slot_mapping`` ``-1``) and attends to one key read from
        block 0 (``seq_lens`` 1, its block table ``[0, -1, ...]``), so every index a
        kernel reads is valid and no sequence's cache changes.
        """
        if self._layout is None:
            if self.block_size is None:
                raise ValueError("no layout in slotted mode: pass allocator= for paged mode")
            seqs, tables = self.requests, self.block_tables
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
            self._layout = _with_padding_rows(self._layout, self.num_padding)
        return self._layout

    def __len__(self) -> int:
        return len(self.seqs)

    def __iter__(self) -> Any:
        return iter(self.seqs)


def _with_padding_rows(layout: StepLayout, num_rows: int) -> StepLayout:
    """``layout`` with ``num_rows`` padding rows after its sequences, as
    `StepBatch.layout` describes them."""
    if num_rows == 0:
        return layout
    total, nseq = layout.num_tokens, layout.num_seqs
    tables = layout.block_tables
    padded_tables = np.full((nseq + num_rows, max(tables.shape[1], 1)), -1, dtype=np.int32)
    padded_tables[:nseq, : tables.shape[1]] = tables
    padded_tables[nseq:, 0] = 0
    new_rows = np.arange(1, num_rows + 1, dtype=np.int32)
    return StepLayout(
        input_ids=np.concatenate([layout.input_ids, np.zeros(num_rows, dtype=np.int64)]),
        positions=np.concatenate([layout.positions, np.zeros(num_rows, dtype=np.int64)]),
        slot_mapping=np.concatenate([layout.slot_mapping, np.full(num_rows, -1, dtype=np.int64)]),
        cu_seqlens_q=np.concatenate([layout.cu_seqlens_q, layout.cu_seqlens_q[-1] + new_rows]),
        cu_seqlens_k=np.concatenate([layout.cu_seqlens_k, layout.cu_seqlens_k[-1] + new_rows]),
        seq_lens=np.concatenate([layout.seq_lens, np.ones(num_rows, dtype=np.int32)]),
        block_tables=padded_tables,
        max_seqlen_q=max(layout.max_seqlen_q, 1),
        max_seqlen_k=max(layout.max_seqlen_k, 1),
        logits_indices=np.concatenate(
            [layout.logits_indices, np.arange(total, total + num_rows, dtype=np.int64)]
        ),
    )
