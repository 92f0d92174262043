"""Machine instructions per request (valgrind): batchkit's asyncio path vs the minimal batcher.

Wall-clock rates on a shared VM move by 20% from run to run, and Python opcodes
(``opcodes.py``) miss the C-level work inside them (allocation, locks, calls). This
script counts every instruction the process executes, under ``valgrind --tool=callgrind``,
for the overhead scenario of ``online.py`` (identity function, 256 concurrent callers,
batches of 32), at two run lengths: the difference divided by the extra requests is
the cost of one request, with start-up and shutdown cancelled out. Runs are made
deterministic (fixed hash seed, one BLAS thread, a max wait long enough never to
fire; the sync function's batches are always full), so a change of a hundred
instructions is visible; with ``--executor`` the function goes through
``run_in_executor`` as in ``online.py``, and thread scheduling makes the count move by
a few hundred. ``--cache`` runs cachegrind instead, which
also simulates the caches and branch predictor: instruction-cache misses, which
instruction counts do not show, are a large part of what a request costs.

Usage (needs ``valgrind`` on the PATH; about a minute per system)::

    python benchmarks/instructions.py                 # batchkit, batchkit-sync, minimal
    python benchmarks/instructions.py --systems batchkit,floor   # floor: see _peers.py
    python benchmarks/instructions.py --executor
    python benchmarks/instructions.py --cache      # cachegrind: cache misses, mispredicts
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHORT, LONG = 2048, 12288
MAX_WAIT_S = 2.0  # batches leave full or when the function is idle, never by the timer
ENV = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


async def _serve(system: str, total: int, executor: bool) -> None:
    sys.path.insert(0, str(HERE))
    import online
    from _peers import FloorBatcher, MinimalBatcher

    import batchkit

    async def ident(xs: list[object]) -> list[object]:
        return xs

    fn = online.async_on_executor(online.identity) if executor else ident
    if system in ("minimal", "floor"):
        peer = (
            MinimalBatcher(fn, online.MAX_BATCH, MAX_WAIT_S)
            if system == "minimal"
            else FloorBatcher(fn, online.MAX_BATCH)
        )
        await online.closed_loop(peer, total, online.CALLERS)
        await peer.close()
        return
    if system == "batchkit-sync":
        # Every batch full (the worker thread would otherwise take whatever waits when
        # it is idle, and valgrind's thread switching makes those sizes vary run to run).
        f = batchkit.batched(batcher=batchkit.StaticBatcher(online.MAX_BATCH))(online.identity)
    else:
        f = batchkit.batched(max_batch_size=online.MAX_BATCH, max_wait_ms=MAX_WAIT_S * 1e3)(fn)
    await online.closed_loop(f.acall, total, online.CALLERS)
    await f.aclose()


# cachegrind's summary lines, with --cache-sim and --branch-sim
_CACHE_LINES = {
    "instructions": r"I\s+refs:\s+([\d,]+)",
    "I1 misses": r"I1\s+misses:\s+([\d,]+)",
    "D1 misses": r"D1\s+misses:\s+([\d,]+)",
    "mispredicts": r"Mispredicts:\s+([\d,]+)",
}


def _count(system: str, total: int, executor: bool, cache: bool) -> dict[str, int]:
    tool = "cachegrind" if cache else "callgrind"
    cmd = ["valgrind", f"--tool={tool}", f"--{tool}-out-file=/dev/null", sys.executable]
    if cache:
        cmd[2:2] = ["--cache-sim=yes", "--branch-sim=yes"]
    cmd += [__file__, "--child", system, str(total)] + (["--executor"] if executor else [])
    out = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True)
    patterns = _CACHE_LINES if cache else {"instructions": r"Collected : (\d+)"}
    found = {k: re.search(p, out.stderr) for k, p in patterns.items()}
    if out.returncode != 0 or not all(found.values()):
        raise RuntimeError(f"valgrind run failed for {system}:\n{out.stderr[-2000:]}")
    return {k: int(m.group(1).replace(",", "")) for k, m in found.items() if m}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--executor", action="store_true", help="the function uses run_in_executor")
    p.add_argument("--systems", default="batchkit,batchkit-sync,minimal")
    p.add_argument(
        "--cache", action="store_true", help="cachegrind: also I1/D1 misses, mispredicts"
    )
    p.add_argument("--child", nargs=2, metavar=("SYSTEM", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        asyncio.run(_serve(args.child[0], int(args.child[1]), args.executor))
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing to count")
        return 1
    per_request: dict[str, dict[str, float]] = {}
    for system in args.systems.split(","):
        short = _count(system, SHORT, args.executor, args.cache)
        long = _count(system, LONG, args.executor, args.cache)
        per_request[system] = {k: (long[k] - short[k]) / (LONG - SHORT) for k in long}
        counts = ", ".join(f"{v:.0f} {k}" for k, v in per_request[system].items())
        print(f"{system:14s} per request: {counts}")
    for peer in ("minimal", "floor"):
        if "batchkit" in per_request and peer in per_request:
            for k, v in per_request["batchkit"].items():
                print(f"batchkit / {peer}, {k}: {v / per_request[peer][k]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
