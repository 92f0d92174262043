"""Discrete-event simulation of a batcher: which settings meet a latency target?

Arrivals (Poisson, or a trace of times) are fed to the real scheduler behind
`@batched` (`batchkit.serve.scheduler.Scheduler`) with simulated time; each batch it
forms "runs" for `latency(batch_size)` seconds of simulated time. Nothing sleeps,
so 100k requests take a second or two, and the same seed gives the same numbers.
With `keys` (each request's length) a token budget cuts the batches as online, by
the policy's `cost`.

Each of the `max_concurrent_batches` slots is assumed to run its batch as if
alone (replicas, or streams that do not slow each other down).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchkit.batchers.base import Batcher, check_positive_int
from batchkit.batchers.cost import BatchCost, CostLike
from batchkit.batchers.dynamic import DynamicBatcher
from batchkit.batchers.static import StaticBatcher
from batchkit.errors import QueueFull
from batchkit.serve.request import Request, State
from batchkit.serve.scheduler import FormedBatch, Scheduler


class LatencyModel:
    """Seconds a batch of `n` items takes: `a + b * n`, or interpolated from a profile.

    Args:
        fn: seconds a batch of `n` items takes (called once per size, then cached).
        description: how the model reads in reports (`"5 ms + 0.5 ms x batch size"`).
    """

    def __init__(self, fn: Callable[[int], float], description: str) -> None:
        self._fn = fn
        self._cache: dict[int, float] = {}
        self.description = description

    @classmethod
    def linear(cls, fixed_ms: float, per_item_ms: float) -> LatencyModel:
        """`fixed_ms + per_item_ms * n` milliseconds.

        Args:
            fixed_ms: a batch's fixed cost, in milliseconds (>= 0).
            per_item_ms: each item's cost, in milliseconds (>= 0; not both 0).

        Raises:
            ValueError: a negative or infinite value, or both 0.
        """
        for name, v in (("fixed_ms", fixed_ms), ("per_item_ms", per_item_ms)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if fixed_ms == per_item_ms == 0:
            raise ValueError("a latency model of 0 ms for every batch size cannot be simulated")
        return cls(
            lambda n: (fixed_ms + per_item_ms * n) / 1e3,
            f"{fixed_ms:g} ms + {per_item_ms:g} ms x batch size",
        )

    @classmethod
    def from_points(cls, sizes: Sequence[int], latencies_ms: Sequence[float]) -> LatencyModel:
        """Measured (batch size, ms) points; linear in between, the last slope beyond.

        Points of the same size (repeated measurements) are averaged.

        Args:
            sizes: the measured batch sizes (>= 1).
            latencies_ms: each size's latency, in milliseconds (> 0).

        Raises:
            ValueError: no points, or a size below 1 or a latency that is not positive.
        """
        pairs = list(zip(sizes, latencies_ms))
        if not pairs:
            raise ValueError("a profile needs at least one (batch size, latency) point")
        if any(not (math.isfinite(ms) and ms > 0) or n < 1 for n, ms in pairs):
            raise ValueError("profile latencies must be positive and batch sizes >= 1")
        # One y per x: a repeated size made the last slope divide by zero (an infinite latency).
        by_size: dict[int, list[float]] = {}
        for n, latency in pairs:
            by_size.setdefault(n, []).append(latency)
        xs = np.array(sorted(by_size), dtype=np.float64)
        ys = np.array([statistics.fmean(by_size[n]) for n in sorted(by_size)], dtype=np.float64)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0

        def ms(n: int) -> float:
            if n > xs[-1]:
                return float(ys[-1] + max(slope, 0.0) * (n - xs[-1]))
            return float(np.interp(n, xs, ys))

        desc = f"profile of {len(xs)} sizes ({int(xs[0])}..{int(xs[-1])})"
        return cls(lambda n: ms(n) / 1e3, desc)

    @classmethod
    def from_profile(cls, profile: Any) -> LatencyModel:
        """From a [`ProfileResult`][batchkit.ProfileResult] or its JSON file.

        Args:
            profile: a `ProfileResult`, or the path of a `batchkit profile --json` file.

        Raises:
            ValueError: the file cannot be read or holds no profile.
        """
        if isinstance(profile, (str, Path)):
            try:
                data = json.loads(Path(profile).read_text())
                points = data["points"]
                sizes = [int(p["batch_size"]) for p in points]
                lat = [float(p["latency_ms"]) for p in points]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"cannot read profile {str(profile)!r}: {exc}") from None
            model = cls.from_points(sizes, lat)
            model.description = f"{model.description} from {profile}"
            return model
        return cls.from_points(
            [p.batch_size for p in profile.points], [p.latency_ms for p in profile.points]
        )

    def seconds(self, n: int) -> float:
        """Simulated run time of a batch of `n` items, in seconds.

        Args:
            n: the batch size the function is called with.
        """
        t = self._cache.get(n)
        if t is None:
            t = self._cache[n] = self._fn(n)
        return t

    def __repr__(self) -> str:
        return f"LatencyModel({self.description})"


LatencyLike = LatencyModel | tuple[float, float] | str | Path | Any


def as_latency_model(latency: LatencyLike) -> LatencyModel:
    """A model from a (fixed_ms, per_item_ms) pair, a profile (object or JSON path), or itself.

    Args:
        latency: a [`LatencyModel`][batchkit.LatencyModel], a `(fixed_ms, per_item_ms)`
            pair, or a profile (result or JSON path).
    """
    if isinstance(latency, LatencyModel):
        return latency
    if isinstance(latency, tuple):
        return LatencyModel.linear(float(latency[0]), float(latency[1]))
    return LatencyModel.from_profile(latency)


def poisson_arrivals(rate: float, num_requests: int, seed: int = 0) -> np.ndarray:
    """Arrival times (seconds, from 0) of a Poisson process of `rate` requests/second.

    Args:
        rate: requests per second (> 0).
        num_requests: how many arrivals (>= 1).
        seed: the random seed.

    Raises:
        ValueError: a rate that is not positive or so low the times overflow, or
            fewer than one request.
    """
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests!r}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)
    gaps[0] = 0.0  # the trace starts with its first request
    with np.errstate(over="ignore"):  # reported below, as one error
        times: np.ndarray = np.cumsum(gaps)
    if not np.isfinite(times).all():  # 1 / rate overflows for a rate such as 1e-320
        raise ValueError(f"rate {rate!r} requests/s is too low: the arrival times overflow")
    return times


def read_trace(path: str | Path) -> np.ndarray:
    """Arrival times in seconds, one per line (`#` comments and blank lines skipped).

    A CSV's first column is read; a first line that is not a number but holds a name
    (a header such as `timestamp,len`) is skipped. Times are sorted and shifted so
    the first request arrives at 0.

    Args:
        path: the trace file.

    Raises:
        ValueError: the file cannot be read, a line is not a finite number, or it
            holds no times.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read trace file {str(path)!r}: {exc}") from None
    times: list[float] = []
    header = False
    for lineno, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip().split(",", 1)[0].strip()
        if not text:
            continue
        try:
            t = float(text)
        except ValueError:
            if not (times or header) and re.search("[A-Za-z_]", text):
                header = True  # a CSV's header row (docs/cli.md: "a CSV's first column works")
                continue
            raise ValueError(f"{path}:{lineno}: not an arrival time in seconds: {text!r}") from None
        if not math.isfinite(t):
            raise ValueError(f"{path}:{lineno}: arrival time must be finite, got {text!r}")
        times.append(t)
    if not times:
        raise ValueError(f"trace file {str(path)!r} holds no arrival times")
    arr = np.sort(np.array(times, dtype=np.float64))
    shifted: np.ndarray = arr - arr[0]
    return shifted


