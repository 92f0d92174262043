"""Soak: twice the emulated accelerator's capacity, for a set time.

An open-loop Poisson stream of asyncio callers (arrivals do not wait for answers)
hits a ``@batched`` sync function that emulates an accelerator: ``a + b * n``
seconds per batch of ``n`` (``time.sleep``, which releases the GIL). The queue is
bounded (``max_queue_size``), so the excess must be refused at once with
``QueueFull`` while accepted requests keep flowing at capacity with bounded latency.

Printed figures (ratios and units of one full-batch service time T, since absolute
times vary across machines):

- accepted throughput / capacity (capacity = B / (a + b B));
- rejection latency (how long a refused caller waited for its ``QueueFull``);
- p50 / p99 latency of accepted requests, in T;
- the ledger: every request ended in exactly one outcome, and batchkit's own
  counters agree with it.

    python benchmarks/soak.py            # 20 s
    python benchmarks/soak.py --quick    # 5 s
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter

import numpy as np

import batchkit

A, B_PER_ITEM, MAX_BATCH = 0.004, 0.0002, 32
FULL_BATCH_T = A + B_PER_ITEM * MAX_BATCH
CAPACITY = MAX_BATCH / FULL_BATCH_T  # requests per second


def accelerator(xs: list[int]) -> list[int]:
    time.sleep(A + B_PER_ITEM * len(xs))
    return [x + 1 for x in xs]


async def soak(seconds: float, load: float, queue_batches: int, seed: int) -> dict[str, object]:
    f = batchkit.batched(
        max_batch_size=MAX_BATCH, max_wait_ms=2, max_queue_size=queue_batches * MAX_BATCH
    )(accelerator)
    rng = random.Random(seed)
    rate = load * CAPACITY
    outcomes: Counter[str] = Counter()
    latencies: list[tuple[float, float]] = []  # (arrival, latency) of accepted requests
    reject_waits: list[float] = []
    # Only tasks still running are kept: holding tens of thousands of finished ones would
    # make every full garbage collection a pause long enough to show up as latency.
    tasks: set[asyncio.Task[None]] = set()

    async def one(x: int) -> None:
        start = time.perf_counter()
        try:
            out = await f.acall(x)
        except batchkit.QueueFull:
            reject_waits.append(time.perf_counter() - start)
            outcomes["rejected"] += 1
            return
        latencies.append((start, time.perf_counter() - start))
        outcomes["ok" if out == x + 1 else "wrong"] += 1

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    next_at, x = t0, 0
    while next_at - t0 < seconds:
        next_at += rng.expovariate(rate)
        # Always yield to the loop: a generator running behind schedule must not starve
        # the callbacks that deliver results (that would be the benchmark's latency).
        await asyncio.sleep(max(next_at - loop.time(), 0.0))
        task = asyncio.ensure_future(one(x))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        x += 1
    accept_window = loop.time() - t0
    while tasks:
        await asyncio.gather(*list(tasks))
    await f.aclose()
    stats = f.stats()
    return {
        "sent": x,
        "outcomes": outcomes,
        "accepted_rate": outcomes["ok"] / accept_window,
        "latency": np.array(sorted(latencies)).reshape(-1, 2)[:, 1],
        "reject_waits": np.array(reject_waits),
        "stats": stats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="5 s instead of 20 s")
    parser.add_argument("--load", type=float, default=2.0, help="arrival rate / capacity")
    parser.add_argument("--queue-batches", type=int, default=2, help="queue bound in full batches")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    seconds = 5.0 if args.quick else args.seconds
    r = asyncio.run(soak(seconds, args.load, args.queue_batches, args.seed))
    lat, rej, s, outcomes = r["latency"], r["reject_waits"], r["stats"], r["outcomes"]
    assert isinstance(lat, np.ndarray) and isinstance(rej, np.ndarray)
    assert isinstance(s, batchkit.Stats) and isinstance(outcomes, Counter)
    accepted_ratio = float(r["accepted_rate"]) / CAPACITY  # type: ignore[arg-type]
    p50, p99 = (np.percentile(lat, [50, 99]) / FULL_BATCH_T).tolist()
    rej_p99 = float(np.percentile(rej, 99)) if rej.size else 0.0
    # Bounded means it does not grow while the overload lasts: compare the p99 of
    # requests that arrived in the second half with the first half's.
    half = lat.size // 2
    p99_first, p99_second = (
        np.percentile(part, 99) / FULL_BATCH_T for part in (lat[:half], lat[half:])
    )
    ledger_ok = (
        sum(outcomes.values()) == r["sent"]
        and outcomes["wrong"] == 0
        and s.rejected == outcomes["rejected"]
        and s.items_run == outcomes["ok"]
        and s.requests == outcomes["ok"]
    )
    print(
        f"soak: {seconds:.0f} s at {args.load:.1f}x capacity ({CAPACITY:.0f} req/s), "
        f"queue bound {args.queue_batches} full batches, T = {FULL_BATCH_T * 1e3:.1f} ms"
    )
    print(
        f"sent {r['sent']}, accepted {outcomes['ok']}, rejected {outcomes['rejected']}, "
        f"mean batch {s.mean_batch_size:.1f}, dispatch {s.dispatch_reasons}"
    )
    print(f"accepted throughput / capacity   {accepted_ratio:.3f}")
    print(f"accepted latency p50 / p99       {p50:.2f} T / {p99:.2f} T")
    print(f"rejection wait p99               {rej_p99 * 1e6:.0f} us")
    print(
        f"inside batchkit: queue wait p50/p99 {s.queue_wait.p50 / FULL_BATCH_T:.2f} T / "
        f"{s.queue_wait.p99 / FULL_BATCH_T:.2f} T, batch latency p50/p99 "
        f"{s.batch_latency.p50 / FULL_BATCH_T:.2f} T / {s.batch_latency.p99 / FULL_BATCH_T:.2f} T"
    )
    checks = [
        ("accepted throughput >= 0.9 x capacity", accepted_ratio >= 0.9),
        (
            f"accepted p99 stays bounded (2nd half {p99_second:.2f} T <= 1.5 x 1st half "
            f"{p99_first:.2f} T)",
            p99_second <= 1.5 * p99_first,
        ),
        ("rejections immediate (p99 < 1 ms)", rej_p99 < 1e-3),
        ("ledger balances (every request one outcome; counters agree)", ledger_ok),
    ]
    for label, ok in checks:
        print(f"{'PASS' if ok else 'MISS'}  {label}")


if __name__ == "__main__":
    main()
