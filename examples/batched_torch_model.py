"""A small torch encoder behind ``@batched``, called from many threads.

Callers send ragged token lists one at a time. ``collate`` pads a batch with
``batchkit.pad`` (a ``[B, L]`` tensor plus its mask), the encoder runs once per
batch, and ``split`` cuts the ``[B, L, D]`` output back into each caller's
``[len_i, D]`` hidden states with ``Padded.unpad``. A ``SortedBatcher`` groups
requests of similar length, so little of each batch is padding. Every result is
checked against the encoder run on that request alone (within 1e-5). Runs on CPU
in a few seconds:

    python examples/batched_torch_model.py
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

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


def encode_one(request: list[int]) -> torch.Tensor:
    """The unbatched reference: one request, no padding."""
    with torch.inference_mode():
        ids = torch.tensor([request])
        return model(ids, torch.ones_like(ids, dtype=torch.bool))[0]


def main(threads: int = 32, per_thread: int = 8) -> None:
    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.zipf(1.6, threads * per_thread) * 6, 200)
    requests = [rng.integers(1, VOCAB, int(n)).tolist() for n in lengths]

    def client(t: int) -> list[torch.Tensor]:
        return [encode(r) for r in requests[t::threads]]  # one blocking call per request

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        per_client = list(pool.map(client, range(threads)))
    t_batched = time.perf_counter() - start
    results: list[torch.Tensor] = [torch.empty(0)] * len(requests)
    for t, outs in enumerate(per_client):
        results[t::threads] = outs

    start = time.perf_counter()
    alone = [encode_one(r) for r in requests]
    t_alone = time.perf_counter() - start

    worst = 0.0
    for r, a, b in zip(requests, results, alone):
        assert a.shape == (len(r), DIM) == b.shape
        worst = max(worst, float((a - b).abs().max()))
    assert worst < 1e-5, worst

    encode.close()
    s = encode.stats()
    assert s.items_run == len(requests) and s.failed == 0
    print(
        f"requests            {len(requests)} from {threads} threads "
        f"(lengths {lengths.min()}..{lengths.max()})"
    )
    print(f"one at a time       {t_alone:.2f} s")
    print(
        f"@batched            {t_batched:.2f} s in {s.batches} batches "
        f"(mean size {s.mean_batch_size:.1f})"
    )
    print(f"max |difference|    {worst:.1e}")
    print(f"dispatch reasons    {s.dispatch_reasons}")


if __name__ == "__main__":
    main()
