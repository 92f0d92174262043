"""Compare two git revisions of batchkit's per-request overhead inside one process.

`compare.py` runs each revision in its own processes; on a shared VM two processes
running the same code differ by 10-30%, more than the differences that matter here.
This script loads both revisions into one Python process instead: each revision's
`batchkit/` is copied under another package name (`batchkit_a`, `batchkit_b`, its
own imports rewritten to match), one instance of each serves the overhead scenarios
of `online.py`, and rounds of the two alternate (A B B A ...), so the machine's
drift hits both alike. Per scenario it prints the median ratio of B's rate to A's
over the pairs of rounds, with their quartiles; `--control` runs B against B, which
gives the method's own noise.

Scenarios (identity function, batches of 32, max wait 5 ms):

- ``overhead async``: an `async def` function calling `run_in_executor`, 256 asyncio
  callers (the overhead row of `online.py`);
- ``overhead sync``: a plain sync function, the same callers with `acall`;
- ``awaited directly``: an `async def` function returning at once (no executor hop:
  the per-request work alone);
- ``threads``: a sync function, 64 caller threads blocking on it.

With ``--load``, the scenarios are a realistic load instead: a model that takes
1 ms + 0.1 ms per item a batch (``time.sleep``, behind one lock like one device;
batches of 32, max wait 5 ms), open-loop Poisson arrivals at 0.5x and 1x of the
capacity C (the model called back to back on full batches, measured at the start),
each pair of rounds on the same arrivals:

- ``load async``: an `async def` function sending the model call through
  `run_in_executor`, asyncio callers (`acall`);
- ``load sync``: the model as a sync function, asyncio callers (`acall`);
- ``load threads``: the sync function, 256 blocking caller threads (`f(x)`).

Per scenario and load it prints each revision's throughput and goodput (answers
within ``--budget-ms`` per second, both over C) and p50/p99 latency (from each
request's scheduled arrival, the load generator's own lateness included), medians
over the rounds, then B against A per pair: throughput and goodput B/A, and latency
A/B (above 1: B answers sooner), median [quartiles].

Usage::

    python benchmarks/compare_inprocess.py d992d8e HEAD            # ~2 min on 2 cores
    python benchmarks/compare_inprocess.py HEAD~1 HEAD --pairs 200
    python benchmarks/compare_inprocess.py HEAD HEAD --control      # the noise floor
    python benchmarks/compare_inprocess.py main HEAD --load --pairs 8   # ~6 min
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import online  # noqa: E402
from _load import issue_from_threads, poisson_arrivals  # noqa: E402
from _report import med, percentile  # noqa: E402
from compare import TOLERANCE, checkout, remove  # noqa: E402

ROUND = 7680  # requests per timed round, as online.py's overhead row
THREAD_ROUND = 2560
_IMPORT = re.compile(r"^(\s*)(from|import) batchkit\b", re.MULTILINE)
OVERHEAD_SCENARIOS = "overhead async,overhead sync,awaited directly,threads"
LOAD_SCENARIOS = "load async,load sync,load threads"
LOADS = (0.5, 1.0)  # offered load, in multiples of the capacity C
MODEL_A, MODEL_B = 0.001, 0.0001  # the model: MODEL_A + MODEL_B * batch size seconds
LOAD_THREADS = 256


def load_as(tree: Path, name: str, into: Path) -> ModuleType:
    """The `batchkit` package of `tree`, imported as `name` (its imports rewritten)."""
    target = into / name
    shutil.copytree(tree / "batchkit", target, ignore=shutil.ignore_patterns("__pycache__"))
    for path in target.rglob("*.py"):
        path.write_text(_IMPORT.sub(rf"\1\2 {name}", path.read_text()))
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    return importlib.import_module(name)


async def _identity(xs: list[Any]) -> list[Any]:
    return xs


def _batch_function(scenario: str) -> Callable[[list[Any]], Any]:
    if scenario == "overhead async":
        return online.async_on_executor(online.identity)
    if scenario == "awaited directly":
        return _identity
    return online.identity


async def _round(f: Any, scenario: str) -> float:
    if scenario == "threads":
        return await asyncio.to_thread(online.threads_closed_loop, f, THREAD_ROUND, online.THREADS)
    return await online.closed_loop(f.acall, ROUND, online.CALLERS)


async def pairs(packages: dict[str, ModuleType], scenario: str, count: int) -> list[float]:
    """B's rate over A's, one ratio per pair of rounds."""
    fs = {
        key: pkg.batched(max_batch_size=online.MAX_BATCH, max_wait_ms=online.MAX_WAIT_S * 1e3)(
            _batch_function(scenario)
        )
        for key, pkg in packages.items()
    }
    for f in fs.values():  # warm-up: each instance's first calls, threads, loop binding
        for _ in range(2):
            await _round(f, scenario)
    ratios = []
    for i in range(count):
        seconds = {}
        for key in ("a", "b") if i % 2 == 0 else ("b", "a"):
            gc.collect()
            seconds[key] = await _round(fs[key], scenario)
        ratios.append(seconds["a"] / seconds["b"])
    for f in fs.values():
        await f.aclose() if scenario in ("overhead async", "awaited directly") else f.close()
    return ratios


# -- the realistic load (--load) -----------------------------------------------------
_DEVICE = threading.Lock()  # one device: a second batch waits for the first


def model(xs: list[Any]) -> list[Any]:
    """The model: `MODEL_A + MODEL_B * len(xs)` seconds on the one device."""
    with _DEVICE:
        time.sleep(MODEL_A + MODEL_B * len(xs))
    return xs


def capacity(batches: int = 200) -> float:
    """Requests per second of the model called back to back on full batches (C)."""
    full = list(range(online.MAX_BATCH))
    started = time.perf_counter()
    for _ in range(batches):
        model(full)
    return batches * online.MAX_BATCH / (time.perf_counter() - started)


@dataclass
class LoadRound:
    """One round of open-loop load on one revision."""

    throughput: float  # answers per second until the last answer, over C
    goodput: float  # the same for answers within the budget
    p50: float  # latency, seconds, from the scheduled arrival
    p99: float


def summary(latencies: list[float], arrivals: list[float], c: float, budget: float) -> LoadRound:
    """A round's figures from its requests' latencies and arrival times (seconds from
    the round's start), the capacity `c` (requests/s) and the goodput `budget` (s)."""
    last_answer = max(at + lat for at, lat in zip(arrivals, latencies))
    in_time = sum(1 for lat in latencies if lat <= budget)
    return LoadRound(
        throughput=len(latencies) / last_answer / c,
        goodput=in_time / last_answer / c,
        p50=percentile(latencies, 0.50),
        p99=percentile(latencies, 0.99),
    )


def _threads_open_loop(f: Any, arrivals: list[float]) -> list[float]:
    latencies = [0.0] * len(arrivals)

    def one(i: int, scheduled: float) -> None:
        if f(i) != i:
            raise AssertionError("wrong result")
        latencies[i] = time.perf_counter() - scheduled

    issue_from_threads(arrivals, one, LOAD_THREADS)
    return latencies


async def _load_round(f: Any, scenario: str, arrivals: list[float]) -> list[float]:
    if scenario == "load threads":
        return await asyncio.to_thread(_threads_open_loop, f, arrivals)
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals)]
    return await online.open_loop(f.acall, gaps)