def read_lengths(path: str | Path) -> list[int]:
    """Request lengths (keys), one int >= 0 per line (`#` comments, blank lines skipped).

    Args:
        path: the lengths file.

    Raises:
        ValueError: the file cannot be read, a line is not an int >= 0, or it holds
            no lengths.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read lengths file {str(path)!r}: {exc}") from None
    lengths: list[int] = []
    for lineno, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            n = int(text)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"{path}:{lineno}: not a length (an int >= 0): {text!r}")
        lengths.append(n)
    if not lengths:
        raise ValueError(f"lengths file {str(path)!r} holds no lengths")
    return lengths


@dataclass(frozen=True)
class LatencySummary:
    """Percentiles of a latency sample, in milliseconds (NaN when empty)."""

    p50: float
    p90: float
    p99: float
    p999: float
    max: float
    mean: float

    @classmethod
    def of_seconds(cls, samples: np.ndarray) -> LatencySummary:
        """Summarise seconds as milliseconds.

        Args:
            samples: latencies in seconds.
        """
        if samples.size == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, nan, nan)
        ms = samples * 1e3
        p50, p90, p99, p999 = np.percentile(ms, [50, 90, 99, 99.9])
        return cls(
            float(p50), float(p90), float(p99), float(p999), float(ms.max()), float(ms.mean())
        )


@dataclass(frozen=True)
class SimResult:
    """What a simulated run measured. Latencies run from arrival to batch end.

    Attributes:
        requests: arrivals replayed.
        served: requests that ran.
        rejected: requests refused with `QueueFull` (`max_queue_size`).
        duration_s: first arrival to last batch end, in seconds.
        offered_rate: requests/s in the arrivals; NaN when they all share one time.
        throughput: served requests/s over `duration_s`.
        capacity: requests/s when every slot runs full batches back to back.
        utilization: the fraction of slot-time spent running batches.
        latency: arrival to batch end.
        queue_wait: arrival to dispatch.
        batches: batches run.
        mean_batch_size: real items per batch, averaged.
        mean_batch_cost: a batch's cost by the policy's `cost` (its padded area by
            default, its total tokens under `"sum"`), averaged; NaN without `keys`.
        batch_sizes: real items per batch -> number of batches.
        dispatch_reasons: why batches left (`"full"`, `"idle"`, ...) -> how many.
        batcher: the policy's settings, as `describe_batcher` names them.
        latency_model: the latency model's description.
        max_concurrent_batches: batches that ran at once.
        latencies_s: each request's latency in seconds, in the order of the arrivals
            as given; NaN if rejected.
        batch_log: `(start, end, size)` of every batch.
    """

    requests: int
    served: int
    rejected: int
    duration_s: float
    offered_rate: float
    throughput: float
    capacity: float
    utilization: float
    latency: LatencySummary
    queue_wait: LatencySummary
    batches: int
    mean_batch_size: float
    mean_batch_cost: float
    batch_sizes: dict[int, int]
    dispatch_reasons: dict[str, int]
    batcher: str
    latency_model: str
    max_concurrent_batches: int
    latencies_s: np.ndarray = field(repr=False)
    batch_log: list[tuple[float, float, int]] = field(repr=False)


def describe_batcher(policy: Batcher) -> str:
    """A short name for the settings that matter: `DynamicBatcher(max_batch_size=32, ...)`.

    Args:
        policy: the batching policy.
    """
    wait = "" if policy.max_wait_s is None else f", max_wait_ms={policy.max_wait_s * 1e3:g}"
    tokens = "" if policy.max_tokens is None else f", max_tokens={policy.max_tokens}"
    if policy.max_tokens is not None and policy.cost.name != "padded":
        tokens += f", cost={policy.cost!r}"
    return f"{type(policy).__name__}(max_batch_size={policy.max_batch_size}{wait}{tokens})"


def _make_batcher(
    policy: str,
    max_batch_size: int,
    max_wait_ms: float,
    max_tokens: int | None,
    cost: CostLike | BatchCost,
) -> Batcher:
    if policy == "dynamic":
        return DynamicBatcher(max_batch_size, max_wait_ms, max_tokens=max_tokens, cost=cost)
    if policy == "static":
        if max_tokens is not None:
            raise ValueError("max_tokens is for policy='dynamic': a static batch is a fixed size")
        return StaticBatcher(max_batch_size)
    raise ValueError(f"policy must be 'dynamic' or 'static', got {policy!r}")


def simulate(
    latency: LatencyLike = (5.0, 0.5),
    *,
    rate: float | None = None,
    num_requests: int = 10_000,
    arrivals: Sequence[float] | np.ndarray | None = None,
    seed: int = 0,
    batcher: Batcher | None = None,
    policy: str = "dynamic",
    max_batch_size: int = 32,
    max_wait_ms: float = 5.0,
    max_concurrent_batches: int = 1,
    max_queue_size: int | None = None,
    keys: Sequence[float] | None = None,
    max_tokens: int | None = None,
    cost: CostLike | BatchCost = "padded",
) -> SimResult:
    """Replay arrivals against a batcher and a latency model; see the module docstring.

    At the end of the arrivals the batcher closes, so a static batcher's partial tail
    is still served.

    Args:
        latency: `(fixed_ms, per_item_ms)`, a [`LatencyModel`][batchkit.LatencyModel],
            or a profile (result or JSON path).
        rate: Poisson arrivals, in requests/s (when `arrivals` is not given).
        num_requests: how many Poisson arrivals.
        arrivals: arrival times in seconds, instead of `rate`.
        seed: the seed of the Poisson arrivals.
        batcher: a policy instance; else one is built from `policy`,
            `max_batch_size`, `max_wait_ms`, `max_tokens` and `cost`.
        policy: `"dynamic"` ([`DynamicBatcher`][batchkit.DynamicBatcher]) or
            `"static"` ([`StaticBatcher`][batchkit.StaticBatcher]).
        max_batch_size: the built policy's largest batch.
        max_wait_ms: the built policy's wait, in milliseconds.
        max_concurrent_batches: batches that run at once, each as if alone.
        max_queue_size: waiting requests beyond this are rejected; None: unbounded.
        keys: each request's key (its length), in the order of `arrivals`: for
            bucketed, sorted or token-budget policies.
        max_tokens: the built dynamic policy's token budget (needs `keys`).
        cost: what `max_tokens` bounds: `"padded"`, `"sum"` or a callable
            ([`as_batch_cost`][batchkit.batchers.cost.as_batch_cost]).

    Raises:
        ValueError: neither `rate` nor `arrivals`, `keys` of another length, a token
            budget without `keys`, or `max_tokens`/`cost` given with `batcher`.
    """
    # Zero slots never dispatch: the replay would wait forever.
    check_positive_int("max_concurrent_batches", max_concurrent_batches)
    if batcher is not None and (max_tokens is not None or cost != "padded"):
        raise ValueError("max_tokens and cost are set on the batcher given, not here")
    if max_tokens is not None and keys is None:
        raise ValueError("max_tokens needs keys= (each request's length) to cut batches by")
    model = as_latency_model(latency)
    if arrivals is None:
        if rate is None:
            raise ValueError("pass rate= (requests/s) or arrivals= (times in seconds)")
        times = poisson_arrivals(rate, num_requests, seed)
    else:
        times = np.asarray(arrivals, dtype=np.float64)
        if times.ndim != 1 or times.size == 0 or not np.isfinite(times).all():
            raise ValueError("arrivals must be a non-empty 1-D sequence of finite times")
    if keys is not None and len(keys) != len(times):
        raise ValueError(f"keys has {len(keys)} entries for {len(times)} arrivals")
    # keys[i] belongs to arrivals[i]: sort both together (stable: ties keep the given order).
    order = np.argsort(times, kind="stable")
    times = times[order]
    if keys is not None:
        keys = [keys[i] for i in order.tolist()]
    policy_obj = batcher or _make_batcher(policy, max_batch_size, max_wait_ms, max_tokens, cost)
    sched = Scheduler(
        policy_obj, max_queue_size=max_queue_size, max_concurrent_batches=max_concurrent_batches
    )
    replay = _replay(sched, times, model, keys)
    result = _summarise(sched, times, replay, model, policy_obj)
    given = np.empty_like(result.latencies_s)  # back in the order the caller gave
    given[order] = result.latencies_s
    return dataclasses.replace(result, latencies_s=given)


@dataclass
class _Replay:
    """What the event loop recorded."""

    done_at: np.ndarray  # per request: when its batch ended (NaN: never ran)
    started_at: np.ndarray  # per request: when its batch started
    log: list[tuple[float, float, int]]  # (start, end, size) per batch
    costs: list[float]  # per batch: its cost by the policy's cost (with keys only)


def _replay(
    sched: Scheduler, times: np.ndarray, model: LatencyModel, keys: Sequence[float] | None
) -> _Replay:
    """The event loop. At equal times: batches end, then arrivals join, then dispatch."""
    n = len(times)
    arrive = times.tolist()
    done_at = [math.nan] * n
    started_at = [math.nan] * n
    running: list[tuple[float, int, FormedBatch]] = []  # (end, tie-break, batch) heap
    order = itertools.count()
    log: list[tuple[float, float, int]] = []
    costs: list[float] = []
    policy = sched.policy
    inf = math.inf
    i, wake, now = 0, inf, 0.0
    while True:
        t = min(arrive[i] if i < n else inf, running[0][0] if running else inf, wake)
        if t == inf:
            if sched.num_waiting == 0:
                break
            if sched.closing:  # closing dispatched nothing and nothing runs: it never will
                raise RuntimeError(f"{sched.num_waiting} requests left waiting after close")
            sched.closing = True  # the trace ended: serve what is left, as close() would
            t = now
        now = t
        while running and running[0][0] <= now:
            _, _, batch = heapq.heappop(running)
            sched.finish(batch, now)
            for req in batch.requests:
                req.state = State.DONE
        while i < n and arrive[i] <= now:
            if keys is None:
                req = Request(i, 0.0, None, 0)
            else:
                key = float(keys[i])
                req = Request(i, key, policy.bucket_of(key), 0)
            req.enqueued_at = arrive[i]
            with contextlib.suppress(QueueFull):  # counted by the scheduler; latency stays NaN
                sched.add(req)
            i += 1
        while True:
            formed, wake_at = sched.poll(now)
            if formed is None:
                break
            seconds = model.seconds(formed.padded_size)
            end = now + seconds
            if not math.isfinite(end):  # a batch that never ends would stall the replay
                raise ValueError(
                    f"a batch of {formed.padded_size} takes {seconds * 1e3:g} ms and would "
                    f"end at {end:g} s: the latency model overflows"
                )
            heapq.heappush(running, (end, next(order), formed))
            log.append((now, end, len(formed.requests)))
            if keys is not None:
                costs.append(policy.cost.of([r.key for r in formed.requests]))
            for req in formed.requests:
                started_at[req.item] = now
                done_at[req.item] = end
        # A wake-up never lies in the past, even when float rounding says the due time is now.
        wake = inf if wake_at is None else max(wake_at, math.nextafter(now, inf))
    return _Replay(np.array(done_at), np.array(started_at), log, costs)


def _summarise(
    sched: Scheduler, times: np.ndarray, replay: _Replay, model: LatencyModel, policy: Batcher
) -> SimResult:
    done_at, started_at, log = replay.done_at, replay.started_at, replay.log
    served_mask = ~np.isnan(done_at)
    latencies = done_at - times
    served = int(served_mask.sum())
    end = float(np.nanmax(done_at)) if served else float(times[-1])
    duration = max(end - float(times[0]), 1e-12)
    span = float(times[-1] - times[0])
    # Arrivals at one instant have no rate: NaN, not inf (which read as overload).
    offered = (len(times) - 1) / span if span > 0 else math.nan
    busy = sum(e - s for s, e, _ in log)
    slots = sched.max_concurrent_batches
    full = policy.padded_size(policy.max_batch_size)
    stats = sched.stats
    return SimResult(
        requests=len(times),
        served=served,
        rejected=stats.rejected,
        duration_s=duration,
        offered_rate=offered,
        throughput=served / duration,
        capacity=slots * policy.max_batch_size / model.seconds(full),
        utilization=busy / (duration * slots),
        latency=LatencySummary.of_seconds(latencies[served_mask]),
        queue_wait=LatencySummary.of_seconds((started_at - times)[served_mask]),
        batches=stats.batches,
        mean_batch_size=stats.items_run / stats.batches if stats.batches else 0.0,
        mean_batch_cost=statistics.fmean(replay.costs) if replay.costs else math.nan,
        batch_sizes=dict(sorted(stats.batch_sizes.items())),
        dispatch_reasons={r.value: n for r, n in stats.reasons.items()},
        batcher=describe_batcher(policy),
        latency_model=model.description,
        max_concurrent_batches=slots,
        latencies_s=latencies,
        batch_log=log,
    )
