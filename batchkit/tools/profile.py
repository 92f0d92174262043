"""Profile a batch function: latency and throughput per batch size, the knee, and
settings for a latency target.

The function under test takes one batch, an array of shape ``[B, *input_shape]``:
a numpy array (``framework="numpy"``) or a torch tensor on ``device``
(``framework="torch"``). Each size is run ``warmup`` times untimed; then the sizes
are timed in rounds, every size once a round (in turn, so that a noisy moment of the
machine slows every size a little instead of one size a lot), until the knee settles
(see `find_knee_range`) or the time budget is spent. Each size's median is reported,
with a 95% confidence interval of that median (which narrows as rounds are added) and
the spread of single runs (their 10th and 90th percentiles). On CUDA every timing is
bracketed by ``torch.cuda.synchronize()`` so queued kernels are counted. An ``async``
function is awaited to completion on a private event loop, and the timing includes that.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

KNEE_FRACTION = 0.95  # the knee: the smallest size within 5% of the peak throughput
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_TIME_BUDGET_S = 10.0  # rounds stop by then if the knee has not settled
DEFAULT_MAX_REPEATS = 1000  # and after this many timed runs per size in any case


@dataclass(frozen=True)
class ProfilePoint:
    """One batch size: median latency, the spread of the repeats, and the throughput.

    Attributes:
        batch_size: Items per call.
        latency_ms: The median over the repeats, in milliseconds.
        min_ms: The fastest repeat.
        max_ms: The slowest repeat.
        p10_ms: The 10th percentile of the repeats (linear interpolation); None on a
            point made by hand from a single latency, which then has no spread.
        p90_ms: The 90th percentile, likewise.
        ci_low_ms: The low end of a 95% confidence interval of the median (an order
            statistic of the repeats: no assumption on their distribution); it
            narrows as repeats are added, unlike the p10-p90 spread. None on a point
            made by hand (the p10-p90 spread stands in for it).
        ci_high_ms: The high end, likewise.
    """

    batch_size: int
    latency_ms: float
    min_ms: float
    max_ms: float
    p10_ms: float | None = None
    p90_ms: float | None = None
    ci_low_ms: float | None = None
    ci_high_ms: float | None = None

    @property
    def throughput(self) -> float:
        """Items per second when batches of this size run back to back."""
        return self.batch_size / (self.latency_ms / 1e3)

    @property
    def throughput_range(self) -> tuple[float, float]:
        """``(low, high)`` items/s over the p10-p90 latency spread (slow runs give low)."""
        slow = self.latency_ms if self.p90_ms is None else self.p90_ms
        fast = self.latency_ms if self.p10_ms is None else self.p10_ms
        return self.batch_size / (slow / 1e3), self.batch_size / (fast / 1e3)

    @property
    def throughput_ci(self) -> tuple[float, float]:
        """``(low, high)`` items/s over the median's 95% confidence interval (the p10-p90
        spread on a point without one): where this size's throughput may really be."""
        if self.ci_low_ms is None or self.ci_high_ms is None:
            return self.throughput_range
        return self.batch_size / (self.ci_high_ms / 1e3), self.batch_size / (self.ci_low_ms / 1e3)


@dataclass(frozen=True)
class Recommendation:
    """Settings for ``DynamicBatcher`` derived from a profile (and a latency target).

    Worst case for a request under load: it arrives just after a full batch left,
    waits for that batch, waits up to ``max_wait_ms`` for its own to form (with
    ``max_concurrent_batches > 1``), then runs: ``2 * latency(B) + max_wait_ms``.

    Attributes:
        max_batch_size: The recommended batch size.
        max_wait_ms: The recommended wait, in milliseconds.
        worst_latency_ms: The bound above, for these settings.
        capacity: Requests per second at full batches, one batch at a time.
        sla_ms: The latency target the settings were chosen for (None: none).
        meets_sla: False when even the smallest batch cannot meet ``sla_ms``.
        reason: Why these settings, in one sentence.
    """

    max_batch_size: int
    max_wait_ms: float
    worst_latency_ms: float
    capacity: float
    sla_ms: float | None
    meets_sla: bool
    reason: str


