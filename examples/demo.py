"""The main job: run a built-in encoder on ragged requests one by one, then batched.

Every batched result is checked against the one-at-a-time result, and the
speed-up is printed. Runs on CPU in a few seconds:

    python examples/demo.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

import batchkit


def build_model(seed: int = 0) -> torch.nn.Module:
    """A small transformer encoder with masked mean pooling (the built-in demo model)."""
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


def main(num_requests: int = 256, batch_size: int = 32) -> None:
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.zipf(1.6, num_requests) * 8, 256)
    requests = [rng.integers(1, 1000, n).tolist() for n in lengths]
    model = build_model()

    with torch.inference_mode():
        start = time.perf_counter()
        alone = [model(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.bool))[0] for r in requests]
        t_alone = time.perf_counter() - start

        start = time.perf_counter()
        batched: list[torch.Tensor] = []
        order = np.argsort(lengths, kind="stable")  # similar lengths together: less padding
        for lo in range(0, num_requests, batch_size):
            idx = order[lo : lo + batch_size]
            padded = batchkit.pad([requests[i] for i in idx], return_tensors="pt", pad_to_multiple_of=8)
            out = model(padded.data, padded.mask)
            batched.extend(zip(idx.tolist(), out))
        results = [r for _, r in sorted(batched, key=lambda p: p[0])]
        t_batched = time.perf_counter() - start

    worst = max(float((a - b).abs().max()) for a, b in zip(alone, results))
    print(f"requests            {num_requests} (lengths {lengths.min()}..{lengths.max()})")
    print(f"one at a time       {num_requests / t_alone:8.1f} req/s")
    print(f"batched (B={batch_size})     {num_requests / t_batched:8.1f} req/s")
    print(f"speed-up            {t_alone / t_batched:8.2f}x")
    print(f"max |batched-alone| {worst:.2e}")
    if worst > 1e-4:
        raise SystemExit("batched results differ from unbatched ones")


if __name__ == "__main__":
    main()
