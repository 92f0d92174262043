"""A tiny GPT-2 (random weights, float64) through ContinuousBatcher in paged mode
generates exactly what ``model.generate`` (greedy) generates for each prompt alone, also
with every step padded to a set of sizes (the padding rows run through the model)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchkit.generate import ContinuousBatcher  # noqa: E402
from batchkit.kv import BlockAllocator  # noqa: E402
from tests.generate._gpt2 import PagedGPT2, tiny_gpt2  # noqa: E402


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "prefix_caching, step_sizes", [(False, None), (True, None), (True, (1, 2, 4))]
)
def test_gpt2_matches_generate(prefix_caching: bool, step_sizes: tuple[int, ...] | None) -> None:
    model = tiny_gpt2()
    rng = random.Random(1)
    common = [rng.randrange(1, 97) for _ in range(9)]  # shared by some prompts: cache hits
    prompts = [
        (common if i % 3 == 0 else []) + [rng.randrange(1, 97) for _ in range(rng.randint(1, 20))]
        for i in range(10)
    ]
    lengths = [rng.randint(1, 16) for _ in prompts]
    want = [greedy(model, p, n) for p, n in zip(prompts, lengths)]

    # 12 blocks of 4 tokens: too few for all at once, so sequences are preempted;
    # a budget of 16 tokens chunks the longer prompts.
    alloc = BlockAllocator(12, 4, prefix_caching=prefix_caching)
    model_step = PagedGPT2(model, alloc.num_blocks, alloc.block_size)
    rows: list[tuple[int, int]] = []  # (rows, padding rows) of each step

    def step(batch):
        rows.append((len(batch.seqs), batch.num_padding))
        return model_step(batch)

    with ContinuousBatcher(
        step, max_num_seqs=4, max_num_batched_tokens=16, allocator=alloc, step_sizes=step_sizes
    ) as batcher:
        handles = [batcher.submit(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
        got = [h.result(timeout=60) for h in handles]
        stats = batcher.stats()
    assert got == want
    assert stats.preemptions > 0
    if prefix_caching:
        assert stats.prefix_hit_rate > 0
    assert alloc.num_free == alloc.num_blocks
    if step_sizes is not None:
        assert {n for n, _ in rows} <= set(step_sizes)
        assert any(padding for _, padding in rows)  # some steps ran padding rows