async def load_pairs(
    packages: dict[str, ModuleType], scenario: str, load: float, args: argparse.Namespace
) -> dict[str, list[LoadRound]]:
    """Rounds of open-loop load, A and B alternating (A B B A ...), each pair on the
    same arrivals; per revision, its rounds."""
    fn = online.async_on_executor(model) if scenario == "load async" else model
    fs = {
        key: pkg.batched(max_batch_size=online.MAX_BATCH, max_wait_ms=online.MAX_WAIT_S * 1e3)(fn)
        for key, pkg in packages.items()
    }
    rate = load * args.capacity
    rng = random.Random(f"{scenario} {load}")
    warm = poisson_arrivals(rng, rate, 0.0, 0.3)
    for f in fs.values():  # warm-up: each instance's threads, loop binding, first calls
        await _load_round(f, scenario, warm)
    rounds: dict[str, list[LoadRound]] = {"a": [], "b": []}
    for i in range(args.pairs):
        arrivals = poisson_arrivals(rng, rate, 0.0, args.seconds)
        for key in ("a", "b") if i % 2 == 0 else ("b", "a"):
            gc.collect()
            latencies = await _load_round(fs[key], scenario, arrivals)
            rounds[key].append(summary(latencies, arrivals, args.capacity, args.budget))
    for f in fs.values():
        await f.aclose()
    return rounds


def _ratios(rounds: dict[str, list[LoadRound]], field: str, b_over_a: bool) -> str:
    pairs = zip(rounds["a"], rounds["b"])
    ratios = [
        getattr(b, field) / getattr(a, field) if b_over_a else getattr(a, field) / getattr(b, field)
        for a, b in pairs
    ]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"{statistics.median(ratios):.3f} [{q[0]:.3f}-{q[2]:.3f}]"


