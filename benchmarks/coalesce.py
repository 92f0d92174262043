"""Coalescing benchmark: identical requests in flight, computed once or every time.

Workload: 128 caller threads in a closed loop (each calls, waits for its answer, calls
again) on an emulated device at saturation: one batch at a time (a lock), each taking
``time.sleep(a + b * rows)`` with a = 4 ms, b = 0.2 ms, max batch 32 rows, max wait
5 ms. The keys are Zipf-distributed within blocks of 64 consecutive requests, and each
block has keys of its own (what is popular now: a trending query, a document several
services embed at once, retries of a request still running), so about 30% of the
requests arrive while a request of the same key is in flight, and few after it ended.

Systems, on the same workload:

- ``plain``        ``@batched``: every request costs a device row;
- ``coalesce``     ``@batched(coalesce=True)``: a key in flight is computed once;
- ``lru_cache``    ``functools.lru_cache`` in front of the plain ``@batched``: it
                   answers a key computed before, but every duplicate that arrives while
                   its key is in flight still misses and costs a row;
- ``coalesce+lru`` ``@batched(cache=cachetools.LRUCache(4096))``: both.

Printed per system: goodput (answers/s), device rows used, rows per request, and the
requests that arrived while their key was in flight (counted by the callers). Targets
(``PASS``/``MISS`` lines):

1. with ``coalesce`` the device rows used equal the distinct keys in flight: the
   requests less those that arrived while their key was in flight, a key being in
   flight from the arrival of a request for it until the device computed it (a
   request that arrives after that, while the answer is handed out, still joins:
   the rows may only be fewer);
2. goodput with ``coalesce`` >= 1.3x ``plain`` and >= ``lru_cache``;
3. overhead: every key unique (nothing to coalesce), same device: goodput with
   ``coalesce`` within 5% of ``plain``. The per-request cost with an instant device
   (an identity function), from the threads and from 256 asyncio tasks (``acall``),
   is printed too, as information.

Each repeat runs every system once, in a rotated order; the figures are medians over
repeats and the ratios come from the same run.

Usage::

    python benchmarks/coalesce.py            # ~1.5 min on 2 cores
    python benchmarks/coalesce.py --quick    # ~20 s, noisier
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import check, med, rotated  # noqa: E402

import batchkit  # noqa: E402

MAX_BATCH = 32
MAX_WAIT_MS = 5.0
A, B = 0.004, 0.0002  # emulated device: a + b * rows seconds per batch
THREADS = 128
BLOCK = 64  # consecutive requests that share a key space
RANKS, ZIPF_S = 400, 0.9  # Zipf over each block's keys: about 30% repeats in flight

SYSTEMS = ("plain", "coalesce", "lru_cache", "coalesce+lru")

Key = tuple[int, int]


def zipf_keys(rng: random.Random, n: int, *, unique: bool = False) -> list[Key]:
    """`n` keys `(block, rank)`: Zipf ranks within each block of `BLOCK` requests (or
    every key distinct, with `unique`)."""
    if unique:
        return [(i, 0) for i in range(n)]
    weights = [1.0 / (r**ZIPF_S) for r in range(1, RANKS + 1)]
    ranks = rng.choices(range(RANKS), weights=weights, k=n)
    return [(i // BLOCK, rank) for i, rank in enumerate(ranks)]


def answer(key: Key) -> int:
    """What the model computes for a key (checked for every request)."""
    return key[0] * 1_000_003 + key[1]


class Device:
    """One emulated accelerator: batches run one at a time; rows are counted.

    It also keeps the keys in flight, as the callers see them: a key is in flight
    from the arrival of a request for it until the device has computed it
    (`arrived`, called by the callers, counts the requests that find their key in
    flight).
    """

    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b
        self.rows = 0
        self.repeats = 0  # requests that arrived while their key was in flight
        self._device = threading.Lock()
        self._books = threading.Lock()
        self._in_flight: set[Key] = set()

    def arrived(self, key: Key) -> None:
        with self._books:
            if key in self._in_flight:
                self.repeats += 1
            else:
                self._in_flight.add(key)

    def __call__(self, keys: list[Key]) -> list[int]:
        with self._device:
            self.rows += len(keys)
            if self.a or self.b:
                time.sleep(self.a + self.b * len(keys))
        with self._books:
            self._in_flight.difference_update(keys)
        return [answer(k) for k in keys]


def make_system(name: str, device: Device) -> tuple[Callable[[Key], int], Callable[[], None]]:
    """`(call, close)` for system `name` over `device`."""
    options: dict[str, Any] = {"max_batch_size": MAX_BATCH, "max_wait_ms": MAX_WAIT_MS}
    if name == "coalesce":
        options["coalesce"] = True
    elif name == "coalesce+lru":
        from cachetools import LRUCache

        options["cache"] = LRUCache(maxsize=4096)
    f = batchkit.batched(device, **options)
    if name == "lru_cache":
        return functools.lru_cache(maxsize=4096)(f), f.close
    return f, f.close


def closed_loop(
    call: Callable[[Key], int], device: Device, keys: list[Key], threads: int
) -> float:
    """Seconds for `threads` callers to get every key's answer, each checked."""
    counter = itertools.count()
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            while (i := next(counter)) < len(keys):
                key = keys[i]
                device.arrived(key)
                if call(key) != answer(key):
                    raise AssertionError(f"wrong answer for {key}")
        except BaseException as exc:  # noqa: BLE001 - reported after the others end
            errors.append(exc)

    pool = [threading.Thread(target=caller) for _ in range(threads)]
    t0 = time.perf_counter()
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


