"""``@batched`` from asyncio: an async function, a sync function, timeouts, priorities.

1. An async batch function (think: one HTTP call to a model server per batch)
   serves 500 concurrent tasks on the event loop, with no threads.
2. A sync numpy function is awaited with ``acall``: batches run on a worker
   thread, so the event loop stays free.
3. ``timeout``: a request that cannot start in time gets ``RequestTimeout`` and
   never runs. ``priority``: lower values jump the queue.

Every result is checked equal to the unbatched function. Runs in about a second:

    python examples/batched_asyncio.py
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

import batchkit

ROUND_TRIP_S = 0.02  # the cost of one call to the remote model, whatever the batch size


def score_one(text: str) -> int:
    """The unbatched reference."""
    return sum(map(ord, text)) % 997


@batchkit.batched(max_batch_size=64, max_wait_ms=5)
async def remote_score(texts: list[str]) -> list[int]:
    """One simulated network round trip per batch."""
    await asyncio.sleep(ROUND_TRIP_S)
    return [score_one(t) for t in texts]


W = np.random.default_rng(0).normal(size=(32, 8))


@batchkit.batched(max_batch_size=128, max_wait_ms=2)
def embed(xs: list[np.ndarray]) -> np.ndarray:
    """A sync function: it runs on a worker thread when awaited with ``acall``."""
    return np.stack(xs) @ W


async def async_function_demo(n: int = 500) -> None:
    texts = [f"request {i}" for i in range(n)]
    start = time.perf_counter()
    results = await asyncio.gather(*(remote_score(t) for t in texts))  # 500 concurrent tasks
    elapsed = time.perf_counter() - start
    assert results == [score_one(t) for t in texts]
    s = remote_score.stats()
    print(
        f"async fn    {n} tasks in {elapsed:.2f} s with {s.batches} round trips "
        f"(unbatched: {n} x {ROUND_TRIP_S * 1e3:.0f} ms = {n * ROUND_TRIP_S:.0f} s sequential)"
    )
    print(f"            batch sizes {s.batch_sizes}, reasons {s.dispatch_reasons}")
    assert s.batches < n // 10


async def sync_function_demo(n: int = 500) -> None:
    xs = [np.random.default_rng(i).normal(size=32) for i in range(n)]
    ticks = 0

    async def heartbeat() -> None:  # keeps running: the loop is never blocked
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    beat = asyncio.create_task(heartbeat())
    outs = await asyncio.gather(*(embed.acall(x) for x in xs))
    mapped = await embed.amap(xs[:10])  # many items, results in input order
    beat.cancel()
    assert all(np.allclose(o, x @ W, rtol=0, atol=1e-12) for o, x in zip(outs, xs))
    assert all(np.allclose(a, b, rtol=0, atol=1e-12) for a, b in zip(mapped, outs[:10]))
    s = embed.stats()
    print(
        f"sync fn     {n} acalls in {s.batches} batches (mean size {s.mean_batch_size:.0f}), "
        f"event loop ticked {ticks} times meanwhile"
    )


async def timeout_and_priority_demo() -> None:
    order: list[str] = []

    @batchkit.batched(max_batch_size=1)  # one item per batch: the queue order is visible
    async def slow(xs: list[str]) -> list[str]:
        order.extend(xs)
        await asyncio.sleep(0.05)
        return [x.upper() for x in xs]

    first = asyncio.create_task(slow("first"))
    await asyncio.sleep(0.01)  # "first" is running; the next ones wait behind it
    background = asyncio.create_task(slow("background", priority=10))
    normal = asyncio.create_task(slow("normal"))
    urgent = asyncio.create_task(slow("urgent", priority=-5))
    try:
        await slow("impatient", timeout=0.02)  # cannot start within 20 ms
        raise AssertionError("expected a RequestTimeout")
    except batchkit.RequestTimeout as err:
        assert isinstance(err, TimeoutError)
        print(f"timeout     {err}")
    results = await asyncio.gather(first, background, normal, urgent)
    assert results == ["FIRST", "BACKGROUND", "NORMAL", "URGENT"]
    assert order == ["first", "urgent", "normal", "background"], order  # "impatient" never ran
    print(f"priority    served in order {order}")
    s = slow.stats()
    assert s.timeouts == 1 and s.items_run == 4
    await slow.aclose()


async def main() -> None:
    await async_function_demo()
    await sync_function_demo()
    await timeout_and_priority_demo()
    await remote_score.aclose()
    await embed.aclose()
    try:
        await remote_score("after close")
    except batchkit.BatcherClosed:
        print("closed      further calls raise BatcherClosed")


if __name__ == "__main__":
    asyncio.run(main())
