"""What submit() and generate() accept and refuse: token ids, max_new_tokens, timeouts, and a
refused prompt among many.
"""

from __future__ import annotations

import numpy as np
import pytest

from batchkit.generate import ContinuousBatcher
from batchkit.kv import BlockAllocator
from tests.generate._toy import PagedToy, SlottedToy, solo


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ([1, 2**70], ValueError, r"prompt_ids\[1\] is 1180591620717411303424, outside"),
        ([1, -1], ValueError, r"prompt_ids\[1\] is -1"),
        ([1.0], TypeError, r"prompt_ids\[0\] is 1.0 \(float\), not an integer"),
        (["7"], TypeError, r"prompt_ids\[0\] is '7' \(str\)"),
    ],
)
def test_bad_prompt_ids_are_refused_at_submit(prompt: list, error: type, match: str) -> None:
    alloc = BlockAllocator(16, 4, prefix_caching=True)  # hashing the prompt broke the worker
    with ContinuousBatcher(
        SlottedToy(), max_num_seqs=2, max_num_batched_tokens=16, allocator=alloc
    ) as b:
        good = b.submit([1, 2, 3, 4, 5], max_new_tokens=2)
        with pytest.raises(error, match=match):
            b.submit(prompt, max_new_tokens=2)
        with pytest.raises(TypeError, match=r"stop_token_ids\[0\]"):
            b.submit([1], max_new_tokens=2, stop_token_ids=[None])  # type: ignore[list-item]
        assert good.result(timeout=10) == solo([1, 2, 3, 4, 5], 2)


def test_numpy_prompt_and_max_new_tokens_are_accepted() -> None:
    with ContinuousBatcher(SlottedToy(), max_num_seqs=2) as b:
        h = b.submit(np.array([4, 2]), max_new_tokens=np.int64(3))
        assert h.result(timeout=10) == solo([4, 2], 3)


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, "1"])
def test_a_bad_timeout_is_refused(timeout: object) -> None:
    with ContinuousBatcher(SlottedToy(), max_num_seqs=2) as b:
        with pytest.raises(ValueError, match="timeout must be None or a number"):
            b.submit([1], max_new_tokens=1, timeout=timeout)  # type: ignore[arg-type]
        assert b.stats().requests == 0


def test_generate_refusing_one_prompt_cancels_the_others_and_names_it() -> None:
    alloc = BlockAllocator(4, 4)
    with ContinuousBatcher(
        PagedToy(4, 4), max_num_seqs=4, max_num_batched_tokens=8, allocator=alloc
    ) as b:
        with pytest.raises(ValueError, match=r"^prompt 2: request 2 can never fit"):
            b.generate([[1, 2, 3], [4, 5], list(range(40))], max_new_tokens=3)
        stats = b.stats()
        assert stats.running == stats.waiting == 0  # nothing left running for nobody
        assert stats.cancelled + stats.finished == 2  # (either may have finished already)
        # ids are not reused: the refused request used up id 2
        assert b.submit([1], max_new_tokens=1).request_id == 3
    assert alloc.num_free == alloc.num_blocks
