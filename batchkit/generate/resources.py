"""What the scheduler's sequences hold while they run: a row each and, in paged mode, KV blocks.

`SeqResources` (held by the `StepScheduler`) checks that a request could ever fit the KV
pool, gives a sequence its row and its blocks (adopting any prefix-cache hit of its
group), grows its blocks step by step, registers the blocks a step completed in the
prefix cache under its group (an adapter's keys and values are its own), and takes
rows and blocks back when a sequence finishes or is preempted. The scheduler decides
who runs.
"""

from __future__ import annotations

import heapq

import numpy as np

from batchkit.generate.sequence import Sequence
from batchkit.kv.allocator import BlockAllocator, OutOfBlocks
from batchkit.kv.block_table import BlockTable, BlockTableRows, blocks_for


class SeqResources:
    """Rows (``max_num_seqs``) and, with an ``allocator``, KV blocks of running sequences.

    Args:
        max_num_seqs: Rows, ``0 .. max_num_seqs-1``.
        allocator: The KV pool (paged mode), or None (slotted mode: rows only).
    """

    def __init__(self, max_num_seqs: int, allocator: BlockAllocator | None) -> None:
        self.allocator = allocator
        self._free_rows = list(range(max_num_seqs))  # a heap: lowest free row first
        self._tables = BlockTableRows(max_num_seqs)  # paged mode: block tables by row
        self._released: list[int] = []  # ids freed since the last step, for the next StepBatch

    @property
    def num_free_rows(self) -> int:
        """Rows no sequence holds."""
        return len(self._free_rows)

    def check_pool_fits(self, seq: Sequence, longest: int) -> None:
        """Raise ``ValueError`` if ``longest`` tokens of ``seq`` could never fit the KV pool.

        Args:
            seq: A new sequence.
            longest: The most tokens it can reach (prompt plus generated).
        """
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

    def _start_plan(self, seq: Sequence, chunk: int) -> tuple[int, list[int]]:
        """(free blocks needed, prefix-cache hit) for ``seq`` to start with ``chunk`` tokens:
        the hit's free blocks are counted in (adopting them takes them from the pool), and
        nothing is taken or counted as a lookup."""
        alloc = self.allocator
        assert alloc is not None
        hits = alloc.match_prefix(seq.token_ids, group=seq.group)  # its adapter's blocks only
        cached = len(hits) * alloc.block_size
        n = min(seq.num_tokens - cached, chunk)
        need = blocks_for(cached + n, alloc.block_size) - len(hits)
        return need + (alloc.num_revived(hits) if hits else 0), hits

    def admit_blocks(self, seq: Sequence, chunk: int) -> bool:
        """Give a waiting sequence its table (with any prefix hit); False if blocks are short.

        Args:
            seq: A waiting sequence (paged mode).
            chunk: The most tokens it will compute in its first step.
        """
        alloc = self.allocator
        assert alloc is not None
        # Check before taking anything: a sequence short of blocks holds no memory, and
        # its lookups (repeated every step it waits) do not count as prefix queries.
        need, hits = self._start_plan(seq, chunk)
        if need > alloc.num_free:
            return False
        table = BlockTable(alloc)
        if alloc.adopt_prefix(seq.token_ids, hits):  # retained now; a miss is counted too
            table.adopt(hits, len(hits) * alloc.block_size)
        seq.block_table = table
        seq.num_computed_tokens = table.num_tokens
        seq.num_cached_tokens += table.num_tokens
        return True

    def take_row(self, seq: Sequence) -> None:
        """Give an admitted sequence the lowest free row.

        Args:
            seq: The sequence (a free row must exist).
        """
        seq.slot = heapq.heappop(self._free_rows)
        if seq.block_table is not None:
            self._tables.assign(seq.slot, seq.block_table.block_ids)

    def blocks_short_after_preempting(
        self, seq: Sequence, chunk: int, victims: list[Sequence]
    ) -> list[int]:
        """Blocks a waiting ``seq`` would still lack to start with (at most) ``chunk``
        tokens after preempting none, the first, the first two, ... of ``victims``
        (``len(victims) + 1`` counts; 0 or less: it fits). Nothing is taken or freed.

        Only blocks whose every reference the victims hold come free: one shared with a
        sequence that keeps running (a prefix-cache hit) stays. Nor does a block of
        ``seq``'s own prefix-cache hit count as gained: freed, it is taken back at once.
        Always zeros in slotted mode.

        Args:
            seq: A waiting sequence.
            chunk: The most tokens it would compute in its first step.
            victims: Running sequences, in the order they would be preempted.
        """
        alloc = self.allocator
        if alloc is None:
            return [0] * (len(victims) + 1)
        need, hits = self._start_plan(seq, chunk)
        short = need - alloc.num_free
        out = [short]
        kept = set(hits)
        left: dict[int, int] = {}  # block -> references left after the preemptions so far
        refcounts = alloc.refcounts
        for victim in victims:
            table = victim.block_table
            for block in () if table is None else table.block_ids:
                refs = left.get(block, refcounts[block]) - 1
                left[block] = refs
                if refs == 0 and block not in kept:
                    short -= 1
            out.append(short)
        return out

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room in ``seq``'s blocks for ``num_tokens`` more; False (nothing taken)
        if the pool is short of blocks. Always True in slotted mode.

        Args:
            seq: A running sequence.
            num_tokens: Tokens it computes next.
        """
        table = seq.block_table
        if table is None:
            return True
        had = len(table.block_ids)
        try:
            table.grow(num_tokens)
        except OutOfBlocks:
            return False
        if len(table.block_ids) != had:
            self._tables.sync(seq.slot, table.block_ids)  # type: ignore[arg-type]
        return True

    def block_tables(self, rows: list[int]) -> np.ndarray:
        """The block tables of these rows, as a step's ``block_tables``.

        Args:
            rows: The step's rows, in its order.
        """
        return self._tables.gather(rows)

    def free(self, seq: Sequence) -> None:
        """Give back the sequence's blocks and row, and tell the step function.

        Args:
            seq: The sequence (its id joins the next step's ``released``).
        """
        if seq.block_table is not None:
            seq.block_table.free()
            seq.block_table = None
        if seq.slot is not None:
            heapq.heappush(self._free_rows, seq.slot)
            seq.slot = None
        self._released.append(seq.request_id)

    def holds_any(self, seq: Sequence) -> bool:
        """Whether ``seq`` still holds a row or blocks.

        Args:
            seq: The sequence.
        """
        return seq.slot is not None or seq.block_table is not None

    def take_released(self) -> list[int]:
        """Ids freed since the last call (the next step's ``released``)."""
        released, self._released = self._released, []
        return released

    def cache_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Register the blocks this step completed (their keys/values now exist).

        Args:
            seq: A sequence of the step (paged mode, prefix caching on).
            start: Its first token computed in the step.
            end: One past its last token computed in the step.
        """
        alloc = self.allocator
        assert alloc is not None and alloc.prefix is not None and seq.block_table is not None
        bs = alloc.block_size
        blocks = seq.block_table.block_ids
        for j in range(start // bs, end // bs):
            alloc.prefix.insert(
                blocks[j],
                blocks[j - 1] if j else -1,
                seq.token_ids[j * bs : (j + 1) * bs],
                group=seq.group,
            )
