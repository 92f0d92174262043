"""Each request's tokens equal its solo run, whatever else shares its steps.

Hypothesis drives the pure scheduler core over the toy recurrence (``_toy.py``) with
random prompts, lengths, arrival steps, priorities, cancellations (some during a step),
row and token limits small enough to chunk every prompt, prefill caps, KV pools
small enough to preempt (for blocks and for more urgent requests), and step sizes
(each step padded with padding rows to a size of the set; their entries would fail a
request they reached). In paged mode every step's layout is also checked against the
general one.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from batchkit.generate import Sequence, StepBatch, StepScheduler
from batchkit.kv import BlockAllocator, blocks_for, build_layout
from tests.generate._toy import VOCAB, PagedToy, SlottedToy, solo

STOP = 5

request = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20),
        "shared_prefix": st.booleans(),  # starts with a common 8 tokens (prefix-cache hits)
        "max_new": st.integers(1, 12),
        "arrive": st.integers(0, 6),  # the step before which it is submitted
        "cancel": st.none() | st.tuples(st.integers(0, 15), st.booleans()),  # (step, in-step?)
        "priority": st.sampled_from([0, 0, 0, 1, -1, 2]),
    }
)
COMMON = [7, 1, 9, 4, 4, 2, 8, 6]


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    reqs = draw(st.lists(request, min_size=1, max_size=8))
    for r in reqs:
        if r["shared_prefix"]:
            r["prompt"] = COMMON + r["prompt"]
    paged = draw(st.booleans())
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 5))
    longest = max(blocks_for(len(r["prompt"]) + r["max_new"] - 1, block_size) for r in reqs)
    return {
        "reqs": reqs,
        "paged": paged,
        "block_size": block_size,
        "num_blocks": longest + draw(st.integers(0, 12)),  # tight pools force preemption
        "prefix_caching": draw(st.booleans()),
        "max_num_seqs": max_num_seqs,
        "budget": (budget := draw(st.integers(1, 24))),
        "max_prefill_chunk": draw(st.none() | st.integers(1, budget)),
        "step_sizes": draw(st.none() | step_sizes(max_num_seqs)),
    }


def step_sizes(max_num_seqs: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Sizes in any order, at least one as large as ``max_num_seqs``."""
    return st.builds(
        lambda smaller, largest: (*smaller, largest),
        st.lists(st.integers(1, max_num_seqs), max_size=3),
        st.integers(max_num_seqs, max_num_seqs + 3),
    )


def run(sc: dict) -> tuple[list[Sequence], StepScheduler]:
    alloc = None
    if sc["paged"]:
        alloc = BlockAllocator(
            sc["num_blocks"], sc["block_size"], prefix_caching=sc["prefix_caching"]
        )
        step = PagedToy(sc["num_blocks"], sc["block_size"])
    else:
        step = SlottedToy()
    sched = StepScheduler(
        max_num_seqs=sc["max_num_seqs"],
        max_num_batched_tokens=sc["budget"],
        allocator=alloc,
        max_prefill_chunk=sc["max_prefill_chunk"],
        step_sizes=sc["step_sizes"],
    )
    seqs = [
        Sequence(
            i,
            list(r["prompt"]),
            max_new_tokens=r["max_new"],
            stop_token_ids=frozenset({STOP}),
            priority=r["priority"],
        )
        for i, r in enumerate(sc["reqs"])
    ]
    pending = sorted(range(len(seqs)), key=lambda i: sc["reqs"][i]["arrive"])
    added: set[int] = set()
    step_no = 0
    while pending or sched.has_work:
        while pending and sc["reqs"][pending[0]]["arrive"] <= step_no:
            added.add(pending[0])
            sched.add(seqs[pending.pop(0)])
        for i in added:
            if sc["reqs"][i]["cancel"] == (step_no, False):
                sched.abort(seqs[i])
        batch = sched.schedule()
        check_step(batch, sc)
        if alloc is not None:
            check_layout(batch)
        for i in added:  # cancelled while the step runs
            if sc["reqs"][i]["cancel"] == (step_no, True):
                sched.abort(seqs[i])
        sched.update(batch, step(batch))
        step_no += 1
        assert step_no < 2000, "no progress"
    return seqs, sched


