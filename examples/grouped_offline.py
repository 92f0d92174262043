"""Grouped batching offline: one adapter per batch, offline, in a sampler and in a stream.

600 requests for three "LoRA adapters" (each a small numpy matrix added to a shared
encoder) are batched by ``SortedBatcher(group=adapter)``: every batch holds the
requests of one adapter, so each batch runs with one adapter loaded. The script
checks that every result equals its request run alone, compares one adapter a batch
with ``max_groups_per_batch=2`` (fewer, fuller batches; two adapters in some), and
shows the same limit in a two-rank training sampler (``groups=``) and in a stream.
Runs in about a second:

    python examples/grouped_offline.py
"""

from __future__ import annotations

from collections import Counter

import numpy as np

import batchkit

VOCAB, DIM = 500, 8
rng = np.random.default_rng(0)
EMBED = rng.normal(size=(VOCAB, DIM))
ADAPTERS = {name: rng.normal(scale=0.1, size=(DIM, DIM)) for name in ("chat", "code", "legal")}


def adapter(request: tuple[str, list[int]]) -> str:
    """A request's group: the adapter it needs (module-level, so the policy pickles)."""
    return request[0]


def tokens(request: tuple[str, list[int]]) -> int:
    """A request's key: its length."""
    return len(request[1])


def encode(ids: np.ndarray, mask: np.ndarray, name: str) -> np.ndarray:
    """Masked mean of the embeddings through one adapter: ``[B, L] -> [B, DIM]``."""
    hidden = np.tanh(EMBED[ids] @ (np.eye(DIM) + ADAPTERS[name])) * mask[..., None]
    return hidden.sum(axis=1) / np.maximum(mask.sum(axis=1, keepdims=True), 1)


def encode_one(request: tuple[str, list[int]]) -> np.ndarray:
    """The unbatched reference."""
    name, ids = request
    return np.tanh(EMBED[np.asarray(ids)] @ (np.eye(DIM) + ADAPTERS[name])).mean(axis=0)


def score(policy: batchkit.SortedBatcher, requests: list[tuple[str, list[int]]]) -> Counter[str]:
    """Run every batch with its adapters; check the results; count batches by adapters."""
    results: list[np.ndarray | None] = [None] * len(requests)
    mixes: Counter[str] = Counter()
    for batch in policy.batches(requests):
        names = sorted({adapter(r) for r in batch})
        mixes["+".join(names)] += 1
        for name in names:  # one forward pass per adapter in the batch
            rows = [j for j, r in enumerate(batch) if adapter(r) == name]
            padded = batchkit.pad([batch[j][1] for j in rows])
            for j, out in zip(rows, encode(padded.data, padded.mask, name)):
                results[batch.indices[j]] = out
    worst = max(float(np.abs(r - encode_one(q)).max()) for r, q in zip(results, requests))
    assert worst < 1e-12, worst  # batched == unbatched, in input order
    return mixes


def main(n: int = 600) -> None:
    names = rng.choice(list(ADAPTERS), n, p=[0.6, 0.3, 0.1]).tolist()
    lengths = np.minimum(rng.zipf(1.6, n) * 3, 200)
    requests = [(name, rng.integers(0, VOCAB, int(k)).tolist()) for name, k in zip(names, lengths)]
    print(f"{n} requests: {dict(Counter(names))}\n")

    # offline: one adapter a batch, then up to two
    one = batchkit.SortedBatcher(key=tokens, batch_size=32, group=adapter)
    two = batchkit.SortedBatcher(key=tokens, batch_size=32, group=adapter, max_groups_per_batch=2)
    for label, policy in (("one adapter a batch", one), ("max_groups_per_batch=2", two)):
        mixes = score(policy, requests)
        print(f"{label:24} {sum(mixes.values()):3d} batches: {dict(sorted(mixes.items()))}")
        assert all(key.count("+") < (policy.max_groups_per_batch or 1) for key in mixes)
    print("(two adapters share a pool, sorted by length as one: fewer batches, some run twice)")

    # training: a sampler sees lengths, so the groups come as a list beside them
    token_counts = [tokens(r) for r in requests]
    ranks = [
        one.sampler(token_counts, groups=names, rank=r, world_size=2, seed=0) for r in range(2)
    ]
    epoch = [list(sampler) for sampler in ranks]
    assert len(epoch[0]) == len(epoch[1])  # no rank waits on a collective
    assert all(len({names[i] for i in b}) == 1 for batches in epoch for b in batches)
    covered = sorted(i for batches in epoch for b in batches for i in b)
    assert set(covered) == set(range(n))
    print(f"\nsampler, 2 ranks: {len(epoch[0])} batches each, one adapter in every batch")

    # a stream: the same limit within each fill of the buffer
    streamed = list(one.stream(iter(requests), buffer_size=100, seed=0))
    assert all(len({adapter(r) for r in b}) == 1 for b in streamed)
    assert sorted(i for b in streamed for i in b.indices) == list(range(n))
    print(f"stream, buffer of 100: {len(streamed)} batches, one adapter in every batch")


if __name__ == "__main__":
    main()
