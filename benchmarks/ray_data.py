"""Ray Data offline inference: batchkit's sorted regrouping vs plain fixed-size batches.

Both runs use the same actor pool and the same model (a token-level float32 layer,
``tanh(E[ids] @ W)``, mean-pooled over real tokens: its cost grows with the padded
area ``B x L``). The baseline is what ``map_batches`` does alone: slices of
``batch_size`` rows in dataset order, each padded to its longest row. batchkit's
:class:`~batchkit.integrations.ray.BatchkitPredictor` takes larger slices and
regroups them with ``SortedBatcher`` (same model batch size) before padding. Every
row records the padded width it ran at, so padding waste is measured from what the
model saw. Results are checked equal (allclose) before anything is printed.

Run:  python benchmarks/ray_data.py            (about 1 min on 2 cores)
      python benchmarks/ray_data.py --quick    (about 30 s)
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402

import batchkit  # noqa: E402
from batchkit.integrations.ray import BatchkitPredictor  # noqa: E402

DIM = 384  # MiniLM's hidden size: the model, not Ray, should dominate
MODEL_BATCH = 32


def make_model() -> Any:
    """Padded ``[B, L]`` ids -> per row: pooled embedding and the width it ran at."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((1000, DIM)).astype(np.float32)
    weight = (rng.standard_normal((DIM, DIM)) / np.sqrt(DIM)).astype(np.float32)

    def run(padded: batchkit.Padded) -> list[dict[str, Any]]:
        hidden = np.tanh(table[padded.data] @ weight)  # [B, L, DIM]: the padded area's cost
        mask = padded.mask[..., None]
        pooled = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1)
        return [{"embedding": row, "width": padded.max_length} for row in pooled]

    return run


class NaivePadded:
    """What ``map_batches(batch_size=...)`` does alone: pad each slice as it comes."""

    def __init__(self) -> None:
        self.model = make_model()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        results = self.model(batchkit.pad(list(batch["input_ids"])))
        return {
            "id": batch["id"],
            "embedding": np.stack([r["embedding"] for r in results]),
            "width": np.array([r["width"] for r in results]),
        }


def run(ds: Any, kind: str, actors: int) -> tuple[float, list[dict[str, Any]]]:
    if kind == "naive":
        mapped = ds.map_batches(
            NaivePadded,
            batch_size=MODEL_BATCH,
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=1,
        )
    else:
        mapped = ds.map_batches(
            BatchkitPredictor,
            fn_constructor_kwargs={
                "model_factory": make_model,
                "policy": batchkit.SortedBatcher(batch_size=MODEL_BATCH),
                "collate": batchkit.pad,
            },
            batch_size=1024,
            compute=ray.data.ActorPoolStrategy(size=actors),
            num_cpus=1,
        )
    start = time.perf_counter()
    rows = mapped.select_columns(["id", "embedding", "width"]).take_all()
    return time.perf_counter() - start, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="4000 rows, 1 repeat")
    args = parser.parse_args()
    n, repeats = (4000, 1) if args.quick else (args.rows, args.repeats)

    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.0, 0.8, n).astype(int), 4, 512)  # median ~55 tokens
    seqs = [rng.integers(1, 1000, size=int(k), dtype=np.int64) for k in lengths]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = ray.data.from_items([{"id": i, "input_ids": s} for i, s in enumerate(seqs)])
        ds = ds.repartition(8).materialize()
        times: dict[str, list[float]] = {"naive": [], "batchkit": []}
        outputs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(repeats):  # interleaved: machine noise hits both alike
            for kind in times:
                elapsed, rows = run(ds, kind, actors=2)
                times[kind].append(elapsed)
                outputs[kind] = rows
    finally:
        ray.shutdown()

    naive, ours = outputs["naive"], outputs["batchkit"]
    assert [r["id"] for r in naive] == [r["id"] for r in ours] == list(range(n))
    for a, b in zip(naive, ours):
        np.testing.assert_allclose(a["embedding"], b["embedding"], rtol=1e-4, atol=1e-5)
    tokens = int(lengths.sum())
    print(
        f"{n} rows, {tokens} tokens (lengths 4..512, median {int(np.median(lengths))}), "
        f"model batch {MODEL_BATCH}, 2 actors; results equal (allclose)"
    )
    print(f"{'system':<50} {'padding waste':>13} {'rows/s':>9} {'speed-up':>9}")
    base = min(times["naive"])
    for kind, label in (
        ("naive", f"map_batches(batch_size={MODEL_BATCH}), naive padding"),
        ("batchkit", "BatchkitPredictor(SortedBatcher), 1024-row slices"),
    ):
        area = sum(int(r["width"]) for r in outputs[kind])
        best = min(times[kind])
        print(f"{label:<50} {1 - tokens / area:>12.1%} {n / best:>9.0f} {base / best:>8.2f}x")


if __name__ == "__main__":
    main()
