"""Online batching benchmark: batchkit's ``@batched`` against its peers, same run.

Systems (max batch size 32, max wait 5 ms for all):

- ``batchkit``       ``@batchkit.batched`` on an ``async def`` batch function;
- ``batchkit-sync``  ``@batchkit.batched`` on a plain sync function (batchkit runs it on
                     its worker thread), awaited with ``.acall``;
- ``ray-serve``      Ray Serve's ``@serve.batch`` on an async method (no cluster; see
                     ``_peers.py``);
- ``mxbai-aio``      mixedbread's ``batched.aio.dynamically`` on an async function;
- ``mxbai-sync``     mixedbread's ``batched.dynamically`` on a sync function, ``.acall``;
- ``minimal``        the blog-post asyncio batcher (queue + collector task, ``_peers.py``);
- ``floor (ref)``    overhead only: the least Python work per request for an async batch
                     function with one batch in flight (``_peers.FloorBatcher``: no max
                     wait, no checks). Its requests/s is bounded by the per-batch
                     executor hop as much as by that work, so it lands near the
                     minimal batcher's; a sync function (no hop) can beat it;
- ``batchkit x2`` / ``ray-serve x2``  the same with ``max_concurrent_batches=2`` (efficiency
                     and latency only): the next batch waits at the device while one runs.

Every async batch function sends the emulated accelerator call through
``loop.run_in_executor``; the sync ones call it directly. Scenarios:

1. overhead: identity accelerator, 256 concurrent callers in a closed loop (each awaits
   its result and calls again) for a fixed number of requests; requests/s;
2. efficiency: accelerator = ``time.sleep(a + b*B)``, a = 4 ms, b = 0.2 ms (releases the
   GIL; one batch at a time, like one device: a lock serialises the calls), the same
   saturating closed loop; throughput / ideal, ideal = 32 / (a + 32b). Steady state:
   each instance first serves two full batches untimed (thread start-up, first calls);
   (two reference rows: the accelerator called back to back on full batches through
   ``run_in_executor`` / directly, no batcher: what this machine's sleep and thread
   wake-ups allow, which bounds every system);
3. latency: open-loop Poisson arrivals at 50% of the ideal throughput; p50 and p99
   latency (from each request's scheduled arrival) in full-batch service times
   T = a + 32b;
4. threads: 64 caller threads, identity function, ``batchkit-sync`` vs ``mxbai-sync``
   called directly (blocking); requests/s.

Each repeat runs every system once (order rotated per repeat); the numbers reported are
medians over repeats (the ``_timing.py`` approach) and the ratios come from one run.

Usage::

    python benchmarks/online.py            # ~2 min on 2 cores
    python benchmarks/online.py --quick    # ~40 s, noisier
    python benchmarks/online.py --only overhead,threads
    python benchmarks/online.py --systems batchkit,minimal --json samples.json
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
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import chosen_systems  # noqa: E402
from _load import issue  # noqa: E402
from _peers import (  # noqa: E402
    FloorBatcher,
    MinimalBatcher,
    MxbaiAsync,
    MxbaiSync,
    RayServeBatcher,
)
from _report import check, med, percentile, rotated  # noqa: E402

import batchkit  # noqa: E402

MAX_BATCH = 32
MAX_WAIT_S = 0.005
A, B = 0.004, 0.0002  # emulated accelerator: a + b * batch_size seconds
FULL_T = A + B * MAX_BATCH  # one full batch
IDEAL = MAX_BATCH / FULL_T  # requests/s with every batch full and no gap
CALLERS = 256
THREADS = 64

SYSTEMS = ("batchkit", "batchkit-sync", "ray-serve", "mxbai-aio", "mxbai-sync", "minimal")
# Two batches in flight: only for the scenarios with a device to keep busy.
PIPELINED = ("batchkit x2", "ray-serve x2")

# --------------------------------------------------------------------------- accelerators


def identity(xs: list[Any]) -> list[Any]:
    return xs


_DEVICE = threading.Lock()  # one accelerator: a second batch waits for the first


def emulated(xs: list[Any]) -> list[Any]:
    with _DEVICE:
        time.sleep(A + B * len(xs))
    return xs


def async_on_executor(accel: Callable[[list[Any]], list[Any]]):
    async def fn(xs: list[Any]) -> list[Any]:
        return await asyncio.get_running_loop().run_in_executor(None, accel, xs)

    return fn


# --------------------------------------------------------------------------- adapters


class _Batchkit:
    def __init__(
        self, accel: Callable[[list[Any]], list[Any]], *, sync: bool, in_flight: int = 1
    ) -> None:
        fn = accel if sync else async_on_executor(accel)
        self.f = batchkit.batched(
            max_batch_size=MAX_BATCH,
            max_wait_ms=MAX_WAIT_S * 1000,
            max_concurrent_batches=in_flight,
        )(fn)
        self.call = self.f.acall
        self.sync_call = self.f

    async def close(self) -> None:
        await self.f.aclose()

    def close_sync(self) -> None:
        self.f.close()


def make_system(name: str, accel: Callable[[list[Any]], list[Any]]) -> Any:
    """A fresh instance of system ``name`` (inside the running loop)."""
    if name == "batchkit":
        return _Batchkit(accel, sync=False)
    if name == "batchkit-sync":
        return _Batchkit(accel, sync=True)
    if name == "batchkit x2":
        return _Batchkit(accel, sync=False, in_flight=2)
    if name in ("ray-serve", "ray-serve x2"):
        in_flight = 2 if name.endswith("x2") else 1
        return RayServeBatcher(async_on_executor(accel), MAX_BATCH, MAX_WAIT_S, in_flight)
    if name == "mxbai-aio":
        return MxbaiAsync(async_on_executor(accel), MAX_BATCH, MAX_WAIT_S)
    if name == "mxbai-sync":
        return MxbaiSync(accel, MAX_BATCH, MAX_WAIT_S)
    if name == "minimal":
        sys_ = MinimalBatcher(async_on_executor(accel), MAX_BATCH, MAX_WAIT_S)
        sys_.call = sys_
        return sys_
    if name == "floor (ref)":
        floor = FloorBatcher(async_on_executor(accel), MAX_BATCH)
        floor.call = floor
        return floor
    raise ValueError(name)


# --------------------------------------------------------------------------- workloads


async def closed_loop(call: Callable[[Any], Awaitable[Any]], total: int, callers: int) -> float:
    """Seconds for ``callers`` tasks to complete ``total`` requests, each checked."""
    counter = itertools.count()

    async def caller() -> None:
        while (i := next(counter)) < total:
            if await call(i) != i:
                raise AssertionError("wrong result")

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return time.perf_counter() - t0


LATENESS: list[float] = []  # p99 of how late the generator issued requests, per sample


async def open_loop(call: Callable[[Any], Awaitable[Any]], gaps: list[float]) -> list[float]:
    """Latencies (s) of requests issued at the given Poisson gaps, from scheduled time
    (the generator's own p99 lateness in issuing them goes to LATENESS)."""
    loop = asyncio.get_running_loop()
    lat = [0.0] * len(gaps)
    late = [0.0] * len(gaps)

    async def one(i: int, scheduled: float) -> None:
        late[i] = loop.time() - scheduled
        if await call(i) != i:
            raise AssertionError("wrong result")
        lat[i] = loop.time() - scheduled

    tasks = await issue(list(itertools.accumulate(gaps)), one, loop.time() + 0.005)
    while tasks:
        await asyncio.gather(*list(tasks))
    LATENESS.append(percentile(late, 0.99))
    return lat


def threads_closed_loop(call: Callable[[Any], Any], total: int, threads: int) -> float:
    counter = itertools.count()
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def caller() -> None:
        barrier.wait()
        try:
            while (i := next(counter)) < total:
                if call(i) != i:
                    raise AssertionError("wrong result")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=caller, daemon=True) for _ in range(threads)]
    for th in ts:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in ts:
        th.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed


