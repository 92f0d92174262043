"""Where the device waits between two batches: the gap `online.py`'s efficiency row loses.

With every caller's request waiting (256 callers in a closed loop, batches of 32),
a batched function's device is idle only between one call's end and the next call's
start. This script records both ends of every emulated device call (`online.py`'s:
4 ms + 0.2 ms per item, one call at a time) and prints, per system, the median idle
gap and its parts:

- ``return hop``: the device call ends -> the batch function's coroutine resumes
  (the executor thread's answer reaching the event loop; the machine's);
- ``between calls``: that coroutine resumes -> the next call is handed to the
  executor (the batcher's own work per batch: settle the batch, form the next);
- ``start hop``: handed over -> the device call starts (the executor thread waking).

The reference rows call the device back to back on full batches with no batcher:
through `run_in_executor` (``direct (ref)``, the same hops, nothing between them)
and directly (``direct-sync (ref)``, no hop). ``busy`` is the device's share of
the time, call / (call + gap); the last column is that share against the reference
with the same hops: what `online.py`'s efficiency row divides by.

Usage::

    python benchmarks/batch_gap.py             # ~10 s
    python benchmarks/batch_gap.py --batches 1000 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online import CALLERS, MAX_BATCH, MAX_WAIT_S, A, B, closed_loop  # noqa: E402

import batchkit  # noqa: E402


class Recorder:
    """The emulated device, recording each call's start and end, and the async
    batch function's hand-over and resumption around it."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []  # (start, end) of each device call
        self.handed: list[float] = []  # the async function hands the call over
        self.resumed: list[float] = []  # ... and resumes with its result

    def clear(self) -> None:
        """Forget what was recorded (the untimed warm-up)."""
        for times in (self.calls, self.handed, self.resumed):
            times.clear()

    def device(self, xs: list[Any]) -> list[Any]:
        start = time.perf_counter()
        time.sleep(A + B * len(xs))
        self.calls.append((start, time.perf_counter()))
        return xs

    async def on_executor(self, xs: list[Any]) -> list[Any]:
        self.handed.append(time.perf_counter())
        out = await asyncio.get_running_loop().run_in_executor(None, self.device, xs)
        self.resumed.append(time.perf_counter())
        return out

    def row(self) -> dict[str, float]:
        """Median gap and parts (seconds); the device's busy share."""
        calls = self.calls[1:]  # (each gap ends at a call's start)
        gaps = [b[0] - a[1] for a, b in zip(self.calls, calls)]
        busy = [(end - start) for start, end in calls]
        row = {"gap": statistics.median(gaps), "busy": sum(busy) / (sum(busy) + sum(gaps))}
        if self.handed:
            n = min(len(self.resumed), len(self.calls)) - 1
            row["return hop"] = statistics.median(
                self.resumed[i] - self.calls[i][1] for i in range(n)
            )
            row["between calls"] = statistics.median(
                self.handed[i + 1] - self.resumed[i] for i in range(n)
            )
            row["start hop"] = statistics.median(
                self.calls[i + 1][0] - self.handed[i + 1] for i in range(n)
            )
        return row


async def batched_row(sync: bool, batches: int) -> dict[str, float]:
    rec = Recorder()
    fn: Callable[[list[Any]], Any] = rec.device if sync else rec.on_executor
    f = batchkit.batched(max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_S * 1000)(fn)
    await closed_loop(f.acall, 2 * MAX_BATCH, CALLERS)  # thread start-up, first calls
    rec.clear()
    await closed_loop(f.acall, batches * MAX_BATCH, CALLERS)
    await f.aclose()
    return rec.row()


async def direct_row(hop: bool, batches: int) -> dict[str, float]:
    rec = Recorder()
    items = list(range(MAX_BATCH))
    for _ in range(batches):
        if hop:
            await rec.on_executor(items)
        else:
            rec.device(items)
    return rec.row()


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=300, help="timed batches per sample")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    makers = {
        "batchkit": lambda: batched_row(False, args.batches),
        "direct (ref)": lambda: direct_row(True, args.batches),
        "batchkit-sync": lambda: batched_row(True, args.batches),
        "direct-sync (ref)": lambda: direct_row(False, args.batches),
    }
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in makers}
    for _ in range(args.repeats):  # interleaved: the machine's drift hits all alike
        for name, make in makers.items():
            samples[name].append(await make())
    print(
        f"# device {A * 1e3:.0f} ms + {B * 1e3:.1f} ms/item, batches of {MAX_BATCH}, "
        f"{CALLERS} callers; medians of {args.repeats} samples of {args.batches} batches, us"
    )
    cols = ("gap", "return hop", "between calls", "start hop")
    print(f"{'system':<18}" + "".join(f"{c:>15}" for c in cols) + f"{'busy':>8}{'vs ref':>8}")
    medians = {
        name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        for name, rows in samples.items()
    }
    for name, median in medians.items():
        ref = "direct (ref)" if name == "batchkit" else "direct-sync (ref)"
        ratio = (
            "" if name == ref or "ref" in name else f"{median['busy'] / medians[ref]['busy']:8.3f}"
        )
        cells = "".join(f"{median[c] * 1e6:15.0f}" if c in median else f"{'':>15}" for c in cols)
        print(f"{name:<18}{cells}{median['busy']:8.3f}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
