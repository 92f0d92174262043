"""Streaming batch benchmark: batchkit's streaming ``@batched`` against Ray Serve's, same run.

A streaming batch function is a generator: each step runs the whole batch once on the
device and yields one entry per item (a chunk, or the end of that item's stream). Both
systems serve one batch at a time (their default), max batch size 16, max wait 5 ms:

- ``batchkit``       ``@batchkit.batched`` on an async generator, read with ``astream``;
- ``batchkit-sync``  ``@batchkit.batched`` on a plain generator (batchkit runs it on its
                     worker thread), read with ``astream``;
- ``ray-serve``      Ray Serve's ``@serve.batch`` on an async generator method (no
                     cluster; see ``_peers.RayServeStreamBatcher``);
- ``device (ref)``   no batcher: the device called back to back on full batches of the
                     same items, directly (saturation only). What this machine allows;
                     it bounds every system.

Emulated device: one lock (one device), a step of a batch of B items costs
``time.sleep(a + b*B)``, a = 2 ms, b = 0.1 ms (the async generators send it through
``loop.run_in_executor``; the sync one calls it directly). Item ``i`` streams ``k_i``
chunks, ``(i, 0) ... (i, k_i - 1)``, k uniform in 4..16 (seeded); a batch runs as many
steps as its longest item, and an item's stream ends (END / StopIteration) at the step
after its last chunk, or when the generator returns. Every caller's chunks are checked
against exactly what it should get before any number is reported.

Scenarios:

1. saturation: 64 callers in a closed loop, each streaming one item to its end and then
   the next; chunks/s, and its ratio to ``device (ref)`` in the same repeat;
2. half load: open-loop Poisson arrivals at 50% of the saturation capacity in items/s
   (full batches, each as long as the expected longest of 16 items); time to first
   chunk from each item's scheduled arrival, p50 and p99, in ms and in full-batch step
   times T = a + 16b.

Each repeat runs every system once per scenario (order rotated per repeat); the table
shows medians over repeats [IQR], and the batchkit / Ray ratios are medians of the
per-repeat ratios. Goals (PASS/MISS lines; exit status 1 on a MISS): each batchkit row's
chunks/s at least Ray's, and its p99 time to first chunk at most Ray's. The ``batch``
columns (mean items per batch) say why the numbers differ.

Usage::

    python benchmarks/stream.py              # ~2 min on 2 cores
    python benchmarks/stream.py --quick      # ~40 s, noisier
    python benchmarks/stream.py --systems batchkit,batchkit-sync --quick --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import chosen_systems  # noqa: E402
from _load import issue  # noqa: E402
from _peers import RayServeStreamBatcher  # noqa: E402
from _report import check, med, percentile, rotated  # noqa: E402

import batchkit  # noqa: E402

MAX_BATCH = 16
MAX_WAIT_S = 0.005
A, B = 0.002, 0.0001  # emulated device: a + b * batch_size seconds per step
STEP_T = A + B * MAX_BATCH  # one step of a full batch
K_MIN, K_MAX = 4, 16  # chunks per item, uniform
CALLERS = 64

SYSTEMS = ("batchkit", "batchkit-sync", "ray-serve")
REFERENCE = "device (ref)"

Item = tuple[int, int]  # (id, number of chunks)


def expected_longest(batch: int) -> float:
    """E[max k] over ``batch`` items, k uniform in K_MIN..K_MAX."""
    n = K_MAX - K_MIN + 1
    below = [((m - K_MIN + 1) / n) ** batch for m in range(K_MIN, K_MAX + 1)]
    return sum(m * (p - q) for m, p, q in zip(range(K_MIN, K_MAX + 1), below, [0.0, *below]))


MEAN_K = (K_MIN + K_MAX) / 2
# Full batches back to back: items/s, and what chunks/s that makes.
CAPACITY = MAX_BATCH / (expected_longest(MAX_BATCH) * STEP_T)
IDEAL_CHUNKS = CAPACITY * MEAN_K

# --------------------------------------------------------------------------- the device

_DEVICE = threading.Lock()  # one device: a second batch's step waits for the first's


def device_step(batch_size: int) -> None:
    with _DEVICE:
        time.sleep(A + B * batch_size)


def step_entries(items: list[Item], step: int, end: Any) -> list[Any]:
    """One step's entries: item i's chunk ``(i, step)``, or ``end`` once it has k chunks."""
    return [(i, step) if step < k else end for i, k in items]


def longest(items: list[Item]) -> int:
    return max(k for _, k in items)


BATCH_SIZES: list[int] = []  # items in each batch the generators ran, this sample


def async_generator(end: Any) -> Callable[[list[Item]], AsyncIterator[list[Any]]]:
    """An async generator batch function whose items' streams end with ``end``."""

    async def stream_batch(items: list[Item]) -> AsyncIterator[list[Any]]:
        loop = asyncio.get_running_loop()
        BATCH_SIZES.append(len(items))
        for step in range(longest(items)):
            await loop.run_in_executor(None, device_step, len(items))
            yield step_entries(items, step, end)

    return stream_batch


