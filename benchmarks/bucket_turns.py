"""Several length buckets past capacity, simulated: are the 503s refusals at admission?

A latency target answers what it cannot serve in time with a 503; one that comes at
admission lets the client go elsewhere at once, one that comes as a drop near the
deadline has cost the client its time. With several buckets the work ahead of a
request is the buckets' turns, and a batch takes what waits in its bucket when it
leaves: planning the turns right decides which of the two a 503 is.

The example service's shape, in `batchkit.simulate` (exact batch times, no
overhead): `benchmarks/service.py`'s texts (5 to 60 words), the app's length
buckets (`BucketedBatcher([128, 256, 512, 1024, 4096], key=len)`), max batch 32, max
wait 2 ms, a 500 ms target, and the batch times the service's model learned on the
2-core machine: 25 ms + 1.1 ms per item + 0.0855 ms per padded character. Twenty lone
requests first (the model learns), then `--seconds` of Poisson arrivals at 1x, 2x
and 4x of 39 requests/s (the capacity `service.py` measured there).

Per load, over `--seeds` seeds (min-max): answered in time per second, the same as a
share of the device's own limit, the share of the 503s that were drops after
admission, and the mean batch size. The limit is measured in the same run: the same
texts all waiting at once, no target, so every batch leaves full from its bucket.
Past it, a target serves more per second than that limit only by refusing the
longest texts more often than the short ones (their batches take longer).

Usage::

    python benchmarks/bucket_turns.py              # ~10 s
    python benchmarks/bucket_turns.py --seeds 5 --seconds 60
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service import texts  # noqa: E402

from batchkit import BucketedBatcher, simulate  # noqa: E402
from batchkit.tools.simulate import LatencyModel  # noqa: E402

CAPACITY = 39.0  # requests/s, as benchmarks/service.py measured the service
LOADS = (1.0, 2.0, 4.0)
TARGET_MS = 500.0
MODEL = LatencyModel.linear(25.0, 1.1, 0.0855)
WARM_UP = [0.2 * k for k in range(20)]  # lone requests: the model learns from them


def apps_policy() -> BucketedBatcher:
    """The example app's batching: its length buckets, max batch 32, max wait 2 ms."""
    return BucketedBatcher([128, 256, 512, 1024, 4096], key=int, max_batch_size=32, max_wait_ms=2)


def text_lengths(count: int, seed: int) -> list[float]:
    """The lengths of `count` of `service.py`'s texts (the app's key: `len`)."""
    return [float(len(text)) for text in texts(count, seed)]


def run(load: float, seed: int, seconds: float) -> tuple[float, float, float]:
    """One load point: (answered in time per second after the warm-up, the share of
    the 503s that were drops after admission, mean batch size)."""
    rng = random.Random(seed)
    start = WARM_UP[-1] + 0.2
    arrivals, t = list(WARM_UP), start
    while True:
        t += rng.expovariate(load * CAPACITY)
        if t >= start + seconds:
            break
        arrivals.append(t)
    keys = text_lengths(len(arrivals), seed)
    result = simulate(
        MODEL, arrivals=arrivals, keys=keys, batcher=apps_policy(), max_latency_ms=TARGET_MS
    )
    in_time = result.latencies_s[len(WARM_UP) :]  # (the warm-up's are all served)
    answered = float((in_time <= TARGET_MS / 1e3).sum()) / seconds
    refusals = result.overloaded + result.shed
    return answered, result.shed / refusals if refusals else 0.0, result.mean_batch_size


def device_limit(seed: int, count: int = 3000) -> float:
    """Requests per second with every text waiting at once and no target: full
    batches, bucket by bucket, back to back."""
    keys = text_lengths(count, seed)
    result = simulate(MODEL, arrivals=[0.0] * count, keys=keys, batcher=apps_policy())
    return result.throughput


def span(values: list[float], fmt: str) -> str:
    """`min-max` of `values` in `fmt`."""
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3, help="seeds per load (default 3)")
    p.add_argument("--seconds", type=float, default=30.0, help="seconds of load (default 30)")
    args = p.parse_args()
    print(
        f"# the example service's shape, simulated: {MODEL.description}, 3 length "
        f"buckets, {TARGET_MS:g} ms target, capacity {CAPACITY:g}/s; "
        f"{args.seeds} seeds x {args.seconds:g} s per load, min-max"
    )
    limit = device_limit(0)
    print(f"device limit (ref): {limit:.1f} requests/s, every text waiting at once, no target")
    header = ("load", "answered in time/s", "of the limit", "503s that were drops", "batch size")
    print("{:>5}  {:>18}  {:>12}  {:>20}  {:>10}".format(*header))
    for load in LOADS:
        rows = [run(load, seed, args.seconds) for seed in range(args.seeds)]
        answered, dropped, size = (list(col) for col in zip(*rows))
        print(
            f"{load:>4g}x  {span(answered, '.1f'):>18}  "
            f"{span([a / limit for a in answered], '.2f'):>12}  "
            f"{span([100 * d for d in dropped], '.1f') + '%':>20}  {span(size, '.2f'):>10}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