# --------------------------------------------------------------------------- rounds


async def run_async(args: argparse.Namespace, only: set[str]) -> dict[str, dict[str, list[float]]]:
    """Interleaved repeats of the asyncio scenarios; per scenario, per system, samples."""
    systems, pipelined = args.systems, args.pipelined
    res: dict[str, dict[str, list[float]]] = {
        k: {s: [] for s in (*systems, *pipelined)} for k in ("overhead", "efficiency", "p50", "p99")
    }
    res["efficiency"]["direct (ref)"] = []
    res["efficiency"]["direct-sync (ref)"] = []
    res["overhead"]["floor (ref)"] = []
    rng = random.Random(1234)
    rate = 0.5 * IDEAL
    with_device = (*systems, *pipelined)

    async def sample(name: str, accel, body, warm: int = 0):
        system = make_system(name, accel)
        try:
            if warm:  # untimed: reach the steady state first
                await closed_loop(system.call, warm, CALLERS)
            return await body(system.call)
        finally:
            await system.close()

    # warm-up: one small run of every system (imports, thread pools, first-call paths)
    for name in (*with_device, "floor (ref)"):
        await sample(name, identity, lambda c: closed_loop(c, 2 * CALLERS, CALLERS))
        if name != "floor (ref)":
            await sample(name, emulated, lambda c: closed_loop(c, 2 * MAX_BATCH, CALLERS))

    for r in range(args.repeats):
        gc.collect()
        if "overhead" in only:
            for name in rotated((*systems, "floor (ref)"), r):
                dt = await sample(
                    name, identity, lambda c: closed_loop(c, args.n_overhead, CALLERS)
                )
                res["overhead"][name].append(args.n_overhead / dt)
        if "efficiency" in only:
            for name in rotated(with_device, r):
                dt = await sample(
                    name, emulated, lambda c: closed_loop(c, args.n_eff, CALLERS), 2 * MAX_BATCH
                )
                res["efficiency"][name].append(args.n_eff / dt / IDEAL)
            # reference: the accelerator called back to back on full batches, no batcher
            loop = asyncio.get_running_loop()
            t0 = time.perf_counter()
            for _ in range(args.n_eff // MAX_BATCH):
                await loop.run_in_executor(None, emulated, list(range(MAX_BATCH)))
            dt = time.perf_counter() - t0
            res["efficiency"]["direct (ref)"].append(
                args.n_eff // MAX_BATCH * MAX_BATCH / dt / IDEAL
            )
            # and without the executor hop (the loop is blocked meanwhile; nothing else runs)
            t0 = time.perf_counter()
            for _ in range(args.n_eff // MAX_BATCH):
                emulated(list(range(MAX_BATCH)))
            dt = time.perf_counter() - t0
            res["efficiency"]["direct-sync (ref)"].append(
                args.n_eff // MAX_BATCH * MAX_BATCH / dt / IDEAL
            )
        if "latency" in only:
            gaps = [rng.expovariate(rate) for _ in range(args.n_lat)]
            for name in rotated(with_device, r):
                lat = await sample(name, emulated, lambda c, g=gaps: open_loop(c, g))
                res["p50"][name].append(percentile(lat, 0.50) / FULL_T)
                res["p99"][name].append(percentile(lat, 0.99) / FULL_T)
    return res


def run_threads(args: argparse.Namespace) -> dict[str, list[float]]:
    names = tuple(n for n in ("batchkit-sync", "mxbai-sync") if n in args.systems)
    out: dict[str, list[float]] = {n: [] for n in names}

    def make(name: str):
        if name == "batchkit-sync":
            return _Batchkit(identity, sync=True)
        return MxbaiSync(identity, MAX_BATCH, MAX_WAIT_S)

    for name in names:  # warm-up
        s = make(name)
        threads_closed_loop(s.sync_call, 4 * THREADS, THREADS)
        s.close_sync()
    for r in range(args.repeats):
        gc.collect()
        for name in rotated(names, r):
            s = make(name)
            try:
                dt = threads_closed_loop(s.sync_call, args.n_threads, THREADS)
            finally:
                s.close_sync()
            out[name].append(args.n_threads / dt)
    return out


# --------------------------------------------------------------------------- report


def spread(xs: list[float]) -> str:
    if len(xs) < 2:
        return ""
    q = statistics.quantiles(xs, n=4)
    return f"[{q[0]:.3g}-{q[2]:.3g}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer/smaller repeats (< 40 s)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--only", default="overhead,efficiency,latency,threads")
    p.add_argument(
        "--systems",
        default=",".join((*SYSTEMS, *PIPELINED)),
        help="comma-separated rows to run (the reference rows always run)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every sample to PATH")
    args = p.parse_args()
    only = set(args.only.split(","))
    chosen = chosen_systems(p, args.systems, (*SYSTEMS, *PIPELINED))
    args.systems = tuple(s for s in SYSTEMS if s in chosen)
    args.pipelined = tuple(s for s in PIPELINED if s in chosen)
    if args.quick:
        args.repeats = args.repeats or 3
        args.n_overhead, args.n_eff, args.n_lat, args.n_threads = 2560, 480, 500, 2560
    else:
        args.repeats = args.repeats or 7
        args.n_overhead, args.n_eff, args.n_lat, args.n_threads = 7680, 960, 1500, 6400

    t_start = time.perf_counter()
    print(
        f"# online batching: max_batch_size={MAX_BATCH}, max_wait={MAX_WAIT_S * 1e3:g} ms, "
        f"accelerator {A * 1e3:g} ms + {B * 1e3:g} ms/item (T = {FULL_T * 1e3:.1f} ms, "
        f"ideal {IDEAL:.0f} req/s); {args.repeats} interleaved repeats, medians [IQR]"
    )
    res = (
        asyncio.run(run_async(args, only)) if only & {"overhead", "efficiency", "latency"} else None
    )
    thr = run_threads(args) if "threads" in only else None

    if res is not None:
        print(
            f"\n{'system':<17} {'overhead req/s':>22} {'efficiency':>20} "
            f"{'p50 / T':>16} {'p99 / T':>16}"
        )
        for name in (
            *args.systems, *args.pipelined, "floor (ref)", "direct (ref)", "direct-sync (ref)"
        ):
            cells = []
            for key, fmt in (
                ("overhead", "{:>9.0f}"),
                ("efficiency", "{:>7.3f}"),
                ("p50", "{:>5.2f}"),
                ("p99", "{:>5.2f}"),
            ):
                xs = res[key].get(name, [])
                cells.append(f"{fmt.format(med(xs))} {spread(xs):>12}" if xs else "")
            print(f"{name:<17} {cells[0]:>22} {cells[1]:>20} {cells[2]:>16} {cells[3]:>16}")
    if thr is not None:
        print(f"\n{'threads (64)':<14} {'req/s':>22}")
        for name, xs in thr.items():
            print(f"{name:<14} {med(xs):>9.0f} {spread(xs):>12}")

    print()
    ok = True
    if args.json:
        Path(args.json).write_text(json.dumps({"async": res, "threads": thr}))
    if res is not None and "overhead" in only and {"minimal", "ray-serve"} <= set(args.systems):
        ov = {k: med(v) for k, v in res["overhead"].items()}
        for name in ("batchkit", "batchkit-sync"):
            ok &= check(
                f"overhead {name} >= minimal",
                ov[name] >= ov["minimal"],
                f"{ov[name]:.0f} vs {ov['minimal']:.0f} req/s ({ov[name] / ov['minimal']:.2f}x)",
            )
            ok &= check(
                f"overhead {name} >= 5x ray-serve",
                ov[name] >= 5 * ov["ray-serve"],
                f"{ov[name] / ov['ray-serve']:.2f}x (the minimal batcher, a queue and one "
                f"task, reaches {ov['minimal'] / ov['ray-serve']:.2f}x in this run; the "
                f"floor, {ov['floor (ref)'] / ov['ray-serve']:.2f}x)",
            )
    if res is not None and "efficiency" in only and {"batchkit", "batchkit-sync"} <= set(
        args.systems
    ):
        for name, ref in (("batchkit", "direct (ref)"), ("batchkit-sync", "direct-sync (ref)")):
            e, r = med(res["efficiency"][name]), med(res["efficiency"][ref])
            ok &= check(
                f"efficiency {name} >= 0.97",
                e >= 0.97,
                f"{e:.3f} of ideal; {e / r:.3f} of what back-to-back calls reach on "
                f"this machine ({ref}: {r:.3f})",
            )
    if res is not None and "efficiency" in only and "batchkit x2" in args.pipelined:
        # Not a target: what a second batch in flight buys (and, in the p50/p99
        # columns, costs) when the function hands the work to one device.
        e = med(res["efficiency"]["batchkit x2"])
        line = f"info  efficiency batchkit x2 (max_concurrent_batches=2): {e:.3f} of ideal"
        if res["p50"]["batchkit x2"]:
            line += (
                f" ({'>=' if e >= 0.97 else '<'} 0.97); p50 "
                f"{med(res['p50']['batchkit x2']):.2f} T against "
                f"{med(res['p50']['batchkit']):.2f} T with one batch in flight"
            )
        print(line)
    if res is not None and "latency" in only:
        q = statistics.quantiles(LATENESS, n=4) if len(LATENESS) > 1 else LATENESS * 3
        print(
            f"note  the arrival generator itself issued requests late by "
            f"{med(LATENESS) * 1e3:.2f} ms at p99 ({med(LATENESS) / FULL_T:.2f} T; IQR over "
            f"samples {q[0] * 1e3:.2f}-{q[-1] * 1e3:.2f} ms): counted in every p99 above"
        )
        for name in ("batchkit", "batchkit-sync"):
            if name not in args.systems:
                continue
            q = med(res["p99"][name])
            ok &= check(f"p99 {name} <= 1.5 T", q <= 1.5, f"{q:.2f} T = {q * FULL_T * 1e3:.1f} ms")
    if thr is not None and len(thr) == 2:
        a, b = med(thr["batchkit-sync"]), med(thr["mxbai-sync"])
        ok &= check(
            "threads batchkit-sync >= 2x mxbai-sync",
            a >= 2 * b,
            f"{a:.0f} vs {b:.0f} req/s ({a / b:.2f}x)",
        )
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
