"""Continuous batching of a toy recurrent "model", streamed from threads and asyncio.

The step function keeps one running state per row (``seq.slot``, slotted mode, as a
static cache or a recurrent state would) and advances it by each sequence's chunk.
Requests of very different lengths share the rows: finished sequences leave at every
step and waiting ones join. Each request's tokens equal its solo run (checked).

Run: python examples/continuous_toy.py
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from batchkit.generate import ContinuousBatcher, StepBatch

VOCAB, EOS = 50, 0


def advance(state: int, tokens: list[int]) -> int:
    for t in tokens:  # a toy: a real model runs one batched forward pass per step
        state = (state * 31 + t + 7) % 1_000_003
    return state


def solo(prompt: list[int], max_new_tokens: int) -> list[int]:
    """What one request generates alone (the reference)."""
    state, out = advance(0, prompt), []
    while len(out) < max_new_tokens:
        out.append(state % VOCAB)
        if out[-1] == EOS:
            break
        state = advance(state, out[-1:])
    return out


states = np.zeros(8, dtype=np.int64)  # one row per running sequence


def step(batch: StepBatch) -> list[int | None]:
    out: list[int | None] = []
    for seq in batch.seqs:
        start_state = 0 if seq.start == 0 else int(states[seq.slot])
        states[seq.slot] = advance(
            start_state, seq.token_ids[seq.start : seq.start + seq.num_tokens]
        )
        out.append(int(states[seq.slot]) % VOCAB if seq.sample else None)
    return out


rng = np.random.default_rng(0)
prompts = [rng.integers(1, VOCAB, size=rng.integers(2, 40)).tolist() for _ in range(40)]
lengths = [int(n) for n in np.clip(rng.lognormal(3, 1, size=40), 1, 200)]

with ContinuousBatcher(
    step, max_num_seqs=8, max_num_batched_tokens=64, eos_token_id=EOS
) as batcher:
    # Offline: all prompts at once, results in order.
    results = batcher.generate(prompts[:20], max_new_tokens=100)
    assert results == [solo(p, 100) for p in prompts[:20]]

    # Online, from threads: each caller streams its own tokens.
    def caller(i: int) -> None:
        got = list(batcher.submit(prompts[i], max_new_tokens=lengths[i]))
        assert got == solo(prompts[i], lengths[i])

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(20, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    # From asyncio: await a result, stream another, cancel a third.
    async def main() -> None:
        a = batcher.submit(prompts[0], max_new_tokens=30)
        b = batcher.submit(prompts[1], max_new_tokens=30)
        c = batcher.submit(prompts[2], max_new_tokens=200)
        assert await a == solo(prompts[0], 30)
        assert [tok async for tok in b] == solo(prompts[1], 30)
        c.cancel()
        assert (await c) == solo(prompts[2], 200)[: len(await c)]  # what it had so far

    asyncio.run(main())
    stats = batcher.stats()

print(
    f"{stats.finished} finished, {stats.steps} steps, slot utilisation "
    f"{stats.slot_utilisation:.2f}, TTFT p50 {stats.time_to_first_token.p50 * 1e3:.2f} ms"
)
