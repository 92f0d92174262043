"""Grouped batching online: one `@batched` function serving several adapters, every
batch holding one adapter (or at most two), with each caller's result equal to running
its item alone.

An emulated multi-adapter model: a batch costs 2 ms, plus 0.2 ms an item, plus 3 ms
for every extra adapter it has to switch to. 300 requests from 24 threads over four
adapters (one hot, three cold); `stats().groups` shows each adapter's share and waits.

Run: python examples/grouped_online.py
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import batchkit

ADAPTERS = ["hot", "cold-a", "cold-b", "cold-c"]
device = threading.Lock()  # one accelerator, shared by every batch
batches: list[list[str]] = []


def adapter_of(request: dict[str, object]) -> str:
    return str(request["adapter"])


def run_adapter(adapter: str, x: int) -> int:
    """What the model answers for one item alone (the reference)."""
    return x * (1 + ADAPTERS.index(adapter))


def emulated_model(requests: list[dict[str, object]]) -> list[int]:
    adapters = sorted({adapter_of(r) for r in requests})
    with device:
        batches.append(adapters)
        time.sleep(0.002 + 0.0002 * len(requests) + 0.003 * (len(adapters) - 1))
    return [run_adapter(adapter_of(r), int(r["x"])) for r in requests]  # type: ignore[call-overload]


def serve(max_groups_per_batch: int) -> None:
    batches.clear()
    f = batchkit.batched(
        max_batch_size=16,
        max_wait_ms=5,
        group=adapter_of,
        max_groups_per_batch=max_groups_per_batch,
    )(emulated_model)
    # Traffic skewed to one adapter: 70% "hot", 10% each cold one.
    requests = [
        {"adapter": ADAPTERS[0] if i % 10 < 7 else ADAPTERS[1 + i % 3], "x": i} for i in range(300)
    ]
    start = time.perf_counter()
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(f, requests))
    elapsed = time.perf_counter() - start
    expected = [run_adapter(adapter_of(r), int(r["x"])) for r in requests]  # type: ignore[call-overload]
    assert results == expected, "a caller got another's result"
    assert all(len(b) <= max_groups_per_batch for b in batches)
    stats = f.stats()
    f.close()
    print(
        f"max_groups_per_batch={max_groups_per_batch}: {len(batches)} batches, "
        f"{stats.mean_batch_size:.1f} items each, "
        f"{sum(map(len, batches)) / len(batches):.2f} adapters each, {elapsed:.2f} s"
    )
    for adapter, group in sorted(stats.groups.items()):
        print(
            f"  {adapter:>7}: {group.requests:3d} requests in {group.batches:3d} batches, "
            f"queue wait p99 {group.queue_wait.p99 * 1e3:5.1f} ms"
        )


if __name__ == "__main__":
    serve(max_groups_per_batch=1)
    serve(max_groups_per_batch=2)
    print("every result equal to its item run alone")
