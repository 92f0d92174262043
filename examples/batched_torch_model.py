"""A small torch encoder behind ``@batched``, called from many threads.

Callers send ragged token lists one at a time. ``collate`` pads a batch with
``batchkit.pad`` (a ``[B, L]`` tensor plus its mask), the encoder runs once per
batch, and ``split`` cuts the ``[B, L, D]`` output back into each caller's
``[len_i, D]`` hidden states with ``Padded.unpad``. A ``SortedBatcher`` groups
requests of similar length, so little of each batch is padding. Every result is
checked against the encoder run on that request alone (within 1e-5).

The timing is a like-for-like comparison: the baseline is the same function served
one request at a time (``max_batch_size=1``), called by the same client threads,
with the same torch threads. Both are warmed up first, then timed in alternating
rounds (the order flips every round, so neither always runs on a warmer machine),
and the medians are reported. Runs on CPU in a few seconds:

    python examples/batched_torch_model.py
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

import batchkit

VOCAB, DIM = 1000, 64


class Encoder(torch.nn.Module):
    """Embedding + one transformer layer; padding positions are masked out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layer = torch.nn.TransformerEncoderLayer(DIM, 4, 128, dropout=0.0, batch_first=True)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` ids, ``[B, L]`` bool mask (True = real) -> ``[B, L, DIM]``."""
        hidden = self.layer(self.embed(ids), src_key_padding_mask=~mask)
        return hidden * mask.unsqueeze(-1)  # padding rows are zero, never used


torch.manual_seed(0)
model = Encoder().eval()


def collate(requests: list[list[int]]) -> batchkit.Padded:
    """Token lists -> one padded ``[B, L]`` batch (torch tensors) with its mask."""
    return batchkit.pad(requests, return_tensors="pt", pad_to_multiple_of=8)


def split(output: tuple[batchkit.Padded, torch.Tensor]) -> list[torch.Tensor]:
    """``[B, L, DIM]`` -> each request's own ``[len_i, DIM]`` rows."""
    padded, hidden = output
    return padded.unpad(hidden)


@batchkit.batched(
    batcher=batchkit.SortedBatcher(batch_size=32, max_tokens=32 * 128, max_wait_ms=5),
    collate=collate,
    split=split,
)
def encode(batch: batchkit.Padded) -> tuple[batchkit.Padded, torch.Tensor]:
    """Runs on batchkit's worker thread, once per batch."""
    with torch.inference_mode():  # grad mode is per thread: set it here
        return batch, model(batch.data, batch.mask)


@batchkit.batched(max_batch_size=1, collate=collate, split=split)
def encode_single(batch: batchkit.Padded) -> tuple[batchkit.Padded, torch.Tensor]:
    """The baseline: the same model and layout, one request per call."""
    with torch.inference_mode():
        return batch, model(batch.data, batch.mask)


def encode_one(request: list[int]) -> torch.Tensor:
    """The unbatched reference: one request, no padding."""
    with torch.inference_mode():
        ids = torch.tensor([request])
        return model(ids, torch.ones_like(ids, dtype=torch.bool))[0]


def serve(
    fn: Callable[[list[int]], torch.Tensor], requests: list[list[int]], threads: int
) -> tuple[list[torch.Tensor], float]:
    """Every request from ``threads`` clients, each blocking on one call at a time:
    the results in request order, and the wall time in seconds."""

    def client(t: int) -> list[torch.Tensor]:
        return [fn(r) for r in requests[t::threads]]

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        per_client = list(pool.map(client, range(threads)))
    elapsed = time.perf_counter() - start
    results: list[torch.Tensor] = [torch.empty(0)] * len(requests)
    for t, outs in enumerate(per_client):
        results[t::threads] = outs
    return results, elapsed


def main(threads: int = 16, num_requests: int = 192, rounds: int = 5) -> None:
    torch.set_num_threads(min(2, os.cpu_count() or 1))  # the same for both runs
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.zipf(1.6, num_requests) * 6, 200)
    requests = [rng.integers(1, VOCAB, int(n)).tolist() for n in lengths]
    runs: dict[str, batchkit.BatchedFunction[Any, Any]] = {
        "one at a time": encode_single,
        "@batched": encode,
    }

    for fn in runs.values():  # warm-up: threads started, kernels and allocator warm
        serve(fn, requests[: 2 * threads], threads)
    times: dict[str, list[float]] = {name: [] for name in runs}
    results: list[torch.Tensor] = []
    for i in range(rounds):
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            out, elapsed = serve(runs[name], requests, threads)
            times[name].append(elapsed)
            if name == "@batched":
                results = out

    worst = 0.0
    for r, got in zip(requests, results):
        want = encode_one(r)
        assert got.shape == (len(r), DIM) == want.shape
        worst = max(worst, float((got - want).abs().max()))
    assert worst < 1e-5, worst

    for fn in runs.values():
        fn.close()
    s = encode.stats()
    assert s.failed == 0 and s.items_run == 2 * threads + rounds * len(requests)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    print(
        f"requests            {len(requests)} per round from {threads} threads "
        f"(lengths {lengths.min()}..{lengths.max()}), {torch.get_num_threads()} torch threads"
    )
    for name, ts in times.items():
        spread = f"{min(ts):.2f}..{max(ts):.2f}"
        print(f"{name:<19} {median[name]:.2f} s median of {rounds} rounds ({spread})")
    print(f"speed-up            x{median['one at a time'] / median['@batched']:.2f}")
    print(f"mean batch size     {s.mean_batch_size:.1f} in {s.batches} batches")
    print(f"max |difference|    {worst:.1e}")


if __name__ == "__main__":
    main()
