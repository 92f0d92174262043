"""Grouped continuous batching: ``submit(..., group=)`` and ``max_groups_per_step``.

Every step within its group limit, waiting groups admitted as running ones drain
(oldest first, with backfilling behind the first one blocked, and a bound on its
wait), urgent requests taking a whole group's place, preemption keeping groups, the
per-group stats, what is refused, and a prefix cache per group (an adapter's keys and
values reused by its own requests only)."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from batchkit.generate import ContinuousBatcher, SeqStatus, Sequence, StepBatch, StepScheduler
from batchkit.kv import BlockAllocator
from tests.generate._toy import VOCAB, PagedToy, SlottedToy, advance, solo

Model = Callable[[StepBatch], list[int | None]]


def make(
    *,
    max_num_seqs: int = 4,
    budget: int = 64,
    groups: int | None = None,
    allocator: BlockAllocator | None = None,
    cap: int | None = None,
    max_model_len: int | None = None,
) -> StepScheduler:
    return StepScheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        allocator=allocator,
        max_prefill_chunk=cap,
        max_model_len=max_model_len,
        max_groups_per_step=groups,
    )


def step(sched: StepScheduler, model: Model) -> StepBatch:
    batch = sched.schedule()
    sched.update(batch, model(batch))
    return batch


def ids(batch: StepBatch) -> set[int]:
    return {s.request_id for s in batch.seqs}


def run_to_end(sched: StepScheduler, model: Model) -> list[StepBatch]:
    batches: list[StepBatch] = []
    for _ in range(2000):
        if not sched.has_work:
            return batches
        batches.append(step(sched, model))
    raise AssertionError("no progress")


def expected(seq: Sequence, max_model_len: int | None = None) -> list[int]:
    prompt = seq.token_ids[: seq.num_prompt_tokens]
    new = seq.max_new_tokens
    if max_model_len is not None:
        new = min(new, max_model_len - len(prompt))
    return solo(prompt, new)


# -- the batcher's surface -------------------------------------------------------------
def test_the_group_reaches_the_step_function_on_each_sequence() -> None:
    seen: dict[int, Hashable] = {}
    inner = SlottedToy()

    def model(batch: StepBatch) -> list[int | None]:
        for s in batch.seqs:
            seen[s.request_id] = s.group
        return inner(batch)

    with ContinuousBatcher(model, max_num_seqs=4, max_groups_per_step=2) as cb:
        handles = [
            cb.submit([1, 2], max_new_tokens=3, group="lora-a"),
            cb.submit([3], max_new_tokens=2, group=("task", 7)),
            cb.submit([4], max_new_tokens=2),
        ]
        assert [h.result(timeout=10) for h in handles] == [
            solo([1, 2], 3),
            solo([3], 2),
            solo([4], 2),
        ]
    assert seen == {0: "lora-a", 1: ("task", 7), 2: None}


@pytest.mark.parametrize("group", [["a"], {"a": 1}, {1, 2}])
def test_an_unhashable_group_is_refused_at_submit_naming_its_type(group: object) -> None:
    with ContinuousBatcher(SlottedToy(), max_num_seqs=2, max_groups_per_step=1) as cb:
        with pytest.raises(
            TypeError, match=rf"group must be hashable, got a {type(group).__name__}"
        ):
            cb.submit([1], max_new_tokens=1, group=group)  # type: ignore[arg-type]
        stats = cb.stats()
        assert stats.requests == 0 and stats.waiting == 0 and stats.running == 0
        assert cb.submit([1], max_new_tokens=2, group="ok").result(timeout=10) == solo([1], 2)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (0, ValueError),
        (-1, ValueError),
        (1.5, ValueError),
        (float("nan"), ValueError),
        (True, TypeError),
        ("2", TypeError),
    ],
)
def test_a_bad_max_groups_per_step_is_refused_naming_it(
    bad: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="max_groups_per_step must be a positive int"):
        ContinuousBatcher(SlottedToy(), max_groups_per_step=bad)  # type: ignore[arg-type]
    with pytest.raises(error, match="max_groups_per_step"):
        make(groups=bad)  # type: ignore[arg-type]


def test_a_whole_number_float_limit_is_taken_as_an_int() -> None:
    limit = make(groups=2.0).max_groups_per_step  # type: ignore[arg-type]
    assert limit == 2 and type(limit) is int
    assert make().max_groups_per_step is None


def test_stats_count_each_groups_requests_steps_and_tokens() -> None:
    sched, model = make(max_num_seqs=4, groups=1), SlottedToy()
    sched.add(Sequence(0, [1, 2, 3], max_new_tokens=2, group="a"))  # 2 steps: 3 + 1 tokens
    sched.add(Sequence(1, [4], max_new_tokens=3, group="b"))  # waits for "a": 3 steps
    sched.add(Sequence(2, [5, 6], max_new_tokens=1, group="a"))  # backfills "a": 1 step
    run_to_end(sched, model)
    groups = sched.stats.snapshot(running=0, waiting=0, kv_usage=0, prefix_hit_rate=0).groups
    assert {
        g: (s.admitted, s.steps, s.tokens_computed, s.tokens_generated) for g, s in groups.items()
    } == {
        "a": (2, 2, 3 + 2 + 1, 3),
        "b": (1, 3, 1 + 1 + 1, 3),
    }


# -- admission under the limit -----------------------------------------------------------
def test_a_waiting_group_joins_only_when_a_running_group_has_drained() -> None:
    sched, model = make(max_num_seqs=4, groups=2), SlottedToy()
    a = Sequence(0, [1], max_new_tokens=3, group="a")
    b = Sequence(1, [2], max_new_tokens=5, group="b")
    c = Sequence(2, [3], max_new_tokens=2, group="c")
    for seq in (a, b, c):
        sched.add(seq)
    batches = run_to_end(sched, model)
    assert [ids(batch) for batch in batches] == [{0, 1}, {0, 1}, {0, 1}, {1, 2}, {1, 2}]
    for seq in (a, b, c):
        assert seq.generated_ids == expected(seq)


def test_behind_a_blocked_sequence_only_work_within_its_groups_horizon_joins() -> None:
    # "a" runs 6 more tokens at most; "b" is blocked. A short "a" request backfills the
    # free rows; a long one would make "a" last longer, so it waits behind "b".
    sched, model = make(max_num_seqs=4, groups=1), SlottedToy()
    running = Sequence(0, [1], max_new_tokens=7, group="a")
    sched.add(running)
    step(sched, model)  # 6 tokens left
    blocked = Sequence(1, [2], max_new_tokens=2, group="b")
    short = Sequence(2, [3, 4], max_new_tokens=5, group="a")  # 2 + 5 - 1 = 6 tokens: fits
    long = Sequence(3, [5], max_new_tokens=7, group="a")  # 7 tokens: would outlast it
    for seq in (blocked, short, long):
        sched.add(seq)
    assert ids(step(sched, model)) == {0, 2}
    batches = run_to_end(sched, model)
    # "a" drains (the short one no later than the first), then "b" runs, then "a" again
    assert [ids(b) for b in batches] == [{0, 2}] * 4 + [{0}] + [{1}] * 2 + [{3}] * 7
    for seq in (running, blocked, short, long):
        assert seq.generated_ids == expected(seq)


def test_without_a_limit_groups_change_no_batch() -> None:
    def batches(grouped: bool) -> list[list[tuple[int, int, int]]]:
        sched, model = make(max_num_seqs=3, budget=6, cap=4), SlottedToy()
        for i in range(9):
            group = i % 4 if grouped else None
            sched.add(Sequence(i, [1 + i % 5] * (1 + i % 7), max_new_tokens=1 + i % 4, group=group))
        return [
            [(s.request_id, s.start, s.num_tokens) for s in b.seqs]
            for b in run_to_end(sched, model)
        ]

    assert batches(grouped=True) == batches(grouped=False)


@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 9), st.integers(1, 5), st.integers(-1, 1)),
        min_size=1,
        max_size=10,
    ),
    st.booleans(),
)
def test_a_limit_no_smaller_than_the_groups_changes_no_batch(
    requests: list[tuple[int, int, int, int]], paged: bool
) -> None:
    def batches(limit: int | None) -> list[list[tuple[int, int, int]]]:
        alloc = BlockAllocator(8, 2, prefix_caching=True) if paged else None
        sched = make(max_num_seqs=3, budget=8, groups=limit, allocator=alloc, cap=4)
        model: Model = PagedToy(8, 2) if paged else SlottedToy()
        for i, (g, length, new, p) in enumerate(requests):
            prompt = [1 + (i + j) % 5 for j in range(length)]
            sched.add(Sequence(i, prompt, max_new_tokens=new, priority=p, group=g))
        return [
            [(s.request_id, s.start, s.num_tokens) for s in b.seqs]
            for b in run_to_end(sched, model)
        ]

    assert batches(3) == batches(None)


# -- urgent requests and preemption ---------------------------------------------------------
def test_an_urgent_request_of_another_group_takes_a_whole_less_urgent_groups_place() -> None:
    sched, model = make(max_num_seqs=4, groups=2), SlottedToy()
    background = [
        Sequence(0, [1], max_new_tokens=9, group="a", priority=1),
        Sequence(1, [2], max_new_tokens=9, group="b", priority=2),
        Sequence(2, [3], max_new_tokens=9, group="b", priority=1),
    ]
    for seq in background:
        sched.add(seq)
    step(sched, model)
    urgent = Sequence(3, [4], max_new_tokens=2, group="c", priority=0)
    sched.add(urgent)
    batch = step(sched, model)
    # "b" goes (its most urgent member, priority 1, is newer than "a"'s): rows were free,
    # yet the group limit needed a whole group
    assert ids(batch) == {0, 3} and sorted(batch.released) == [1, 2]
    assert sched.stats.preemptions == 2
    batches = run_to_end(sched, model)
    assert all(len({s.group for s in b.seqs}) <= 2 for b in batches)
    for seq in (*background, urgent):
        assert seq.generated_ids == expected(seq)


def test_an_urgent_request_waits_when_every_group_has_a_member_as_urgent() -> None:
    sched, model = make(max_num_seqs=4, groups=1), SlottedToy()
    sched.add(Sequence(0, [1], max_new_tokens=5, group="a", priority=2))
    sched.add(Sequence(1, [2], max_new_tokens=3, group="a", priority=0))
    step(sched, model)
    urgent = Sequence(2, [3], max_new_tokens=1, group="b", priority=1)
    sched.add(urgent)
    assert ids(step(sched, model)) == {0, 1}  # nobody preempted for nothing
    assert sched.stats.preemptions == 0
    run_to_end(sched, model)
    assert urgent.generated_ids == expected(urgent)


def test_a_sequence_preempted_for_blocks_keeps_its_group_and_the_limit() -> None:
    alloc = BlockAllocator(4, 2)
    sched, model = make(allocator=alloc, groups=1), PagedToy(4, 2)
    seqs = [Sequence(i, [4, 5, 6 + i], max_new_tokens=4, group="a") for i in range(2)]
    other = Sequence(2, [7], max_new_tokens=2, group="b")
    for seq in (*seqs, other):
        sched.add(seq)
    groups_seen: list[set[Hashable]] = []
    while sched.has_work:
        batch = step(sched, model)
        groups_seen.append({s.group for s in batch.seqs})
    assert sched.stats.preemptions >= 1
    assert all(len(g) <= 1 for g in groups_seen) and groups_seen[-1] == {"b"}
    assert [s.group for s in seqs] == ["a", "a"]
    for seq in (*seqs, other):
        assert seq.generated_ids == expected(seq)
    assert alloc.num_free == alloc.num_blocks


# -- the prefix cache per group -------------------------------------------------------------
class AdapterToy:
    """A paged toy whose keys and values depend on the group, as a LoRA adapter's do:
    each token is cached tagged with its sequence's group, so a block computed in
    another group reads back wrong (an error); tokens are ``PagedToy``'s."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.cache = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.block_size = block_size
        self.tags: dict[Hashable, int] = {}

    def tag(self, group: Hashable) -> int:
        return 1000 * self.tags.setdefault(group, len(self.tags))

    def __call__(self, batch: StepBatch) -> list[int | None]:
        layout = batch.layout
        tags = np.repeat(
            [self.tag(s.group) for s in batch.seqs], [s.num_tokens for s in batch.seqs]
        )
        self.cache[layout.slot_mapping] = layout.input_ids + tags
        bs = self.block_size
        out: list[int | None] = []
        for b, s in enumerate(batch.seqs):
            length = int(layout.seq_lens[b])
            blocks = layout.block_tables[b, : -(-length // bs)]
            history = self.cache.reshape(-1, bs)[blocks].reshape(-1)[:length] - self.tag(s.group)
            if (history != np.asarray(s.token_ids[:length])).any():
                raise AssertionError(
                    f"request {s.request_id} of group {s.group!r}: its cache holds other "
                    "tokens or another group's keys and values"
                )
            out.append(advance(0, history.tolist()) % VOCAB if s.sample else None)
        return out


def test_a_cached_prefix_is_reused_by_its_own_group_only() -> None:
    alloc = BlockAllocator(16, 2, prefix_caching=True)
    sched, model = make(allocator=alloc), AdapterToy(16, 2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 4 full blocks of 2 may be shared
    cached: dict[Hashable, list[int]] = {}
    for i, group in enumerate(["lora-a", "lora-b", "lora-a", None, "lora-b", None]):
        seq = Sequence(i, list(prompt), max_new_tokens=3, group=group)
        sched.add(seq)
        run_to_end(sched, model)
        assert seq.generated_ids == solo(prompt, 3)
        cached.setdefault(group, []).append(seq.num_cached_tokens)
    # The first request of each group computes the prompt; the second reuses its 8 tokens.
    assert cached == {"lora-a": [0, 8], "lora-b": [0, 8], None: [0, 8]}
    assert alloc.num_free == alloc.num_blocks


@given(
    requests=st.lists(
        st.tuples(
            st.integers(0, 4),  # arrival step
            st.sampled_from([None, "lora-a", "lora-b"]),
            st.integers(0, 2),  # which shared system prompt
            st.lists(st.integers(1, 4), max_size=4),  # the request's own tokens after it
            st.integers(1, 4),  # max_new_tokens
        ),
        min_size=1,
        max_size=10,
    ),
    limit=st.one_of(st.none(), st.integers(1, 2)),
    num_blocks=st.integers(8, 24),
)
def test_groups_sharing_prompts_reuse_only_their_own_cached_blocks(
    requests: list[tuple[int, Hashable, int, list[int], int]],
    limit: int | None,
    num_blocks: int,
) -> None:
    """Requests of three groups over three shared system prompts, through a pool small
    enough to evict and preempt: no sequence ever reads a block computed in another
    group (``AdapterToy`` would fail), every output is exact, and nothing is leaked."""
    systems = [[1, 2, 3, 4], [1, 2, 5, 6], [3, 3, 3, 3, 3, 3]]
    alloc = BlockAllocator(num_blocks, 2, prefix_caching=True)
    sched = make(max_num_seqs=3, budget=8, groups=limit, allocator=alloc)
    model = AdapterToy(num_blocks, 2)
    seqs = [
        Sequence(i, systems[k] + own, max_new_tokens=new, group=g)
        for i, (_, g, k, own, new) in enumerate(requests)
    ]
    arrivals = sorted(zip((r[0] for r in requests), seqs), key=lambda a: a[0])
    for t in range(2000):
        while arrivals and arrivals[0][0] <= t:
            sched.add(arrivals.pop(0)[1])
        if not (arrivals or sched.has_work):
            break
        step(sched, model)
    else:
        raise AssertionError("no progress")
    for seq in seqs:
        assert seq.generated_ids == expected(seq)
    assert alloc.num_free == alloc.num_blocks


# -- the property --------------------------------------------------------------------------
def tokens_left(seq: Sequence, max_model_len: int | None) -> int:
    """The test's own count: tokens not computed yet, then one per later sample."""
    samples = seq.max_new_tokens - seq.num_generated
    if max_model_len is not None:
        samples = min(samples, max_model_len - seq.num_tokens)
    return seq.num_tokens - seq.num_computed_tokens + samples - 1


@given(
    requests=st.lists(
        st.tuples(
            st.integers(0, 6),  # arrival step
            st.integers(0, 4),  # group
            st.integers(1, 12),  # prompt length
            st.integers(1, 8),  # max_new_tokens
            st.integers(0, 1),  # priority (paged runs only)
        ),
        min_size=1,
        max_size=14,
    ),
    limit=st.integers(1, 4),
    max_num_seqs=st.integers(1, 5),
    budget=st.integers(1, 24),
    cap=st.one_of(st.none(), st.integers(1, 8)),
    max_model_len=st.one_of(st.none(), st.integers(13, 20)),
    paged=st.booleans(),
)
@example(  # a stream of one group behind a blocked one: backfilling past its horizon starves it
    requests=[(0, 0, 1, 1, 0)] * 6 + [(0, 0, 1, 2, 0), (0, 1, 1, 1, 0), (4, 0, 1, 2, 0)],
    limit=1, max_num_seqs=2, budget=2, cap=None, max_model_len=None, paged=False,
)  # fmt: skip
def test_every_step_within_the_limit_every_request_exact_and_none_starved(
    requests: list[tuple[int, int, int, int, int]],
    limit: int,
    max_num_seqs: int,
    budget: int,
    cap: int | None,
    max_model_len: int | None,
    paged: bool,
) -> None:
    """Random arrivals, groups and lengths: every step holds at most ``limit`` groups and
    each sequence once; every request finishes once, with exactly its solo tokens. In
    slotted mode at one priority (no preemption), the first waiting sequence blocked by
    the limit starts once W steps that computed every running sequence have run (W the
    smallest running group's horizon when it was first blocked), at the first step after
    them that leaves token budget."""
    cap = None if cap is None else min(cap, budget)
    alloc = BlockAllocator(16, 2, prefix_caching=True) if paged else None
    sched = make(
        max_num_seqs=max_num_seqs, budget=budget, groups=limit, allocator=alloc, cap=cap,
        max_model_len=max_model_len,
    )  # fmt: skip
    model: Model = PagedToy(16, 2) if paged else SlottedToy()
    seqs = [
        Sequence(
            i, [1 + (g + j) % 5 for j in range(length)], max_new_tokens=new,
            priority=p if paged else 0, group=f"g{g}",
        )
        for i, (_, g, length, new, p) in enumerate(requests)
    ]  # fmt: skip
    arrivals = sorted(zip((r[0] for r in requests), seqs), key=lambda a: a[0])
    finished: list[int] = []
    # blocked head -> [W, full steps since it was first blocked]
    blocked: dict[int, list[int]] = {}
    for t in range(3000):
        while arrivals and arrivals[0][0] <= t:
            sched.add(arrivals.pop(0)[1])
        if not (arrivals or sched.has_work):
            break
        running = list(sched.running)
        head = sched.waiting[0] if sched.waiting else None
        groups = {s.group for s in running}
        if (
            not paged
            and head is not None
            and head.request_id not in blocked
            and head.group not in groups
            and len(groups) >= limit
        ):
            horizons: dict[Hashable, int] = {}
            for s in running:
                horizons[s.group] = max(horizons.get(s.group, 0), tokens_left(s, max_model_len))
            blocked[head.request_id] = [min(horizons.values()), 0]
        batch = step(sched, model)
        in_step = [s.request_id for s in batch.seqs]
        assert len(in_step) == len(set(in_step)), f"step {t}: a sequence twice: {in_step}"
        step_groups = {s.group for s in batch.seqs}
        assert len(step_groups) <= limit, f"step {t}: groups {step_groups} over {limit}"
        assert len({s.group for s in sched.running}) <= limit
        finished += [s.request_id for s in batch.seqs if s.seq.is_finished]
        full = set(in_step) >= {s.request_id for s in running}
        for rid, wait in blocked.items():
            seq = seqs[rid]
            if seq.started:
                continue
            w, full_steps = wait
            # After W full steps its group may join: only a step without budget left defers it.
            assert full_steps < w or batch.num_tokens == budget, (
                f"request {rid} blocked at W={w}, still waiting after {full_steps} full steps"
            )
            wait[1] += full
    else:
        raise AssertionError("no progress")
    assert sorted(finished) == list(range(len(seqs))), "a request lost or finished twice"
    for seq in seqs:
        assert seq.status is SeqStatus.FINISHED and seq.finish_reason == "length"
        assert seq.generated_ids == expected(seq, max_model_len)
    if alloc is not None:
        assert alloc.num_free == alloc.num_blocks
