"""Recovering from a model that hangs: ``batch_timeout`` gives the stuck batch up.

The emulated model hangs on one poisoned input (as a deadlocked kernel or a remote
call without a timeout would). Without a bound, every later caller would wait behind
it forever. With ``batch_timeout=0.3``, the hung batch's callers get ``BatchTimeout``
after 0.3 s, a replacement worker serves everyone else, and ``stats()`` shows the stuck
thread until the hung call finally returns.

Run:  python examples/watchdog_recovery.py
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import batchkit

unstick = threading.Event()


@batchkit.batched(max_batch_size=8, max_wait_ms=2, batch_timeout=0.3)
def classify(texts: list[str]) -> list[str]:
    if "poison" in texts:
        unstick.wait(30)  # hangs until released
    return ["long" if len(t) > 4 else "short" for t in texts]


def main() -> None:
    started = time.monotonic()
    try:
        classify("poison")
    except batchkit.BatchTimeout as exc:
        print(f"after {time.monotonic() - started:.2f} s: {type(exc).__name__}: {exc}")
    texts = [f"text{i}" * (i % 3) for i in range(64)]
    with ThreadPoolExecutor(16) as pool:
        labels = list(pool.map(classify, texts))
    assert labels == ["long" if len(t) > 4 else "short" for t in texts]
    stats = classify.stats()
    print(
        f"{len(texts)} later requests served; batch_timeouts={stats.batch_timeouts}, "
        f"abandoned_workers={stats.abandoned_workers}, healthy={stats.healthy}"
    )
    assert stats.batch_timeouts == 1 and stats.abandoned_workers == 1 and stats.healthy
    unstick.set()  # the hung call returns at last: its thread rejoins or exits
    deadline = time.monotonic() + 5
    while classify.stats().abandoned_workers and time.monotonic() < deadline:
        time.sleep(0.01)
    print(f"after the hung call returned: abandoned_workers={classify.stats().abandoned_workers}")
    classify.close()


if __name__ == "__main__":
    main()
