"""Choose batcher settings before deploying: latency, goodput under a target, policies.

1. A model whose batch of n takes 4 ms + 0.5 ms x n, 1000 requests/s of Poisson
   traffic, and a p99 target of 20 ms: every candidate max_batch_size / max_wait_ms /
   max_concurrent_batches is replayed through batchkit's own scheduler in simulated
   time, and the fastest setting that meets the target is printed. Same as
   ``batchkit simulate --rate 1000 --latency-ms 4 --per-item-ms 0.5 --max-batch-size 8,16,32 ...``.
2. Past capacity (a device of 10 ms + 1 ms x n in batches of 16: 615 requests/s),
   with and without ``max_latency_ms=100``: without it every request is served ever
   later; with it the excess is refused or shed (``Overloaded``) and the goodput,
   answers within 100 ms, stays at capacity. Same as ``batchkit simulate --rate 1230
   --latency-ms 10 --per-item-ms 1 --max-batch-size 16 --max-latency-ms 100``.
3. A batch time that grows with its tokens (``per_cost_ms``, by the padded cost:
   batch size x longest request), with long-tailed lengths: which policy gets the most
   answers within a 200 ms target. (A static batch waits to be full, so its first
   batches, before the target has learned their times, are late.) Same as
   ``batchkit simulate --rate 150 --latency-ms 5 --per-item-ms 0.5 --per-cost-ms 0.02
   --length-dist lognormal:128,0.8 --max-batch-size 16 --max-latency-ms 200 --policy
   bucketed``.
4. Requests for 12 adapters (groups, Zipf-skewed: a few adapters get most of the
   traffic), where each adapter past the first in a batch costs 2 ms more: which
   ``max_groups_per_batch`` gives the lowest p99. One adapter a batch leaves batches
   small; every adapter a batch pays for the switching. Same as ``batchkit simulate
   --rate 600 --groups 12 --group-skew 1.1 --switch-ms 2 --max-groups-per-batch
   1,2,4,8,12``.
5. A static shape grid for a compiled model (``ShapeBuckets``), on the traffic of 3 at
   60 requests/s: each grid's shapes compiled (cells reached) and padding (padded
   over real tokens) beside the run without a grid, and the grid of fewest shapes
   whose p99 stays within 1.5 times the run without one. Same as ``batchkit simulate
   --rate 60 --latency-ms 5 --per-item-ms 0.5 --per-cost-ms 0.02 --length-dist
   lognormal:128,0.8 --grid-batch-sizes 1,2,4,8,16 --grid-lengths 128,512,2048``.

    python examples/simulate_settings.py
"""

from __future__ import annotations

import itertools

from batchkit import ShapeBuckets
from batchkit.tools.simulate import (
    POLICIES,
    LatencyModel,
    poisson_arrivals,
    sample_groups,
    sample_lengths,
    simulate,
)

P99_TARGET_MS = 20.0


def choose_settings() -> None:
    arrivals = poisson_arrivals(rate=1000, num_requests=10_000, seed=0)  # the same for all
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


def goodput_past_capacity() -> None:
    capacity = 16 / 26e-3  # full batches of 16 take 10 + 16 ms
    print(f"\n10 ms + 1 ms x batch size, batches of 16: capacity {capacity:.0f} req/s")
    header = ("load", "target", "goodput", "good", "refused", "shed", "p99 ms")
    print("".join(f"{h:>{w}}" for h, w in zip(header, (5, 8, 9, 6, 9, 7, 9))))
    for load in (0.5, 1.0, 1.5, 2.0):
        arrivals = poisson_arrivals(rate=load * capacity, num_requests=5000, seed=0)
        for target in (None, 100.0):
            r = simulate(
                (10.0, 1.0),
                arrivals=arrivals,
                max_batch_size=16,
                max_latency_ms=target,
                goodput_ms=100.0,  # answers within 100 ms count, with a target or not
            )
            print(
                f"{load:>4g}x{'none' if target is None else f'{target:g} ms':>8}"
                f"{r.goodput:>9.0f}{r.goodput_fraction:>6.0%}{r.overloaded:>9}{r.shed:>7}"
                f"{r.latency.p99:>9.1f}"
            )