def run_once(name: str, keys: list[Key], a: float, b: float) -> dict[str, float]:
    """One sample of system `name`: goodput, rows, repeats in flight."""
    device = Device(a, b)
    call, close = make_system(name, device)
    warm = [(-1, i) for i in range(2 * MAX_BATCH)]  # start-up, untimed
    closed_loop(call, device, warm, THREADS)
    device.rows = device.repeats = 0
    try:
        seconds = closed_loop(call, device, keys, THREADS)
    finally:
        close()
    return {
        "goodput": len(keys) / seconds,
        "rows": float(device.rows),
        "repeats": float(device.repeats),
    }


def measure(
    systems: tuple[str, ...], keys: list[Key], a: float, b: float, repeats: int
) -> dict[str, dict[str, float]]:
    """Medians over interleaved repeats, per system and figure."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    for k in range(repeats):
        for name in rotated(list(systems), k):
            samples[name].append(run_once(name, keys, a, b))
    return {
        name: {fig: med([s[fig] for s in runs]) for fig in runs[0]}
        for name, runs in samples.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repeats")
    parser.add_argument("--requests", type=int, default=None, help="requests per sample")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n = args.requests or (2000 if args.quick else 4000)
    repeats = args.repeats or (3 if args.quick else 5)
    keys = zipf_keys(random.Random(args.seed), n)
    distinct = len(set(keys))
    print(
        f"{n} requests, {distinct} distinct keys ({1 - distinct / n:.0%} repeats overall); "
        f"{THREADS} caller threads; device {A * 1e3:g} ms + {B * 1e3:g} ms/row, "
        f"max batch {MAX_BATCH}; medians of {repeats} interleaved repeats"
    )

    results = measure(SYSTEMS, keys, A, B, repeats)
    print(f"\n{'system':<14}{'goodput/s':>11}{'rows':>8}{'rows/req':>10}{'in flight':>11}")
    for name, r in results.items():
        print(
            f"{name:<14}{r['goodput']:>11.0f}{r['rows']:>8.0f}{r['rows'] / n:>10.2f}"
            f"{r['repeats'] / n:>10.0%}"
        )
    co, plain, lru = results["coalesce"], results["plain"], results["lru_cache"]
    print()
    ok = True
    in_flight_keys = n - co["repeats"]
    ok &= check(
        "coalesce: device rows = distinct keys in flight",
        co["rows"] <= in_flight_keys,
        f"{co['rows']:.0f} rows, {in_flight_keys:.0f} distinct keys in flight "
        f"({co['repeats'] / n:.0%} of requests arrived while their key was in flight)",
    )
    ok &= check(
        "coalesce goodput >= 1.3x plain",
        co["goodput"] >= 1.3 * plain["goodput"],
        f"{co['goodput'] / plain['goodput']:.2f}x",
    )
    ok &= check(
        "coalesce goodput >= lru_cache in front of @batched",
        co["goodput"] >= lru["goodput"],
        f"{co['goodput'] / lru['goodput']:.2f}x",
    )

    unique = zipf_keys(random.Random(args.seed), n, unique=True)
    both = ("plain", "coalesce")
    device_bound = measure(both, unique, A, B, repeats)
    ratio = device_bound["coalesce"]["goodput"] / device_bound["plain"]["goodput"]
    ok &= check(
        "overhead: no duplicates, same device, coalesce within 5% of plain",
        ratio >= 0.95,
        f"{ratio:.3f}x ({device_bound['coalesce']['goodput']:.0f} vs "
        f"{device_bound['plain']['goodput']:.0f} answers/s)",
    )
    instant = measure(both, unique, 0.0, 0.0, repeats)
    _print_per_request(f"{THREADS} threads", {n: r["goodput"] for n, r in instant.items()})
    from_loop: dict[str, list[float]] = {name: [] for name in both}
    for k in range(repeats):
        for name in rotated(list(both), k):
            from_loop[name].append(asyncio.run(tasks_goodput(name, unique)))
    _print_per_request(f"{TASKS} asyncio tasks", {n: med(g) for n, g in from_loop.items()})
    return 0 if ok else 1


TASKS = 256  # asyncio callers of the instant device, each awaiting f.acall


async def tasks_goodput(name: str, keys: list[Key]) -> float:
    """Answers/s for `TASKS` tasks in a closed loop on an instant device (`acall`)."""
    call, close = make_system(name, Device(0.0, 0.0))
    acall = call.acall  # type: ignore[attr-defined]
    counter = itertools.count()

    async def caller() -> None:
        while (i := next(counter)) < len(keys):
            if await acall(keys[i]) != answer(keys[i]):
                raise AssertionError(f"wrong answer for {keys[i]}")

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(TASKS)))
    elapsed = time.perf_counter() - t0
    close()
    return len(keys) / elapsed


def _print_per_request(callers: str, goodput: dict[str, float]) -> None:
    plain, coalesce = (1e6 / goodput[name] for name in ("plain", "coalesce"))
    print(
        f"info  instant device (identity), {callers}: {plain:.1f} us/request plain, "
        f"{coalesce:.1f} us/request coalesce ({coalesce / plain:.2f}x)"
    )


if __name__ == "__main__":
    sys.exit(main())
