"""Continuous batching for a compiled model: every step padded to a set of sizes.

A model captured for fixed shapes (CUDA graphs, ``torch.compile`` with
``dynamic=False``) is built once per batch size it sees. Continuous batching changes
the number of rows every step, as sequences finish and others join, so it sees all of
them. ``ContinuousBatcher(..., step_sizes=(1, 2, 4, 8))`` pads each step with padding
rows (``seq.is_padding``: one token each, no request's; their results are ignored) up
to the smallest size that holds its sequences, so four graphs serve every step.

The model here is a small torch next-token model over each row's last token and its
position, compiled with a backend that counts its compilations; with and without
``step_sizes`` every request gets the tokens it gets alone.
"""

from __future__ import annotations

import random

import torch

import batchkit

VOCAB, DIM, MAX_LEN = 64, 16, 128
STEP_SIZES = (1, 2, 4, 8)

torch.manual_seed(0)
model = torch.nn.ModuleDict(
    {
        "tokens": torch.nn.Embedding(VOCAB, DIM),
        "positions": torch.nn.Embedding(MAX_LEN, DIM),
        "head": torch.nn.Linear(DIM, VOCAB),
    }
).eval()


def next_token(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The next token of each row ``[B]`` from its last token and that token's position."""
    hidden = torch.tanh(model["tokens"](tokens) + model["positions"](positions))
    return model["head"](hidden).argmax(-1)


def alone(prompt: list[int], max_new_tokens: int) -> list[int]:
    """What one request generates by itself, eagerly."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(next_token(torch.tensor([ids[-1]]), torch.tensor([len(ids) - 1]))))
    return ids[len(prompt) :]


def serve(requests: list[tuple[list[int], int]], step_sizes: tuple[int, ...] | None) -> None:
    """Run ``requests`` through a batcher around the compiled model; print what it cost."""
    compiled_for: list[int] = []  # the batch size of each compilation

    def counting_backend(graph, example_inputs):  # counts, then runs the graph eagerly
        rows = next(x for x in example_inputs if not x.dtype.is_floating_point)
        compiled_for.append(int(rows.shape[0]))
        return graph.forward

    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 16  # room for every size the batcher makes
    compiled = torch.compile(next_token, backend=counting_backend, dynamic=False)
    rows_seen: set[int] = set()

    def step(batch: batchkit.StepBatch) -> list[int | None]:
        # A padding row is computed like any row (token 0 at position 0): no branch,
        # so the step's shape is the captured one.
        last = [s.token_ids[s.start + s.num_tokens - 1] for s in batch.seqs]
        where = [s.start + s.num_tokens - 1 for s in batch.seqs]
        rows_seen.add(len(batch.seqs))
        with torch.no_grad():
            tokens = compiled(torch.tensor(last), torch.tensor(where)).tolist()
        return [tok if s.sample else None for tok, s in zip(tokens, batch.seqs)]

    with batchkit.ContinuousBatcher(
        step, max_num_seqs=8, max_num_batched_tokens=64, step_sizes=step_sizes
    ) as batcher:
        handles = [batcher.submit(p, max_new_tokens=n) for p, n in requests]
        results = [h.result(timeout=120) for h in handles]
        stats = batcher.stats()
    assert results == [alone(p, n) for p, n in requests]  # each request's own tokens
    if step_sizes is not None:
        assert rows_seen <= set(step_sizes) and len(compiled_for) <= len(step_sizes)
    print(
        f"step_sizes={step_sizes}: {stats.steps} steps, {stats.padding_rows} padding rows, "
        f"row counts {sorted(rows_seen)}, {len(compiled_for)} compilations "
        f"(batch sizes {sorted(compiled_for)})"
    )


def main() -> None:
    rng = random.Random(0)
    requests = [
        ([rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))], rng.randint(1, 24))
        for _ in range(40)
    ]
    serve(requests, None)  # a graph for every row count the traffic makes
    serve(requests, STEP_SIZES)  # at most one per size of the set


if __name__ == "__main__":
    main()
