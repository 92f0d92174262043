"""A DDP training loop on packed batches streamed from a corpus too large to hold.

Two CPU processes (``torch.multiprocessing``, the ``gloo`` backend) each stream the
same synthetic corpus (a generator: 3,000 token sequences of lognormal lengths, never
a list) through ``PackingBatcher(max_tokens=2048).stream(..., rank=r, world_size=2)``,
lay each batch out with ``pack_varlen`` (one concatenated sequence, no padding) and
train a small model under ``DistributedDataParallel``. The script checks what DDP
relies on: both ranks take the same number of steps (no rank hangs in the gradient
all-reduce), every sequence is trained on exactly once across the ranks, no batch
exceeds the budget, and it prints how full the batches are and how evenly the two
ranks' tokens match at each step. About ten seconds:

    python examples/ddp_packed_stream.py
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import batchkit

WORLD_SIZE = 2
SEQUENCES = 3_000
BUDGET = 2048  # tokens per rank and step
VOCAB = 256


def corpus() -> Iterator[np.ndarray]:
    """The synthetic corpus, generated lazily (a real one would be read from disk): runs
    that count up from a random token, something for the model to learn."""
    rng = np.random.default_rng(0)
    for _ in range(SEQUENCES):
        n = int(np.clip(rng.lognormal(4.5, 0.8), 4, 1024))
        yield (rng.integers(0, VOCAB) + np.arange(n)) % VOCAB


class TinyLM(torch.nn.Module):
    """Next-token prediction from each token's embedding (position-free, so a packed
    sequence needs no mask: its ``cu_seqlens`` only say where each one ends)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def train(rank: int, init_file: str, results: dict[int, dict[str, object]]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE
    )
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyLM())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    policy = batchkit.PackingBatcher(max_tokens=BUDGET)
    seen: list[int] = []
    tokens_per_step: list[int] = []
    losses: list[float] = []
    # every rank reads the same stream and keeps its own batch of each step
    for batch in policy.stream(
        corpus(), buffer_size=1_000, seed=0, rank=rank, world_size=WORLD_SIZE
    ):
        packed = batchkit.pack_varlen(batch, return_tensors="pt")
        tokens = packed.values.long()
        cu = packed.cu_seqlens.long()
        # targets: the next token within the same sequence (each sequence's last has none)
        targets = torch.roll(tokens, -1)
        keep = torch.ones_like(tokens, dtype=torch.bool)
        keep[cu[1:] - 1] = False
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients: every rank must get here
        opt.step()
        seen += batch.indices
        tokens_per_step.append(int(packed.total_length))
        losses.append(loss.item())
    results[rank] = {"seen": seen, "tokens": tokens_per_step, "losses": losses}
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(train, args=(os.path.join(tmp, "init"), results), nprocs=WORLD_SIZE)
        ranks = [results[r] for r in range(WORLD_SIZE)]
    steps = [len(r["tokens"]) for r in ranks]
    assert len(set(steps)) == 1, f"ranks took different step counts: {steps}"
    seen = sorted(i for r in ranks for i in r["seen"])
    assert seen == list(range(SEQUENCES)), "some sequence was skipped or trained on twice"
    tokens = np.array([r["tokens"] for r in ranks], dtype=np.float64)
    assert tokens.max() <= BUDGET
    fill = tokens.sum() / (tokens.size * BUDGET)
    imbalance = np.mean((tokens.max(axis=0) - tokens.min(axis=0)) / tokens.max(axis=0))
    first, last = ranks[0]["losses"][0], ranks[0]["losses"][-1]
    print(f"{WORLD_SIZE} ranks x {steps[0]} steps: every one of {SEQUENCES} sequences once")
    print(
        f"batches {fill:.1%} full of the {BUDGET}-token budget; "
        f"per-step token imbalance between ranks {imbalance:.2%}"
    )
    print(f"loss {first:.2f} -> {last:.2f}")
    assert last < first


if __name__ == "__main__":
    main()
