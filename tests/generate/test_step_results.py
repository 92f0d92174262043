"""What a step function returns: a bad entry fails only its own request; integer-likes are
accepted as token ids.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from batchkit.generate import ContinuousBatcher, StepBatch
from batchkit.kv import BlockAllocator
from tests.generate._toy import SlottedToy, solo


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("bad", ["oops", float("inf"), 1.5, -3, 2**70])
def test_a_bad_step_result_fails_only_its_own_request(paged: bool, bad: object) -> None:
    entered, gate = threading.Event(), threading.Event()
    steps: list[list[int]] = []

    def step(batch: StepBatch) -> list[object]:
        entered.set()
        gate.wait(10)  # the first step (request 0 alone) holds until 1 and 2 wait
        steps.append([s.request_id for s in batch.seqs])
        return [bad if s.request_id == 2 else 1 for s in batch.seqs]

    alloc = BlockAllocator(16, 4) if paged else None
    with ContinuousBatcher(step, max_num_seqs=4, max_num_batched_tokens=64, allocator=alloc) as b:
        first = b.submit([9], max_new_tokens=1)
        assert entered.wait(10)
        ok = b.submit([5, 6, 7], max_new_tokens=1)
        victim = b.submit([5, 6, 8], max_new_tokens=3)
        gate.set()  # now 1 and 2 share a step
        assert first.result(timeout=10) == [1]
        assert ok.result(timeout=10) == [1]
        with pytest.raises(ValueError, match="request 2: the step function returned"):
            victim.result(timeout=10)
        assert victim.finish_reason == "error"
        assert steps[:2] == [[0], [1, 2]]
        # the driver lives on and serves the next request
        assert b.submit([1], max_new_tokens=2).result(timeout=10) == [1, 1]
        assert b.stats().failed == 1
    if alloc is not None:
        assert alloc.num_free == alloc.num_blocks


def test_numpy_tokens_from_the_step_are_accepted() -> None:
    toy = SlottedToy()

    def step(batch: StepBatch) -> list[object]:
        return [None if t is None else np.int64(t) for t in toy(batch)]

    with ContinuousBatcher(step, max_num_seqs=2, max_num_batched_tokens=4) as b:
        got = b.generate([[3, 4, 5, 6, 7], [1]], max_new_tokens=5)
    assert got == [solo([3, 4, 5, 6, 7], 5), solo([1], 5)]
    assert all(type(t) is int for out in got for t in out)