def sync_generator(items: list[Item]) -> Iterator[list[Any]]:
    BATCH_SIZES.append(len(items))
    for step in range(longest(items)):
        device_step(len(items))
        yield step_entries(items, step, batchkit.END)


def expected_chunks(item: Item) -> list[tuple[int, int]]:
    i, k = item
    return [(i, step) for step in range(k)]


# --------------------------------------------------------------------------- systems


class BatchkitStream:
    """``@batchkit.batched`` on a streaming batch function, read with ``astream``."""

    def __init__(self, fn: Callable[[list[Item]], Any]) -> None:
        self.f = batchkit.batched(max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_S * 1000)(fn)
        self.call = self.f.astream

    async def close(self) -> None:
        await self.f.aclose()


def make_system(name: str) -> Any:
    """A fresh instance of system ``name`` (inside the running loop); ``call(item)``
    returns that item's async iterator of chunks."""
    if name == "batchkit":
        return BatchkitStream(async_generator(batchkit.END))
    if name == "batchkit-sync":
        return BatchkitStream(sync_generator)
    if name == "ray-serve":
        return RayServeStreamBatcher(async_generator(StopIteration), MAX_BATCH, MAX_WAIT_S)
    raise ValueError(name)


# --------------------------------------------------------------------------- workloads


def make_items(rng: random.Random, n: int) -> list[Item]:
    return [(i, rng.randint(K_MIN, K_MAX)) for i in range(n)]


class WrongChunks(AssertionError):
    """A caller did not receive exactly its item's chunks."""


def verify(system: str, item: Item, got: list[Any]) -> None:
    want = expected_chunks(item)
    if got != want:
        differ = next((j for j, (g, w) in enumerate(zip(got, want)) if g != w), None)
        first = min(len(got), len(want)) if differ is None else differ
        raise WrongChunks(
            f"{system}: item {item[0]} (k={item[1]}) received {len(got)} chunks, expected "
            f"{len(want)}; first difference at chunk {first}"
        )


async def closed_loop(
    system: str, call: Callable[[Item], AsyncIterator[Any]], items: list[Item]
) -> float:
    """Chunks/s of CALLERS tasks streaming the items one after another (each checked).

    Measured in the steady state: from the moment the first CALLERS items have ended
    (the start-up burst is over) to the moment the last item is handed out (after it,
    callers run out of work and batches thin)."""
    if len(items) < 3 * CALLERS:
        raise ValueError(f"{len(items)} items: a closed loop needs at least {3 * CALLERS}")
    counter = itertools.count()
    chunks = ended = 0
    start: tuple[float, int] | None = None
    stop: tuple[float, int] | None = None

    async def caller() -> None:
        nonlocal chunks, ended, start, stop
        while (i := next(counter)) < len(items):
            if i == len(items) - 1:
                stop = (time.perf_counter(), chunks)
            got = []
            async for chunk in call(items[i]):
                chunks += 1
                got.append(chunk)
            verify(system, items[i], got)
            ended += 1
            if ended == CALLERS:
                start = (time.perf_counter(), chunks)

    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    assert start is not None and stop is not None and stop[0] > start[0]
    return (stop[1] - start[1]) / (stop[0] - start[0])


LATENESS: list[float] = []  # p99 of how late the generator issued arrivals, per sample


