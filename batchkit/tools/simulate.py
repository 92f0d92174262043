"""Discrete-event simulation of a batcher: which settings meet a latency target?

Arrivals (Poisson, or a trace of times) are fed to the real
:class:`~batchkit.serve.scheduler.Scheduler` with simulated time; each batch it
forms "runs" for ``latency(batch_size)`` seconds of simulated time. Nothing sleeps,
so 100k requests take a second or two, and the same seed gives the same numbers.

Each of the ``max_concurrent_batches`` slots is assumed to run its batch as if
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
from batchkit.batchers.dynamic import DynamicBatcher
from batchkit.batchers.static import StaticBatcher
from batchkit.errors import QueueFull
from batchkit.serve.request import Request, State
from batchkit.serve.scheduler import FormedBatch, Scheduler


class LatencyModel:
    """Seconds a batch of ``n`` items takes: ``a + b * n``, or interpolated from a profile."""

    def __init__(self, fn: Callable[[int], float], description: str) -> None:
        self._fn = fn
        self._cache: dict[int, float] = {}
        self.description = description

    @classmethod
    def linear(cls, fixed_ms: float, per_item_ms: float) -> LatencyModel:
        """``fixed_ms + per_item_ms * n`` milliseconds."""
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
        """From a :class:`~batchkit.tools.profile.ProfileResult` or its JSON file."""
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
        """Simulated run time of a batch of ``n``."""
        t = self._cache.get(n)
        if t is None:
            t = self._cache[n] = self._fn(n)
        return t

    def __repr__(self) -> str:
        return f"LatencyModel({self.description})"


LatencyLike = LatencyModel | tuple[float, float] | str | Path | Any


def as_latency_model(latency: LatencyLike) -> LatencyModel:
    """A model from a (fixed_ms, per_item_ms) pair, a profile (object or JSON path), or itself."""
    if isinstance(latency, LatencyModel):
        return latency
    if isinstance(latency, tuple):
        return LatencyModel.linear(float(latency[0]), float(latency[1]))
    return LatencyModel.from_profile(latency)


def poisson_arrivals(rate: float, num_requests: int, seed: int = 0) -> np.ndarray:
    """Arrival times (seconds, from 0) of a Poisson process of ``rate`` requests/second."""
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
    """Arrival times in seconds, one per line (``#`` comments and blank lines skipped).

    A CSV's first column is read; a first line that is not a number but holds a name
    (a header such as ``timestamp,len``) is skipped. Times are sorted and shifted so
    the first request arrives at 0.
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
        """Summarise seconds as milliseconds."""
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
    """What a simulated run measured. Latencies run from arrival to batch end."""

    requests: int
    served: int
    rejected: int  # refused with QueueFull (max_queue_size)
    duration_s: float  # first arrival to last batch end
    offered_rate: float  # requests/s in the arrivals; NaN when they all share one time
    throughput: float  # served requests/s over duration_s
    capacity: float  # requests/s when every slot runs full batches back to back
    utilization: float  # fraction of slot-time spent running batches
    latency: LatencySummary
    queue_wait: LatencySummary  # arrival to dispatch
    batches: int
    mean_batch_size: float
    batch_sizes: dict[int, int]  # real items per batch -> number of batches
    dispatch_reasons: dict[str, int]
    batcher: str
    latency_model: str
    max_concurrent_batches: int
    # per request, in the order of the arrivals as given; NaN if rejected
    latencies_s: np.ndarray = field(repr=False)
    batch_log: list[tuple[float, float, int]] = field(repr=False)  # (start, end, size)


def describe_batcher(policy: Batcher) -> str:
    """A short name for the settings that matter: ``DynamicBatcher(max_batch_size=32, ...)``."""
    wait = "" if policy.max_wait_s is None else f", max_wait_ms={policy.max_wait_s * 1e3:g}"
    tokens = "" if policy.max_tokens is None else f", max_tokens={policy.max_tokens}"
    return f"{type(policy).__name__}(max_batch_size={policy.max_batch_size}{wait}{tokens})"


def _make_batcher(policy: str, max_batch_size: int, max_wait_ms: float) -> Batcher:
    if policy == "dynamic":
        return DynamicBatcher(max_batch_size, max_wait_ms)
    if policy == "static":
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
) -> SimResult:
    """Replay arrivals against a batcher and a latency model; see the module docstring.

    ``latency``: ``(fixed_ms, per_item_ms)``, a :class:`LatencyModel`, or a profile
    (result or JSON path). Arrivals: ``arrivals`` (seconds), else ``num_requests``
    Poisson arrivals at ``rate`` requests/s drawn with ``seed``. The batcher: a
    ``Batcher`` instance, else ``policy`` (``"dynamic"``/``"static"``) with
    ``max_batch_size`` and ``max_wait_ms``. ``keys``: each request's key (length),
    for bucketed, sorted or token-budget policies. At the end of the arrivals the
    batcher closes, so a static batcher's partial tail is still served.
    """
    # Zero slots never dispatch: the replay would wait forever.
    check_positive_int("max_concurrent_batches", max_concurrent_batches)
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
    policy_obj = batcher or _make_batcher(policy, max_batch_size, max_wait_ms)
    sched = Scheduler(
        policy_obj, max_queue_size=max_queue_size, max_concurrent_batches=max_concurrent_batches
    )
    done_at, started_at, log = _replay(sched, times, model, keys)
    result = _summarise(sched, times, done_at, started_at, log, model, policy_obj)
    given = np.empty_like(result.latencies_s)  # back in the order the caller gave
    given[order] = result.latencies_s
    return dataclasses.replace(result, latencies_s=given)


def _replay(
    sched: Scheduler, times: np.ndarray, model: LatencyModel, keys: Sequence[float] | None
) -> tuple[np.ndarray, np.ndarray, list[tuple[float, float, int]]]:
    """The event loop. At equal times: batches end, then arrivals join, then dispatch."""
    n = len(times)
    arrive = times.tolist()
    done_at = [math.nan] * n
    started_at = [math.nan] * n
    running: list[tuple[float, int, FormedBatch]] = []  # (end, tie-break, batch) heap
    order = itertools.count()
    log: list[tuple[float, float, int]] = []
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
            for req in formed.requests:
                started_at[req.item] = now
                done_at[req.item] = end
        # A wake-up never lies in the past, even when float rounding says the due time is now.
        wake = inf if wake_at is None else max(wake_at, math.nextafter(now, inf))
    return np.array(done_at), np.array(started_at), log


def _summarise(
    sched: Scheduler,
    times: np.ndarray,
    done_at: np.ndarray,
    started_at: np.ndarray,
    log: list[tuple[float, float, int]],
    model: LatencyModel,
    policy: Batcher,
) -> SimResult:
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
        batch_sizes=dict(sorted(stats.batch_sizes.items())),
        dispatch_reasons={r.value: n for r, n in stats.reasons.items()},
        batcher=describe_batcher(policy),
        latency_model=model.description,
        max_concurrent_batches=slots,
        latencies_s=latencies,
        batch_log=log,
    )
