"""One sequence's logical-to-physical block map (the virtual side of paging).

Token ``i`` of a sequence lives in block ``block_ids[i // block_size]`` at offset
``i % block_size``; its *slot* (the row of a flat ``[num_blocks * block_size, ...]``
cache) is ``block_ids[i // block_size] * block_size + i % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from batchkit.kv.allocator import BlockAllocator


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``.

    Args:
        num_tokens: A number of tokens (>= 0).
        block_size: Tokens per block.
    """
    return -(-num_tokens // block_size)


class BlockTable:
    """The blocks of one sequence, in order, and how many tokens they hold.

    Args:
        allocator: The pool its blocks come from and return to.
    """

    __slots__ = ("allocator", "block_ids", "num_tokens")

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.block_ids: list[int] = []
        self.num_tokens = 0  # tokens whose slots were handed out by append()

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.allocator.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks held."""
        return len(self.block_ids)

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Fresh blocks [`append`][batchkit.BlockTable.append] of ``num_new_tokens`` would allocate.

        Args:
            num_new_tokens: Tokens to add after the ``num_tokens`` held.
        """
        bs = self.allocator.block_size
        return max(-(-(self.num_tokens + num_new_tokens) // bs) - len(self.block_ids), 0)

    def append(self, num_new_tokens: int) -> np.ndarray:
        """Make room for ``num_new_tokens`` more tokens; int64 slots of the new tokens.

        Args:
            num_new_tokens: Tokens to add (>= 0).

        Returns:
            The new tokens' slots, int64 ``[num_new_tokens]``.

        Raises:
            OutOfBlocks: The pool cannot supply the blocks; nothing changed.
            ValueError: ``num_new_tokens`` is negative.
        """
        start = self.num_tokens
        self.grow(num_new_tokens)
        return slots_of(self.block_ids, self.allocator.block_size, start, self.num_tokens)

    def grow(self, num_new_tokens: int) -> None:
        """[`append`][batchkit.BlockTable.append] without computing the slots.

        The scheduler's per-step path.

        Args:
            num_new_tokens: Tokens to add (>= 0).

        Raises:
            OutOfBlocks: The pool cannot supply the blocks; nothing changed.
            ValueError: ``num_new_tokens`` is negative.
        """
        if num_new_tokens < 0:
            raise ValueError(f"cannot append {num_new_tokens} tokens")
        alloc = self.allocator
        bs = alloc.block_size
        blocks = self.block_ids
        start = self.num_tokens
        end = start + num_new_tokens
        need = -(-end // bs) - len(blocks)
        if need > 0:
            blocks.extend(alloc.allocate(need))
        self.num_tokens = end
        if end == start:
            return
        # New tokens land in the private tail (only full blocks are ever shared), so the
        # fill counts of the touched blocks rise by exactly num_new_tokens in total.
        fill = alloc.fill
        first, last = start // bs, (end - 1) // bs
        if first == last:
            fill[blocks[first]] += num_new_tokens
        else:
            fill[blocks[first]] = bs
            for j in range(first + 1, last):
                fill[blocks[j]] = bs
            fill[blocks[last]] = end - last * bs
        alloc.add_tokens_stored(num_new_tokens)

    def adopt(self, block_ids: Sequence[int], num_tokens: int) -> None:
        """Start from already-retained full blocks (a prefix-cache hit).

        Args:
            block_ids: The blocks, each retained for this table (as
                [`lookup_prefix`][batchkit.BlockAllocator.lookup_prefix] returns them).
            num_tokens: Tokens they hold: ``len(block_ids) * block_size``.

        Raises:
            ValueError: The table is not empty, or ``num_tokens`` does not fill the
                blocks exactly.
        """
        if self.block_ids:
            raise ValueError("adopt() is for an empty table")
        if num_tokens != len(block_ids) * self.block_size:
            raise ValueError("a prefix hit covers whole blocks only")
        self.block_ids = list(block_ids)
        self.num_tokens = num_tokens

    def fork(self) -> tuple[BlockTable, list[tuple[int, int]]]:
        """A copy sharing this table's full blocks; the partial tail is copied eagerly.

        Returns the new table and ``[(src_block, dst_block)]``, the block copies the
        caller must apply to its KV cache before either sequence writes again. Raises
        [`OutOfBlocks`][batchkit.OutOfBlocks] (nothing shared) when no block is free for
        the tail.
        """
        bs = self.allocator.block_size
        child = BlockTable(self.allocator)
        full = self.num_tokens // bs
        tail = len(self.block_ids) > full  # a partly filled last block
        copies: list[tuple[int, int]] = []
        tail_block = self.allocator.allocate(1) if tail else []
        self.allocator.retain(self.block_ids[:full])
        child.block_ids = self.block_ids[:full] + tail_block
        child.num_tokens = self.num_tokens
        if tail:
            copies.append((self.block_ids[full], tail_block[0]))
            self.allocator.set_tokens_stored(tail_block[0], self.num_tokens - full * bs)
        return child, copies

    def free(self) -> None:
        """Release every block, the last first; the table is empty afterwards (and reusable).

        Last first: a freed block is reused in the order it was released, so the
        sequence's cached blocks are evicted from its end, and its first blocks (the
        prefix others share, and that every later block's cache entry hangs from) go last.
        """
        if self.block_ids:
            self.allocator.release(reversed(self.block_ids))
        self.block_ids = []
        self.num_tokens = 0

    def slots(self) -> np.ndarray:
        """int64 slots of all ``num_tokens`` tokens."""
        return slots_of(self.block_ids, self.allocator.block_size, 0, self.num_tokens)


def slots_of(block_ids: Sequence[int], block_size: int, start: int, end: int) -> np.ndarray:
    """int64 slots of tokens ``start .. end-1`` of a sequence with these blocks.

    Args:
        block_ids: The sequence's blocks, in order.
        block_size: Tokens per block.
        start: The first token's position in the sequence.
        end: One past the last token's position.

    Returns:
        ``[end - start]`` slots: rows of a flat ``[num_blocks * block_size, ...]`` cache.
    """
    pos = np.arange(start, end, dtype=np.int64)
    table = np.asarray(block_ids, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size


class BlockTableRows:
    """The block tables of up to ``num_rows`` running sequences as one int32 array.

    Row ``r`` holds the blocks of the sequence in row (slot) ``r``, ``-1`` padded. It is
    kept up to date as sequences gain blocks (only new blocks are copied), so a step's
    ``block_tables`` is one gather (`gather`) instead of a rebuild from lists.

    Args:
        num_rows: Rows (``max_num_seqs``).
        width: Blocks per row to start with (the array widens as needed).
    """

    __slots__ = ("array", "lengths")

    def __init__(self, num_rows: int, width: int = 8) -> None:
        self.array = np.full((num_rows, max(width, 1)), -1, dtype=np.int32)
        self.lengths = [0] * num_rows  # blocks written in each row

    def assign(self, row: int, block_ids: Sequence[int]) -> None:
        """Row ``row`` now belongs to a sequence holding ``block_ids``.

        Args:
            row: The row.
            block_ids: The sequence's blocks.
        """
        self.lengths[row] = 0
        self.sync(row, block_ids)
        self.array[row, len(block_ids) :] = -1  # the row's last owner may have held more

    def sync(self, row: int, block_ids: Sequence[int]) -> None:
        """Copy the blocks appended to ``block_ids`` since row ``row`` was last written.

        Args:
            row: The row.
            block_ids: Its sequence's blocks (only ever appended to since).
        """
        old, new = self.lengths[row], len(block_ids)
        if new == old:
            return
        if new > self.array.shape[1]:  # widen (doubling): rare
            wider = np.full((self.array.shape[0], 2 * new), -1, dtype=np.int32)
            wider[:, : self.array.shape[1]] = self.array
            self.array = wider
        if new == old + 1:  # one block more, the common case: a scalar store
            self.array[row, old] = block_ids[old]
        else:
            self.array[row, old:new] = block_ids[old:]
        self.lengths[row] = new

    def gather(self, rows: list[int]) -> np.ndarray:
        """``[len(rows), most blocks among them]`` int32 (a copy): a step's ``block_tables``.

        Args:
            rows: The step's rows, in its order.
        """
        width = max(max(map(self.lengths.__getitem__, rows), default=1), 1)
        return self.array[:, :width].take(rows, axis=0)  # take: a cheaper path than a[rows, :w]
