"""A latency target at twice capacity: what is served stays in time, the rest is refused.

An emulated accelerator (10 ms + 1 ms per item, one batch at a time) behind
``@batched(max_batch_size=16)`` gets open-loop Poisson arrivals at twice what it can
serve, for two seconds (after 0.3 s at half load), twice: once with a fixed batcher,
once with ``max_latency_ms=100``. The fixed one answers everything, later and later; with the
target, the function learns its batch time, refuses (``batchkit.Overloaded``) what it
predicts would be late and keeps answering the rest within 100 ms, at about the
device's capacity.

Run:  python examples/latency_target.py
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable

import batchkit

FIXED_S, PER_ITEM_S, MAX_BATCH, TARGET_S = 0.010, 0.001, 16, 0.100
CAPACITY = MAX_BATCH / (FIXED_S + PER_ITEM_S * MAX_BATCH)  # items/s: about 615


async def device(xs: list[int]) -> list[int]:
    await asyncio.sleep(FIXED_S + PER_ITEM_S * len(xs))
    return [x * 2 for x in xs]


async def offer(
    f: batchkit.BatchedFunction[int, int, Awaitable[int]], rate: float, seconds: float
) -> dict[str, float]:
    """Poisson arrivals at `rate` for `seconds`; in-time answers, refusals, latencies."""
    rng = random.Random(0)
    latencies: list[float] = []
    refused = 0

    async def one(x: int) -> None:
        nonlocal refused
        start = time.monotonic()
        try:
            assert await f.acall(x) == 2 * x  # every answer is the caller's own
        except batchkit.QueueFull:  # Overloaded is a QueueFull
            refused += 1
            return
        latencies.append(time.monotonic() - start)

    tasks = []
    begin = due = time.monotonic()
    while due - begin < seconds:
        due += rng.expovariate(rate)
        await asyncio.sleep(max(due - time.monotonic(), 0.0))
        tasks.append(asyncio.ensure_future(one(len(tasks))))
    await asyncio.gather(*tasks)
    latencies.sort()
    in_time = sum(1 for x in latencies if x <= TARGET_S)
    return {
        "offered": len(tasks),
        "goodput": in_time / seconds / CAPACITY,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1e3,
        "refused": refused,
    }


async def main() -> None:
    fixed = batchkit.batched(max_batch_size=MAX_BATCH, max_wait_ms=5)(device)
    targeted = batchkit.batched(
        max_batch_size=MAX_BATCH, max_wait_ms=5, max_latency_ms=TARGET_S * 1e3
    )(device)
    print(f"device capacity {CAPACITY:.0f} items/s; offered twice that for 2 s")
    for name, f in (("fixed", fixed), ("max_latency_ms=100", targeted)):
        # Half load first: a target admits everything until it has seen 8 batches.
        await offer(f, 0.5 * CAPACITY, 0.3)
        r = await offer(f, 2 * CAPACITY, 2.0)
        print(
            f"{name:>20}: goodput {r['goodput']:.2f} of capacity, served p99 "
            f"{r['p99_ms']:.0f} ms, refused {r['refused']:.0f} of {r['offered']:.0f}"
        )
        await f.aclose()
    stats = targeted.stats()
    model = stats.latency_model
    assert model is not None
    print(
        f"learned: {model.fixed_ms:.1f} ms + {model.per_item_ms:.2f} ms/item "
        f"(+{model.margin_ms:.1f} ms margin); refused at admission {stats.overloaded}, "
        f"dropped while waiting {stats.shed}"
    )


if __name__ == "__main__":
    asyncio.run(main())