async def open_loop(
    system: str, call: Callable[[Item], AsyncIterator[Any]], items: list[Item], gaps: list[float]
) -> list[float]:
    """Times to first chunk (s, from the scheduled arrival) of items arriving at ``gaps``;
    every stream is read to its end and checked."""
    loop = asyncio.get_running_loop()
    first = [0.0] * len(items)
    late = [0.0] * len(items)

    async def one(i: int, scheduled: float) -> None:
        late[i] = loop.time() - scheduled
        got: list[Any] = []
        async for chunk in call(items[i]):
            if not got:
                first[i] = loop.time() - scheduled
            got.append(chunk)
        verify(system, items[i], got)

    tasks = await issue(list(itertools.accumulate(gaps)), one, loop.time() + 0.005)
    while tasks:
        await asyncio.gather(*list(tasks))
    LATENESS.append(percentile(late, 0.99))
    return first


def device_back_to_back(items: list[Item]) -> float:
    """Seconds for the device to run ``items`` in full batches, no batcher, no loop."""
    t0 = time.perf_counter()
    for start in range(0, len(items), MAX_BATCH):
        for _ in sync_generator(items[start : start + MAX_BATCH]):
            pass
    return time.perf_counter() - t0


# --------------------------------------------------------------------------- rounds


Samples = dict[str, dict[str, list[float]]]


async def run(args: argparse.Namespace) -> Samples:
    """Interleaved repeats of both scenarios: per measure, per system, the samples."""
    systems: tuple[str, ...] = args.systems
    res: Samples = {
        "chunks/s": {s: [] for s in (*systems, REFERENCE)},
        "p50": {s: [] for s in systems},
        "p99": {s: [] for s in systems},
        "batch saturation": {s: [] for s in (*systems, REFERENCE)},
        "batch half": {s: [] for s in systems},
    }
    rng = random.Random(1234)

    async def sample(name: str, body: Callable[[str, Any], Any], batches: str) -> Any:
        BATCH_SIZES.clear()
        system = make_system(name)
        try:
            return await body(name, system.call)
        finally:
            await system.close()
            res[batches][name].append(statistics.fmean(BATCH_SIZES))

    # warm-up: imports, thread pools, first-call paths
    warm = make_items(rng, 3 * CALLERS)
    for name in systems:
        await sample(name, lambda n, c: closed_loop(n, c, warm), "batch saturation")
    for samples in res["batch saturation"].values():
        samples.clear()

    for r in range(args.repeats):
        gc.collect()
        items = make_items(rng, args.n_saturation)
        for name in rotated((*systems, REFERENCE), r):
            if name == REFERENCE:
                BATCH_SIZES.clear()
                rate = sum(k for _, k in items) / device_back_to_back(items)
                res["batch saturation"][name].append(statistics.fmean(BATCH_SIZES))
            else:
                rate = await sample(
                    name, lambda n, c, items=items: closed_loop(n, c, items), "batch saturation"
                )
            res["chunks/s"][name].append(rate)
        items = make_items(rng, args.n_half)
        gaps = [rng.expovariate(0.5 * CAPACITY) for _ in items]
        for name in rotated(systems, r):
            first = await sample(
                name,
                lambda n, c, items=items, gaps=gaps: open_loop(n, c, items, gaps),
                "batch half",
            )
            res["p50"][name].append(percentile(first, 0.50))
            res["p99"][name].append(percentile(first, 0.99))
    return res


# --------------------------------------------------------------------------- report


def spread(xs: list[float], fmt: str = "{:.3g}") -> str:
    if len(xs) < 2:
        return ""
    q = statistics.quantiles(xs, n=4)
    return f"[{fmt.format(q[0])}-{fmt.format(q[2])}]"


def ratios(res: Samples, key: str, name: str, base: str) -> list[float]:
    """Per-repeat ratios ``name / base`` of one measure (same repeat, same items)."""
    return [x / y for x, y in zip(res[key][name], res[key][base])]