def check_step(batch: StepBatch, sc: dict) -> None:
    """Within the budget, the prefill cap, the rows; no sequence twice; with step sizes,
    a size of the set, the padding rows last and marked, the smallest size that fits."""
    cap = sc["max_prefill_chunk"] or sc["budget"]
    seqs = batch.requests
    assert sum(s.num_tokens for s in seqs) <= sc["budget"]
    assert all(1 <= s.num_tokens <= cap for s in seqs)
    assert len(seqs) <= sc["max_num_seqs"]
    assert len({s.request_id for s in seqs}) == len(seqs)
    assert not any(s.is_padding for s in seqs)
    padding = batch.seqs[len(seqs) :]
    assert len(padding) == batch.num_padding
    sizes = sc["step_sizes"]
    if sizes is None:
        assert not padding
        return
    assert len(batch.seqs) == min(n for n in sizes if n >= len(seqs))
    for row in padding:
        assert row.is_padding and row.request_id == -1 and row.slot is None
        assert (row.start, row.num_tokens, row.sample) == (0, 1, True)


def check_layout(batch: StepBatch) -> None:
    """The batch's layout (decode-only steps take a faster path, block tables come from the
    scheduler's incrementally kept rows) equals the general one, rebuilt from lists, for
    the sequences' rows; the padding rows after them write nothing and read block 0."""
    seqs = batch.requests
    assert batch.block_size is not None
    want = build_layout(
        [s.token_ids for s in seqs],
        [s.start for s in seqs],
        [s.num_tokens for s in seqs],
        [s.block_ids or [] for s in seqs],
        batch.block_size,
    )
    got = batch.layout
    b, t, p = len(seqs), want.num_tokens, batch.num_padding
    assert (got.num_seqs, got.num_tokens) == (b + p, t + p)
    rows = {"seq_lens": b, "block_tables": b, "logits_indices": b}
    rows |= {"cu_seqlens_q": b + 1, "cu_seqlens_k": b + 1}
    for name in want.__dataclass_fields__:
        a, w = getattr(got, name), getattr(want, name)
        if isinstance(w, int):
            assert a == (max(w, 1) if p else w), name
            continue
        assert a.dtype == w.dtype, name
        a = a[: rows.get(name, t)]
        if name == "block_tables":
            a = a[:, : w.shape[1]]
        assert np.array_equal(a, w), name
    if p:
        assert (got.slot_mapping[t:] == -1).all() and (got.seq_lens[b:] == 1).all()
        assert (got.input_ids[t:] == 0).all() and (got.positions[t:] == 0).all()
        assert (got.block_tables[b:, 0] == 0).all() and (got.block_tables[b:, 1:] == -1).all()
        assert np.array_equal(np.diff(got.cu_seqlens_q[b:]), np.ones(p))
        assert np.array_equal(got.logits_indices[b:], np.arange(t, t + p))


@given(scenarios())
@settings(max_examples=150)
def test_tokens_equal_solo_run(sc: dict) -> None:
    check_solo_runs(sc)


@given(scenarios(), st.data())
@settings(max_examples=100)
def test_steps_padded_to_step_sizes_keep_solo_tokens(sc: dict, data: st.DataObject) -> None:
    """Every step has a row count of ``step_sizes`` (checked each step), and each
    request still gets its solo tokens: the padding rows' results reach nobody."""
    sc["step_sizes"] = data.draw(step_sizes(sc["max_num_seqs"]))
    check_solo_runs(sc)


def check_solo_runs(sc: dict) -> None:
    seqs, sched = run(sc)
    for seq, r in zip(seqs, sc["reqs"]):
        want = solo(r["prompt"], r["max_new"], frozenset({STOP}))
        if seq.finish_reason == "cancelled":
            assert seq.generated_ids == want[: len(seq.generated_ids)]
        else:
            assert seq.generated_ids == want
            assert seq.finish_reason == ("stop" if want[-1] == STOP else "length")
    alloc = sched.allocator
    if alloc is not None:  # everything returned to the pool
        assert alloc.num_free == alloc.num_blocks
        assert all(c == 0 for c in alloc.refcounts)
        assert alloc.tokens_stored == 0
    assert sched.num_free_rows == sc["max_num_seqs"]  # every row given back
