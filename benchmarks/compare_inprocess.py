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

Usage::

    python benchmarks/compare_inprocess.py d992d8e HEAD            # ~2 min on 2 cores
    python benchmarks/compare_inprocess.py HEAD~1 HEAD --pairs 200
    python benchmarks/compare_inprocess.py HEAD HEAD --control      # the noise floor
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import online  # noqa: E402
from compare import TOLERANCE, checkout, remove  # noqa: E402

ROUND = 7680  # requests per timed round, as online.py's overhead row
THREAD_ROUND = 2560
_IMPORT = re.compile(r"^(\s*)(from|import) batchkit\b", re.MULTILINE)


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev_a", help="the baseline revision (e.g. main)")
    p.add_argument("rev_b", help="the candidate revision (e.g. HEAD)")
    p.add_argument("--pairs", type=int, default=60, help="pairs of rounds per scenario")
    p.add_argument(
        "--only", default="overhead async,overhead sync,awaited directly,threads"
    )
    p.add_argument("--control", action="store_true", help="B against B: the noise floor")
    args = p.parse_args()
    rev_a = args.rev_b if args.control else args.rev_a
    started = time.perf_counter()
    ok = True
    with tempfile.TemporaryDirectory(prefix="batchkit-inprocess-") as tmp:
        trees = {rev: checkout(rev, Path(tmp)) for rev in {rev_a, args.rev_b}}
        try:
            packages = {
                "a": load_as(trees[rev_a], "batchkit_a", Path(tmp) / "pkgs"),
                "b": load_as(trees[args.rev_b], "batchkit_b", Path(tmp) / "pkgs"),
            }
            print(
                f"# {rev_a} (A) against {args.rev_b} (B), one process, {args.pairs} pairs "
                "of interleaved rounds per scenario: B's rate / A's, median [quartiles]"
            )
            for scenario in args.only.split(","):
                ratios = asyncio.run(pairs(packages, scenario, args.pairs))
                median = statistics.median(ratios)
                q = statistics.quantiles(ratios, n=4)
                passed = median >= 1 - TOLERANCE
                ok &= passed
                print(
                    f"{'PASS' if passed else 'MISS'}  {scenario:17s} {median:.3f} "
                    f"[{q[0]:.3f}-{q[2]:.3f}]"
                )
        finally:
            remove(trees.values())
    print(f"({time.perf_counter() - started:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
