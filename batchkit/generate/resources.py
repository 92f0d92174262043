"""What the scheduler's sequences hold while they run: a row each and, in paged mode, KV blocks.

:class:`SeqResources` (a mixin of :class:`~batchkit.generate.scheduler.Scheduler`)
checks that a request could ever fit the KV pool, gives a waiting sequence its blocks
(adopting any prefix-cache hit), registers the blocks a step completed in the prefix
cache, and takes rows and blocks back when a sequence finishes or is preempted. The
scheduler decides who runs; per-step growth of a running sequence (the decode fast
path) stays inline in :meth:`~batchkit.generate.scheduler.Scheduler.schedule`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from batchkit.generate.sequence import SeqStatus, Sequence
from batchkit.generate.stats import GenerationStatsRecorder
from batchkit.kv.allocator import BlockAllocator
from batchkit.kv.block_table import BlockTable, blocks_for


class SeqResources:
    """Rows and KV blocks of the scheduler's sequences: taken, registered, given back (a
    mixin of :class:`~batchkit.generate.scheduler.Scheduler`, which sets the state below)."""

    allocator: BlockAllocator | None
    running: list[Sequence]
    stats: GenerationStatsRecorder
    _free_slots: list[int]  # a heap: lowest free row first
    _released: list[int]  # ids freed since the last step, for the next StepBatch
    _enqueue: Callable[[Sequence], None]  # the scheduler's: into the waiting line, in order

    def _check_pool_fits(self, seq: Sequence, longest: int) -> None:
        """Raise ``ValueError`` if ``longest`` tokens of ``seq`` could never fit the KV pool."""
        alloc = self.allocator
        if alloc is not None:
            # The last generated token is returned, never computed: it needs no KV slot.
            need = blocks_for(longest - 1, alloc.block_size)
            if need > alloc.num_blocks:
                raise ValueError(
                    f"request {seq.request_id} can never fit: {seq.num_prompt_tokens} prompt + "
                    f"{seq.max_new_tokens} new tokens need {need} KV blocks of "
                    f"{alloc.block_size}, the pool has {alloc.num_blocks}"
                )

    def _admit_blocks(self, seq: Sequence, budget: int) -> bool:
        """Give a waiting sequence its table (with any prefix hit); False if blocks are short."""
        alloc = self.allocator
        assert alloc is not None
        # Check before taking anything: a sequence short of blocks holds no memory, and
        # its lookups (repeated every step it waits) do not count as prefix queries.
        hits = alloc.match_prefix(seq.token_ids)
        cached = len(hits) * alloc.block_size
        n = min(seq.num_tokens - cached, budget)
        need = blocks_for(cached + n, alloc.block_size) - len(hits)
        if need + (alloc.num_revived(hits) if hits else 0) > alloc.num_free:
            return False
        table = BlockTable(alloc)
        if alloc.adopt_prefix(seq.token_ids, hits):  # retained now; a miss is counted too
            table.adopt(hits, cached)
        seq.block_table = table
        seq.num_computed_tokens = table.num_tokens
        seq.num_cached_tokens += table.num_tokens
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Back to waiting, first in line; its blocks are freed and recomputed later."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        self._enqueue(seq)
        self.stats.preemptions += 1

    def _free(self, seq: Sequence) -> None:
        """Give back the sequence's blocks and row, and tell the step function."""
        if seq.block_table is not None:
            seq.block_table.free()
            seq.block_table = None
        if seq.slot is not None:
            heapq.heappush(self._free_slots, seq.slot)
            seq.slot = None
        self._released.append(seq.request_id)

    def _cache_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Register the blocks this step completed (their keys/values now exist)."""
        alloc = self.allocator
        assert alloc is not None and alloc.prefix is not None and seq.block_table is not None
        bs = alloc.block_size
        blocks = seq.block_table.block_ids
        for j in range(start // bs, end // bs):
            alloc.prefix.insert(
                blocks[j], blocks[j - 1] if j else -1, seq.token_ids[j * bs : (j + 1) * bs]
            )
