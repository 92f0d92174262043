"""Counters of a continuous batcher, and the snapshot ``batcher.stats()`` returns."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchkit.percentiles import SAMPLE_WINDOW, Percentiles

if TYPE_CHECKING:
    from batchkit.generate.sequence import ScheduledSeq, Sequence
    from batchkit.kv.allocator import BlockAllocator


@dataclass(frozen=True)
class GenerationGroupStats:
    """One group's share of a continuous batcher (``submit(..., group=...)``).

    Attributes:
        admitted: Its requests that started (ran a first step).
        steps: Steps that computed at least one of its sequences.
        tokens_computed: Tokens computed for it (prompts, recomputation and decode).
        tokens_generated: Tokens sampled for it.
    """

    admitted: int
    steps: int
    tokens_computed: int
    tokens_generated: int


@dataclass(slots=True)
class _GroupCounts:
    """The mutable counters behind one `GenerationGroupStats`."""

    admitted: int = 0
    steps: int = 0
    tokens_computed: int = 0
    tokens_generated: int = 0


@dataclass(frozen=True)
class GenerationStats:
    """A snapshot of one continuous batcher since it was created.

    Utilisations are means over steps: ``slot_utilisation`` is sequences per step over
    ``max_num_seqs`` (``slot_utilisation_waiting`` the same, over the steps that left
    requests waiting), ``token_budget_utilisation`` tokens per step over
    ``max_num_batched_tokens``. KV figures are paged mode only (0 otherwise):
    ``kv_usage`` now, ``mean_kv_usage`` and ``mean_kv_waste`` (internal waste, see
    [`AllocatorStats`][batchkit.kv.AllocatorStats]) over steps.

    Attributes:
        requests: Requests submitted (refused ones not counted).
        finished: Requests that ended at a stop token or a length limit.
        cancelled: Requests cancelled.
        timeouts: Requests that timed out before they started.
        failed: Requests that failed (the step function raised or returned a bad
            entry, or ``close`` cut them).
        steps: Steps run.
        running: Sequences running now.
        waiting: Sequences waiting now (new or preempted).
        preemptions: Times a running sequence was preempted (to be recomputed).
        tokens_generated: Tokens sampled.
        tokens_computed: Tokens computed (prompts, recomputation and decode).
        padding_rows: Padding rows the steps computed besides (``step_sizes``), one
            token each: what the fixed step sizes cost.
        slot_utilisation: Mean sequences per step over ``max_num_seqs``.
        slot_utilisation_waiting: The same, over the steps that left requests waiting.
        token_budget_utilisation: Mean tokens per step over ``max_num_batched_tokens``.
        kv_usage: Share of KV blocks in use now.
        mean_kv_usage: Mean share of KV blocks in use, over steps.
        mean_kv_waste: Mean internal waste of the blocks in use, over steps.
        prefix_hit_rate: Share of queried full prompt blocks found in the prefix cache.
        time_to_first_token: Seconds from submit to the first token, over recent
            requests.
        inter_token_latency: Seconds between consecutive tokens, over recent tokens.
        groups: Group -> its
            [`GenerationGroupStats`][batchkit.generate.GenerationGroupStats], for every
            group that started a request (``None``: the default group).
    """

    requests: int
    finished: int
    cancelled: int
    timeouts: int
    failed: int
    steps: int
    running: int
    waiting: int
    preemptions: int
    tokens_generated: int
    tokens_computed: int
    padding_rows: int
    slot_utilisation: float
    slot_utilisation_waiting: float
    token_budget_utilisation: float
    kv_usage: float
    mean_kv_usage: float
    mean_kv_waste: float
    prefix_hit_rate: float
    time_to_first_token: Percentiles
    inter_token_latency: Percentiles
    groups: dict[Hashable, GenerationGroupStats]


@dataclass
class GenerationStatsRecorder:
    """Mutable counters; updated by the scheduler under its owner's lock.

    Constructed empty (every field has its default); the fields are those of
    [`GenerationStats`][batchkit.GenerationStats] plus the running sums its means
    are made of.
    """

    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    timeouts: int = 0
    failed: int = 0
    steps: int = 0
    preemptions: int = 0
    tokens_generated: int = 0
    tokens_computed: int = 0
    padding_rows: int = 0
    seqs_sum: float = 0.0  # sum over steps of scheduled/max_num_seqs
    waiting_steps: int = 0
    seqs_sum_waiting: float = 0.0
    tokens_sum: float = 0.0  # sum over steps of tokens/max_num_batched_tokens
    kv_steps: int = 0
    kv_usage_sum: float = 0.0
    kv_waste_sum: float = 0.0
    ttft: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))
    itl: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))
    # One entry per group ever started: groups are few (adapters, tasks), not per user.
    groups: dict[Hashable, _GroupCounts] = field(default_factory=dict)

    def group(self, group: Hashable) -> _GroupCounts:
        """The counters of ``group`` (created on first use).

        Args:
            group: A sequence's group.
        """
        counts = self.groups.get(group)
        if counts is None:
            counts = self.groups[group] = _GroupCounts()
        return counts

    def record_group_step(self, scheduled: Iterable[ScheduledSeq]) -> None:
        """Account one step's tokens computed, and the step itself, to each group in it.

        Args:
            scheduled: The step's sequences.
        """
        tokens: dict[Hashable, int] = {}
        for s in scheduled:
            tokens[s.group] = tokens.get(s.group, 0) + s.num_tokens
        for group, n in tokens.items():
            counts = self.group(group)
            counts.steps += 1
            counts.tokens_computed += n

    def record_group_tokens(self, produced: Iterable[Sequence]) -> None:
        """Account one step's sampled tokens to their groups.

        Args:
            produced: The sequences that got a token in the step.
        """
        groups = self.groups
        for seq in produced:
            groups[seq.group].tokens_generated += 1  # started: its entry exists

    def record_step(
        self,
        *,
        seq_util: float,
        token_util: float,
        tokens: int,
        requests_waiting: bool,
        allocator: BlockAllocator | None,
    ) -> None:
        """Account one scheduled step: slot and token-budget use, KV use and waste.

        Args:
            seq_util: Sequences in the step over ``max_num_seqs``.
            token_util: Tokens in the step over ``max_num_batched_tokens``.
            tokens: Tokens computed in the step.
            requests_waiting: Whether requests were left waiting.
            allocator: The KV pool (paged mode), or None.
        """
        self.steps += 1
        self.seqs_sum += seq_util
        if requests_waiting:
            self.waiting_steps += 1
            self.seqs_sum_waiting += seq_util
        self.tokens_sum += token_util
        self.tokens_computed += tokens
        if allocator is not None:
            used = allocator.num_used
            self.kv_steps += 1
            self.kv_usage_sum += used / allocator.num_blocks
            if used:
                self.kv_waste_sum += 1.0 - allocator.tokens_stored / (used * allocator.block_size)

    def snapshot(
        self, *, running: int, waiting: int, kv_usage: float, prefix_hit_rate: float
    ) -> GenerationStats:
        """Freeze the current values.

        Args:
            running: Sequences running now.
            waiting: Sequences waiting now.
            kv_usage: Share of KV blocks in use now (0 in slotted mode).
            prefix_hit_rate: The pool's prefix-cache hit rate (0 without one).
        """
        steps = self.steps or 1
        return GenerationStats(
            requests=self.requests,
            finished=self.finished,
            cancelled=self.cancelled,
            timeouts=self.timeouts,
            failed=self.failed,
            steps=self.steps,
            running=running,
            waiting=waiting,
            preemptions=self.preemptions,
            tokens_generated=self.tokens_generated,
            tokens_computed=self.tokens_computed,
            padding_rows=self.padding_rows,
            slot_utilisation=self.seqs_sum / steps,
            slot_utilisation_waiting=(
                self.seqs_sum_waiting / self.waiting_steps if self.waiting_steps else 0.0
            ),
            token_budget_utilisation=self.tokens_sum / steps,
            kv_usage=kv_usage,
            mean_kv_usage=self.kv_usage_sum / self.kv_steps if self.kv_steps else 0.0,
            mean_kv_waste=self.kv_waste_sum / self.kv_steps if self.kv_steps else 0.0,
            prefix_hit_rate=prefix_hit_rate,
            time_to_first_token=Percentiles.of(self.ttft),
            inter_token_latency=Percentiles.of(self.itl),
            groups={
                group: GenerationGroupStats(
                    c.admitted, c.steps, c.tokens_computed, c.tokens_generated
                )
                for group, c in self.groups.items()
            },
        )