@dataclass(frozen=True)
class ProfileResult:
    """A batch-size sweep and what it implies; [`profile`][batchkit.profile] returns it.

    Attributes:
        target: The profiled function's name.
        input_shape: One item's shape (a batch is ``[B, *input_shape]``).
        framework: ``"numpy"`` or ``"torch"``.
        dtype: The inputs' dtype (a numpy name).
        device: Where the inputs were (``"cpu"``, ``"cuda"``, ...).
        warmup: Untimed calls per batch size.
        repeats: Timed calls per batch size (every size the same number: one per
            round).
        points: One ``ProfilePoint`` per batch size, smallest first: the median
            ``latency_ms``, ``min_ms``/``max_ms``, the ``p10_ms``-``p90_ms`` spread,
            and ``throughput`` in items per second.
        knee: The smallest batch size within 5% of the peak throughput.
        recommendation: ``max_batch_size``, ``max_wait_ms``, the worst-case latency
            they give, and whether they meet ``sla_ms`` (and why). Computed from the
            medians whatever their uncertainty: act on it only when
            ``knee_determined`` (the command refuses to advise otherwise).
        time_budget_s: The seconds the rounds could take before they stopped unsettled
            (None: no budget).
        elapsed_s: The seconds the timed rounds took.
    """

    target: str
    input_shape: tuple[int, ...]
    framework: str
    dtype: str
    device: str
    warmup: int
    repeats: int
    points: list[ProfilePoint]
    knee: int  # batch size
    recommendation: Recommendation
    time_budget_s: float | None = None
    elapsed_s: float = 0.0

    @property
    def peak(self) -> ProfilePoint:
        """The point with the highest throughput."""
        return max(self.points, key=lambda p: p.throughput)

    @property
    def knee_range(self) -> tuple[int, int]:
        """The smallest and largest batch size the knee can be, given each size's
        median and its 95% confidence interval (see `find_knee_range`); ``knee`` lies
        between them."""
        return find_knee_range(self.points)

    @property
    def knee_determined(self) -> bool:
        """Whether the medians' uncertainty leaves one knee: ``knee_range`` is a single
        size. False means the timings are too noisy to pick a knee (another run may
        pick another), and ``recommendation`` is not to be acted on."""
        low, high = self.knee_range
        return low == high

    def fit(self) -> tuple[float, float]:
        """A robust ``(fixed_ms, per_item_ms)`` of ``latency = fixed + per_item * B``.

        Theil-Sen over the medians: the slope is the median of the slopes between every
        two sizes and the intercept the median of what is left, so that one or two
        sizes caught by a noisy moment cannot flatten the line (a least-squares fit
        through two outliers once gave ``3.066 ms + 0.0000 ms x B``). Both are >= 0.
        """
        sizes = [float(p.batch_size) for p in self.points]
        lat = [p.latency_ms for p in self.points]
        if len(sizes) < 2:
            return lat[0], 0.0
        slope = statistics.median(
            (lat[j] - lat[i]) / (sizes[j] - sizes[i])
            for i in range(len(sizes))
            for j in range(i + 1, len(sizes))
        )
        slope = max(slope, 0.0)
        intercept = statistics.median(y - slope * x for x, y in zip(sizes, lat))
        return max(intercept, 0.0), slope

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``--json`` writes and ``simulate --profile`` reads)."""
        data = asdict(self)
        data["batchkit_profile"] = 1
        data["input_shape"] = list(self.input_shape)
        for point, raw in zip(self.points, data["points"]):
            raw["throughput"] = point.throughput
        data["fit_ms"] = dict(zip(("fixed", "per_item"), self.fit()))
        data["knee_range"] = list(self.knee_range)
        data["knee_determined"] = self.knee_determined
        return data

    def save(self, path: str | Path) -> None:
        """Write [`to_json`][batchkit.ProfileResult.to_json] to ``path`` (indented JSON).

        Args:
            path: The file to write (replaced if it exists).
        """
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def find_knee(points: Sequence[ProfilePoint], fraction: float = KNEE_FRACTION) -> int:
    """The smallest batch size whose throughput is within ``1 - fraction`` of the peak.

    Args:
        points: The sweep (not empty).
        fraction: The share of the peak throughput that counts as the knee.
    """
    peak = max(p.throughput for p in points)
    return min(p.batch_size for p in points if p.throughput >= fraction * peak)


def find_knee_range(
    points: Sequence[ProfilePoint], fraction: float = KNEE_FRACTION
) -> tuple[int, int]:
    """The knee's possible sizes when each throughput may be anywhere in its interval.

    Each size's interval is its median's 95% confidence interval
    (`ProfilePoint.throughput_ci`; the p10-p90 spread on a point without one). A size
    *may* be within ``1 - fraction`` of the peak if its highest throughput reaches
    ``fraction`` of the highest lowest throughput (the lowest the peak can be); it
    *surely* is if its lowest throughput reaches ``fraction`` of every other size's
    highest. The knee is at least the smallest size that may qualify and at most the
    smallest that surely does (the largest size measured, if none surely does). One
    size: the knee is known; two: the timings are too noisy to pick a knee.

    Args:
        points: The sweep (not empty).
        fraction: The share of the peak throughput that counts as the knee.

    Returns:
        ``(smallest, largest)`` batch size the knee can be.
    """
    ranges = [(p.batch_size, *p.throughput_ci) for p in points]
    lowest_peak = max(low for _, low, _ in ranges)
    may = [size for size, _, high in ranges if high >= fraction * lowest_peak]
    surely = [
        size
        for i, (size, low, _) in enumerate(ranges)
        if all(low >= fraction * high for j, (_, _, high) in enumerate(ranges) if j != i)
    ]
    largest = max(size for size, _, _ in ranges)
    return min(may), min(surely, default=largest)


def recommend(points: Sequence[ProfilePoint], sla_ms: float | None = None) -> Recommendation:
    """Settings from a sweep: the knee, or the largest size up to it that fits ``sla_ms``.

    ``max_batch_size``: the knee, or the largest size up to it whose worst case fits
    ``sla_ms``. ``max_wait_ms``: the slack left, capped at one batch's run time
    (waiting longer than a batch takes rarely fills it further), in 0.1 ms steps.

    Args:
        points: The sweep (not empty).
        sla_ms: A latency target, in milliseconds; ``None``: recommend the knee.

    Raises:
        ValueError: ``sla_ms`` is not a positive finite number.
    """
    if sla_ms is not None and not (math.isfinite(sla_ms) and sla_ms > 0):
        raise ValueError(f"sla_ms must be a positive number, got {sla_ms!r}")
    by_size = {p.batch_size: p for p in points}
    knee, peak = find_knee(points), find_peak(points)
    sizes = sorted(s for s in by_size if s <= knee)
    fitting = sizes if sla_ms is None else [s for s in sizes if 2 * by_size[s].latency_ms <= sla_ms]
    if fitting:
        size, meets = fitting[-1], True
    else:
        size, meets = sizes[0], False
    lat = by_size[size].latency_ms
    slack = lat if sla_ms is None else max(sla_ms - 2 * lat, 0.0)
    wait = math.floor(min(slack, lat) * 10 + 1e-9) / 10  # 0.1 ms steps, never over the slack
    if not meets:
        reason = f"even a batch of {size} takes {lat:.1f} ms: no setting meets {sla_ms:g} ms"
    elif size == knee:
        share = by_size[size].throughput / peak
        reason = f"the knee: batches of {size} give {share:.0%} of the peak throughput"
    else:
        reason = f"the largest size up to the knee whose worst case fits {sla_ms:g} ms"
    return Recommendation(
        max_batch_size=size,
        max_wait_ms=wait,
        worst_latency_ms=2 * lat + wait,
        capacity=by_size[size].throughput,
        sla_ms=sla_ms,
        meets_sla=meets,
        reason=reason,
    )


def find_peak(points: Sequence[ProfilePoint]) -> float:
    """The highest throughput (items/s) in a sweep.

    Args:
        points: The sweep (not empty).
    """
    return max(p.throughput for p in points)


def median_ci(times_ms: Sequence[float]) -> tuple[float, float]:
    """A 95% confidence interval of the median of ``times_ms``, distribution-free.

    The order statistics of ranks ``n/2 -+ 0.98 sqrt(n)`` (the binomial count of runs
    below the median, in its normal approximation): under 6 runs that is the whole
    range, and it narrows as ``1/sqrt(n)`` with more.

    Args:
        times_ms: The timed runs of one size (not empty).
    """
    ordered = sorted(times_ms)
    n = len(ordered)
    half = 0.98 * math.sqrt(n)
    low = max(round(n / 2 - half), 1)  # 1-based ranks
    high = min(round(1 + n / 2 + half), n)
    return ordered[low - 1], ordered[high - 1]


def _point(size: int, times_ms: list[float]) -> ProfilePoint:
    """One size's timings, summarised: the median and its confidence interval, the
    extremes, the p10-p90 spread."""
    p10, p90 = (float(q) for q in np.percentile(times_ms, [10, 90]))
    median = statistics.median(times_ms)
    ci_low, ci_high = median_ci(times_ms)
    return ProfilePoint(size, median, min(times_ms), max(times_ms), p10, p90, ci_low, ci_high)


def _make_input(framework: str, shape: tuple[int, ...], dtype: str, device: str) -> Any:
    rng = np.random.default_rng(0)
    np_dtype = np.dtype(dtype)
    if np_dtype.kind in "iub":
        host = rng.integers(0, 100, shape).astype(np_dtype)  # token-id-like values
    else:
        host = rng.standard_normal(shape).astype(np_dtype)
    if framework == "numpy":
        return host
    import torch

    try:
        return torch.from_numpy(host).to(device)
    except torch.cuda.OutOfMemoryError as exc:  # the host copy fitted, the device's did not
        raise MemoryError(str(exc)) from None


def _check_torch(dtype: str, device: str) -> None:
    """Refuse a dtype or device this torch build cannot use, before anything runs."""
    import torch

    try:
        torch.from_numpy(np.zeros(1, dtype=dtype))
    except TypeError:  # e.g. float128: numpy has it, torch does not
        raise ValueError(f"dtype {dtype} is not supported by torch") from None
    try:
        torch.zeros(1).to(device)
    except (AssertionError, RuntimeError) as exc:  # not compiled with CUDA, bad name, no GPU
        reason = " ".join(str(exc).split())
        raise ValueError(f"device {device!r} is not available: {reason}") from None


def _check_dtype(dtype: str) -> None:
    try:
        kind = np.dtype(dtype).kind
    except TypeError:
        raise ValueError(
            f"unknown dtype {dtype!r} (numpy names: float32, float16, int64, ...)"
        ) from None
    if kind not in "biuf":
        raise ValueError(f"dtype must be numeric, got {dtype!r}")


def _synchronizer(framework: str, device: str) -> Callable[[], None]:
    """What to call before reading the clock: CUDA work is asynchronous."""
    if framework != "torch":
        return lambda: None
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _private_loop() -> asyncio.AbstractEventLoop:
    """The loop an async ``fn`` runs on: one for the whole profile run."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # none running in this thread: it can block on its own loop
        return asyncio.new_event_loop()
    raise RuntimeError(
        "profile() cannot await an async function inside a running event loop; "
        "run it in a thread: await asyncio.to_thread(profile, ...)"
    )


