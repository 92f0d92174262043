"""Identical requests computed once: `@batched(coalesce=...)` and `cache=`.

An emulated embedding model (2 ms + 0.1 ms a row, one batch at a time) asked for
popular texts by 32 threads and 200 asyncio tasks at once. With `coalesce=True` each
text in flight is computed once; with `cache=` a text computed before is answered
without queueing. Every caller's result is checked equal to the text embedded alone,
and a caller that changes its vector in place changes nobody else's.

Run: python examples/batched_coalesce.py
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from cachetools import LRUCache

import batchkit

device = threading.Lock()  # one accelerator
rows = 0


def embed_alone(text: str) -> np.ndarray:
    """What the model answers for one text (the reference)."""
    seed = sum(map(ord, text))
    return np.random.default_rng(seed).standard_normal(8).astype(np.float32)


def model(texts: list[str]) -> list[np.ndarray]:
    global rows
    with device:
        rows += len(texts)
        time.sleep(0.002 + 0.0001 * len(texts))
    return [embed_alone(t) for t in texts]


# Popular texts: Zipf over 40 queries, 600 requests.
rng = random.Random(0)
queries = [f"query {k}" for k in range(40)]
asked = rng.choices(queries, weights=[1 / (k + 1) for k in range(40)], k=600)


def from_threads(f: batchkit.BatchedFunction[np.ndarray]) -> list[np.ndarray]:
    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(f, asked))


def check(results: list[np.ndarray]) -> None:
    for text, vector in zip(asked, results):
        np.testing.assert_array_equal(vector, embed_alone(text))


def main() -> None:
    global rows
    plain = batchkit.batched(max_batch_size=32, max_wait_ms=2)(model)
    check(from_threads(plain))
    plain_rows, rows = rows, 0
    plain.close()

    coalesced = batchkit.batched(max_batch_size=32, max_wait_ms=2, coalesce=True)(model)
    results = from_threads(coalesced)
    check(results)
    stats = coalesced.stats()
    assert stats.requests + stats.coalesced == len(asked) and rows == stats.items_run
    print(f"threads, plain:    {plain_rows} rows for {len(asked)} requests")
    print(
        f"threads, coalesce: {rows} rows for {len(asked)} requests "
        f"({stats.coalesced} callers joined a text in flight)"
    )
    # Callers of one text hold copies: changing one in place changes no other.
    assert len({id(vector) for vector in results}) == len(results)
    first, second = [i for i, t in enumerate(asked) if t == asked[0]][:2]
    results[first] += 1.0
    np.testing.assert_array_equal(results[second], embed_alone(asked[0]))
    coalesced.close()

    rows = 0
    cache: LRUCache[str, np.ndarray] = LRUCache(maxsize=1000)
    cached = batchkit.batched(max_batch_size=32, max_wait_ms=2, cache=cache)(model)

    async def from_tasks() -> list[np.ndarray]:
        return list(await asyncio.gather(*(cached.acall(t) for t in asked[:200])))

    check(asyncio.run(from_tasks()))
    check(from_threads(cached))  # later callers: answered from the cache
    stats = cached.stats()
    assert rows == len(set(asked)) == len(cache)  # each text computed once, ever
    print(
        f"asyncio + threads, cache: {rows} rows for {200 + len(asked)} requests "
        f"({stats.coalesced} joined in flight, {stats.cache_hits} cache hits)"
    )
    cached.close()


if __name__ == "__main__":
    main()
