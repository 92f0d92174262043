"""The pure scheduler core, step by step: prefill caps, priorities that reach running
sequences (preemption victims), and what it keeps alive."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from batchkit.generate import ContinuousBatcher, SeqStatus, Sequence, StepBatch, StepScheduler
from batchkit.kv import BlockAllocator
from tests.generate._toy import PagedToy, SlottedToy, solo


class Prompt(list):  # type: ignore[type-arg]
    """A prompt list that can be weakly referenced (the sequence keeps it as its tokens)."""


def test_deadlines_of_started_requests_do_not_keep_their_tokens_alive() -> None:
    sched = StepScheduler(max_num_seqs=1, max_num_batched_tokens=8)
    alive: list[weakref.ref[Prompt]] = []
    for i in range(500):  # long timeouts, each request served before the next arrives
        prompt = Prompt([1])
        alive.append(weakref.ref(prompt))
        sched.add(Sequence(i, prompt, max_new_tokens=1, deadline=1e9))
        del prompt
        batch = sched.schedule()
        sched.update(batch, [1])
        del batch
    gc.collect()
    kept = sum(ref() is not None for ref in alive)
    assert kept <= 66  # was 500: every started request's entry held its sequence


# -- helpers ----------------------------------------------------------------------
def make(
    *,
    max_num_seqs: int = 4,
    budget: int = 64,
    allocator: BlockAllocator | None = None,
    cap: int | None = None,
) -> StepScheduler:
    return StepScheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        allocator=allocator,
        max_prefill_chunk=cap,
    )


def step(sched: StepScheduler, model: Callable[[StepBatch], list[int | None]]) -> StepBatch:
    batch = sched.schedule()
    sched.update(batch, model(batch))
    return batch


def shares(batch: StepBatch) -> dict[int, int]:
    """Tokens each request computes in the step."""
    return {s.request_id: s.num_tokens for s in batch.seqs}


def run_to_end(sched: StepScheduler, model: Callable[[StepBatch], list[int | None]]) -> None:
    for _ in range(1000):
        if not sched.has_work:
            return
        step(sched, model)
    raise AssertionError("no progress")


def assert_solo(*seqs: Sequence) -> None:
    for seq in seqs:
        assert seq.generated_ids == solo(seq.token_ids[: seq.num_prompt_tokens], seq.max_new_tokens)


# -- fair prefill -------------------------------------------------------------------
@pytest.mark.parametrize(("cap", "first_token_at"), [(None, 4), (16, 2)])
def test_a_short_prompt_behind_a_long_prefill_waits_for_it_only_without_a_cap(
    cap: int | None, first_token_at: int
) -> None:
    sched, model = make(budget=64, cap=cap), SlottedToy()
    long = Sequence(0, [1] * 200, max_new_tokens=2)
    sched.add(long)
    step(sched, model)
    short = Sequence(1, [2, 3, 4], max_new_tokens=1)
    sched.add(short)
    steps = 1
    while short.num_generated == 0:
        batch = step(sched, model)
        steps += 1
        assert batch.num_tokens <= 64 and shares(batch)[0] <= (cap or 64)
    # no cap: the long prefill takes the whole budget (64 + 64 + 64 + 8 tokens) first
    assert steps == first_token_at
    run_to_end(sched, model)
    assert_solo(long, short)


def test_capped_prefills_of_several_sequences_share_a_step_with_decodes() -> None:
    sched, model = make(budget=40, cap=16), SlottedToy()
    decoding = Sequence(0, [5], max_new_tokens=10)
    sched.add(decoding)
    step(sched, model)
    sched.add(Sequence(1, [1] * 50, max_new_tokens=1))
    sched.add(Sequence(2, [2] * 50, max_new_tokens=1))
    assert shares(step(sched, model)) == {0: 1, 1: 16, 2: 16}
    assert shares(step(sched, model)) == {0: 1, 1: 16, 2: 16}


@pytest.mark.parametrize("bad", [0, -3, 65, 1.5, "8", True])
def test_a_bad_max_prefill_chunk_is_refused(bad: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"max_prefill_chunk must be None or a positive int at most max_num_batched_tokens=64",
    ):
        make(budget=64, cap=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_prefill_chunk"):
        ContinuousBatcher(SlottedToy(), max_num_batched_tokens=64, max_prefill_chunk=bad)  # type: ignore[arg-type]


# -- priorities that reach running sequences ------------------------------------------
@pytest.mark.parametrize(
    ("priorities", "victim"),
    [((1, 1), 1), ((2, 1), 0)],  # the newest among equals; else the least urgent, even if older
)
def test_an_urgent_request_takes_the_row_of_the_least_urgent_running_one(
    priorities: tuple[int, int], victim: int
) -> None:
    sched, model = make(max_num_seqs=2), SlottedToy()
    running = [
        Sequence(i, [1, 2 + i], max_new_tokens=20, priority=p) for i, p in enumerate(priorities)
    ]
    for seq in running:
        sched.add(seq)
    step(sched, model)
    urgent = Sequence(2, [5], max_new_tokens=3, priority=0)
    sched.add(urgent)
    batch = step(sched, model)
    assert set(shares(batch)) == {2, 1 - victim}  # the urgent one starts at once
    assert batch.released == [victim]
    assert sched.stats.preemptions == 1
    run_to_end(sched, model)
    assert_solo(*running, urgent)


def test_an_urgent_request_takes_kv_blocks_from_the_least_urgent() -> None:
    alloc = BlockAllocator(4, 4)
    sched, model = make(allocator=alloc), PagedToy(4, 4)
    background = [Sequence(i, [1 + i] * 7, max_new_tokens=6) for i in range(2)]  # 2 blocks each
    for seq in background:
        sched.add(seq)
    step(sched, model)
    assert alloc.num_free == 0
    urgent = Sequence(2, [9, 8, 7], max_new_tokens=2, priority=-1)
    sched.add(urgent)
    batch = step(sched, model)
    assert set(shares(batch)) == {0, 2} and batch.released == [1]
    run_to_end(sched, model)
    assert_solo(*background, urgent)
    assert alloc.num_free == alloc.num_blocks


def test_nobody_is_preempted_when_that_would_not_make_room() -> None:
    alloc = BlockAllocator(4, 4)
    sched, model = make(allocator=alloc), PagedToy(4, 4)
    sched.add(Sequence(0, [1] * 10, max_new_tokens=3, priority=-1))  # 3 blocks, more urgent
    sched.add(Sequence(1, [2] * 3, max_new_tokens=8, priority=1))  # 1 block
    step(sched, model)
    urgent = Sequence(2, [3] * 7, max_new_tokens=1, priority=0)  # needs 2 blocks: 1 could be freed
    sched.add(urgent)
    assert shares(step(sched, model)) == {0: 1, 1: 1}  # the urgent one waits for blocks
    assert sched.stats.preemptions == 0
    run_to_end(sched, model)
    assert_solo(urgent)


@pytest.mark.parametrize(("urgent_priority", "preempted"), [(1, []), (-1, [1, 0])])
def test_blocks_shared_with_a_more_urgent_sequence_are_not_counted_as_freed(
    urgent_priority: int, preempted: list[int]
) -> None:
    # A less urgent sequence that shares its system-prompt blocks with a more urgent one
    # frees only its own blocks: preempting it alone cannot make room. Before, it was
    # counted as freeing all it held, preempted, and the urgent request waited anyway.
    alloc = BlockAllocator(8, 4, prefix_caching=True)
    sched, model = make(allocator=alloc), PagedToy(8, 4)
    system = [1, 2, 3, 4, 5, 6, 7, 8]  # 2 full blocks
    first = Sequence(0, system + [9], max_new_tokens=10, priority=0)  # 3 blocks
    sched.add(first)
    step(sched, model)
    second = Sequence(1, system + [10, 11, 12, 13, 14], max_new_tokens=10, priority=5)
    sched.add(second)
    step(sched, model)  # shares the 2 system blocks, takes 2 of its own
    assert alloc.num_free == 3 and [alloc.refcount(b) for b in range(5)] == [2, 2, 1, 1, 1]
    urgent = Sequence(2, list(range(30, 53)), max_new_tokens=1, priority=urgent_priority)
    sched.add(urgent)  # 23 tokens: 6 blocks
    batch = step(sched, model)
    assert sched.stats.preemptions == len(preempted)  # was 1 with priority 1
    assert batch.released == preempted
    if preempted:  # both less urgent: preempting both frees all 5 blocks
        assert urgent.num_generated == 1
    else:  # only the second is less urgent, and 2 of its 4 blocks would come free
        assert second.status is SeqStatus.RUNNING and urgent.status is SeqStatus.WAITING
        assert set(shares(batch)) == {0, 1}
    run_to_end(sched, model)
    assert_solo(first, second, urgent)


def test_blocks_of_the_urgent_requests_own_prefix_hit_are_not_counted_as_freed() -> None:
    # Preempting the only less urgent sequence frees its 3 blocks, but 2 of them are the
    # urgent request's prefix-cache hit: it takes them back, so only 1 is gained.
    alloc = BlockAllocator(8, 4, prefix_caching=True)
    sched, model = make(allocator=alloc), PagedToy(8, 4)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    keeps = Sequence(0, list(range(40, 49)), max_new_tokens=3, priority=-5)  # 3 blocks
    sched.add(keeps)
    step(sched, model)
    less = Sequence(1, system + [9], max_new_tokens=3, priority=5)  # 3 blocks
    sched.add(less)
    step(sched, model)
    assert alloc.num_free == 2
    urgent = Sequence(2, system + list(range(20, 36)), max_new_tokens=1)  # 2 cached + 4
    sched.add(urgent)
    assert set(shares(step(sched, model))) == {0, 1}  # it waits for blocks
    assert sched.stats.preemptions == 0  # was 1: the hit's 2 blocks counted as gained
    run_to_end(sched, model)
    assert_solo(keeps, less, urgent)


@pytest.mark.parametrize(("priorities", "victim"), [((1, 0), 0), ((0, 1), 1)])
def test_a_block_shortage_preempts_the_least_urgent_never_a_more_urgent_one(
    priorities: tuple[int, int], victim: int
) -> None:
    # Two sequences fill 4 blocks of 2; the older one (0, first in the running order)
    # needs a block first. Before, the newest (1) was preempted whatever its priority.
    alloc = BlockAllocator(4, 2)
    sched, model = make(allocator=alloc), PagedToy(4, 2)
    seqs = [
        Sequence(i, [4, 5, 6 + i], max_new_tokens=4, priority=p) for i, p in enumerate(priorities)
    ]
    sched.add(seqs[0])
    step(sched, model)
    sched.add(seqs[1])  # there is room: it joins without preempting anyone
    batch = step(sched, model)
    while sched.stats.preemptions == 0:
        batch = step(sched, model)
    assert batch.released == [victim]
    run_to_end(sched, model)
    assert_solo(*seqs)


def test_a_preempted_sequence_is_not_preempted_again_by_an_equal_before_a_token() -> None:
    # Found by a random search: without the guard, request 2 is preempted (step 2),
    # readmitted to recompute (step 7) and preempted again by request 1 (step 8) before
    # it produced a token: its recompute was thrown away. Now request 1 gives way.
    alloc = BlockAllocator(4, 2)
    sched, model = make(budget=7, allocator=alloc), PagedToy(4, 2)
    seqs = [
        Sequence(0, [18, 11, 2], max_new_tokens=6),
        Sequence(1, [19, 11], max_new_tokens=5),
        Sequence(2, [1, 16, 12, 1], max_new_tokens=3),
    ]
    for seq in seqs:
        sched.add(seq)
    generated_when_preempted: dict[int, int] = {}
    while sched.has_work:
        before = [s.num_generated for s in seqs]
        batch = step(sched, model)
        for rid in batch.released:
            if not seqs[rid].is_finished:  # preempted
                assert generated_when_preempted.get(rid) != before[rid], f"{rid} thrashed"
                generated_when_preempted[rid] = before[rid]
    assert sched.stats.preemptions >= 2
    assert_solo(*seqs)


def test_two_preempted_equals_do_not_take_turns_forever() -> None:
    # With 1-token chunks, each preempted sequence could be readmitted with one block,
    # take the block the other needs next, and be preempted in turn: neither ever
    # produced a token. A preempted sequence now waits until its whole recompute fits.
    alloc = BlockAllocator(4, 2)
    sched, model = make(budget=8, allocator=alloc, cap=1), PagedToy(4, 2)
    seqs = [Sequence(0, [1, 2, 3], max_new_tokens=5), Sequence(1, [4, 5, 6], max_new_tokens=5)]
    for seq in seqs:
        sched.add(seq)
    run_to_end(sched, model)
    assert_solo(*seqs)
    assert sched.stats.preemptions == 1


# -- the batch's order -----------------------------------------------------------------
def test_an_urgent_request_admitted_into_a_later_row_is_listed_in_row_order() -> None:
    sched, model = make(max_num_seqs=2), SlottedToy()
    for i in range(2):
        sched.add(Sequence(i, [1, 2 + i], max_new_tokens=5, priority=1))
    step(sched, model)
    sched.add(Sequence(2, [5], max_new_tokens=3, priority=0))  # takes request 1's row 1
    batch = step(sched, model)
    assert [(s.request_id, s.slot) for s in batch.seqs] == [(0, 0), (2, 1)]  # was 2 first


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(1, 6), st.integers(-1, 1)),
        min_size=1,
        max_size=8,
    ),
    st.booleans(),
)
@example(requests=[(0, 12, 6, 0)], paged=True)
def test_every_batch_lists_its_sequences_in_row_order(
    requests: list[tuple[int, int, int, int]], paged: bool
) -> None:
    """Arrivals over time with priorities (urgent admissions, preemptions, finished rows
    reused): every batch is in row order, its block tables row by row its sequences'
    blocks, and every output what the request generates alone."""
    alloc = BlockAllocator(8, 2, prefix_caching=True) if paged else None
    sched = make(max_num_seqs=3, budget=8, allocator=alloc, cap=4)
    model: Callable[[StepBatch], list[int | None]] = PagedToy(8, 2) if paged else SlottedToy()
    # paged: every request must fit the pool alone (16 KV slots; the last token needs none)
    seqs = [
        Sequence(
            i,
            [1 + (i + j) % 5 for j in range(length)],
            max_new_tokens=min(new, 17 - length) if paged else new,
            priority=p,
        )
        for i, (_, length, new, p) in enumerate(requests)
    ]
    arrivals = sorted(zip((r[0] for r in requests), seqs), key=lambda a: a[0])
    for t in range(1000):
        while arrivals and arrivals[0][0] <= t:
            sched.add(arrivals.pop(0)[1])
        if not (arrivals or sched.has_work):
            break
        batch = step(sched, model)
        slots = [s.slot for s in batch.seqs]
        assert slots == sorted(slots)
        if batch.block_tables is not None:
            for row, s in zip(batch.block_tables.tolist(), batch.seqs):
                assert row[: len(s.block_ids or [])] == s.block_ids
    assert_solo(*seqs)
