"""Python opcodes executed per request: batchkit's asyncio path vs the minimal batcher.

Wall-clock overhead on a shared 2-vCPU VM moves by 10-20% from run to run; the number
of Python opcodes a request costs does not. This script traces them (``sys.settrace``
with ``f_trace_opcodes``) for the overhead scenario of ``online.py`` (identity
function, 256 concurrent callers, batches of 32) and prints, per system, the opcodes
per request and the functions they are spent in. Opcodes are not all equally
expensive (C calls inside them are not counted), so this is a guide to where Python
work goes, not a replacement for ``online.py``'s timings.

With ``--sync`` the batch function is a plain sync function (``batchkit-sync``), whose
worker thread is traced too; its batches are always full (a static batcher), since
tracing slows the two threads unevenly and would otherwise change how batches form.

Usage::

    python benchmarks/opcodes.py                 # identity function awaited directly
    python benchmarks/opcodes.py --executor      # through run_in_executor, as online.py
    python benchmarks/opcodes.py --sync          # a sync function on its worker thread
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import online  # noqa: E402
from _peers import FloorBatcher, MinimalBatcher  # noqa: E402

import batchkit  # noqa: E402

WARMUP, REQUESTS = 2048, 8192


async def identity(xs: list[Any]) -> list[Any]:
    return xs


async def count(name: str, executor: bool, sync: bool = False) -> collections.Counter[str]:
    fn = online.async_on_executor(online.identity) if executor else identity
    per_thread: dict[int, collections.Counter[str]] = {}
    counting = False

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode" and counting:  # one counter per thread: no lost updates
            counts = per_thread.setdefault(threading.get_ident(), collections.Counter())
            code = frame.f_code
            counts[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return tracer

    if sync:  # the worker thread starts on the first call: traced from its start
        threading.settrace(tracer)
        sys.settrace(tracer)
    if name == "batchkit" and sync:
        f = batchkit.batched(batcher=batchkit.StaticBatcher(32))(online.identity)
        call, close = f.acall, f.aclose
    elif name == "batchkit":
        f = batchkit.batched(max_batch_size=32, max_wait_ms=5)(fn)
        call, close = f.acall, f.aclose
    elif name == "minimal":
        m = MinimalBatcher(fn, 32, 0.005)
        call, close = m, m.close
    else:
        floor = FloorBatcher(fn, 32)
        call, close = floor, floor.close

    await online.closed_loop(call, WARMUP, online.CALLERS)
    sys.settrace(tracer)  # traces frames created from here on, in this thread
    counting = True
    try:
        await online.closed_loop(call, REQUESTS, online.CALLERS)
    finally:
        counting = False
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    await close()
    total: collections.Counter[str] = collections.Counter()
    for counts in per_thread.values():
        total.update(counts)
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--executor", action="store_true", help="call through run_in_executor")
    parser.add_argument("--sync", action="store_true", help="a sync function (batchkit only)")
    parser.add_argument("--top", type=int, default=12, help="functions listed per system")
    args = parser.parse_args()
    totals = {}
    for name in ("batchkit",) if args.sync else ("batchkit", "minimal", "floor"):
        counts = asyncio.run(count(name, args.executor, args.sync))
        totals[name] = sum(counts.values()) / REQUESTS
        print(f"{name}: {totals[name]:.1f} opcodes per request")
        for where, n in counts.most_common(args.top):
            print(f"  {n / REQUESTS:6.1f}  {where}")
    print()
    for peer in ("minimal", "floor") if not args.sync else ():
        print(f"batchkit / {peer}: {totals['batchkit'] / totals[peer]:.3f} (opcodes per request)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
