"""BlockAllocator and BlockTable invariants under random operation sequences; errors that
change nothing (all or nothing). The prefix cache is tested in test_prefix_cache.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_release_and_retain_refuse_bad_ids_and_change_nothing() -> None:
    alloc = BlockAllocator(4, 2)
    blocks = alloc.allocate(2)  # [0, 1]

    def refcounts() -> list[int]:
        return [alloc.refcount(b) for b in range(alloc.num_blocks)]

    with pytest.raises(ValueError, match="release: block -1 is not in this pool"):
        alloc.release([-1])  # was: freed block 3 (-1 pads block tables)
    with pytest.raises(ValueError, match="retain: block 3 is free"):
        alloc.retain([0, 1, 3])
    assert refcounts() == [1, 1, 0, 0]  # was [2, 2, 0, 0]
    with pytest.raises(ValueError, match="block 0 released 2 times but holds 1"):
        alloc.release([0, 0])
    with pytest.raises(ValueError, match="block 9 is not in this pool"):
        alloc.release([1, 9])
    with pytest.raises(TypeError):
        alloc.release([0.0])  # type: ignore[list-item]
    assert refcounts() == [1, 1, 0, 0] and alloc.num_free == 2
    alloc.release(np.array(blocks))  # numpy ids are fine
    assert alloc.num_free == 4


def test_set_tokens_stored_refuses_blocks_outside_the_pool_or_free() -> None:
    alloc = BlockAllocator(4, 2)
    alloc.allocate(4)  # every block in use, holding nothing yet
    outside = r"set_tokens_stored: block -1 is not in this pool \(0\.\.3\)"
    with pytest.raises(ValueError, match=outside):
        alloc.set_tokens_stored(-1, 2)  # was: wrote to block 3
    with pytest.raises(ValueError, match="set_tokens_stored: block 4 is not in this pool"):
        alloc.set_tokens_stored(4, 2)
    assert alloc.fill == [0, 0, 0, 0] and alloc.tokens_stored == 0
    alloc.release([2])
    with pytest.raises(ValueError, match="set_tokens_stored: block 2 is free"):
        alloc.set_tokens_stored(2, 2)  # was: counted in tokens_stored, no block in use holding it
    assert alloc.tokens_stored == 0 and alloc.stats().internal_waste == 1.0
    alloc.set_tokens_stored(3, 2)
    assert alloc.tokens_stored == 2


@pytest.mark.parametrize("bad", [True, False])
def test_allocate_refuses_a_bool_as_a_count(bad: bool) -> None:
    alloc = BlockAllocator(4, 2)
    with pytest.raises(TypeError, match=f"allocate: a count of blocks is an int, got {bad}"):
        alloc.allocate(bad)  # was: True allocated 1 block
    assert alloc.num_free == 4
    assert alloc.allocate(np.int64(2)) == [0, 1]  # integer-likes are counts