def report(res: Samples, systems: tuple[str, ...]) -> bool:
    """Print the table, the ratios and the goals; True when no goal is missed."""
    print(
        f"\n{'':<15} {'saturation':-^39}  {'half load: time to first chunk':-^56}\n"
        f"{'system':<15} {'chunks/s':>8} {'[IQR]':>13} {'of bound':>8} {'batch':>6}"
        f"  {'p50 ms':>7} {'p99 ms':>7} {'[IQR]':>15} {'p50/T':>7} {'p99/T':>7} {'batch':>6}"
    )
    for name in (*systems, REFERENCE):
        cps = res["chunks/s"][name]
        of_bound = med(ratios(res, "chunks/s", name, REFERENCE))
        line = (
            f"{name:<15} {med(cps):>8.0f} {spread(cps, '{:.0f}'):>13} {of_bound:>8.3f}"
            f" {med(res['batch saturation'][name]):>6.1f}"
        )
        if name in res["p50"]:
            p50, p99 = med(res["p50"][name]), med(res["p99"][name])
            line += (
                f"  {p50 * 1e3:>7.1f} {p99 * 1e3:>7.1f}"
                f" {spread([x * 1e3 for x in res['p99'][name]], '{:.1f}'):>15}"
                f" {p50 / STEP_T:>7.2f} {p99 / STEP_T:>7.2f} {med(res['batch half'][name]):>6.1f}"
            )
        print(line)
    print("(batch: mean items per batch in a sample; T: one full-batch step)")
    print(
        f"\nnote  the arrival generator itself was late by {med(LATENESS) * 1e3:.2f} ms at p99 "
        f"(median over samples; counted in every time to first chunk above)"
    )
    if "ray-serve" not in systems:
        print("info  the goals compare with ray-serve, which did not run")
        return True
    ok = True
    for name in (n for n in systems if n != "ray-serve"):
        thr = ratios(res, "chunks/s", name, "ray-serve")
        p99 = ratios(res, "p99", name, "ray-serve")
        print(
            f"ratio {name} / ray-serve: chunks/s {med(thr):.3f} {spread(thr)}, "
            f"p99 time to first chunk {med(p99):.3f} {spread(p99)}"
        )
    for name in (n for n in systems if n != "ray-serve"):
        thr = med(ratios(res, "chunks/s", name, "ray-serve"))
        ok &= check(
            f"chunks/s {name} >= ray-serve",
            thr >= 1.0,
            f"{thr:.3f}x ({med(res['chunks/s'][name]):.0f} vs "
            f"{med(res['chunks/s']['ray-serve']):.0f} chunks/s)",
        )
        p99 = med(ratios(res, "p99", name, "ray-serve"))
        ok &= check(
            f"p99 time to first chunk {name} <= ray-serve",
            p99 <= 1.0,
            f"{p99:.3f}x ({med(res['p99'][name]) * 1e3:.1f} vs "
            f"{med(res['p99']['ray-serve']) * 1e3:.1f} ms)",
        )
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer, smaller repeats (~40 s)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated rows to run (the device reference always runs)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every sample to PATH")
    args = p.parse_args()
    args.systems = chosen_systems(p, args.systems, SYSTEMS)
    if args.quick:
        args.repeats = args.repeats or 3
        args.n_saturation, args.n_half = 4 * CALLERS, 200
    else:
        args.repeats = args.repeats or 5
        args.n_saturation, args.n_half = 8 * CALLERS, 500
    if args.repeats < 1:
        p.error("--repeats must be at least 1")

    t_start = time.perf_counter()
    print(
        f"# streaming batches: max_batch_size={MAX_BATCH}, max_wait={MAX_WAIT_S * 1e3:g} ms, "
        f"device step {A * 1e3:g} ms + {B * 1e3:g} ms/item (T = {STEP_T * 1e3:.1f} ms), "
        f"{K_MIN}-{K_MAX} chunks per item"
    )
    print(
        f"# full batches back to back: {CAPACITY:.0f} items/s, {IDEAL_CHUNKS:.0f} chunks/s "
        f"(a batch lasts as long as its longest item); half load = {0.5 * CAPACITY:.0f} "
        f"items/s; {args.repeats} interleaved repeats, medians [IQR]"
    )
    res = asyncio.run(run(args))
    ok = report(res, args.systems)
    if args.json:
        Path(args.json).write_text(json.dumps(res))
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
