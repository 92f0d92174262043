"""Regressions from a review of the KV blocks: each test failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest

from batchkit.generate import ContinuousBatcher, StepBatch
from batchkit.generate.scheduler import Scheduler
from batchkit.generate.sequence import Sequence
from batchkit.kv import BlockAllocator, BlockTable
from batchkit.kv.attention import write_kv


def test_a_revived_block_is_reused_last_when_freed_again() -> None:
    alloc = BlockAllocator(4, 2, prefix_caching=True)
    table = BlockTable(alloc)
    table.append(3)  # blocks [0, 1]; block 0 is full
    alloc.prefix.insert(table.block_ids[0], -1, [5, 6])  # type: ignore[union-attr]
    table.free()  # free order: 2, 3, 0, 1
    hot = alloc.lookup_prefix([5, 6, 7])
    assert hot == [0]
    alloc.release(hot)  # freed most recently: the back of the order
    assert alloc.allocate(3) == [2, 3, 1]  # was [0, ...]: the hot prefix went first
    assert alloc.lookup_prefix([5, 6, 7]) == [0]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_write_kv_writes_through_a_non_contiguous_cache(lib: str) -> None:
    both = np.zeros((3, 2, 4, 1, 2))  # [num_blocks, k/v, block_size, heads, dim]
    if lib == "torch":
        torch = pytest.importorskip("torch")
        both = torch.zeros(3, 2, 4, 1, 2, dtype=torch.float64)
        ones = torch.ones(2, 1, 2, dtype=torch.float64)
        slots = torch.tensor([5, -1, 9])
        key = torch.cat([ones[:1], ones[:1] * 9, ones[1:]])
    else:
        ones = np.ones((2, 1, 2))
        slots = np.array([5, -1, 9])
        key = np.concatenate([ones[:1], ones[:1] * 9, ones[1:]])
    k_cache, v_cache = both[:, 0], both[:, 1]  # strided views of one buffer
    write_kv(k_cache, v_cache, key, key * 2, slots)
    assert float(k_cache.sum()) == 4.0 and float(v_cache.sum()) == 8.0  # was 0: a copy
    assert float(k_cache[1, 1].sum()) == 2.0 and float(k_cache[2, 1].sum()) == 2.0


def test_release_and_retain_refuse_bad_ids_and_change_nothing() -> None:
    alloc = BlockAllocator(4, 2)
    blocks = alloc.allocate(2)  # [0, 1]
    with pytest.raises(ValueError, match="release: block -1 is not in this pool"):
        alloc.release([-1])  # was: freed block 3 (-1 pads block tables)
    with pytest.raises(ValueError, match="retain: block 3 is free"):
        alloc.retain([0, 1, 3])
    assert alloc.refcounts == [1, 1, 0, 0]  # was [2, 2, 0, 0]
    with pytest.raises(ValueError, match="block 0 released 2 times but holds 1"):
        alloc.release([0, 0])
    with pytest.raises(ValueError, match="block 9 is not in this pool"):
        alloc.release([1, 9])
    with pytest.raises(TypeError):
        alloc.release([0.0])  # type: ignore[list-item]
    assert alloc.refcounts == [1, 1, 0, 0] and alloc.num_free == 2
    alloc.release(np.array(blocks))  # numpy ids are fine
    assert alloc.num_free == 4


def test_a_request_waiting_for_blocks_does_not_inflate_prefix_queries() -> None:
    alloc = BlockAllocator(6, 2, prefix_caching=True)
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, allocator=alloc)
    sched.add(Sequence(0, [1, 2, 3, 4, 5, 6, 7, 8, 9], max_new_tokens=3))  # 5 blocks, then 6
    sched.add(Sequence(1, [9, 9, 9, 9, 9], max_new_tokens=2))  # waits: 3 blocks, 1 free
    for _ in range(3):
        batch = sched.schedule()
        assert [s.request_id for s in batch.seqs] == [0]
        sched.update(batch, [None if not s.sample else 1 for s in batch.seqs])
    assert alloc.prefix.queries == 4  # type: ignore[union-attr]  # seq 0's (was 4 + 2 a step)
    assert alloc.prefix.hits == 0  # type: ignore[union-attr]


def test_prefix_hit_rate_counts_each_admitted_request_once() -> None:
    def step(batch: StepBatch) -> list[int | None]:
        return [7 if s.sample else None for s in batch.seqs]

    alloc = BlockAllocator(8, 2, prefix_caching=True)
    with ContinuousBatcher(step, max_num_seqs=1, max_num_batched_tokens=64, allocator=alloc) as b:
        b.generate([[1, 2, 3, 4, 5]] * 3, max_new_tokens=1)
        stats = alloc.stats()
    # 2 full blocks queried per request; the 2nd and 3rd find both
    assert (stats.prefix_queries, stats.prefix_hits) == (6, 4)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 16.5, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        {"block_size": 16, "num_layers": 2.5, "num_kv_heads": 2, "head_dim": 8},
        {"block_size": 16, "num_layers": 2, "num_kv_heads": True, "head_dim": 8},
    ],
)
def test_kv_sizes_must_be_whole_numbers(kwargs: dict) -> None:
    from batchkit.kv import kv_block_bytes

    with pytest.raises(ValueError, match="must be a positive integer"):
        kv_block_bytes(**kwargs)


@pytest.mark.parametrize("memory", [float("inf"), float("nan"), -1])
def test_num_blocks_for_refuses_a_memory_that_is_no_size(memory: float) -> None:
    from batchkit.kv import num_blocks_for

    with pytest.raises(ValueError, match="memory_bytes must be a finite number"):
        num_blocks_for(memory, block_size=16, num_layers=2, num_kv_heads=2, head_dim=8)
