"""The prefix cache: which physical blocks hold which full blocks of tokens.

A full block is keyed by a chain hash, a 128-bit BLAKE2b digest of its parent's
digest and its own token ids, so one lookup per block finds the longest cached
prefix. A hit is never trusted on the hash alone: the entry stores the block's
tokens and which registration of its parent block it was computed after, and both
are compared, so a collision (or a parent block since reused for other tokens) is a
miss, never a wrong answer.

Chains are per group (``Sequence.group``: a LoRA adapter, a task): the keys and
values of one prompt differ between adapters, so a block is reused only by a lookup
of its own group. A group seeds its chains' root (`root_digest`; the default group
``None`` keeps ``b""``, so its digests are those of a cache without groups), and the
first block of a chain stores its group, compared on every hit like the tokens: two
groups whose roots collide (equal ``hash()``) still never share a block.

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
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

ROOT = b""  # the parent digest of a first block of the default group (None)
NO_PARENT = -1  # the parent block of a sequence's first block
_GROUP_ROOT = b"batchkit.group"  # BLAKE2b personalisation of a group's root digest


def root_digest(group: Hashable) -> bytes:
    """The parent digest of ``group``'s first blocks: the root its chains hang from.

    ``b""`` for the default group ``None`` (the digests of a cache without groups);
    for any other group, BLAKE2b-128 of its ``hash()``, so that equal groups (equal as
    dict keys: ``1`` and ``True`` are one group, as in the scheduler) share a root.
    The hash only spreads groups apart: groups with equal hashes share a root, and a
    hit tells them apart by the group each first block stores.

    Args:
        group: The group (any hashable).

    Returns:
        ``b""`` for None, else 16 bytes.

    Raises:
        TypeError: ``group`` is not hashable.
    """
    if group is None:
        return ROOT
    seed = hash(group).to_bytes(8, "little", signed=True)  # hash() fits a signed 64-bit int
    return hashlib.blake2b(seed, digest_size=16, person=_GROUP_ROOT).digest()


def _same_group(a: Hashable, b: Hashable) -> bool:
    """Whether two groups are one (as dict keys are: identical or equal)."""
    return a is b or bool(a == b)


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chain hash of one full block: BLAKE2b-128 over the parent digest and the ids.

    Args:
        parent: The digest of the block before it (for a sequence's first block, its
            group's [`root_digest`][batchkit.kv.prefix.root_digest]: ``b""`` for the
            default group).
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
    # The group it was computed in: its first block's, since every block of a chain is
    # registered by sequences of one group (insert refuses a child of another group's).
    group: Hashable


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

    def match(
        self,
        token_ids: Sequence[int],
        *,
        max_blocks: int,
        count: bool = True,
        group: Hashable = None,
    ) -> list[int]:
        """Block ids holding the longest cached run of ``token_ids``' first full blocks.

        Args:
            token_ids: The sequence's token ids, from the start.
            max_blocks: Look at most this many full blocks deep.
            count: Add this lookup to the ``queries`` and ``hits`` counters (see
                [`count`][batchkit.kv.PrefixCache.count]).
            group: The sequence's group: only blocks computed in it are found
                (``None``: the default group).

        Returns:
            One chain of blocks, in order (empty when the first block is not cached).

        Raises:
            TypeError: ``group`` is not hashable.
        """
        bs = self.block_size
        by_block = self._by_block
        # Block i of the prompt may be any cached copy whose tokens are the prompt's and
        # that was computed after one of the verified copies of block i - 1 (that very
        # registration of it: its serial, not just its block id). Block 0's parent is the
        # group itself: a first block of this group.
        verified: list[int] = [NO_PARENT]  # serials of the verified copies of block i - 1
        deepest: list[int] = []  # their blocks
        parent = root_digest(group)
        for i in range(max(max_blocks, 0)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            digest = block_digest(parent, tokens)
            copies = self._by_digest.get(digest)
            if copies is None:
                break
            blocks = [
                block
                for block in copies
                if by_block[block].tokens == tokens
                and by_block[block].parent_serial in verified
                and (i or _same_group(by_block[block].group, group))
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

    def insert(
        self,
        block_id: int,
        parent_block: int,
        tokens: Sequence[int],
        *,
        group: Hashable = None,
    ) -> None:
        """Record that ``block_id`` holds ``tokens`` (a full block) after ``parent_block``.

        ``parent_block`` must be cached already (or -1 for a first block); otherwise the
        chain is broken and nothing is recorded. A block already cached keeps its entry.
        Contents cached in another block already are registered again: the copies are
        interchangeable, and the blocks after this one chain to it.

        Args:
            block_id: The block that holds the tokens' keys and values.
            parent_block: The block before it in its sequence (-1 for a first block).
            tokens: The block's token ids: exactly ``block_size`` of them.
            group: The group its keys and values were computed in (the sequence's;
                ``None``: the default group): only lookups of that group find it.

        Raises:
            ValueError: ``tokens`` is not a full block, or ``parent_block`` is cached
                for another group (a sequence's blocks are all of its own group).
            TypeError: ``group`` is not hashable.
        """
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached, got {len(tokens)} tokens")
        if block_id in self._by_block:
            return
        if parent_block == NO_PARENT:
            parent, parent_serial = root_digest(group), NO_PARENT
        else:
            parent_entry = self._by_block.get(parent_block)
            if parent_entry is None:
                return
            if not _same_group(parent_entry.group, group):
                raise ValueError(
                    f"block {block_id} of group {group!r}: its parent block {parent_block} "
                    f"is cached for group {parent_entry.group!r}"
                )
            parent, parent_serial = parent_entry.digest, parent_entry.serial
        tokens = tuple(tokens)
        digest = block_digest(parent, tokens)
        self._by_digest.setdefault(digest, {})[block_id] = None
        self._by_block[block_id] = _Entry(
            digest, parent_block, parent_serial, tokens, next(self._serials), group
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
