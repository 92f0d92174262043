"""A fixed pool of KV-cache blocks with reference counts (the physical side of paging).

Blocks are numbered ``0 .. num_blocks-1``; a block holds ``block_size`` tokens' keys
and values for every layer. A block is *free* when its reference count is zero.
Sequences that share a prefix (a fork, or a prefix-cache hit) share its full blocks
and each hold a reference; the block returns to the pool when the last one releases
it.

With ``prefix_caching=True`` a freed block keeps its contents and its place in the
prefix cache until it is handed out again. Eviction order: free blocks that hold no
cached contents are handed out first; cached ones only when those run out, least
recently freed first, so recently used prefixes survive longest. Within one
`BlockAllocator.release` blocks join the order as listed (the first listed is
reused first); a `BlockTable` releases its tail first, so a
sequence's blocks are evicted from its end and its first blocks, the ones other
prompts share, go last (and a cached block is never evicted before the blocks
cached after it, which no lookup could reach without it).
"""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from batchkit.errors import BatchkitError
from batchkit.kv.prefix import PrefixCache


class OutOfBlocks(BatchkitError, RuntimeError):
    """The pool has fewer free blocks than requested; nothing was allocated."""


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """A snapshot of a [`BlockAllocator`][batchkit.BlockAllocator], from its ``stats()``.

    Attributes:
        num_blocks: Blocks in the pool.
        block_size: Tokens per block.
        num_free: Blocks with no reference (cached-but-free ones included).
        num_used: Blocks with at least one reference.
        usage: ``num_used / num_blocks``.
        tokens_stored: Tokens held by blocks in use (a shared block counted once),
            as their owners recorded them through
            [`set_tokens_stored`][batchkit.BlockAllocator.set_tokens_stored].
        internal_waste: ``1 - tokens_stored / (num_used * block_size)``: the share of
            allocated token slots that hold nothing (partly filled tail blocks); 0
            with no block in use.
        num_cached: Blocks whose contents the prefix cache holds (0 without prefix
            caching).
        prefix_queries: Full prompt blocks looked up in the prefix cache.
        prefix_hits: Those found there.
    """

    num_blocks: int
    block_size: int
    num_free: int
    num_used: int
    usage: float
    tokens_stored: int
    internal_waste: float
    num_cached: int
    prefix_queries: int
    prefix_hits: int

    @property
    def prefix_hit_rate(self) -> float:
        """Share of queried full prompt blocks that were found in the prefix cache."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class BlockAllocator:
    """A fixed pool of ``num_blocks`` blocks of ``block_size`` tokens, refcounted.

    [`allocate`][batchkit.BlockAllocator.allocate] is all-or-nothing and raises
    [`OutOfBlocks`][batchkit.OutOfBlocks]; [`retain`][batchkit.BlockAllocator.retain]
    adds a reference to blocks in use; [`release`][batchkit.BlockAllocator.release]
    drops one.

    Args:
        num_blocks: Blocks in the pool (a positive int); ids are
            ``0 .. num_blocks-1``.
        block_size: Tokens per block (a positive int).
        prefix_caching: Keep freed full blocks' contents in a prefix cache, so that
            sequences of one group with an equal prefix share them (see
            [`lookup_prefix`][batchkit.BlockAllocator.lookup_prefix]).

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` is not a positive int.
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False) -> None:
        if type(num_blocks) is not int or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcounts = [0] * num_blocks
        # Free ids in two ordered sets, least recently freed first: those holding nothing
        # cached (handed out first), and cached ones (evicted only when the first set is
        # empty). A block revived by a prefix hit leaves its set at once, and goes to the
        # back when it is freed again.
        self._free_uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # Tokens each block holds, as its owners report (for the internal-waste statistic);
        # public so that BlockTable can count a decode token with one list update.
        self.fill = [0] * num_blocks
        self._stored_total = 0
        self.prefix: PrefixCache | None = PrefixCache(block_size) if prefix_caching else None

    # -- the pool -------------------------------------------------------------
    @property
    def prefix_caching(self) -> bool:
        """Whether full blocks are shared between sequences of one group with equal prefixes."""
        return self.prefix is not None

    @property
    def num_free(self) -> int:
        """Blocks with no reference (cached-but-free blocks included: they are reusable)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference."""
        return self.num_blocks - self.num_free

    @property
    def usage(self) -> float:
        """``num_used / num_blocks``."""
        return self.num_used / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        """Whether [`allocate`][batchkit.BlockAllocator.allocate] of ``n`` blocks would succeed now.

        Args:
            n: A number of blocks.
        """
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, each with one reference.

        Blocks holding nothing cached go first; cached ones are evicted (least recently
        freed first) only when those run out.

        Args:
            n: How many blocks (an int >= 0).

        Returns:
            The block ids, in the order they were handed out.

        Raises:
            OutOfBlocks: Fewer than ``n`` blocks are free; nothing was allocated.
            ValueError: ``n`` is negative.
            TypeError: ``n`` is not an integer, or is a bool.
        """
        if type(n) is not int:
            if isinstance(n, bool):  # an int to operator.index, but a flag, not a count
                raise TypeError(f"allocate: a count of blocks is an int, got {n!r}")
            n = operator.index(n)
        free = self.num_free
        if n > free:
            raise OutOfBlocks(f"{n} blocks requested, {free} of {self.num_blocks} free")
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        uncached, refcounts, prefix = self._free_uncached, self.refcounts, self.prefix
        fresh = min(n, len(uncached))
        out = [uncached.popitem(last=False)[0] for _ in range(fresh)]
        if fresh < n:
            evict = self._free_cached.popitem
            out.extend(evict(last=False)[0] for _ in range(n - fresh))
        for block in out:
            refcounts[block] = 1
            if prefix is not None:
                prefix.forget(block)  # its old contents are about to be overwritten
        return out

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block; every block must be in use already.

        Args:
            block_ids: Block ids of this pool (ints in ``0 .. num_blocks-1``); an id may
                appear more than once (and then gains one reference per appearance).

        Raises:
            ValueError: A block is free or not in this pool; no count changed.
            TypeError: An id is not an integer.
        """
        ids = self._checked(block_ids, "retain")
        refcounts = self.refcounts
        for block in ids:
            if refcounts[block] <= 0:
                raise ValueError(f"retain: block {block} is free; retain only blocks in use")
        for block in ids:
            refcounts[block] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks left with none return to the pool.

        Freed blocks join the eviction order as listed: the first listed is reused first.

        Args:
            block_ids: Block ids of this pool (ints in ``0 .. num_blocks-1``); an id may
                appear more than once (and then loses one reference per appearance).

        Raises:
            ValueError: More references released than a block holds (a double
                release), or an id outside the pool; no count changed.
            TypeError: An id is not an integer.
        """
        ids = self._checked(block_ids, "release")
        refcounts, fill, prefix = self.refcounts, self.fill, self.prefix
        uncached, cached = self._free_uncached, self._free_cached
        if len(set(ids)) == len(ids):
            if 0 in map(refcounts.__getitem__, ids):
                block = next(b for b in ids if refcounts[b] <= 0)
                raise ValueError(f"release: block {block} is already free (double release)")
        else:
            for block, times in Counter(ids).items():
                if refcounts[block] < times:
                    raise ValueError(
                        f"release: block {block} released {times} times but holds "
                        f"{refcounts[block]} references (double release)"
                    )
        for block in ids:
            count = refcounts[block]
            refcounts[block] = count - 1
            if count == 1:
                # the back of its set: freed most recently, reused last
                if prefix is not None and block in prefix:
                    cached[block] = None
                else:
                    uncached[block] = None
                self._stored_total -= fill[block]
                fill[block] = 0

    def _checked(self, block_ids: Iterable[int], what: str) -> list[int]:
        """``block_ids`` as a list of ints in ``[0, num_blocks)`` (else a ``ValueError``).

        A negative id must not index from the end: -1 pads block tables.
        """
        ids = list(map(operator.index, block_ids))  # TypeError for a non-integer id
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            bad = next(b for b in ids if not 0 <= b < self.num_blocks)
            raise ValueError(f"{what}: block {bad} is not in this pool (0..{self.num_blocks - 1})")
        return ids

    def refcount(self, block_id: int) -> int:
        """The number of references to ``block_id`` (0 = free).

        Args:
            block_id: A block of this pool.
        """
        return self.refcounts[block_id]

    # -- occupancy accounting (for the internal-waste statistic) ------------
    def set_tokens_stored(self, block_id: int, num_tokens: int) -> None:
        """Record how many tokens ``block_id`` holds (its owner calls this as it fills).

        Args:
            block_id: A block in use.
            num_tokens: Tokens it holds now, ``0 .. block_size`` (it replaces the
                previous count).

        Raises:
            ValueError: ``num_tokens`` is outside ``0 .. block_size``, or ``block_id``
                is not in this pool (a negative id does not count from the end) or is
                free (``tokens_stored`` counts blocks in use only); nothing changed.
            TypeError: ``block_id`` is not an integer.
        """
        (block_id,) = self._checked((block_id,), "set_tokens_stored")
        if self.refcounts[block_id] <= 0:
            raise ValueError(
                f"set_tokens_stored: block {block_id} is free; only a block in use holds tokens"
            )
        if not 0 <= num_tokens <= self.block_size:
            raise ValueError(f"a block holds 0..{self.block_size} tokens, got {num_tokens}")
        self._stored_total += num_tokens - self.fill[block_id]
        self.fill[block_id] = num_tokens

    def add_tokens_stored(self, num_tokens: int) -> None:
        """Adjust the total after updating ``fill`` directly (the fast path).

        Args:
            num_tokens: The change made to ``fill`` (negative when tokens were removed).
        """
        self._stored_total += num_tokens

    @property
    def tokens_stored(self) -> int:
        """Tokens held by blocks in use (a shared block counted once)."""
        return self._stored_total

    # -- prefix caching -------------------------------------------------------
    def lookup_prefix(self, token_ids: Sequence[int], *, group: Hashable = None) -> list[int]:
        """Blocks holding the longest cached prefix of ``token_ids``, each retained once.

        Only full blocks are shared, and never the whole prompt: at least its last token
        is left to compute, so the step that computes it can sample. Only blocks
        computed in ``group`` are found: another group's (another adapter's) keys and
        values differ. Empty without prefix caching. The same as
        [`adopt_prefix`][batchkit.BlockAllocator.adopt_prefix] of
        [`match_prefix`][batchkit.BlockAllocator.match_prefix].

        Args:
            token_ids: The sequence's token ids (its prompt), from the start.
            group: The sequence's group (``Sequence.group``; ``None``: the default
                group), as its blocks were registered.

        Returns:
            The shared blocks, in order: they hold its first ``len(result) *
            block_size`` tokens.

        Raises:
            TypeError: ``group`` is not hashable.
        """
        return self.adopt_prefix(token_ids, self.match_prefix(token_ids, group=group))

    def match_prefix(self, token_ids: Sequence[int], *, group: Hashable = None) -> list[int]:
        """The blocks [`lookup_prefix`][batchkit.BlockAllocator.lookup_prefix] would return.

        They are neither retained nor counted in the statistics: this checks first
        whether the rest of the sequence fits.

        Args:
            token_ids: The sequence's token ids (its prompt), from the start.
            group: The sequence's group (``None``: the default group).

        Raises:
            TypeError: ``group`` is not hashable.
        """
        prefix = self.prefix
        if prefix is None:
            return []
        return prefix.match(
            token_ids, max_blocks=self._shareable_blocks(token_ids), count=False, group=group
        )

    def adopt_prefix(self, token_ids: Sequence[int], hits: list[int]) -> list[int]:
        """Retain ``hits`` and count the lookup in the hit-rate statistics.

        Args:
            token_ids: The token ids ``hits`` was matched for.
            hits: What [`match_prefix`][batchkit.BlockAllocator.match_prefix] of
                ``token_ids`` returned, with nothing allocated or released since.

        Returns:
            ``hits``, each block now holding one more reference (a free one is taken
            back from the pool).
        """
        prefix = self.prefix
        if prefix is None:
            return hits
        prefix.count(self._shareable_blocks(token_ids), len(hits))
        for block in hits:
            if self.refcounts[block] == 0:  # revived: in use again
                if block in self._free_cached:
                    del self._free_cached[block]
                else:
                    del self._free_uncached[block]
                self.fill[block] = self.block_size
                self._stored_total += self.block_size
            self.refcounts[block] += 1
        return hits

    def _shareable_blocks(self, token_ids: Sequence[int]) -> int:
        """Full blocks of ``token_ids`` a prefix may share: never the last token's."""
        return (len(token_ids) - 1) // self.block_size

    def num_revived(self, hits: Sequence[int]) -> int:
        """How many of ``hits`` are free now (adopting them takes them from the pool).

        Args:
            hits: Blocks from [`match_prefix`][batchkit.BlockAllocator.match_prefix].
        """
        refcounts = self.refcounts
        return sum(1 for block in hits if refcounts[block] == 0)

    def stats(self) -> AllocatorStats:
        """A snapshot of occupancy, waste and prefix-cache counters."""
        used = self.num_used
        capacity = used * self.block_size
        prefix = self.prefix
        return AllocatorStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_free=self.num_free,
            num_used=used,
            usage=used / self.num_blocks,
            tokens_stored=self._stored_total,
            internal_waste=1.0 - self._stored_total / capacity if capacity else 0.0,
            num_cached=len(prefix) if prefix is not None else 0,
            prefix_queries=prefix.queries if prefix is not None else 0,
            prefix_hits=prefix.hits if prefix is not None else 0,
        )
