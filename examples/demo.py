"""The main job: a built-in encoder served to many concurrent callers, one request
at a time and then through ``@batched``; every batched result is checked against
the one-at-a-time result, and throughput, latency and speed-up are printed.

    python examples/demo.py        # about 10 s on 2 CPU cores
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import batchkit


def build_model(seed: int = 0) -> torch.nn.Module:
    """The built-in model: a small transformer encoder with masked mean pooling."""
    torch.manual_seed(seed)

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(1000, 64)
            self.layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            hidden = self.layer(self.embed(ids), src_key_padding_mask=~mask)
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)

    return Encoder().eval()


def serve(call: Callable[[list[int]], torch.Tensor], requests: list[list[int]], callers: int):
    """Fire every request from ``callers`` threads; results in order and latencies."""
    latencies = [0.0] * len(requests)

    def one(i: int) -> torch.Tensor:
        start = time.perf_counter()
        out = call(requests[i])
        latencies[i] = time.perf_counter() - start
        return out

    start = time.perf_counter()
    with ThreadPoolExecutor(callers) as pool:
        results = list(pool.map(one, range(len(requests))))
    return results, time.perf_counter() - start, np.array(latencies)


def main(num_requests: int = 1024, callers: int = 64) -> None:
    torch.set_num_threads(1)  # one core for the model, one for the callers
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 48, num_requests)
    requests = [rng.integers(1, 1000, n).tolist() for n in lengths]
    model = build_model()
    lock = threading.Lock()  # one model: unbatched callers take turns

    @torch.inference_mode()
    def alone(ids: list[int]) -> torch.Tensor:
        with lock:
            return model(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.bool))[0]

    @batchkit.batched(batcher=batchkit.BucketedBatcher([16, 32, 48], max_batch_size=32))
    @torch.inference_mode()
    def embed(batch: list[list[int]]) -> torch.Tensor:
        padded = batchkit.pad(batch, return_tensors="pt")
        return model(padded.data, padded.mask)

    rows = []
    expected, t_alone, lat_alone = serve(alone, requests, callers)
    rows.append(("one at a time", t_alone, lat_alone, 1.0))
    got, t_batched, lat_batched = serve(embed, requests, callers)
    stats = embed.stats()
    embed.close()
    rows.append(("@batched (bucketed)", t_batched, lat_batched, stats.mean_batch_size))

    print(
        f"{num_requests} requests from {callers} threads, lengths {lengths.min()}..{lengths.max()}"
    )
    print(f"{'':22}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'batch':>7}{'speed-up':>10}")
    for name, wall, lat, size in rows:
        print(
            f"{name:22}{num_requests / wall:9.0f}{np.percentile(lat, 50) * 1e3:9.1f}"
            f"{np.percentile(lat, 99) * 1e3:9.1f}{size:7.1f}{t_alone / wall:9.2f}x"
        )
    worst = max(float((a - b).abs().max()) for a, b in zip(expected, got))
    print(f"max |batched - alone| = {worst:.1e} (dispatch reasons: {stats.dispatch_reasons})")
    if worst > 1e-4:
        raise SystemExit("batched results differ from one-at-a-time results")


if __name__ == "__main__":
    main()
