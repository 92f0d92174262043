"""Grouped continuous batching: requests for several LoRA-style adapters, two per step.

A toy recurrent "model" with four adapters: each adapter changes how the state
advances (as a LoRA changes the keys and values), so a step runs one adapter pass per
adapter it holds. ``submit(..., group=adapter)`` tags each request;
``max_groups_per_step=2`` keeps every step within two adapters, admitting waiting
adapters as running ones drain (oldest first, short requests backfilling rows behind
a blocked one). Checked: every step holds at most two adapters, every request's
tokens equal its solo run under its adapter. Printed: steps and adapter passes with
and without the limit (fewer passes, as steps mix fewer adapters; more steps, as rows
wait while an adapter drains), and ``stats().groups``.

Run: python examples/continuous_groups.py
"""

from __future__ import annotations

import threading

import numpy as np

from batchkit.generate import ContinuousBatcher, StepBatch

VOCAB, ROWS = 50, 8
ADAPTERS = ["lora-a", "lora-b", "lora-c", "lora-d"]


def advance(state: int, tokens: list[int], adapter: str) -> int:
    salt = ADAPTERS.index(adapter) + 1  # the adapter's own weights
    for t in tokens:
        state = (state * 31 + t * salt + 7) % 1_000_003
    return state


def solo(prompt: list[int], max_new_tokens: int, adapter: str) -> list[int]:
    """What one request generates alone under its adapter (the reference)."""
    state, out = advance(0, prompt, adapter), list[int]()
    while len(out) < max_new_tokens:
        out.append(state % VOCAB)
        state = advance(state, out[-1:], adapter)
    return out


class Model:
    """One step: a pass per adapter over its rows (a multi-LoRA kernel's cost)."""

    def __init__(self) -> None:
        self.states = np.zeros(ROWS, dtype=np.int64)
        self.steps = 0
        self.adapter_passes = 0
        self.most_adapters = 0
        # The first step (the first request alone) waits for the whole queue: both runs
        # then schedule the same steps and print the same counts on any machine.
        self.entered, self.queued = threading.Event(), threading.Event()

    def __call__(self, batch: StepBatch) -> list[int | None]:
        self.entered.set()
        self.queued.wait()
        adapters = {seq.group for seq in batch.seqs}
        self.steps += 1
        self.adapter_passes += len(adapters)
        self.most_adapters = max(self.most_adapters, len(adapters))
        out: list[int | None] = []
        for seq in batch.seqs:
            start = 0 if seq.start == 0 else int(self.states[seq.slot])
            chunk = seq.token_ids[seq.start : seq.start + seq.num_tokens]
            self.states[seq.slot] = advance(start, chunk, str(seq.group))
            out.append(int(self.states[seq.slot]) % VOCAB if seq.sample else None)
        return out


rng = np.random.default_rng(0)
requests = [
    (
        rng.integers(1, VOCAB, size=rng.integers(2, 30)).tolist(),
        int(rng.integers(4, 40)),
        ADAPTERS[int(rng.integers(0, len(ADAPTERS)))],
    )
    for _ in range(64)
]


def serve(max_groups_per_step: int | None) -> tuple[Model, ContinuousBatcher]:
    model = Model()
    with ContinuousBatcher(
        model, max_num_seqs=ROWS, max_num_batched_tokens=128,
        max_groups_per_step=max_groups_per_step,
    ) as batcher:  # fmt: skip
        handles = []
        for prompt, new, adapter in requests:
            handles.append(batcher.submit(prompt, max_new_tokens=new, group=adapter))
            model.entered.wait()
        model.queued.set()
        for handle, (prompt, new, adapter) in zip(handles, requests):
            assert handle.result(timeout=60) == solo(prompt, new, adapter)
    return model, batcher


free, _ = serve(None)
grouped, batcher = serve(2)
assert grouped.most_adapters <= 2
for label, run in [("no limit", free), ("max_groups_per_step=2", grouped)]:
    print(f"{label:22s} {run.steps:4d} steps, {run.adapter_passes:4d} adapter passes")
for adapter, g in sorted(batcher.stats().groups.items()):
    print(f"  {adapter}: {g.admitted} requests, {g.tokens_generated} tokens in {g.steps} steps")
print(f"all {len(requests)} requests equal their solo runs; at most 2 adapters per step")
