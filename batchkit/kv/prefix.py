"""The prefix cache: which physical blocks hold which full blocks of tokens.

A full block is keyed by a chain hash, a 128-bit BLAKE2b digest of its parent's
digest and its own token ids, so one lookup per block finds the longest cached
prefix. A hit is never trusted on the hash alone: the entry stores the block's
tokens and which registration of its parent block it was computed after, and both
are compared, so a collision (or a parent block since reused for other tokens) is a
miss, never a wrong answer.

Several blocks may hold the same contents (two sequences computed one prefix in the
same step, before either was cached): each copy is registered, and so is everything
after it, so every sequence's own continuation stays reachable and the prefix stays
cached while any copy of it lives. A lookup returns one chain, each block the parent
the next one was registered under.

Entries are dropped when their block is handed out again (`PrefixCache.forget`),
so no stale hash ever points at overwritten contents.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROOT = b""  # the parent digest of a sequence's first block
NO_PARENT = -1  # the parent block of a sequence's first block


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chain hash of one full block: BLAKE2b-128 over the parent digest and the ids.

    Args:
        parent: The digest of the block before it (``b""`` for a sequence's first block).
        tokens: The block's token ids.

    Returns:
        16 bytes.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


@dataclass(slots=True)
class _Entry:
    digest: bytes
    parent_block: int  # NO_PARENT for a first block
    # The parent's entry (its `serial`) this block's keys and values were computed
    # after: the parent block may be handed out and cached again with other tokens
    # while this entry stays, and its id alone would then match the wrong history.
    parent_serial: int  # NO_PARENT for a first block
    tokens: tuple[int, ...]
    serial: int  # this registration's own number, never reused


class PrefixCache:
    """Digest -> the block ids (one or more copies) of full blocks whose keys and values
    are computed.

    Args:
        block_size: Tokens per block (only full blocks are cached).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # Every copy of a digest, oldest registered first (an ordered set).
        self._by_digest: dict[bytes, dict[int, None]] = {}
        self._by_block: dict[int, _Entry] = {}
        self._serials = itertools.count()
        self.queries = 0  # full prompt blocks looked up
        self.hits = 0  # ... and found

    def __len__(self) -> int:
        """Cached blocks, every copy counted."""
        return len(self._by_block)

    def __contains__(self, block_id: object) -> bool:
        """Whether ``block_id`` is cached."""
        return block_id in self._by_block

    def digest_of(self, block_id: int) -> bytes | None:
        """The digest under which ``block_id`` is cached, if it is (else None).

        Args:
            block_id: A block of the pool.
        """
        entry = self._by_block.get(block_id)
        return None if entry is None else entry.digest

    def match(self, token_ids: Sequence[int], *, max_blocks: int, count: bool = True) -> list[int]:
        """Block ids holding the longest cached run of ``token_ids``' first full blocks.

        Args:
            token_ids: The sequence's token ids, from the start.
            max_blocks: Look at most this many full blocks deep.
            count: Add this lookup to the ``queries`` and ``hits`` counters (see
                [`count`][batchkit.kv.PrefixCache.count]).

        Returns:
            One chain of blocks, in order (empty when the first block is not cached).
        """
        bs = self.block_size
        by_block = self._by_block
        # Block i of the prompt may be any cached copy whose tokens are the prompt's and
        # that was computed after one of the verified copies of block i - 1 (that very
        # registration of it: its serial, not just its block id).
        verified: list[int] = [NO_PARENT]  # serials of the verified copies of block i - 1
        deepest: list[int] = []  # their blocks
        parent = ROOT
        for i in range(max(max_blocks, 0)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            digest = block_digest(parent, tokens)
            copies = self._by_digest.get(digest)
            if copies is None:
                break
            blocks = [
                block
                for block in copies
                if by_block[block].tokens == tokens and by_block[block].parent_serial in verified
            ]  # none: a hash collision or a stale chain, recompute rather than guess
            if not blocks:
                break
            deepest, parent = blocks, digest
            verified = [by_block[block].serial for block in blocks]
        hits: list[int] = []
        if deepest:  # walk back from the deepest copy: one chain, parent by parent
            block = deepest[0]
            while block != NO_PARENT:
                hits.append(block)
                block = by_block[block].parent_block
            hits.reverse()
        if count:
            self.count(max_blocks, len(hits))
        return hits

    def count(self, queried: int, hit: int) -> None:
        """Record a lookup in the ``queries`` and ``hits`` counters.

        Args:
            queried: Full blocks looked up (a negative number counts as 0).
            hit: How many of them were found.
        """
        self.queries += max(queried, 0)
        self.hits += hit

    def insert(self, block_id: int, parent_block: int, tokens: Sequence[int]) -> None:
        """Record that ``block_id`` holds ``tokens`` (a full block) after ``parent_block``.

        ``parent_block`` must be cached already (or -1 for a first block); otherwise the
        chain is broken and nothing is recorded. A block already cached keeps its entry.
        Contents cached in another block already are registered again: the copies are
        interchangeable, and the blocks after this one chain to it.

        Args:
            block_id: The block that holds the tokens' keys and values.
            parent_block: The block before it in its sequence (-1 for a first block).
            tokens: The block's token ids: exactly ``block_size`` of them.

        Raises:
            ValueError: ``tokens`` is not a full block.
        """
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached, got {len(tokens)} tokens")
        if block_id in self._by_block:
            return
        if parent_block == NO_PARENT:
            parent, parent_serial = ROOT, NO_PARENT
        else:
            parent_entry = self._by_block.get(parent_block)
            if parent_entry is None:
                return
            parent, parent_serial = parent_entry.digest, parent_entry.serial
        tokens = tuple(tokens)
        digest = block_digest(parent, tokens)
        self._by_digest.setdefault(digest, {})[block_id] = None
        self._by_block[block_id] = _Entry(
            digest, parent_block, parent_serial, tokens, next(self._serials)
        )

    def forget(self, block_id: int) -> None:
        """Drop ``block_id``'s entry (it is about to hold other tokens); a no-op if it has none.

        Args:
            block_id: A block of the pool.
        """
        entry = self._by_block.pop(block_id, None)
        if entry is None:
            return
        copies = self._by_digest[entry.digest]
        del copies[block_id]
        if not copies:
            del self._by_digest[entry.digest]
