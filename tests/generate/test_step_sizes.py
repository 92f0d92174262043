"""``step_sizes``: every step the step function sees has a row count of the set (padding
rows last, marked), the padding rows' entries reach no request whatever they are, a
padded paged layout changes neither the sequences' attention nor the cache, and bad
sizes are refused by name. (The property test over random traffic, chunking,
preemption and cancellation is in ``test_exactness.py``; a model run through padded
steps is in ``test_gpt2.py``.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import batchkit
from batchkit.generate import ContinuousBatcher, Sequence, StepBatch, StepScheduler
from batchkit.kv import BlockAllocator, build_layout, paged_attention, write_kv
from tests.generate._toy import PagedToy, SlottedToy, solo

PROMPTS = [[i % 23, (5 * i) % 23, 2, 7][: 1 + i % 4] for i in range(11)]


def recording(toy, junk: object):
    """``toy``, recording each step's row counts and answering padding rows with
    ``junk`` instead of the toy's own entry."""
    steps: list[tuple[int, int]] = []

    def step(batch: StepBatch) -> list:
        steps.append((len(batch.seqs), batch.num_padding))
        out = toy(batch)
        return [junk if s.is_padding else tok for s, tok in zip(batch.seqs, out)]

    return step, steps


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("junk", [None, ValueError("padding"), "not a token", -5])
def test_each_step_has_a_size_of_the_set_and_padding_reaches_nobody(
    paged: bool, junk: object
) -> None:
    alloc = BlockAllocator(24, 2) if paged else None
    toy = PagedToy(24, 2) if paged else SlottedToy()
    step, steps = recording(toy, junk)
    with ContinuousBatcher(
        step, max_num_seqs=6, max_num_batched_tokens=9, allocator=alloc, step_sizes=(8, 1, 2, 4)
    ) as b:
        got = b.generate(PROMPTS, max_new_tokens=7)
        stats = b.stats()
    assert got == [solo(p, 7) for p in PROMPTS]
    assert stats.finished == len(PROMPTS) and stats.failed == 0
    assert {n for n, _ in steps} <= {1, 2, 4, 8}
    assert {n - pad for n, pad in steps} - {1, 2, 4, 8}  # some steps were padded


def test_stats_count_the_padding_rows_apart_from_the_sequences() -> None:
    with ContinuousBatcher(SlottedToy(), max_num_seqs=3, step_sizes=(4,)) as b:
        assert b.generate([[1, 2, 3]], max_new_tokens=2) == [solo([1, 2, 3], 2)]
        stats = b.stats()
    assert (stats.steps, stats.padding_rows, stats.tokens_computed) == (2, 6, 4)
    assert stats.slot_utilisation == pytest.approx(1 / 3)  # one sequence of 3 rows


def test_a_shape_grid_gives_its_batch_sizes() -> None:
    grid = batchkit.ShapeBuckets(batch_sizes=(2, 4), lengths=(16,))
    sched = StepScheduler(max_num_seqs=4, max_num_batched_tokens=16, step_sizes=grid)
    assert sched.step_sizes == (2, 4)


def test_an_async_step_function_sees_padded_steps_too() -> None:
    step, steps = recording(SlottedToy(), None)

    async def astep(batch: StepBatch) -> list:
        await asyncio.sleep(0)
        return step(batch)

    async def main() -> list[list[int]]:
        async with ContinuousBatcher(astep, max_num_seqs=3, step_sizes=(4,)) as b:
            return await b.agenerate(PROMPTS[:5], max_new_tokens=4)

    assert asyncio.run(main()) == [solo(p, 4) for p in PROMPTS[:5]]
    assert {n for n, _ in steps} == {4}


def test_a_result_without_the_padding_rows_fails_the_step() -> None:
    def step(batch: StepBatch) -> list:
        return [7 for s in batch.seqs if not s.is_padding]  # one short per padding row

    with ContinuousBatcher(step, max_num_seqs=2, step_sizes=(4,)) as b:
        handle = b.submit([1, 2], max_new_tokens=3)
        with pytest.raises(ValueError, match="returned 1 results for 4 rows"):
            handle.result(timeout=10)


@pytest.mark.parametrize(
    "sizes, error, match",
    [
        ((1, 2), ValueError, r"step_sizes \[1, 2\] has no size for a step of max_num_seqs=4"),
        ((), ValueError, "at least one size"),
        ((4, 0), ValueError, r"step_sizes\[1\] must be >= 1, got 0"),
        ((4, 2.0), TypeError, r"step_sizes\[1\] must be an int, got float"),
        ((4, True), TypeError, r"step_sizes\[1\] must be an int"),
        ("48", TypeError, "step_sizes must be None, ShapeBuckets or ints"),
        (8, TypeError, "step_sizes must be None, ShapeBuckets or ints"),
    ],
)
def test_bad_step_sizes_are_refused_by_name(sizes: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ContinuousBatcher(SlottedToy(), max_num_seqs=4, step_sizes=sizes)  # type: ignore[arg-type]


@pytest.mark.parametrize("use_torch", [False, True])
def test_padded_layout_leaves_the_sequences_outputs_and_cache_alone(use_torch: bool) -> None:
    """Reference paged attention over a padded step: the sequences' rows and the cache
    are those of the unpadded step; the padding rows read only valid blocks."""
    block_size = 2
    alloc = BlockAllocator(8, block_size)
    sched = StepScheduler(
        max_num_seqs=3, max_num_batched_tokens=64, allocator=alloc, step_sizes=(1, 5)
    )
    for i, prompt in enumerate([[10, 11, 12, 13, 14], [20, 21], [30, 31, 32]]):
        sched.add(Sequence(i, prompt, max_new_tokens=2))
    batch = sched.schedule()
    assert (len(batch.seqs), batch.num_padding) == (5, 2)
    seqs = batch.requests
    plain = build_layout(
        [s.token_ids for s in seqs],
        [s.start for s in seqs],
        [s.num_tokens for s in seqs],
        [s.block_ids or [] for s in seqs],
        block_size,
    )
    padded = batch.layout
    t = plain.num_tokens
    assert padded.num_tokens == t + 2 and padded.slot_mapping[t:].tolist() == [-1, -1]
    assert padded.block_tables[3:].tolist() == [[0, -1, -1], [0, -1, -1]]

    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(t + 2, 2, 4)) for _ in range(3))
    caches = [rng.normal(size=(8, block_size, 2, 4)) for _ in range(2)]
    unpadded = [c.copy() for c in caches]
    if use_torch:
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_numpy(a) for a in (q, k, v))
        caches = [torch.from_numpy(c) for c in caches]
        unpadded = [torch.from_numpy(c) for c in unpadded]
        plain, padded = plain.to_torch(), padded.to_torch()
    write_kv(*unpadded, k[:t], v[:t], plain.slot_mapping)
    write_kv(*caches, k, v, padded.slot_mapping)
    for got, want in zip(caches, unpadded):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    out = np.asarray(paged_attention(q, *caches, padded))
    np.testing.assert_array_equal(out[:t], np.asarray(paged_attention(q[:t], *unpadded, plain)))
    assert np.isfinite(out[t:]).all()
    sched.update(batch, [1, 2, 3, -1, -1])  # the padding rows' entries: ignored
    assert [s.generated_ids for s in sched.running] == [[1], [2], [3]]