def profile(
    fn: Callable[[Any], Any],
    input_shape: Sequence[int],
    *,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    framework: str = "numpy",
    dtype: str = "float32",
    device: str | None = None,
    warmup: int = 2,
    repeats: int = 5,
    max_repeats: int = DEFAULT_MAX_REPEATS,
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S,
    sla_ms: float | None = None,
    name: str | None = None,
    on_step: Callable[[int, int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> ProfileResult:
    """Time ``fn`` on batches of each size: latency, throughput, the knee, settings.

    Each size is run ``warmup`` times untimed; then every size is timed once a round,
    in turn (the order rotating from round to round), for at least ``repeats`` rounds
    and then until the knee settles (`find_knee_range` leaves one size, given each
    median's 95% confidence interval), ``time_budget_s`` is spent, or ``max_repeats``
    rounds are done, whichever comes first. Each size's median is reported, with its
    confidence interval and the spread of its runs. On CUDA every timing is bracketed by
    ``torch.cuda.synchronize()`` so queued kernels are counted. ``fn`` may be
    ``async`` (or return an awaitable): each call is awaited to completion on one
    private event loop, so call ``profile`` from synchronous code (a thread, not
    inside a running loop).

    Args:
        fn: The batch function: takes one array ``[B, *input_shape]`` (random values;
            integers in ``0..99`` for an integer dtype).
        input_shape: One item's shape, every dimension >= 1.
        batch_sizes: The sizes ``B`` to time (positive ints; duplicates dropped,
            reported smallest first).
        framework: ``"numpy"`` (numpy arrays) or ``"torch"`` (tensors on ``device``).
        dtype: The inputs' dtype, a numeric numpy name (``"float32"``, ``"int64"``).
        device: For torch, where the inputs go; ``None``: ``"cuda"`` when available,
            else ``"cpu"``.
        warmup: Untimed calls per size (>= 0).
        repeats: The fewest timed calls per size (>= 1).
        max_repeats: The most timed calls per size (>= ``repeats``).
        time_budget_s: Seconds of timed rounds (by ``clock``) after which no new
            round starts, settled or not; ``None``: no budget (``max_repeats`` bounds
            the run).
        sla_ms: A latency target, in milliseconds, for the recommended settings;
            ``None``: recommend the knee.
        name: The name the result and errors give ``fn`` (default: its qualname).
        on_step: ``on_step(done, total)`` after each timed or warm-up call (progress;
            ``total`` counts ``max_repeats`` rounds, and is ``done`` at the end).
        clock: Seconds; replaces ``time.perf_counter`` (a fake clock makes the
            timings exact in tests, the time budget included).

    Raises:
        ValueError: A bad ``framework``, shape, size, count, budget, ``sla_ms`` or
            dtype; a dtype or device torch cannot use; a batch too large for memory.
        ImportError: ``framework="torch"`` without torch installed.
        RuntimeError: ``fn`` raised (the message names the batch shape), or an
            async ``fn`` was profiled inside a running event loop.
    """
    if framework not in ("numpy", "torch"):
        raise ValueError(f"framework must be 'numpy' or 'torch', got {framework!r}")
    shape = tuple(int(d) for d in input_shape)
    if any(d < 1 for d in shape):
        raise ValueError(f"input_shape dimensions must be >= 1, got {shape}")
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be positive ints, got {list(batch_sizes)}")
    if warmup < 0 or repeats < 1 or max_repeats < repeats:
        raise ValueError(
            f"need warmup >= 0 and 1 <= repeats <= max_repeats, got {warmup}, {repeats} "
            f"and {max_repeats}"
        )
    if time_budget_s is not None and not (time_budget_s >= 0 and math.isfinite(time_budget_s)):
        raise ValueError(f"time_budget_s must be a number of seconds >= 0, got {time_budget_s!r}")
    _check_dtype(dtype)
    if framework == "torch":
        try:
            import torch
        except ImportError:
            raise ImportError(
                'framework="torch" needs torch: pip install "batchkit-ml[torch]"'
            ) from None
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        _check_torch(dtype, device)
    else:
        device = device or "cpu"
    sync = _synchronizer(framework, device)
    target = name or str(getattr(fn, "__qualname__", repr(fn)))
    total, done = len(sizes) * (warmup + max_repeats), 0
    # Made before the first timing when fn is async; else on the first awaitable result.
    loop = _private_loop() if inspect.iscoroutinefunction(fn) else None

    def timed(size: int, batch: Any) -> float:
        """One call of fn on the batch, in milliseconds (counted for progress)."""
        nonlocal loop, done
        sync()
        start = clock()
        try:
            result = fn(batch)
            if inspect.isawaitable(result):  # without this, only the coroutine is made
                loop = loop or _private_loop()
                loop.run_until_complete(result)
        except Exception as exc:
            raise RuntimeError(
                f"{target} failed on a batch of shape {(size, *shape)}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        sync()
        elapsed = (clock() - start) * 1e3
        done += 1
        if on_step is not None:
            on_step(done, total)
        return elapsed

    try:
        batches = {size: _batch(framework, (size, *shape), dtype, device) for size in sizes}
        for size in sizes:
            for _ in range(warmup):
                timed(size, batches[size])
        times: dict[int, list[float]] = {size: [] for size in sizes}
        began = clock()
        for round_ in range(max_repeats):
            # In turn, from a rotating start: a slow moment of the machine costs every
            # size one slow run, where timing each size's runs back to back let it
            # skew one size (and so the knee) entirely.
            first = round_ % len(sizes)
            for size in sizes[first:] + sizes[:first]:
                times[size].append(timed(size, batches[size]))
            if round_ + 1 < repeats:
                continue
            points = [_point(size, times[size]) for size in sizes]
            low, high = find_knee_range(points)
            if low == high:
                break  # the knee has settled
            if time_budget_s is not None and clock() - began >= time_budget_s:
                break
        elapsed = clock() - began
    finally:
        if loop is not None:
            loop.close()
    if on_step is not None and done < total:
        on_step(done, done)  # stopped early: the bar is full
    return ProfileResult(
        target=target,
        input_shape=shape,
        framework=framework,
        dtype=dtype,
        device=device,
        warmup=warmup,
        repeats=len(times[sizes[0]]),
        points=points,
        knee=find_knee(points),
        recommendation=recommend(points, sla_ms),
        time_budget_s=time_budget_s,
        elapsed_s=elapsed,
    )


def _batch(framework: str, batch_shape: tuple[int, ...], dtype: str, device: str) -> Any:
    """The input of one size, or a ValueError saying how much memory it needed."""
    try:
        return _make_input(framework, batch_shape, dtype, device)
    except MemoryError:
        nbytes = math.prod(batch_shape) * np.dtype(dtype).itemsize
        raise ValueError(
            f"not enough memory for a batch of shape {batch_shape} {dtype} "
            f"({nbytes / 2**30:,.1f} GiB)"
        ) from None
