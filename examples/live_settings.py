"""Changing a batched function's settings while it serves.

Sixteen threads call an emulated accelerator (a lock and a sleep per batch) in a closed
loop while an operator thread turns the knobs: first a small max batch size, then a
larger one and a second batch in flight. Throughput follows the settings, and every
caller gets exactly its own result throughout (nothing lost or run twice).

Run:  python examples/live_settings.py
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import batchkit

DEVICE = threading.Lock()


@batchkit.batched(max_batch_size=2, max_wait_ms=2)
def double(xs: list[int]) -> list[int]:
    with DEVICE:  # one accelerator: batches run one at a time on it
        time.sleep(0.002 + 0.0001 * len(xs))
    return [2 * x for x in xs]


def served_per_second(seconds: float) -> float:
    """Run the closed loop for ``seconds``; requests per second, results checked."""
    stop = time.monotonic() + seconds
    done = [0] * 16

    def caller(k: int) -> None:
        i = 0
        while time.monotonic() < stop:
            assert double(k * 1_000_000 + i) == 2 * (k * 1_000_000 + i)
            i += 1
        done[k] = i

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(caller, range(16)))
    return sum(done) / seconds


def main() -> None:
    phases = [
        {"max_batch_size": 2},
        {"max_batch_size": 16},
        {"max_batch_size": 16, "max_concurrent_batches": 2},
    ]
    for change in phases:
        settings = double.configure(**change)
        rate = served_per_second(0.5)
        print(
            f"max_batch_size={settings.max_batch_size:>2} "
            f"max_concurrent_batches={settings.max_concurrent_batches}: {rate:7.0f} req/s, "
            f"mean batch so far {double.stats().mean_batch_size:.1f}"
        )
    stats = double.stats()
    assert stats.requests == stats.items_run and stats.failed == 0
    double.close()


if __name__ == "__main__":
    main()
