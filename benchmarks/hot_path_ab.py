"""Interleaved wall-clock A/B, in one process, of the choices the serving hot path keeps.

A whole-process comparison (``compare.py``) cannot tell a 3% difference on a shared VM:
the same code measured in two processes moves by 10-30%. Here one process serves the
overhead scenario of ``online.py`` (identity function, 256 asyncio callers, batches of
32) and swaps one choice for its alternative between rounds of 8192 requests, A B B A
..., so that the machine's drift hits both alike; the ratio of each pair's times is
reported (median and quartiles; above 1: the kept choice is faster). The ``control``
swaps a choice for itself: its ratio is the method's own noise.

Choices:

- ``lock``: `ServingCore.submit` taking the lock by acquire/release, against `with`,
  for a sync function called with ``acall``;
- ``lane``: the arrival lane open to the loop's callers (admitted without the lock),
  against it shut (every asyncio caller makes its request and submits it under the
  lock, as under a bounded queue).

Usage::

    python benchmarks/hot_path_ab.py                 # every choice and the control
    python benchmarks/hot_path_ab.py --only lock --pairs 200
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import online  # noqa: E402

import batchkit  # noqa: E402
from batchkit.serve.core import ServingCore  # noqa: E402
from batchkit.serve.lane import ArrivalLane  # noqa: E402
from batchkit.serve.request import Request  # noqa: E402

ROUND = 8192  # requests per timed round (a multiple of the batch size)


def _submit_with(self: ServingCore, req: Request) -> None:
    """`ServingCore.submit` with the lock taken by `with` (the same body otherwise)."""
    with self.lock:
        if self.closed:
            raise batchkit.BatcherClosed(f"{self.name} is closed")
        if self.check_loop is not None:
            self.check_loop(req.loop)
        req.enqueued_at = self.clock()
        if self.bulk_arrivals and req.priority == 0:
            self.lane.arrivals.append(req)
        else:
            self.sched.add(req)  # (no bounded queue here: nothing is refused)
        self.wake()


_kept_submit = ServingCore.submit


def _install_lock(kept: bool) -> None:
    ServingCore.submit = _kept_submit if kept else _submit_with  # type: ignore[method-assign]


_lanes: list[ArrivalLane] = []  # the lane of the function under test


def _install_lane(kept: bool) -> None:
    # Shut, every asyncio caller takes the lock (make_request, submit) as a caller of a
    # bounded queue does; open again on the loop running the benchmark.
    for lane in _lanes:
        lane.loop = asyncio.get_running_loop() if kept else None


CHOICES: dict[str, tuple[Callable[[bool], None], bool]] = {
    # name: (install(kept), whether the batch function is sync)
    "lock": (_install_lock, True),
    "lane": (_install_lane, False),
    "control": (lambda kept: None, False),
}


async def pairs(choice: str, count: int) -> list[float]:
    install, sync = CHOICES[choice]

    async def identity(xs: list[Any]) -> list[Any]:
        return xs

    f = batchkit.batched(max_batch_size=online.MAX_BATCH, max_wait_ms=5)(
        online.identity if sync else identity
    )
    await online.closed_loop(f.acall, 4 * ROUND, online.CALLERS)  # warm-up
    _lanes[:] = [] if sync else [f._driver.lane]  # type: ignore[attr-defined]
    ratios = []
    for i in range(count):
        times = {}
        for kept in (True, False) if i % 2 == 0 else (False, True):
            install(kept)
            gc.collect()
            times[kept] = await online.closed_loop(f.acall, ROUND, online.CALLERS)
        install(True)
        ratios.append(times[False] / times[True])
    await f.aclose()
    return ratios


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(CHOICES), help="comma-separated choices")
    p.add_argument("--pairs", type=int, default=100, help="A/B pairs per choice")
    args = p.parse_args()
    for choice in args.only.split(","):
        ratios = asyncio.run(pairs(choice, args.pairs))
        q = statistics.quantiles(ratios, n=4)
        print(
            f"{choice:12s} alternative / kept, time per round: median "
            f"{statistics.median(ratios):.3f} [{q[0]:.3f}-{q[2]:.3f}] ({args.pairs} pairs)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