def policies_with_a_cost_term() -> None:
    count = 6000  # the first batches run before the target has learned their times
    lengths = sample_lengths("lognormal:128,0.8", count, seed=0)
    arrivals = poisson_arrivals(rate=150, num_requests=count, seed=0)
    print("\n5 ms + 0.5 ms x batch size + 0.02 ms x padded tokens; lognormal lengths, 150 req/s")
    header = ("policy", "goodput", "good", "refused", "shed", "p99 ms", "batch", "tokens")
    print("".join(f"{h:>{w}}" for h, w in zip(header, (9, 9, 6, 9, 7, 9, 7, 8))))
    for policy in POLICIES:
        r = simulate(
            (5.0, 0.5, 0.02),
            arrivals=arrivals,
            keys=lengths,
            policy=policy,
            max_batch_size=16,
            max_latency_ms=200.0,
        )
        print(
            f"{policy:>9}{r.goodput:>9.0f}{r.goodput_fraction:>6.0%}{r.overloaded:>9}"
            f"{r.shed:>7}{r.latency.p99:>9.1f}{r.mean_batch_size:>7.1f}{r.mean_batch_cost:>8.0f}"
        )


def choose_max_groups_per_batch() -> None:
    count = 10_000
    arrivals = poisson_arrivals(rate=600, num_requests=count, seed=0)
    adapters = sample_groups(12, count, seed=0, skew=1.1)  # adapter 0 the most requested
    model = LatencyModel.linear(5.0, 0.5, switch_ms=2.0)
    print(f"\n{model.description}; 12 adapters (Zipf 1.1), 600 req/s")
    header = ("groups", "p50 ms", "p99 ms", "batch", "grp/b", "worst p99", "adapter")
    print("".join(f"{h:>{w}}" for h, w in zip(header, (6, 8, 8, 7, 7, 10, 9))))
    runs = {}
    for limit in (1, 2, 4, 8, 12):
        r = simulate(model, arrivals=arrivals, groups=adapters, max_groups_per_batch=limit)
        runs[limit] = r
        print(
            f"{limit:>6}{r.latency.p50:>8.1f}{r.latency.p99:>8.1f}{r.mean_batch_size:>7.1f}"
            f"{r.mean_groups_per_batch:>7.2f}{r.worst_group_p99:>10.1f}{r.worst_group!s:>9}"
        )
    # The lowest p99 over all requests; the worst adapter's p99 says how the rare ones fare.
    limit = min(runs, key=lambda k: runs[k].latency.p99)
    r = runs[limit]
    print(
        f"choose max_groups_per_batch={limit}: p99 {r.latency.p99:.1f} ms, the worst "
        f"adapter's ({r.worst_group}) {r.worst_group_p99:.1f} ms"
    )


def choose_a_shape_grid() -> None:
    count = 6000
    lengths = sample_lengths("lognormal:128,0.8", count, seed=0)
    arrivals = poisson_arrivals(rate=60, num_requests=count, seed=0)
    print("\n5 ms + 0.5 ms x batch size + 0.02 ms x padded tokens; lognormal lengths, 60 req/s")
    header = ("grid lengths", "shapes", "padded", "dummy", "p50 ms", "p99 ms")
    print("".join(f"{h:>{w}}" for h, w in zip(header, (22, 9, 8, 7, 8, 8))))
    model = (5.0, 0.5, 0.02)
    plain = simulate(model, arrivals=arrivals, keys=lengths, max_batch_size=16)
    runs = {(): plain}
    for grid_lengths in ((64, 128, 256, 512, 2048), (128, 512, 2048), (256, 2048)):
        grid = ShapeBuckets(batch_sizes=(1, 2, 4, 8, 16), lengths=grid_lengths)
        runs[grid_lengths] = simulate(model, arrivals=arrivals, keys=lengths, shapes=grid)
    costs = {g: r.shape_cost for g, r in runs.items() if r.shape_cost is not None}  # (all)
    for grid_lengths, r in runs.items():
        cost = costs[grid_lengths]
        name = ",".join(map(str, grid_lengths)) or "no grid"
        shapes = f"{cost.compiled}" if cost.cells is None else f"{cost.compiled}/{cost.cells}"
        print(
            f"{name:>22}{shapes:>9}{cost.padding:>7.2f}x{cost.dummy_rows:>7}"
            f"{r.latency.p50:>8.1f}{r.latency.p99:>8.1f}"
        )
    # The fewest compilations whose p99 stays within 1.5 times the run without a grid.
    fits = [g for g, r in runs.items() if g and r.latency.p99 <= 1.5 * plain.latency.p99]
    if not fits:
        raise SystemExit("no grid keeps p99 within 1.5x of the run without one: add lengths")
    best = min(fits, key=lambda g: costs[g].compiled)
    print(f"choose lengths={best}: {costs[best].compiled} shapes to compile")


def main() -> None:
    choose_settings()
    goodput_past_capacity()
    policies_with_a_cost_term()
    choose_max_groups_per_batch()
    choose_a_shape_grid()


if __name__ == "__main__":
    main()
