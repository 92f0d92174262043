"""Each request's tokens equal its solo run, whatever else shares its steps.

Hypothesis drives the pure scheduler core over the toy recurrence (``_toy.py``) with
random prompts, lengths, arrival steps, priorities, cancellations (some during a step),
row and token limits small enough to chunk every prompt, prefill caps, and KV pools
small enough to preempt (for blocks and for more urgent requests).
In paged mode every step's layout is also checked against the general one.
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
    longest = max(blocks_for(len(r["prompt"]) + r["max_new"] - 1, block_size) for r in reqs)
    return {
        "reqs": reqs,
        "paged": paged,
        "block_size": block_size,
        "num_blocks": longest + draw(st.integers(0, 12)),  # tight pools force preemption
        "prefix_caching": draw(st.booleans()),
        "max_num_seqs": draw(st.integers(1, 5)),
        "budget": (budget := draw(st.integers(1, 24))),
        "max_prefill_chunk": draw(st.none() | st.integers(1, budget)),
    }


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
    """Within the budget, the prefill cap, the rows; no sequence twice."""
    cap = sc["max_prefill_chunk"] or sc["budget"]
    assert batch.num_tokens <= sc["budget"]
    assert all(1 <= s.num_tokens <= cap for s in batch.seqs)
    assert len(batch.seqs) <= sc["max_num_seqs"]
    assert len({s.request_id for s in batch.seqs}) == len(batch.seqs)


def check_layout(batch: StepBatch) -> None:
    """The batch's layout (decode-only steps take a faster path, block tables come from the
    scheduler's incrementally kept rows) equals the general one, rebuilt from lists."""
    seqs = batch.seqs
    assert batch.block_size is not None
    want = build_layout(
        [s.token_ids for s in seqs],
        [s.start for s in seqs],
        [s.num_tokens for s in seqs],
        [s.block_ids or [] for s in seqs],
        batch.block_size,
    )
    got = batch.layout
    for name in want.__dataclass_fields__:
        a, b = getattr(got, name), getattr(want, name)
        assert type(a) is type(b) and np.array_equal(a, b), name
        assert getattr(a, "dtype", None) == getattr(b, "dtype", None), name


@given(scenarios())
@settings(max_examples=150)
def test_tokens_equal_solo_run(sc: dict) -> None:
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
