"""The prefix cache: which physical block holds which full block of tokens.

A full block is keyed by a chain hash, a 128-bit BLAKE2b digest of its parent's
digest and its own token ids, so one lookup per block finds the longest cached
prefix. A hit is never trusted on the hash alone: the entry stores the block's
tokens and its parent's block id, and both are compared, so a collision (or a parent
block reused for other tokens) is a miss, never a wrong answer.

Entries are dropped when their block is handed out again (:meth:`PrefixCache.forget`),
so no stale hash ever points at overwritten contents.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROOT = b""  # the parent digest of a sequence's first block


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chain hash of one full block: BLAKE2b-128 over the parent digest and the ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


@dataclass(slots=True)
class _Entry:
    digest: bytes
    parent_block: int  # -1 for a first block
    tokens: tuple[int, ...]


class PrefixCache:
    """Digest -> block id for full blocks whose keys and values are computed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_digest: dict[bytes, int] = {}
        self._by_block: dict[int, _Entry] = {}
        self.queries = 0  # full prompt blocks looked up
        self.hits = 0  # ... and found

    def __len__(self) -> int:
        return len(self._by_block)

    def digest_of(self, block_id: int) -> bytes | None:
        """The digest under which ``block_id`` is cached, if it is."""
        entry = self._by_block.get(block_id)
        return None if entry is None else entry.digest

    def match(self, token_ids: Sequence[int], *, max_blocks: int, count: bool = True) -> list[int]:
        """Block ids holding the longest cached run of ``token_ids``' first full blocks.

        ``count``: add this lookup to :attr:`queries` and :attr:`hits` (see :meth:`count`).
        """
        bs = self.block_size
        hits: list[int] = []
        parent, parent_block = ROOT, -1
        for i in range(max(max_blocks, 0)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            digest = block_digest(parent, tokens)
            block = self._by_digest.get(digest)
            if block is None:
                break
            entry = self._by_block[block]
            if entry.tokens != tokens or entry.parent_block != parent_block:
                break  # a hash collision or a stale chain: recompute rather than guess
            hits.append(block)
            parent, parent_block = digest, block
        if count:
            self.count(max_blocks, len(hits))
        return hits

    def count(self, queried: int, hit: int) -> None:
        """Record a lookup of ``queried`` full blocks, ``hit`` of them found."""
        self.queries += max(queried, 0)
        self.hits += hit

    def insert(self, block_id: int, parent_block: int, tokens: Sequence[int]) -> None:
        """Record that ``block_id`` holds ``tokens`` (a full block) after ``parent_block``.

        ``parent_block`` must be cached already (or -1 for a first block); otherwise the
        chain is broken and nothing is recorded. A digest already cached in another
        block keeps its first block (two copies of one prefix; the second stays private).
        """
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached, got {len(tokens)} tokens")
        if block_id in self._by_block:
            return
        if parent_block == -1:
            parent = ROOT
        else:
            parent_entry = self._by_block.get(parent_block)
            if parent_entry is None:
                return
            parent = parent_entry.digest
        tokens = tuple(tokens)
        digest = block_digest(parent, tokens)
        if digest in self._by_digest:
            return
        self._by_digest[digest] = block_id
        self._by_block[block_id] = _Entry(digest, parent_block, tokens)

    def forget(self, block_id: int) -> None:
        """Drop ``block_id``'s entry (it is about to hold other tokens)."""
        entry = self._by_block.pop(block_id, None)
        if entry is not None and self._by_digest.get(entry.digest) == block_id:
            del self._by_digest[entry.digest]
