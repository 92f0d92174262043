"""Choose max_batch_size / max_wait_ms / max_concurrent_batches before deploying.

A model whose batch of n takes 4 ms + 0.5 ms x n, 1000 requests/s of Poisson
traffic, and a p99 target of 20 ms: every candidate setting is replayed through
batchkit's own scheduler in simulated time (about a second for all of them), and
the fastest setting that meets the target is printed. Same as
``batchkit simulate --rate 1000 --latency-ms 4 --per-item-ms 0.5 --max-batch-size 8,16,32 ...``.

    python examples/simulate_settings.py
"""

from __future__ import annotations

import itertools

from batchkit.tools.simulate import poisson_arrivals, simulate

P99_TARGET_MS = 20.0


def main() -> None:
    arrivals = poisson_arrivals(
        rate=1000, num_requests=10_000, seed=0
    )  # the same for every setting
    header = ("max_batch", "wait ms", "slots", "req/s", "p50 ms", "p99 ms", "batch")
    print("".join(f"{h:>{w}}" for h, w in zip(header, (9, 8, 6, 8, 8, 8, 7))))
    candidates = []
    for size, wait, slots in itertools.product((8, 16, 32), (0.0, 2.0, 5.0), (1, 2)):
        r = simulate(
            (4.0, 0.5),
            arrivals=arrivals,
            max_batch_size=size,
            max_wait_ms=wait,
            max_concurrent_batches=slots,
        )
        print(
            f"{size:>9}{wait:>8g}{slots:>6}{r.throughput:>8.0f}{r.latency.p50:>8.1f}"
            f"{r.latency.p99:>8.1f}{r.mean_batch_size:>7.1f}"
        )
        # Keeps up with the traffic (not overloaded) and meets the latency target.
        if r.offered_rate < r.capacity and r.latency.p99 <= P99_TARGET_MS:
            candidates.append((slots, r.latency.p99, size, wait, r))
    if not candidates:
        raise SystemExit(f"no setting meets p99 <= {P99_TARGET_MS} ms: a faster model is needed")
    # Fewest concurrent batches (least device memory), then the lowest p99.
    slots, p99, size, wait, r = min(candidates, key=lambda c: c[:2])
    print(
        f"choose max_batch_size={size}, max_wait_ms={wait:g}, max_concurrent_batches={slots}: "
        f"p99 {p99:.1f} ms, mean batch {r.mean_batch_size:.1f}, device busy {r.utilization:.0%}"
    )


if __name__ == "__main__":
    main()
