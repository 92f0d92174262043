"""64 threads call a ``@batched`` numpy function one item at a time.

Each thread sends its own feature vectors; ``@batched`` groups concurrent calls into
batches, runs one matrix multiply per batch on a worker thread, and hands every
thread its own row back. The results are checked equal to the unbatched function,
and the batcher's statistics are printed. Runs on CPU in a few seconds:

    python examples/batched_threads.py
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import batchkit

DIM, HIDDEN, OUT = 64, 256, 16
rng = np.random.default_rng(0)
W1 = rng.normal(size=(DIM, HIDDEN)) / np.sqrt(DIM)
W2 = rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN)
CALL_OVERHEAD_S = 0.001  # a fixed cost per call, like a kernel launch or an RPC
DEVICE = threading.Lock()  # one accelerator: one model call at a time


def mlp(x: np.ndarray) -> np.ndarray:
    """The model on a ``[B, DIM]`` batch."""
    with DEVICE:
        time.sleep(CALL_OVERHEAD_S)
        return np.tanh(x @ W1) @ W2


def predict_one(x: np.ndarray) -> np.ndarray:
    """The unbatched reference: one item, one call."""
    return mlp(x[None, :])[0]


@batchkit.batched(max_batch_size=64, max_wait_ms=2)
def predict(xs: list[np.ndarray]) -> np.ndarray:
    """The batched version: a list of ``[DIM]`` vectors -> ``[B, OUT]`` (one row each)."""
    return mlp(np.stack(xs))


def main(threads: int = 64, per_thread: int = 20) -> None:
    inputs = rng.normal(size=(threads, per_thread, DIM))

    def client(t: int) -> list[np.ndarray]:
        return [predict(x) for x in inputs[t]]  # one blocking call per item

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        batched_out = list(pool.map(client, range(threads)))
    t_batched = time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        alone_out = list(pool.map(lambda t: [predict_one(x) for x in inputs[t]], range(threads)))
    t_alone = time.perf_counter() - start

    worst = max(
        float(np.abs(a - b).max())
        for rows_a, rows_b in zip(batched_out, alone_out)
        for a, b in zip(rows_a, rows_b)
    )
    assert worst < 1e-9, worst  # every thread got exactly its own result

    predict.close()
    s = predict.stats()
    total = threads * per_thread
    assert s.requests == s.items_run == total and s.failed == 0
    print(f"calls               {total} from {threads} threads")
    print(f"unbatched           {t_alone:.2f} s ({total} model calls)")
    print(f"batched             {t_batched:.2f} s ({s.batches} model calls)")
    print(f"max |difference|    {worst:.1e}")
    print(f"mean batch size     {s.mean_batch_size:.1f}")
    top = sorted(s.batch_sizes.items(), key=lambda kv: -kv[1])[:5]
    print(f"common batch sizes  {dict(top)}  (size: batches)")
    print(f"dispatch reasons    {s.dispatch_reasons}")
    for label, pct in (("queue wait", s.queue_wait), ("batch latency", s.batch_latency)):
        print(f"{label:20}p50 {pct.p50 * 1e3:.2f} ms, p99 {pct.p99 * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
