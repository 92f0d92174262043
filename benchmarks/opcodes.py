"""Python opcodes executed per request: batchkit's asyncio path vs the minimal batcher.

Wall-clock overhead on a shared 2-vCPU VM moves by 10-20% from run to run; the number
of Python opcodes a request costs does not. This script traces them (``sys.settrace``
with ``f_trace_opcodes``) for the overhead scenario of ``online.py`` (identity
function, 256 concurrent callers, batches of 32) and prints, per system, the opcodes
per request and the functions they are spent in. Opcodes are not all equally
expensive (C calls inside them are not counted), so this is a guide to where Python
work goes, not a replacement for ``online.py``'s timings.

Usage::

    python benchmarks/opcodes.py                 # identity function awaited directly
    python benchmarks/opcodes.py --executor      # through run_in_executor, as online.py
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
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


async def count(name: str, executor: bool) -> collections.Counter[str]:
    fn = online.async_on_executor(online.identity) if executor else identity
    if name == "batchkit":
        f = batchkit.batched(max_batch_size=32, max_wait_ms=5)(fn)
        call, close = f.acall, f.aclose
    elif name == "minimal":
        m = MinimalBatcher(fn, 32, 0.005)
        call, close = m, m.close
    else:
        floor = FloorBatcher(fn, 32)
        call, close = floor, floor.close
    counts: collections.Counter[str] = collections.Counter()

    def tracer(frame: FrameType, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
        return tracer

    await online.closed_loop(call, WARMUP, online.CALLERS)
    sys.settrace(tracer)  # traces frames created from here on, in this thread
    try:
        await online.closed_loop(call, REQUESTS, online.CALLERS)
    finally:
        sys.settrace(None)
    await close()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--executor", action="store_true", help="call through run_in_executor")
    parser.add_argument("--top", type=int, default=12, help="functions listed per system")
    args = parser.parse_args()
    totals = {}
    for name in ("batchkit", "minimal", "floor"):
        counts = asyncio.run(count(name, args.executor))
        totals[name] = sum(counts.values()) / REQUESTS
        print(f"{name}: {totals[name]:.1f} opcodes per request")
        for where, n in counts.most_common(args.top):
            print(f"  {n / REQUESTS:6.1f}  {where}")
    print()
    for peer in ("minimal", "floor"):
        print(f"batchkit / {peer}: {totals['batchkit'] / totals[peer]:.3f} (opcodes per request)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
