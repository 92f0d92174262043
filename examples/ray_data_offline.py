"""Offline inference with Ray Data: a batchkit pipeline as a ``map_batches`` actor pool.

3000 token sequences of very different lengths go through
``ds.map_batches(BatchkitPredictor, ...)``: each 1000-row slice is regrouped by
length (``SortedBatcher``, at most 32 rows and 4096 padded tokens per model call),
padded with ``batchkit.pad``, run, and returned in the slice's row order. The script
checks every row against the model run on that row alone.

Run:  python examples/ray_data_offline.py      (about 20 s on 2 cores)
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # read when Ray is imported

import numpy as np  # noqa: E402

import batchkit  # noqa: E402
from batchkit.integrations.ray import BatchkitPredictor  # noqa: E402

try:
    import ray
except ImportError:  # the example is optional: it needs batchkit-ml[ray]
    print("skipped: Ray Data is not installed (pip install 'batchkit-ml[ray]')")
    sys.exit(0)


def load_model() -> Any:
    """Runs once per actor: here a running sum of token embeddings (per-token outputs)."""
    table = np.random.default_rng(0).standard_normal((1000, 16)).astype(np.float32)

    def run(padded: batchkit.Padded) -> list[np.ndarray]:
        return padded.unpad(np.cumsum(table[padded.data], axis=1))  # one [len, 16] per row

    return run


def main() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(3.5, 0.9, 3000).astype(int), 1, 400)
    seqs = [rng.integers(1, 1000, size=int(n), dtype=np.int64) for n in lengths]

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        ds = ray.data.from_items([{"id": i, "input_ids": s} for i, s in enumerate(seqs)])
        ds = ds.map_batches(
            BatchkitPredictor,
            fn_constructor_kwargs={
                "model_factory": load_model,
                "policy": batchkit.SortedBatcher(batch_size=32, max_tokens=4096),
                "collate": batchkit.pad,
                "columns": "input_ids",
            },
            batch_size=1000,  # rows regrouped together: more rows, less padding
            compute=ray.data.ActorPoolStrategy(size=2),
            num_cpus=1,
        )
        rows = ds.take_all()
    finally:
        ray.shutdown()

    model = load_model()
    assert [r["id"] for r in rows] == list(range(len(seqs))), "row order kept"
    for seq, row in zip(seqs, rows):
        np.testing.assert_allclose(row["output"], model(batchkit.pad([seq]))[0], rtol=1e-5)
    print(f"{len(rows)} rows in order; every output equals the unbatched one")


if __name__ == "__main__":
    main()
