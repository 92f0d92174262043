"""The prefix cache: full blocks only, never the whole prompt, verified hits, no stale
entries; chains per group (an adapter's blocks found by its own requests only, the
default group's digests unchanged); copies of one prefix all registered; eviction
order (uncached blocks first, then least recently freed, a sequence from its end); the
hit-rate counters.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import pytest
from hypothesis import given
from hypothesis import strategies as st

import batchkit.kv.prefix as prefix_mod
from batchkit.generate import ContinuousBatcher, StepBatch
from batchkit.kv import BlockAllocator, BlockTable, OutOfBlocks


def _fill(alloc: BlockAllocator, tokens: list[int], group: Hashable = None) -> BlockTable:
    """A table holding ``tokens``, its full blocks registered as computed in ``group``."""
    t = BlockTable(alloc)
    t.append(len(tokens))
    bs = alloc.block_size
    assert alloc.prefix is not None
    for j in range(len(tokens) // bs):
        alloc.prefix.insert(
            t.block_ids[j],
            t.block_ids[j - 1] if j else -1,
            tokens[j * bs : (j + 1) * bs],
            group=group,
        )
    return t


class CachedStarts:
    """A step function that records where each request's first chunk starts (its
    cached tokens), samples token 7, and can hold its first step until released."""

    def __init__(self, *, hold_first_step: bool = False) -> None:
        self.first_start: dict[int, int] = {}
        self.in_first_step = threading.Event()
        self.release_first_step = threading.Event()
        if not hold_first_step:
            self.release_first_step.set()

    def __call__(self, batch: StepBatch) -> list[int | None]:
        self.in_first_step.set()
        self.release_first_step.wait(timeout=10)
        for s in batch.seqs:
            self.first_start.setdefault(s.request_id, s.start)
        return [7 if s.sample else None for s in batch.seqs]


# -- hits -------------------------------------------------------------------------
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
    alloc = BlockAllocator(8, 2, prefix_caching=True)
    _fill(alloc, [1, 2, 3])
    assert alloc.lookup_prefix([5, 6, 7]) == []  # same "hash", other tokens: a miss
    assert len(alloc.lookup_prefix([1, 2, 3])) == 1
    # Every block under one "hash": [3, 4] is cached, but after [1, 2], not after [5, 6].
    _fill(alloc, [1, 2, 3, 4, 0])
    _fill(alloc, [5, 6, 0])
    assert len(alloc.lookup_prefix([5, 6, 3, 4, 0])) == 1


def test_a_hit_checks_what_the_parent_held_when_the_child_was_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefix_mod, "block_digest", lambda parent, tokens: b"same")
    alloc = BlockAllocator(2, 2, prefix_caching=True)
    assert alloc.prefix is not None
    parent, child = alloc.allocate(2)
    alloc.prefix.insert(parent, -1, [1, 2])  # one user's [1, 2] ...
    alloc.prefix.insert(child, parent, [3, 4])  # ... and [3, 4] computed after it
    alloc.release([parent])
    assert alloc.allocate(1) == [parent]  # handed out again: it holds other tokens now
    alloc.prefix.insert(parent, -1, [5, 6])  # another user's [5, 6], in the same block
    # [3, 4]'s keys and values were computed after [1, 2]: after [5, 6] they are wrong
    assert alloc.lookup_prefix([5, 6, 3, 4, 0]) == [parent]  # was [parent, child]
    assert alloc.lookup_prefix([1, 2, 3, 4, 0]) == []


def test_block_digest_is_128_bit_and_chained() -> None:
    d = prefix_mod.block_digest(b"", [1, 2])
    assert len(d) == 16
    assert prefix_mod.block_digest(d, [3, 4]) != prefix_mod.block_digest(b"", [3, 4])


# -- groups ---------------------------------------------------------------------------
def test_a_prefix_is_found_by_its_own_group_only() -> None:
    alloc = BlockAllocator(16, 2, prefix_caching=True)
    prompt = [1, 2, 3, 4, 5]
    a = _fill(alloc, prompt, group="lora-a")
    assert alloc.lookup_prefix(prompt, group="lora-b") == []  # another adapter's keys
    assert alloc.lookup_prefix(prompt) == []  # nor the default group's
    assert alloc.lookup_prefix(prompt, group="lora-a") == a.block_ids[:2]
    b = _fill(alloc, prompt, group="lora-b")  # computed again: a chain of its own
    assert alloc.lookup_prefix(prompt, group="lora-b") == b.block_ids[:2]
    assert alloc.lookup_prefix(prompt, group="lora-a") == a.block_ids[:2]
    s = alloc.stats()
    assert s.num_cached == 4 and (s.prefix_queries, s.prefix_hits) == (10, 6)


def test_the_default_groups_digests_are_those_of_a_cache_without_groups() -> None:
    alloc = BlockAllocator(8, 2, prefix_caching=True)
    assert alloc.prefix is not None
    t = _fill(alloc, [1, 2, 3, 4])
    first = prefix_mod.block_digest(b"", [1, 2])
    assert prefix_mod.root_digest(None) == b""
    assert alloc.prefix.digest_of(t.block_ids[0]) == first
    assert alloc.prefix.digest_of(t.block_ids[1]) == prefix_mod.block_digest(first, [3, 4])
    other = _fill(alloc, [1, 2, 3, 4], group="lora-a")
    assert alloc.prefix.digest_of(other.block_ids[0]) == prefix_mod.block_digest(
        prefix_mod.root_digest("lora-a"), [1, 2]
    )
    assert len({prefix_mod.root_digest(g) for g in (None, "lora-a", "lora-b", 0)}) == 4


def test_equal_groups_share_and_groups_with_equal_hashes_do_not() -> None:
    assert hash(-1) == hash(-2)  # CPython: -1 is hash()'s error value, so -1 hashes as -2
    assert prefix_mod.root_digest(-1) == prefix_mod.root_digest(-2)  # one root ...
    alloc = BlockAllocator(8, 2, prefix_caching=True)
    t = _fill(alloc, [1, 2, 3], group=-1)
    assert alloc.lookup_prefix([1, 2, 3], group=-2) == []  # ... told apart by the group
    assert alloc.lookup_prefix([1, 2, 3], group=-1) == t.block_ids[:1]
    # Equal as dict keys, so one group to the scheduler: they share.
    assert alloc.lookup_prefix([1, 2, 3], group=-1.0) == t.block_ids[:1]


def test_a_colliding_digest_of_another_group_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_mod, "block_digest", lambda parent, tokens: b"same")
    alloc = BlockAllocator(8, 2, prefix_caching=True)
    a = _fill(alloc, [1, 2, 3, 4, 0], group="lora-a")
    assert alloc.lookup_prefix([1, 2, 3, 4, 0], group="lora-b") == []  # same hash, tokens
    assert alloc.lookup_prefix([1, 2, 3, 4, 0], group="lora-a") == a.block_ids[:2]
    # A chain of b's own, under the same "hash": each group finds its own copy.
    b = _fill(alloc, [1, 2, 3, 4, 0], group="lora-b")
    assert alloc.lookup_prefix([1, 2, 3, 4, 0], group="lora-b") == b.block_ids[:2]
    assert alloc.lookup_prefix([1, 2, 3, 4, 0], group="lora-a") == a.block_ids[:2]


def test_a_block_after_another_groups_block_is_refused_naming_both() -> None:
    alloc = BlockAllocator(4, 2, prefix_caching=True)
    assert alloc.prefix is not None
    parent, child = alloc.allocate(2)
    alloc.prefix.insert(parent, -1, [1, 2], group="lora-a")
    with pytest.raises(ValueError, match=r"block 1 of group 'lora-b'.*block 0.*'lora-a'"):
        alloc.prefix.insert(child, parent, [3, 4], group="lora-b")
    assert child not in alloc.prefix


def test_an_unhashable_group_is_a_type_error() -> None:
    alloc = BlockAllocator(4, 2, prefix_caching=True)
    with pytest.raises(TypeError):
        alloc.lookup_prefix([1, 2, 3], group=["lora-a"])  # type: ignore[arg-type]


# -- copies of one prefix ------------------------------------------------------------
def test_every_copy_of_a_prefix_is_cached_and_so_is_what_follows_it() -> None:
    alloc = BlockAllocator(8, 2, prefix_caching=True)
    a = _fill(alloc, [1, 2, 3, 4, 0])
    b = _fill(alloc, [1, 2, 3, 4, 5, 6, 0])  # the same two blocks again, then its own
    assert alloc.stats().num_cached == 5  # was 2: b's copies, and so [5, 6], were dropped
    hits = alloc.lookup_prefix([1, 2, 3, 4, 5, 6, 9])
    assert hits == b.block_ids[:3]  # one chain: each block the parent of the next
    assert alloc.lookup_prefix([1, 2, 3, 4, 9]) in (a.block_ids[:2], b.block_ids[:2])


def test_a_prefix_stays_cached_while_a_copy_of_it_lives() -> None:
    alloc = BlockAllocator(6, 4, prefix_caching=True)
    system = list(range(8))
    first = _fill(alloc, system + [50])  # blocks 0, 1 (+ a partial tail)
    second = _fill(alloc, system + [60])  # blocks 3, 4: the same contents, computed again
    first.free()
    alloc.allocate(3)  # evicts every block of the first copy
    assert alloc.lookup_prefix(system + [70]) == second.block_ids[:2]  # was []


def test_a_second_prompt_computed_in_the_same_step_keeps_its_own_continuation() -> None:
    # Two prompts share an 8-token system prompt (2 blocks of 4) and are computed in one
    # step, so neither finds the other's blocks: both copies are computed.
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    first, second = system + [20, 21, 22, 23, 24], system + [30, 31, 32, 33, 34]
    alloc = BlockAllocator(32, 4, prefix_caching=True)
    step = CachedStarts(hold_first_step=True)
    with ContinuousBatcher(step, max_num_seqs=4, allocator=alloc) as batcher:
        gate = batcher.submit([99], max_new_tokens=1)  # holds the first step ...
        assert step.in_first_step.wait(timeout=10)
        a, b = (batcher.submit(p, max_new_tokens=1) for p in (first, second))
        step.release_first_step.set()  # ... so that a and b are admitted together
        out_a, out_b = a.result(timeout=10), b.result(timeout=10)
        gate.result(timeout=10)
        assert step.first_start[a.request_id] == step.first_start[b.request_id] == 0
        next_a = batcher.submit(first + out_a + [40, 41, 42], max_new_tokens=1)
        next_b = batcher.submit(second + out_b + [40, 41, 42], max_new_tokens=1)
        next_a.result(timeout=10), next_b.result(timeout=10)
    # 12 computed tokens of each first turn = 3 full blocks cached (was 8 for b: its
    # copy of the system prompt, and so its own third block, were never cached)
    assert step.first_start[next_a.request_id] == 12
    assert step.first_start[next_b.request_id] == 12


# -- eviction order ----------------------------------------------------------------
def test_a_freed_sequence_is_evicted_from_its_end() -> None:
    alloc = BlockAllocator(4, 4, prefix_caching=True)
    prompt = list(range(12))
    _fill(alloc, prompt).free()  # 3 cached blocks
    alloc.allocate(2)  # the free uncached block, then the prompt's last block
    assert len(alloc.lookup_prefix(prompt + [99])) == 2  # was 0: the root went first


@pytest.mark.parametrize(("num_blocks", "cached_tokens"), [(7, 12), (6, 8)])
def test_a_finished_prompt_is_still_cached_after_an_unrelated_request(
    num_blocks: int, cached_tokens: int
) -> None:
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4 and a partial one
    other = list(range(101, 114))  # unrelated, just as long: 4 blocks
    alloc = BlockAllocator(num_blocks, 4, prefix_caching=True)
    step = CachedStarts()
    with ContinuousBatcher(step, max_num_seqs=1, allocator=alloc) as batcher:
        for p in (prompt, other):
            batcher.submit(p, max_new_tokens=1).result(timeout=10)
        again = batcher.submit(prompt, max_new_tokens=1)
        again.result(timeout=10)
    # The other request takes the never-used blocks and the prompt's partial tail, then
    # (with 6 blocks) the prompt's last cached block: the first ones survive (was 0 with
    # either pool: the prompt's first block was the second block reused, then the chain
    # after it was unreachable).
    assert step.first_start[again.request_id] == cached_tokens


def test_free_uncached_blocks_are_reused_before_cached_ones() -> None:
    alloc = BlockAllocator(4, 2, prefix_caching=True)
    cached = _fill(alloc, [1, 2, 3, 4])  # blocks 0, 1
    scratch = alloc.allocate(2)  # blocks 2, 3: nothing cached in them
    cached.free()
    alloc.release(scratch)  # freed after the cached blocks, yet reused first
    assert sorted(alloc.allocate(2)) == sorted(scratch)  # was [1, 0]
    assert alloc.lookup_prefix([1, 2, 3, 4, 5]) == [0, 1]


def test_a_revived_block_is_reused_last_when_freed_again() -> None:
    alloc = BlockAllocator(4, 2, prefix_caching=True)
    table = _fill(alloc, [5, 6, 7])  # blocks [0, 1]; block 0 is full and cached
    table.free()
    hot = alloc.lookup_prefix([5, 6, 7])
    assert hot == [0]
    alloc.release(hot)  # freed most recently: the back of the order
    assert alloc.allocate(3) == [2, 3, 1]  # was [0, ...]: the hot prefix went first
    assert alloc.lookup_prefix([5, 6, 7]) == [0]


# -- hit-rate counters -------------------------------------------------------------
def test_a_request_waiting_for_blocks_does_not_inflate_prefix_queries() -> None:
    alloc = BlockAllocator(6, 2, prefix_caching=True)
    step = CachedStarts(hold_first_step=True)
    with ContinuousBatcher(step, max_num_seqs=4, allocator=alloc) as batcher:
        # 9 prompt tokens + 3 new: 5 blocks, then 6; the second (3 blocks) waits for them
        long = batcher.submit([1, 2, 3, 4, 5, 6, 7, 8, 9], max_new_tokens=3)
        assert step.in_first_step.wait(timeout=10)
        waits = batcher.submit([9, 9, 9, 9, 9], max_new_tokens=2)
        step.release_first_step.set()
        long.result(timeout=10), waits.result(timeout=10)
        stats = batcher.stats()
    assert stats.steps >= 4  # the second request waited for at least 2 of them
    # 4 full blocks queried for the first, 2 for the second (was 4 + 2 a waiting step)
    assert (alloc.stats().prefix_queries, alloc.stats().prefix_hits) == (6, 0)


def test_prefix_hit_rate_counts_each_admitted_request_once() -> None:
    alloc = BlockAllocator(8, 2, prefix_caching=True)
    with ContinuousBatcher(
        CachedStarts(), max_num_seqs=1, max_num_batched_tokens=64, allocator=alloc
    ) as batcher:
        batcher.generate([[1, 2, 3, 4, 5]] * 3, max_new_tokens=1)
        stats = alloc.stats()
    # 2 full blocks queried per request; the 2nd and 3rd find both
    assert (stats.prefix_queries, stats.prefix_hits) == (6, 4)


# -- a model of what the blocks hold -----------------------------------------------
prompt = st.lists(st.integers(1, 2), min_size=1, max_size=10)
# None (the default group), an adapter, and two groups whose hash() is equal (-1, -2).
group = st.sampled_from([None, None, "lora-a", -1, -2])
cache_op = st.one_of(
    st.tuples(st.just("admit"), st.lists(st.tuples(group, prompt), min_size=1, max_size=3)),
    st.tuples(st.just("free"), st.integers(0, 9)),
    st.tuples(st.just("grab"), st.integers(0, 3)),  # a raw allocate (or release) by a user
)


@given(st.integers(2, 16), st.lists(cache_op, max_size=40))
def test_hits_are_the_longest_cached_prefix_and_hold_its_tokens(num_blocks: int, ops: list) -> None:
    """Sequences of several groups (adapters) admitted together (looked up together,
    then computed and registered, as in one scheduler step), freed, and blocks grabbed
    raw, against a model of the contents each block holds: every hit holds the
    looked-up prefix computed in the sequence's own group, and no cached prefix of its
    group is missed while some copy of each of its blocks lives."""
    bs = 2
    alloc = BlockAllocator(num_blocks, bs, prefix_caching=True)
    # cached block -> its group and the whole prefix it ends
    holds: dict[int, tuple[Hashable, tuple[int, ...]]] = {}
    tables: list[tuple[BlockTable, list[int]]] = []
    raw: list[list[int]] = []

    def allocated(blocks: list[int]) -> None:
        for b in blocks:
            holds.pop(b, None)  # overwritten from now on

    for name, arg in ops:
        if name == "admit":
            admitted = []
            for group, tokens in arg:
                shareable = (len(tokens) - 1) // bs
                live = set(holds.values())
                expect = 0
                while expect < shareable and (group, tuple(tokens[: (expect + 1) * bs])) in live:
                    expect += 1
                hits = alloc.lookup_prefix(tokens, group=group)
                assert len(hits) == expect
                for j, b in enumerate(hits):
                    assert holds[b] == (group, tuple(tokens[: (j + 1) * bs]))
                table = BlockTable(alloc)
                table.adopt(hits, len(hits) * bs)
                try:
                    table.append(len(tokens) - table.num_tokens)
                except OutOfBlocks:
                    table.free()
                    continue
                allocated(table.block_ids[len(hits) :])
                admitted.append((table, group, tokens, len(hits)))
            for table, group, tokens, cached in admitted:  # the step ran: register its blocks
                assert alloc.prefix is not None
                for j in range(cached, len(tokens) // bs):
                    block = table.block_ids[j]
                    parent = table.block_ids[j - 1] if j else -1
                    alloc.prefix.insert(block, parent, tokens[j * bs : (j + 1) * bs], group=group)
                    holds[block] = (group, tuple(tokens[: (j + 1) * bs]))
                tables.append((table, tokens))
        elif name == "free" and tables:
            tables.pop(arg % len(tables))[0].free()
        elif name == "grab":
            if arg and alloc.can_allocate(arg):
                raw.append(alloc.allocate(arg))
                allocated(raw[-1])
            elif raw:
                alloc.release(raw.pop())
        assert alloc.stats().num_cached == len(holds)
        owners = [0] * num_blocks
        for table, _ in tables:
            for b in table.block_ids:
                owners[b] += 1
        for blocks in raw:
            for b in blocks:
                owners[b] += 1
        assert [alloc.refcount(b) for b in range(num_blocks)] == owners
