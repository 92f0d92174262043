"""BlockAllocator and BlockTable invariants under random operation sequences, and the
prefix cache: full blocks only, never the whole prompt, verified hits, no stale entries."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit.kv.prefix as prefix_mod
from batchkit.kv import BlockAllocator, BlockTable, OutOfBlocks, blocks_for

op = st.one_of(
    st.tuples(st.just("new"), st.just(0)),
    st.tuples(st.just("append"), st.integers(0, 9)),
    st.tuples(st.just("fork"), st.integers(0, 9)),
    st.tuples(st.just("free"), st.integers(0, 9)),
    st.tuples(st.just("grab"), st.integers(0, 4)),  # raw allocate / release by a user
)


def check(alloc: BlockAllocator, tables: list[BlockTable], raw: list[list[int]]) -> None:
    """Refcounts are exactly the owners; free + used = total; stored tokens exact."""
    owners = np.zeros(alloc.num_blocks, dtype=np.int64)
    stored: dict[int, int] = {}
    for t in tables:
        assert len(t.block_ids) == blocks_for(t.num_tokens, alloc.block_size)
        assert len(set(t.block_ids)) == len(t.block_ids)  # never one block twice in a table
        for j, b in enumerate(t.block_ids):
            owners[b] += 1
            stored[b] = max(
                stored.get(b, 0), min(alloc.block_size, t.num_tokens - j * alloc.block_size)
            )
    for blocks in raw:
        for b in blocks:
            owners[b] += 1
    assert owners.tolist() == alloc.refcounts
    assert alloc.num_free == int((owners == 0).sum())
    assert alloc.num_used + alloc.num_free == alloc.num_blocks
    assert alloc.tokens_stored == sum(stored.values())
    s = alloc.stats()
    if s.num_used:
        assert s.internal_waste == pytest.approx(
            1 - s.tokens_stored / (s.num_used * alloc.block_size)
        )


@given(
    st.integers(1, 12),
    st.integers(1, 5),
    st.lists(op, max_size=60),
)
@settings(max_examples=200)
def test_random_operations_keep_invariants(num_blocks: int, block_size: int, ops: list) -> None:
    alloc = BlockAllocator(num_blocks, block_size)
    tables: list[BlockTable] = []
    raw: list[list[int]] = []
    for name, arg in ops:
        if name == "new":
            tables.append(BlockTable(alloc))
        elif name == "append" and tables:
            t = tables[arg % len(tables)]
            before = (list(t.block_ids), t.num_tokens, alloc.num_free)
            n = arg % 7
            try:
                slots = t.append(n)
            except OutOfBlocks:
                assert (list(t.block_ids), t.num_tokens, alloc.num_free) == before  # all or nothing
            else:
                assert len(slots) == n
                assert (slots // block_size).tolist() == [
                    t.block_ids[p // block_size] for p in range(before[1], t.num_tokens)
                ]
                assert (slots % block_size).tolist() == [
                    p % block_size for p in range(before[1], t.num_tokens)
                ]
        elif name == "fork" and tables:
            t = tables[arg % len(tables)]
            free_before = alloc.num_free
            try:
                child, copies = t.fork()
            except OutOfBlocks:
                assert alloc.num_free == free_before
            else:
                full = t.num_tokens // block_size
                assert child.block_ids[:full] == t.block_ids[:full]
                assert copies == (
                    [(t.block_ids[full], child.block_ids[full])] if len(t.block_ids) > full else []
                )
                tables.append(child)
        elif name == "free" and tables:
            tables.pop(arg % len(tables)).free()
        elif name == "grab":
            if arg and alloc.can_allocate(arg):
                raw.append(alloc.allocate(arg))
            elif raw:
                alloc.release(raw.pop())
        check(alloc, tables, raw)
    for t in tables:
        t.free()
    for blocks in raw:
        alloc.release(blocks)
    assert alloc.num_free == num_blocks and not any(alloc.refcounts)
    assert alloc.tokens_stored == 0


def test_allocate_is_all_or_nothing_and_errors_are_real() -> None:
    alloc = BlockAllocator(4, 2)
    got = alloc.allocate(3)
    with pytest.raises(OutOfBlocks, match="2 blocks requested, 1 of 4 free"):
        alloc.allocate(2)
    assert alloc.num_free == 1 and alloc.usage == 0.75
    alloc.release(got)
    with pytest.raises(ValueError, match="double release"):
        alloc.release(got[:1])
    with pytest.raises(ValueError, match="retain only blocks in use"):
        alloc.retain(got[:1])
    with pytest.raises(ValueError):
        BlockAllocator(0, 4)
    assert isinstance(OutOfBlocks("x"), RuntimeError)


def _fill(alloc: BlockAllocator, tokens: list[int]) -> BlockTable:
    """A table holding ``tokens``, its full blocks registered as computed."""
    t = BlockTable(alloc)
    t.append(len(tokens))
    bs = alloc.block_size
    assert alloc.prefix is not None
    for j in range(len(tokens) // bs):
        alloc.prefix.insert(
            t.block_ids[j], t.block_ids[j - 1] if j else -1, tokens[j * bs : (j + 1) * bs]
        )
    return t


def test_prefix_hits_cover_full_blocks_but_never_the_whole_prompt() -> None:
    alloc = BlockAllocator(8, 4, prefix_caching=True)
    a = _fill(alloc, list(range(10)))  # blocks: [0-3] [4-7] [8,9]
    assert alloc.lookup_prefix(list(range(8)) + [99]) == a.block_ids[:2]
    # exactly two full blocks of prompt: only the first is shared (one token must run)
    assert alloc.lookup_prefix(list(range(8))) == a.block_ids[:1]
    assert alloc.lookup_prefix([0, 1, 2, 5, 4]) == []  # differs inside the first block
    assert alloc.refcount(a.block_ids[0]) == 3 and alloc.refcount(a.block_ids[2]) == 1
    s = alloc.stats()
    assert (s.prefix_queries, s.prefix_hits) == (4, 3)


def test_freed_blocks_stay_cached_until_reused_then_stale_hashes_are_dropped() -> None:
    alloc = BlockAllocator(3, 2, prefix_caching=True)
    a = _fill(alloc, [1, 2, 3, 4])
    first = list(a.block_ids)
    a.free()
    assert alloc.num_free == 3 and alloc.stats().num_cached == 2
    assert alloc.lookup_prefix([1, 2, 3, 4, 5]) == first  # revived from the free pool
    assert alloc.num_free == 1
    alloc.release(first)
    # Reuse every block for other tokens: the old entries must go.
    b = _fill(alloc, [7, 7, 8, 8, 9, 9])
    assert alloc.lookup_prefix([1, 2, 3, 4, 5]) == []
    assert alloc.lookup_prefix([7, 7, 8, 8, 0]) == b.block_ids[:2]


def test_hash_collisions_are_verified_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_mod, "block_digest", lambda parent, tokens: b"same")
    alloc = BlockAllocator(4, 2, prefix_caching=True)
    _fill(alloc, [1, 2, 3])
    assert alloc.lookup_prefix([5, 6, 7]) == []  # same "hash", other tokens: a miss
    assert len(alloc.lookup_prefix([1, 2, 3])) == 1


def test_block_digest_is_128_bit_and_chained() -> None:
    d = prefix_mod.block_digest(b"", [1, 2])
    assert len(d) == 16
    assert prefix_mod.block_digest(d, [3, 4]) != prefix_mod.block_digest(b"", [3, 4])