def report_load(scenario: str, load: float, rounds: dict[str, list[LoadRound]]) -> bool:
    """Print one scenario's rows; True when B's goodput is within TOLERANCE of A's."""
    for key in ("a", "b"):
        rs = rounds[key]
        print(
            f"      {scenario:12s} {load:g}x {key.upper()}: throughput "
            f"{med([r.throughput for r in rs]):.3f}  goodput {med([r.goodput for r in rs]):.3f}"
            f"  p50 {med([r.p50 for r in rs]) * 1e3:6.2f} ms  "
            f"p99 {med([r.p99 for r in rs]) * 1e3:6.2f} ms"
        )
    goodput = statistics.median(b.goodput / a.goodput for a, b in zip(rounds["a"], rounds["b"]))
    passed = goodput >= 1 - TOLERANCE
    print(
        f"{'PASS' if passed else 'MISS'}  {scenario:12s} {load:g}x  throughput B/A "
        f"{_ratios(rounds, 'throughput', True)}  goodput B/A {_ratios(rounds, 'goodput', True)}"
        f"  p50 A/B {_ratios(rounds, 'p50', False)}  p99 A/B {_ratios(rounds, 'p99', False)}"
    )
    return passed


def compare_overhead(
    packages: dict[str, ModuleType], rev_a: str, args: argparse.Namespace
) -> bool:
    """The overhead scenarios; True when B's rate is within TOLERANCE of A's in each."""
    print(
        f"# {rev_a} (A) against {args.rev_b} (B), one process, {args.pairs} pairs "
        "of interleaved rounds per scenario: B's rate / A's, median [quartiles]"
    )
    ok = True
    for scenario in args.only.split(","):
        ratios = asyncio.run(pairs(packages, scenario, args.pairs))
        median = statistics.median(ratios)
        q = statistics.quantiles(ratios, n=4)
        passed = median >= 1 - TOLERANCE
        ok &= passed
        verdict = "PASS" if passed else "MISS"
        print(f"{verdict}  {scenario:17s} {median:.3f} [{q[0]:.3f}-{q[2]:.3f}]")
    return ok


def compare_load(packages: dict[str, ModuleType], rev_a: str, args: argparse.Namespace) -> bool:
    """The realistic load scenarios (--load); True when B's goodput is within
    TOLERANCE of A's in each scenario and load."""
    args.capacity = capacity()
    print(
        f"# {rev_a} (A) against {args.rev_b} (B), one process, {args.pairs} pairs of "
        f"interleaved rounds of {args.seconds:g} s per scenario and load; model "
        f"{MODEL_A * 1e3:g} ms + {MODEL_B * 1e3:g} ms/item, C = {args.capacity:.0f} req/s; "
        f"throughput and goodput (within {args.budget_ms:g} ms) over C, medians over rounds"
    )
    ok = True
    for scenario in args.only.split(","):
        for load in LOADS:
            rounds = asyncio.run(load_pairs(packages, scenario, load, args))
            ok &= report_load(scenario, load, rounds)
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev_a", help="the baseline revision (e.g. main)")
    p.add_argument("rev_b", help="the candidate revision (e.g. HEAD)")
    p.add_argument("--pairs", type=int, help="pairs of rounds per scenario (60; 8 with --load)")
    p.add_argument("--only", help="comma-separated scenarios (default: every one of the mode)")
    p.add_argument("--control", action="store_true", help="B against B: the noise floor")
    p.add_argument("--load", action="store_true", help="the realistic load scenarios")
    p.add_argument("--seconds", type=float, default=1.5, help="--load: arrivals per round")
    p.add_argument(
        "--budget-ms", type=float, default=50.0, help="--load: an answer in time for goodput"
    )
    args = p.parse_args()
    args.pairs = args.pairs or (8 if args.load else 60)
    args.only = args.only or (LOAD_SCENARIOS if args.load else OVERHEAD_SCENARIOS)
    args.budget = args.budget_ms / 1e3
    rev_a = args.rev_b if args.control else args.rev_a
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="batchkit-inprocess-") as tmp:
        trees = {rev: checkout(rev, Path(tmp)) for rev in {rev_a, args.rev_b}}
        try:
            packages = {
                "a": load_as(trees[rev_a], "batchkit_a", Path(tmp) / "pkgs"),
                "b": load_as(trees[args.rev_b], "batchkit_b", Path(tmp) / "pkgs"),
            }
            ok = (compare_load if args.load else compare_overhead)(packages, rev_a, args)
        finally:
            remove(trees.values())
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
