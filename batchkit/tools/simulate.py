"""Discrete-event simulation of a batcher: which settings meet a latency target?

Arrivals (Poisson, or a trace of times) are fed to the real scheduler behind
`@batched` (`batchkit.serve.scheduler.Scheduler`) with simulated time; each batch it
forms "runs" for the latency model's time of its padded size and the cost of its
keys (`a + b * size + c * cost`). Nothing sleeps, so 100k requests take a second or
two, and the same seed gives the same numbers. With `keys` (each request's length)
a token budget cuts the batches as online, by the policy's `cost`; with
`max_latency_ms` the scheduler refuses and drops what would be late, as online, and
the result counts them and the goodput.

With `groups` (each request's group: drawn from a count or weights, or a trace's
group column) the policy gets `group=` and `max_groups_per_batch=`, grouped requests
go through the scheduler as `@batched(group=...)` sends them, a batch of `g` groups
runs `switch_ms * (g - 1)` longer, and the result holds each group's latency.

With `keys`, the result holds the shapes the batches were called with and the
padding they carried (`SimResult.shape_cost`): with `shapes` (a `ShapeBuckets`
grid) the grid cells reached, else each batch padded to its longest key; replaying
the same arrivals with and without a grid shows what the grid costs in padding
against the shapes a compiled model is built for.

Each of the `max_concurrent_batches` slots is assumed to run its batch as if
alone (replicas, or streams that do not slow each other down).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
import numbers
import re
import statistics
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from batchkit.batchers.base import Batcher
from batchkit.batchers.bucketed import BucketedBatcher
from batchkit.batchers.checks import positive_count
from batchkit.batchers.cost import BatchCost, CostLike, as_batch_cost
from batchkit.batchers.dynamic import DynamicBatcher
from batchkit.batchers.sorted import SortedBatcher
from batchkit.batchers.static import StaticBatcher
from batchkit.collate.shapes import ShapeBuckets
from batchkit.errors import Overloaded
from batchkit.serve.options import check_has_wait, check_latency_target, is_positive_finite
from batchkit.serve.request import DONE, RUNNING, WAITING, Request, new_request
from batchkit.serve.scheduler import FormedBatch, Scheduler, group_bucket
from batchkit.serve.targets import LearnedLatency


class LatencyModel:
    """Seconds a batch takes: `a + b * size + c * cost + s * (groups - 1)`, or a
    profile's curve in place of `a + b * size`.

    `size` is the padded batch size (what the function is called with); `cost` is the
    policy's cost of the batch's keys ([`BatchCost`][batchkit.batchers.cost.BatchCost]:
    batch size x longest key for `"padded"`, the default; the keys' total for
    `"sum"`), and 0 when the simulation has no keys. So `c` prices tokens, as
    [`LearnedLatency.per_cost_ms`][batchkit.serve.LearnedLatency] does online.
    `groups` is how many distinct groups the batch holds (1 without groups): `s`,
    `switch_ms`, prices each group past the first (loading another adapter, switching
    weights or a task's head).

    Args:
        fn: seconds a batch of `n` items takes, without the cost and switching terms
            (called once per size, then cached).
        description: how the size part reads in reports (`"5 ms + 0.5 ms x batch
            size"`); the cost and switching terms, if any, are appended.
        per_cost_ms: c, milliseconds per unit of a batch's cost (>= 0; default 0).
        switch_ms: s, milliseconds each group past the first adds to a batch (>= 0;
            default 0).

    Raises:
        ValueError: a `per_cost_ms` or `switch_ms` that is negative or not finite.
    """

    def __init__(
        self,
        fn: Callable[[int], float],
        description: str,
        *,
        per_cost_ms: float = 0.0,
        switch_ms: float = 0.0,
    ) -> None:
        _check_ms("per_cost_ms", per_cost_ms)
        _check_ms("switch_ms", switch_ms)
        self._fn = fn
        self._cache: dict[int, float] = {}
        self._per_cost_s = per_cost_ms / 1e3
        self._switch_s = switch_ms / 1e3
        self.per_cost_ms = float(per_cost_ms)
        self.switch_ms = float(switch_ms)
        if per_cost_ms:
            description += f" + {per_cost_ms:g} ms x batch cost"
        if switch_ms:
            description += f" + {switch_ms:g} ms x extra group"
        self.description = description

    @classmethod
    def linear(
        cls,
        fixed_ms: float,
        per_item_ms: float,
        per_cost_ms: float = 0.0,
        *,
        switch_ms: float = 0.0,
    ) -> LatencyModel:
        """`fixed_ms + per_item_ms * n + per_cost_ms * cost + switch_ms * (groups - 1)` ms.

        Args:
            fixed_ms: a, a batch's fixed time, in milliseconds (>= 0).
            per_item_ms: b, each item's time, in milliseconds (>= 0).
            per_cost_ms: c, the time per unit of the batch's cost (tokens, by the
                policy's `cost`), in milliseconds (>= 0; default 0).
            switch_ms: s, the time each group past the first adds to a batch, in
                milliseconds (>= 0; default 0).

        Raises:
            ValueError: a negative or infinite value, or `fixed_ms`, `per_item_ms`
                and `per_cost_ms` all 0.
        """
        for name, v in (("fixed_ms", fixed_ms), ("per_item_ms", per_item_ms)):
            _check_ms(name, v)
        _check_ms("per_cost_ms", per_cost_ms)
        if fixed_ms == per_item_ms == per_cost_ms == 0:
            raise ValueError("a latency model of 0 ms for every batch size cannot be simulated")
        return cls(
            lambda n: (fixed_ms + per_item_ms * n) / 1e3,
            f"{fixed_ms:g} ms + {per_item_ms:g} ms x batch size",
            per_cost_ms=per_cost_ms,
            switch_ms=switch_ms,
        )

    @classmethod
    def from_points(
        cls,
        sizes: Sequence[int],
        latencies_ms: Sequence[float],
        *,
        per_cost_ms: float = 0.0,
        switch_ms: float = 0.0,
    ) -> LatencyModel:
        """Measured (batch size, ms) points; linear in between, the last slope beyond.

        Points of the same size (repeated measurements) are averaged.

        Args:
            sizes: the measured batch sizes (>= 1).
            latencies_ms: each size's latency, in milliseconds (> 0).
            per_cost_ms: c, milliseconds per unit of batch cost added to the measured
                time (>= 0; default 0: the points hold the whole time).
            switch_ms: s, milliseconds each group past the first adds to a batch
                (>= 0; default 0: the points were measured on batches of one group).

        Raises:
            ValueError: no points, a size below 1, a latency that is not positive, or
                a bad `per_cost_ms` or `switch_ms`.
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
        return cls(lambda n: ms(n) / 1e3, desc, per_cost_ms=per_cost_ms, switch_ms=switch_ms)

    @classmethod
    def from_profile(
        cls, profile: Any, *, per_cost_ms: float = 0.0, switch_ms: float = 0.0
    ) -> LatencyModel:
        """From a [`ProfileResult`][batchkit.ProfileResult] or its JSON file.

        A profile times batches of one input shape, so it holds no lengths or cost:
        the cost term is `per_cost_ms`, 0 by default (the profiled shape's tokens are
        already in the measured per-item time). Give one only for what the profile
        did not exercise, knowing that it adds to the measured time; to fit `c`,
        serve with `max_latency_ms` and use
        [`from_learned`][batchkit.LatencyModel.from_learned].

        Args:
            profile: a `ProfileResult`, or the path of a `batchkit profile --json` file.
            per_cost_ms: c, milliseconds per unit of batch cost (>= 0; default 0).
            switch_ms: s, milliseconds each group past the first adds to a batch
                (>= 0; default 0: a profile times batches of one group).

        Raises:
            ValueError: the file cannot be read or holds no profile, or a bad
                `per_cost_ms` or `switch_ms`.
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
            return cls(
                model._fn,
                f"{model.description} from {profile}",
                per_cost_ms=per_cost_ms,
                switch_ms=switch_ms,
            )
        return cls.from_points(
            [p.batch_size for p in profile.points],
            [p.latency_ms for p in profile.points],
            per_cost_ms=per_cost_ms,
            switch_ms=switch_ms,
        )

    @classmethod
    def from_learned(
        cls, learned: LearnedLatency | None, *, with_margin: bool = False, switch_ms: float = 0.0
    ) -> LatencyModel:
        """The batch-time model a latency target learned online, to simulate with.

        Fit online with `@batched(max_latency_ms=...)`, then read
        [`Stats.latency_model`][batchkit.Stats] and replay other settings or loads
        against it.

        Args:
            learned: a [`LearnedLatency`][batchkit.serve.LearnedLatency] (`stats.latency_model`).
            with_margin: add its `margin_ms` (the recent residuals' upper quantile)
                to every batch: a pessimistic device. By default the fit alone, the
                device's typical time.
            switch_ms: s, milliseconds each group past the first adds to a batch
                (>= 0; default 0: the learned fit has no switching term).

        Raises:
            ValueError: `learned` is None (no latency target) or still warming up
                (it has not seen enough batches yet), or its coefficients are not
                finite numbers >= 0, or all 0, or a bad `switch_ms`.
        """
        if learned is None or learned.state == "warming":
            raise ValueError(
                "no learned latency model yet: stats.latency_model is None without a "
                "latency target (max_latency_ms), and its state is 'warming' until "
                "the target has seen enough batches"
            )
        fixed = learned.fixed_ms + (learned.margin_ms if with_margin else 0.0)
        model = cls.linear(fixed, learned.per_item_ms, learned.per_cost_ms, switch_ms=switch_ms)
        model.description = f"learned {model.description}"
        return model

    def seconds(self, n: int, cost: float = 0.0, groups: int = 1) -> float:
        """Simulated run time of a batch of `n` items whose keys cost `cost` and that
        holds `groups` distinct groups, in seconds.

        Args:
            n: the batch size the function is called with.
            cost: the policy's cost of the batch's keys (0 without keys).
            groups: the batch's distinct groups (1 without groups).
        """
        t = self._cache.get(n)
        if t is None:
            t = self._cache[n] = self._fn(n)
        if cost:
            t += self._per_cost_s * cost
        if groups > 1:
            t += self._switch_s * (groups - 1)
        return t

    def __repr__(self) -> str:
        return f"LatencyModel({self.description})"


def _check_ms(name: str, value: float) -> None:
    try:
        ok = math.isfinite(value) and value >= 0
    except TypeError:  # not a number
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


LatencyLike = LatencyModel | tuple[float, ...] | LearnedLatency | str | Path | Any


def as_latency_model(latency: LatencyLike) -> LatencyModel:
    """A model from `(a, b)`, `(a, b, c)` or `(a, b, c, s)` ms, a learned model, a
    profile, or itself.

    Args:
        latency: a [`LatencyModel`][batchkit.LatencyModel], a `(fixed_ms,
            per_item_ms)`, `(fixed_ms, per_item_ms, per_cost_ms)` or `(fixed_ms,
            per_item_ms, per_cost_ms, switch_ms)` tuple, a
            [`LearnedLatency`][batchkit.serve.LearnedLatency], or a profile (result
            or JSON path).

    Raises:
        ValueError: a tuple of another length, or a bad value (see the constructors).
    """
    if isinstance(latency, LatencyModel):
        return latency
    if isinstance(latency, tuple):
        if len(latency) not in (2, 3, 4):
            raise ValueError(
                "a latency tuple is (fixed_ms, per_item_ms), (fixed_ms, per_item_ms, "
                f"per_cost_ms) or (fixed_ms, per_item_ms, per_cost_ms, switch_ms), got "
                f"{len(latency)} values"
            )
        values = [float(v) for v in latency]
        return LatencyModel.linear(*values[:3], switch_ms=values[3] if len(values) == 4 else 0.0)
    if isinstance(latency, LearnedLatency):
        return LatencyModel.from_learned(latency)
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
    times, _, _ = _read_trace_rows(path)
    arr = np.sort(np.array(times, dtype=np.float64))
    shifted: np.ndarray = arr - arr[0]
    return shifted


def read_trace_lengths(path: str | Path) -> tuple[np.ndarray, list[int]]:
    """Arrival times and request lengths from a CSV trace: `time,length` per line.

    As `read_trace` (comments, a header row, sorted and shifted to start at 0), with
    each line's second column, an int >= 0, as that request's length (its key), in
    the order of the returned times.

    Args:
        path: the trace file.

    Raises:
        ValueError: the file cannot be read, or a line lacks a time or a length.
    """
    times, lengths, _ = _read_trace_rows(path, with_lengths=True)
    order = np.argsort(np.array(times, dtype=np.float64), kind="stable")
    arr = np.array(times, dtype=np.float64)[order]
    shifted: np.ndarray = arr - arr[0]
    return shifted, [lengths[i] for i in order.tolist()]


GROUP_COLUMN = "group"  # the header of a trace's group column


def read_trace_groups(path: str | Path) -> tuple[np.ndarray, list[str]]:
    """Arrival times and request groups from a CSV trace with a `group` column.

    As `read_trace` (comments, sorted and shifted to start at 0), with each line's
    field in the column its header row names `group` (case and spaces aside; such as
    `time,length,group`) as that request's group (its adapter, model or task), as
    text, in the order of the returned times. Times that tie keep the file's order,
    as `read_trace_lengths` keeps them, so the lengths and the groups of one trace
    line up.

    Args:
        path: the trace file.

    Raises:
        ValueError: the file cannot be read, it has no header row naming a `group`
            column, or a line lacks a time or a group.
    """
    times, _, groups = _read_trace_rows(path, with_groups=True)
    order = np.argsort(np.array(times, dtype=np.float64), kind="stable")
    arr = np.array(times, dtype=np.float64)[order]
    shifted: np.ndarray = arr - arr[0]
    return shifted, [groups[i] for i in order.tolist()]


KEY_COLUMN = "key"  # the header of a trace's coalescing-key column


def read_trace_keys(path: str | Path) -> tuple[np.ndarray, list[str]]:
    """Arrival times and coalescing keys from a CSV trace with a `key` column.

    As `read_trace_groups`, for the column headed `key` (such as `time,length,key`):
    each request's key as text (a query, a document's hash), for
    `simulate(duplicates=...)`.

    Args:
        path: the trace file.

    Raises:
        ValueError: the file cannot be read, it has no header row naming a `key`
            column, or a line lacks a time or a key.
    """
    times, _, found = _read_trace_rows(path, with_groups=True, column=KEY_COLUMN)
    order = np.argsort(np.array(times, dtype=np.float64), kind="stable")
    arr = np.array(times, dtype=np.float64)[order]
    shifted: np.ndarray = arr - arr[0]
    return shifted, [found[i] for i in order.tolist()]


def _read_trace_rows(
    path: str | Path,
    *,
    with_lengths: bool = False,
    with_groups: bool = False,
    column: str = GROUP_COLUMN,
) -> tuple[list[float], list[int], list[str]]:
    """Each data line's time (with its length, the second column, and its group, the
    column headed `column`, when asked), in the file's order."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read trace file {str(path)!r}: {exc}") from None
    times: list[float] = []
    lengths: list[int] = []
    groups: list[str] = []
    header: list[str] | None = None
    group_column: int | None = None
    for lineno, line in enumerate(lines, 1):
        fields = [f.strip() for f in line.split("#", 1)[0].split(",")]
        text = fields[0]
        if not text:
            continue
        try:
            t = float(text)
        except ValueError:
            if not (times or header) and re.search("[A-Za-z_]", text):
                header = [f.lower() for f in fields]  # a CSV's header row (docs/cli.md)
                if column in header:
                    group_column = header.index(column)
                continue
            raise ValueError(f"{path}:{lineno}: not an arrival time in seconds: {text!r}") from None
        if not math.isfinite(t):
            raise ValueError(f"{path}:{lineno}: arrival time must be finite, got {text!r}")
        if with_groups and group_column is None:
            named = "has no header row" if header is None else f"header {','.join(header)!r}"
            raise ValueError(
                f"{path}: no {column!r} column: the trace {named}; a header row such "
                f"as time,length,{column} names the column of each request's {column}"
            )
        times.append(t)
        if with_lengths:
            length = fields[1] if len(fields) > 1 else ""
            lengths.append(_length(length, f"{path}:{lineno}: second column"))
        if group_column is not None and with_groups:
            group = fields[group_column] if len(fields) > group_column else ""
            if not group:
                raise ValueError(
                    f"{path}:{lineno}: no {column} in column {group_column + 1} ({column!r})"
                )
            groups.append(group)
    if not times:
        raise ValueError(f"trace file {str(path)!r} holds no arrival times")
    return times, lengths, groups


def _length(text: str, where: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{where}: not a length (an int >= 0): {text!r}")
    return n


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
        if text:
            lengths.append(_length(text, f"{path}:{lineno}"))
    if not lengths:
        raise ValueError(f"lengths file {str(path)!r} holds no lengths")
    return lengths


LENGTH_DISTRIBUTIONS = ("uniform", "lognormal")


def sample_lengths(spec: str, count: int, seed: int = 0) -> list[int]:
    """`count` request lengths drawn from a distribution named by `spec`.

    - `uniform:LO,HI`: ints from LO to HI, both included (0 <= LO <= HI);
    - `lognormal:MEDIAN,SIGMA`: `MEDIAN * exp(SIGMA * N(0, 1))`, rounded, at least
      1 (MEDIAN > 0, SIGMA >= 0): the long tail of prompt lengths.

    Args:
        spec: the distribution and its parameters, as above.
        count: how many lengths (>= 1).
        seed: the random seed.

    Raises:
        ValueError: an unknown distribution, or parameters out of range.
    """
    name, _, params = spec.partition(":")
    if name not in LENGTH_DISTRIBUTIONS:
        raise ValueError(
            f"unknown length distribution {name!r}: expected uniform:LO,HI or "
            f"lognormal:MEDIAN,SIGMA, got {spec!r}"
        )
    try:
        a, b = (float(v) for v in params.split(","))
    except ValueError:
        raise ValueError(f"{name} takes two numbers ({name}:X,Y), got {spec!r}") from None
    count = positive_count("count", count)
    rng = np.random.default_rng(seed)
    if name == "uniform":
        if not (a.is_integer() and b.is_integer() and 0 <= a <= b):
            raise ValueError(f"uniform:LO,HI needs ints 0 <= LO <= HI, got {spec!r}")
        return [int(n) for n in rng.integers(int(a), int(b), size=count, endpoint=True).tolist()]
    if not (math.isfinite(a) and a > 0 and math.isfinite(b) and b >= 0):
        raise ValueError(f"lognormal:MEDIAN,SIGMA needs MEDIAN > 0 and SIGMA >= 0, got {spec!r}")
    drawn = np.maximum(np.rint(a * np.exp(b * rng.standard_normal(count))), 1)
    if not np.isfinite(drawn).all() or drawn.max() > 2**53:
        raise ValueError(f"{spec!r} draws lengths too large to count")
    return [int(n) for n in drawn.tolist()]


GroupsLike = int | Mapping[Hashable, float] | Sequence[Hashable] | np.ndarray
# The groups are drawn from a stream of their own: drawn from the arrivals' stream
# (the same seed), a request's group would follow the gap before it.
_GROUP_STREAM = 1


def sample_groups(
    groups: int | Mapping[Hashable, float], count: int, seed: int = 0, *, skew: float = 0.0
) -> list[Hashable]:
    """`count` request groups drawn from a number of groups or from weights.

    - an int `n`: groups `0 .. n-1`, group `k` drawn with weight `1 / (k + 1) ** skew`
      (Zipf: group 0 the most requested; `skew` 0, the default, draws them evenly);
    - a mapping `{group: weight}`: each group in proportion to its weight (>= 0,
      not all 0).

    The same seed gives the same groups; they are drawn independently of the
    Poisson arrivals of that seed.

    Args:
        groups: how many groups, or each group's weight.
        count: how many requests (>= 1).
        seed: the random seed.
        skew: the Zipf exponent for an int `groups` (a finite number >= 0).

    Raises:
        ValueError: a count of groups below 1, an empty mapping, a weight that is
            negative or not finite, weights all 0, a bad `skew`, or a `skew` with a
            mapping (its weights say it all).
        TypeError: `groups` is neither an int nor a mapping.
    """
    count = positive_count("count", count)
    _check_skew("group_skew", skew)
    if isinstance(groups, Mapping):
        if skew:
            raise ValueError(
                f"group_skew={skew!r} is for a number of groups: the weights of the "
                "groups given say how often each is drawn"
            )
        names: list[Hashable] = list(groups)
        if not names:
            raise ValueError("groups is an empty mapping: give at least one group's weight")
        for name in names:
            weight = groups[name]
            if not (_is_number(weight) and math.isfinite(weight) and weight >= 0):
                raise ValueError(
                    f"group {name!r}: its weight must be a finite number >= 0, got {weight!r}"
                )
        weights = np.array([float(groups[name]) for name in names], dtype=np.float64)
        if weights.sum() == 0:
            raise ValueError("every group's weight is 0: at least one must be drawn")
    elif isinstance(groups, numbers.Integral) and not isinstance(groups, bool):
        if groups < 1:
            raise ValueError(f"groups must be a number of groups >= 1, got {groups!r}")
        names = list(range(int(groups)))
        weights = _zipf_weights(len(names), skew)
    else:
        raise TypeError(
            f"groups to draw from must be a number of groups or a mapping of group -> "
            f"weight, got {type(groups).__name__}"
        )
    return [names[k] for k in _draw(weights, count, seed, _GROUP_STREAM)]


_DUPLICATE_STREAM = 2  # (the duplicates' draws: independent of the groups' of a seed)


def sample_duplicates(keys: int, count: int, seed: int = 0, *, skew: float = 1.0) -> list[int]:
    """`count` coalescing keys drawn from `keys` distinct ones, key `k` with weight
    `1 / (k + 1) ** skew` (Zipf: key 0 the most requested), for
    `simulate(duplicates=...)`. The same seed gives the same keys, drawn independently
    of the arrivals and groups of that seed.

    Args:
        keys: how many distinct keys (>= 1).
        count: how many requests (>= 1).
        seed: the random seed.
        skew: the Zipf exponent (a finite number >= 0; default 1).

    Raises:
        ValueError: a count below 1 or a bad `skew`.
    """
    keys = positive_count("keys", keys)
    count = positive_count("count", count)
    _check_skew("skew", skew)
    return _draw(_zipf_weights(keys, skew), count, seed, _DUPLICATE_STREAM)


def _check_skew(name: str, skew: float) -> None:
    if not (_is_number(skew) and math.isfinite(skew) and skew >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {skew!r}")


def _zipf_weights(n: int, skew: float) -> np.ndarray:
    """Rank k's weight, 1 / (k + 1) ** skew, for ranks 0 .. n-1."""
    return 1.0 / np.arange(1, n + 1, dtype=np.float64) ** skew


def _draw(weights: np.ndarray, count: int, seed: int, stream: int) -> list[int]:
    """`count` indices drawn in proportion to `weights`, from `seed`'s stream `stream`
    (each kind of draw its own, so that they are independent of one another)."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream,)))
    drawn: list[int] = rng.choice(len(weights), size=count, p=weights / weights.sum()).tolist()
    return drawn


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
class GroupSummary:
    """One group's share of a simulated run (`SimResult.groups`).

    Attributes:
        requests: requests of the group replayed.
        served: those that ran.
        batches: batches that held at least one of its requests.
        latency: arrival to batch end, of its served requests.
    """

    requests: int
    served: int
    batches: int
    latency: LatencySummary


@dataclass(frozen=True)
class ShapeCost:
    """The shapes a simulated run's batches were called with, and their padding
    (`SimResult.shape_cost`): what a compiled model pays for them.

    A shape is `(batch size, length)`: with a grid, the cell a batch was padded to
    (its grid batch size, the grid length of its longest key); without one, its
    real size and its longest key (rounded up), as `pad` lays it out. Each shape is
    a compilation (or a captured graph) for a model built for static shapes.

    Attributes:
        grid: the [`ShapeBuckets`][batchkit.ShapeBuckets] the policy padded to;
            None without a grid.
        shapes: each shape called -> the batches called with it, ascending.
        real_tokens: the keys (lengths) of the requests that ran, summed.
        padded_tokens: batch size x length of every batch, summed: the slots the
            function computes over, dummy rows and padding included.
        dummy_rows: rows added to batches to reach a grid batch size.
    """

    grid: ShapeBuckets | None
    shapes: dict[tuple[int, int], int]
    real_tokens: float
    padded_tokens: int
    dummy_rows: int

    @property
    def compiled(self) -> int:
        """How many distinct shapes the batches were called with (grid cells
        reached, with a grid)."""
        return len(self.shapes)

    @property
    def cells(self) -> int | None:
        """How many cells the grid has; None without a grid."""
        return None if self.grid is None else len(self.grid.cells)

    @property
    def padding(self) -> float:
        """Padded slots over real tokens (1.0: no padding; inf when every key is 0
        and something was padded; NaN when nothing ran)."""
        if self.real_tokens:
            return self.padded_tokens / self.real_tokens
        return math.inf if self.padded_tokens else math.nan


@dataclass(frozen=True)
class SimResult:
    """What a simulated run measured. Latencies run from arrival to batch end.

    Every request replayed is counted once: `served + overloaded + shed + rejected
    == requests`.

    Attributes:
        requests: arrivals replayed.
        served: requests that ran.
        rejected: requests refused with `QueueFull` (`max_queue_size`).
        overloaded: requests refused at admission with
            [`Overloaded`][batchkit.Overloaded]: under `max_latency_ms`, predicted
            to be answered too late.
        shed: admitted requests dropped with `Overloaded` before they ran: they
            could no longer be answered in time.
        on_time: served requests answered within `goodput_ms`.
        goodput: `on_time` per second over `duration_s`.
        goodput_fraction: `on_time` as a fraction of `requests` (what was offered).
        max_latency_ms: the latency target the scheduler enforced; None for none.
        goodput_ms: the latency within which an answer counts for `goodput`
            (`max_latency_ms` unless given); None: every answer counts.
        duration_s: first arrival to the later of the last batch end and the last
            arrival, in seconds.
        offered_rate: requests/s in the arrivals; NaN when they all share one time.
        throughput: served requests/s over `duration_s`.
        capacity: requests/s when every slot runs full batches back to back (with
            `keys` and a cost term, of the mean cost of the full batches the keys
            make in arrival order within each bucket: a lower bound for a sorted
            policy, whose batches pad less).
        utilization: the fraction of slot-time spent running batches.
        latency: arrival to batch end, of the served requests.
        queue_wait: arrival to dispatch, of the served requests.
        batches: batches run.
        mean_batch_size: real items per batch, averaged.
        mean_batch_cost: a batch's cost by the policy's `cost` (its padded area by
            default, its total tokens under `"sum"`; under `shapes`, its cell's
            area: what the function computes over), averaged; NaN without `keys`.
        batch_sizes: real items per batch -> number of batches.
        dispatch_reasons: why batches left (`"full"`, `"idle"`, `"deadline"`, ...)
            -> how many.
        batcher: the policy's settings, as `describe_batcher` names them.
        latency_model: the latency model's description.
        learned_latency: under `max_latency_ms`, the batch-time model the scheduler
            learned from the simulated batches
            ([`LearnedLatency`][batchkit.serve.LearnedLatency]); None otherwise.
        max_concurrent_batches: batches that ran at once.
        latencies_s: each request's latency in seconds, in the order of the arrivals
            as given; NaN if it did not run (rejected, overloaded or shed).
        batch_log: `(start, end, size)` of every batch.
        warnings: settings that make the run meaningless, in words (a latency target
            or goodput threshold shorter than one batch's time); each was also
            issued as a `batchkit.tools.simulate.SimulationWarning`.
        max_groups_per_batch: with groups, the policy's limit; None without.
        groups: with groups, each group's requests, batches and latency
            (`batchkit.tools.simulate.GroupSummary`), the most
            requested first; empty without groups.
        batch_groups: with groups, each batch's number of distinct groups, in the
            order of `batch_log`; empty without groups.
        coalesced: with `duplicates`, requests that joined one of the same key
            waiting or running: answered with it, without a row of their own (the
            device work saved); counted in `served` (or `shed`, with a request that
            was shed).
        shape_cost: with `keys`, the shapes the batches were called with and the
            padding they carried ([`ShapeCost`][batchkit.tools.simulate.ShapeCost]):
            the grid's cells under `shapes`; None without keys.
    """

    requests: int
    served: int
    rejected: int
    overloaded: int
    shed: int
    on_time: int
    goodput: float
    goodput_fraction: float
    max_latency_ms: float | None
    goodput_ms: float | None
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
    learned_latency: LearnedLatency | None
    max_concurrent_batches: int
    latencies_s: np.ndarray = field(repr=False)
    batch_log: list[tuple[float, float, int]] = field(repr=False)
    warnings: tuple[str, ...] = ()
    max_groups_per_batch: int | None = None
    groups: dict[Hashable, GroupSummary] = field(default_factory=dict)
    batch_groups: list[int] = field(default_factory=list, repr=False)
    coalesced: int = 0
    shape_cost: ShapeCost | None = None

    @property
    def groups_per_batch(self) -> dict[int, int]:
        """Distinct groups in a batch -> number of batches; empty without groups."""
        counts: dict[int, int] = {}
        for g in self.batch_groups:
            counts[g] = counts.get(g, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def mean_groups_per_batch(self) -> float:
        """Distinct groups per batch, averaged; NaN without groups (or batches)."""
        return statistics.fmean(self.batch_groups) if self.batch_groups else math.nan

    @property
    def worst_group(self) -> Hashable | None:
        """The group whose served requests have the highest p99 latency (the first of
        the most requested on a tie); None without groups or without a served request."""
        served = [(g, s.latency.p99) for g, s in self.groups.items() if s.served]
        if not served:
            return None
        return max(served, key=lambda gp: gp[1])[0]

    @property
    def worst_group_p99(self) -> float:
        """The p99 latency of `worst_group`, in milliseconds; NaN when there is none."""
        worst = self.worst_group
        return math.nan if worst is None else self.groups[worst].latency.p99


def describe_batcher(policy: Batcher) -> str:
    """A short name for the settings that matter: `DynamicBatcher(max_batch_size=32, ...)`.

    Args:
        policy: the batching policy.
    """
    wait = "" if policy.max_wait_s is None else f", max_wait_ms={policy.max_wait_s * 1e3:g}"
    tokens = "" if policy.max_tokens is None else f", max_tokens={policy.max_tokens}"
    if policy.max_tokens is not None and policy.cost.name != "padded":
        tokens += f", cost={policy.cost!r}"
    if policy.shapes is not None:  # (a bucketed policy's boundaries are the grid's lengths)
        grid = policy.shapes
        buckets = f", shapes={list(grid.batch_sizes)}x{list(grid.lengths)}"
    elif isinstance(policy, BucketedBatcher):
        buckets = f", boundaries={list(policy.boundaries)}"
    else:
        buckets = ""
    if policy.group is not None:
        buckets += f", max_groups_per_batch={policy.max_groups_per_batch}"
    return f"{type(policy).__name__}(max_batch_size={policy.max_batch_size}{wait}{tokens}{buckets})"


POLICIES = ("dynamic", "static", "bucketed", "sorted")
GRID_POLICIES = ("dynamic", "bucketed")  # the built policies that take a ShapeBuckets
DEFAULT_BUCKETS = 4  # equal-token buckets of a bucketed policy, at most one per length
DEFAULT_MAX_WAIT_MS = 5.0  # a built policy's wait when none is given (as @batched's)


def _make_batcher(
    policy: str,
    max_batch_size: int,
    max_wait_ms: float | None,
    max_tokens: int | None,
    cost: CostLike | BatchCost,
    keys: Sequence[float] | None,
    buckets: int | Sequence[float] | None,
    groups: Sequence[Hashable] | None,
    max_groups_per_batch: int | None,
    shapes: ShapeBuckets | None = None,
) -> Batcher:
    """The policy named, with the key `@batched(key=len)` would give it when there are keys.

    With a key the scheduler knows each request's length, so a latency target learns
    the cost term of the batch times too. With groups its `group` maps a request (its
    index in the arrivals, the simulated item) to its group, as `group=` maps an item
    online. With `shapes` the dynamic or bucketed policy takes the grid (the bucketed
    one's boundaries are its lengths).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(map(repr, POLICIES))}, got {policy!r}")
    if buckets is not None and policy != "bucketed":
        raise ValueError(f"buckets is for policy='bucketed', not {policy!r}")
    if shapes is not None:
        if policy not in GRID_POLICIES:
            raise ValueError(
                f"shapes is for policy='dynamic' or 'bucketed' (which take a ShapeBuckets), "
                f"not {policy!r}"
            )
        if buckets is not None:
            raise ValueError(
                "buckets and shapes both cut the lengths: the grid's lengths are the "
                "bucketed policy's boundaries, give shapes alone"
            )
    key = None if keys is None else len
    if policy in ("bucketed", "sorted") and keys is None:
        raise ValueError(f"policy={policy!r} groups requests by length: pass keys=")
    wait = DEFAULT_MAX_WAIT_MS if max_wait_ms is None else max_wait_ms
    grouping: dict[str, Any] = {}
    if groups is not None:
        grouping = {"group": groups.__getitem__, "max_groups_per_batch": max_groups_per_batch}
    if shapes is not None:
        grouping["shapes"] = shapes
    if policy == "dynamic":
        return DynamicBatcher(
            max_batch_size, wait, max_tokens=max_tokens, cost=cost, key=key, **grouping
        )
    if policy == "static":
        if max_tokens is not None:
            raise ValueError(
                "max_tokens is not for policy='static': a static batch is a fixed size"
            )
        static = StaticBatcher(max_batch_size, **grouping)
        check_has_wait(static, max_wait_ms)  # a wait it would ignore: refused, as configure does
        # It has no budget, but the latency model's cost term counts by this cost.
        static.cost, static.key = as_batch_cost(cost), key
        return static
    options: dict[str, Any] = {
        "max_wait_ms": wait,
        "max_tokens": max_tokens,
        "cost": cost,
        **grouping,
    }
    if policy == "sorted":
        return SortedBatcher(batch_size=max_batch_size, **options)
    assert keys is not None
    if shapes is not None:
        return BucketedBatcher(max_batch_size=max_batch_size, **options)
    if buckets is None or isinstance(buckets, int):
        lengths = [math.ceil(k) for k in keys]
        count = min(DEFAULT_BUCKETS, len(set(lengths))) if buckets is None else buckets
        return BucketedBatcher.from_lengths(
            lengths, num_buckets=count, max_batch_size=max_batch_size, **options
        )
    return BucketedBatcher(buckets, max_batch_size=max_batch_size, **options)


def simulate(
    latency: LatencyLike = (5.0, 0.5),
    *,
    rate: float | None = None,
    num_requests: int = 10_000,
    arrivals: Sequence[float] | np.ndarray | None = None,
    seed: int = 0,
    batcher: Batcher | None = None,
    policy: str = "dynamic",
    max_batch_size: int | None = None,
    max_wait_ms: float | None = None,
    max_concurrent_batches: int = 1,
    max_queue_size: int | None = None,
    max_latency_ms: float | None = None,
    goodput_ms: float | None = None,
    keys: Sequence[float] | None = None,
    max_tokens: int | None = None,
    cost: CostLike | BatchCost = "padded",
    buckets: int | Sequence[float] | None = None,
    groups: GroupsLike | None = None,
    group_skew: float | None = None,
    max_groups_per_batch: int | None = None,
    duplicates: Sequence[Hashable] | None = None,
    shapes: ShapeBuckets | None = None,
) -> SimResult:
    """Replay arrivals against a batcher and a latency model; see the module docstring.

    A batch of padded size `n` whose keys cost `cost` (by the policy's `cost`; 0
    without `keys`) runs for `latency.seconds(n, cost)`. At the end of the arrivals
    the batcher closes, so a static batcher's partial tail is still served.

    With `max_latency_ms` the scheduler enforces the target as `@batched` does: it
    learns the batch times from the simulated batches, refuses requests it predicts
    late ([`Overloaded`][batchkit.Overloaded], counted as `overloaded`), drops
    waiting ones that can no longer be in time (`shed`), and cuts batches so their
    most urgent member is in time. `goodput` counts the answers within the target.

    With `groups` each request has a group (an adapter, a model, a task), the
    policy has `group=` and `max_groups_per_batch=` as `@batched(group=...)` gives
    them, and the requests reach the scheduler as a grouped function sends them: a
    batch holds at most `max_groups_per_batch` groups, the oldest group first. A
    batch of `g` groups runs the latency model's `switch_ms * (g - 1)` longer, and
    the result holds each group's latency (`groups`, `worst_group`) and the groups
    per batch (`mean_groups_per_batch`): simulate a few `max_groups_per_batch`
    values to choose one.

    With `shapes` (a [`ShapeBuckets`][batchkit.ShapeBuckets] grid, and `keys`) the
    policy pads each batch up to a grid batch size and batches requests by the grid
    length they pad to, as `@batched(shapes=...)` does; a batch runs for its cell
    (`latency.seconds(batch size, batch size x length)`: the cost term counts the
    cell's area). `SimResult.shape_cost` holds the cells reached and the padding
    paid; replay the same arrivals without `shapes` for the shapes and padding of a
    run without a grid (each batch padded to its longest key).

    Args:
        latency: `(fixed_ms, per_item_ms)` or `(fixed_ms, per_item_ms, per_cost_ms)`,
            a [`LatencyModel`][batchkit.LatencyModel], a learned model
            ([`LearnedLatency`][batchkit.serve.LearnedLatency]), or a profile
            (result or JSON path).
        rate: Poisson arrivals, in requests/s (when `arrivals` is not given).
        num_requests: how many Poisson arrivals.
        arrivals: arrival times in seconds, instead of `rate`.
        seed: the seed of the Poisson arrivals.
        batcher: a policy instance; else one is built from `policy`,
            `max_batch_size`, `max_wait_ms`, `max_tokens`, `cost` and `buckets`.
        policy: `"dynamic"` ([`DynamicBatcher`][batchkit.DynamicBatcher]),
            `"static"` ([`StaticBatcher`][batchkit.StaticBatcher]), `"bucketed"`
            ([`BucketedBatcher`][batchkit.BucketedBatcher]) or `"sorted"`
            ([`SortedBatcher`][batchkit.SortedBatcher]); the last two need `keys`.
            Built with `keys`, the policy has a key (as `@batched(key=len)`), so a
            latency target learns the cost term too.
        max_batch_size: the built policy's largest batch; None (the default): 32, or
            with `shapes` the grid's largest batch size.
        max_wait_ms: the built policy's wait, in milliseconds; None (the default):
            5 ms for a policy that waits. Refused for `"static"` (a static batch
            waits until full) and beside `batcher`, rather than ignored.
        max_concurrent_batches: batches that run at once, each as if alone.
        max_queue_size: waiting requests beyond this are rejected; None: unbounded.
        max_latency_ms: each request's latency target, in milliseconds, as
            `@batched(max_latency_ms=)`; None (the default): none.
        goodput_ms: an answer within this many milliseconds counts for `goodput`;
            default `max_latency_ms` (give it without a target to measure the
            goodput an untargeted run would have); both None: every answer counts.
        keys: each request's key (its length), in the order of `arrivals`: for
            bucketed, sorted or token-budget policies, and the cost term.
        max_tokens: the built policy's token budget (needs `keys`; not static).
        cost: what `max_tokens` bounds and the latency model's cost term counts:
            `"padded"`, `"sum"` or a callable
            ([`as_batch_cost`][batchkit.batchers.cost.as_batch_cost]).
        buckets: the built bucketed policy's buckets: their boundaries, or how many
            of equal tokens to cut from `keys`; default up to 4 of equal tokens.
        groups: each request's group: a sequence of hashable groups in the order of
            `arrivals` (a trace's: `batchkit.tools.simulate.read_trace_groups`); or
            drawn with `seed`, independently of the arrivals
            (`batchkit.tools.simulate.sample_groups`): an int `n`,
            groups `0 .. n-1` by Zipf weights of exponent `group_skew`, or a mapping
            `{group: weight}`. None (the default): no groups.
        group_skew: the Zipf exponent of an int `groups` (>= 0; None, the default:
            0, every group equally often); group `k` is drawn with weight
            `1 / (k + 1) ** group_skew`.
        max_groups_per_batch: the built policy's most groups in one batch (needs
            `groups`; default 1, as `group=` without it). A `batcher` given brings
            its own (it must have `group=`; its group function is not called: the
            requests' groups are `groups`).
        duplicates: each request's coalescing key, in the order of `arrivals`, as
            `@batched(coalesce=...)` computes it (equal keys, equal results): a
            request whose key (with its group, if any) is waiting or running joins
            it and runs no row of its own; it is answered when that request is
            (`SimResult.coalesced` counts them). None (the default): every request
            runs.
        shapes: a [`ShapeBuckets`][batchkit.ShapeBuckets] grid for the built policy
            (`"dynamic"` or `"bucketed"`, whose boundaries are its lengths); needs
            `keys`. Beside `batcher` it must be the batcher's own (a batcher built
            with `shapes=` brings it). None (the default): no grid.

    Raises:
        ValueError: neither `rate` nor `arrivals`, `keys` of another length, a token
            budget without `keys`, `max_wait_ms`/`max_tokens`/`cost` given with
            `batcher`, `max_wait_ms` for `policy="static"`, an
            unknown `policy`, a bucketed or sorted policy without `keys`, a target
            or goodput threshold that is not a positive number, or a latency model
            whose batches take no time without `keys`; `groups` of another length,
            bad weights or counts (see `sample_groups`), `group_skew` without an int
            `groups`, `max_groups_per_batch` without `groups` or beside `batcher`,
            a `batcher` with `group=` without `groups` or one without `group=`
            with them; `duplicates` of another length; `shapes` without `keys`,
            with a `max_batch_size` below its largest batch size,
            for a static or sorted policy, beside `buckets` or beside a batcher
            with other shapes, or a key longer than the grid's largest length
            (naming the request); also when the policy's
            `select` picks nothing, or a batch's end overflows (the replay could
            never end).
        TypeError: `groups` of another type, such as a string, or an unhashable
            group; `shapes` that is not a `ShapeBuckets`.

    Warns:
        SimulationWarning: `max_latency_ms` or `goodput_ms` is shorter than the
            quickest batch (one request alone): nothing can be in time, so the run's
            throughput says nothing about the target (also in `SimResult.warnings`).
    """
    # Zero slots never dispatch: the replay would wait forever. (Counts from a YAML or
    # JSON config may come as 4.0: taken, and used as ints from here on.)
    max_concurrent_batches = positive_count("max_concurrent_batches", max_concurrent_batches)
    max_queue_size = positive_count("max_queue_size", max_queue_size, allow_none=True)
    grid = _grid_of(shapes, batcher, keys)
    if max_batch_size is None:
        max_batch_size = 32 if grid is None else grid.max_batch_size
    elif shapes is not None and max_batch_size < shapes.max_batch_size:
        raise ValueError(
            f"max_batch_size={max_batch_size} is below the grid's largest batch size "
            f"({shapes.max_batch_size}): the grid's batch sizes set the largest batch "
            f"(leave max_batch_size out, or drop the sizes above {max_batch_size} from it)"
        )
    max_batch_size = positive_count("max_batch_size", max_batch_size)
    max_tokens = positive_count("max_tokens", max_tokens, allow_none=True)
    check_latency_target(max_latency_ms)  # (the check of @batched and configure())
    if goodput_ms is not None and not is_positive_finite(goodput_ms):
        raise ValueError(
            f"goodput_ms must be a positive number of milliseconds, got {goodput_ms!r}"
        )
    if batcher is not None and (
        max_tokens is not None or cost != "padded" or buckets is not None or max_wait_ms is not None
    ):
        raise ValueError(
            "max_wait_ms, max_tokens, cost and buckets are set on the batcher given, not here"
        )
    if max_tokens is not None and keys is None:
        raise ValueError("max_tokens needs keys= (each request's length) to cut batches by")
    _check_group_options(groups, max_groups_per_batch, batcher)
    max_groups_per_batch = positive_count(
        "max_groups_per_batch", max_groups_per_batch, allow_none=True
    )
    model = as_latency_model(latency)
    if keys is None and model.seconds(1) == 0:
        raise ValueError(
            f"latency model {model.description}: a batch without keys would take 0 ms "
            "(its time is all in the cost term): pass keys= (each request's length)"
        )
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
    if duplicates is not None and len(duplicates) != len(times):
        raise ValueError(f"duplicates has {len(duplicates)} entries for {len(times)} arrivals")
    request_groups = _request_groups(groups, group_skew, len(times), seed)
    # keys[i] and groups[i] belong to arrivals[i]: sort them together (stable: ties keep
    # the given order).
    order = np.argsort(times, kind="stable")
    times = times[order]
    if keys is not None:
        keys = [keys[i] for i in order.tolist()]
    if request_groups is not None:
        request_groups = [request_groups[i] for i in order.tolist()]
    joins = None
    if duplicates is not None:
        ordered = [duplicates[i] for i in order.tolist()]
        joins = _Joins(ordered if request_groups is None else list(zip(request_groups, ordered)))
    policy_obj = batcher or _make_batcher(
        policy,
        max_batch_size,
        max_wait_ms,
        max_tokens,
        cost,
        keys,
        buckets,
        request_groups,
        max_groups_per_batch,
        shapes,
    )
    sched = Scheduler(
        policy_obj,
        max_queue_size=max_queue_size,
        max_concurrent_batches=max_concurrent_batches,
        max_latency_s=None if max_latency_ms is None else max_latency_ms / 1e3,
    )
    replay = _replay(sched, times, model, keys, request_groups, joins)
    lost = 0 if joins is None else joins.settle(replay)
    threshold = max_latency_ms if goodput_ms is None else goodput_ms
    result = _summarise(sched, times, replay, model, policy_obj, keys, max_latency_ms, threshold)
    if joins is not None:
        # (A request that joined one shed shares its fate: counted as shed too.)
        result = dataclasses.replace(
            result, coalesced=len(joins.leader_of), shed=result.shed + lost
        )
    if request_groups is not None:
        result = dataclasses.replace(
            result,
            max_groups_per_batch=policy_obj.max_groups_per_batch,
            groups=_group_summaries(request_groups, result.latencies_s, replay.group_batches),
            batch_groups=replay.batch_groups,
        )
    given = np.empty_like(result.latencies_s)  # back in the order the caller gave
    given[order] = result.latencies_s
    found = _target_warnings(model, policy_obj, keys, max_latency_ms, goodput_ms)
    for message in found:
        warnings.warn(message, SimulationWarning, stacklevel=2)
    return dataclasses.replace(result, latencies_s=given, warnings=found)


def _grid_of(
    shapes: ShapeBuckets | None, batcher: Batcher | None, keys: Sequence[float] | None
) -> ShapeBuckets | None:
    """The grid the run pads to (`shapes`, or the batcher's own), checked against the
    batcher and the keys: every key must fit its largest length."""
    if shapes is not None and not isinstance(shapes, ShapeBuckets):
        raise TypeError(f"shapes must be a ShapeBuckets, got {type(shapes).__name__}")
    if batcher is not None and shapes is not None and batcher.shapes != shapes:
        raise ValueError(
            f"shapes={shapes!r} but the batcher given has shapes={batcher.shapes!r}: give "
            "the grid to the batcher alone (simulate then reads it from there)"
        )
    grid = shapes if batcher is None else batcher.shapes
    if grid is None:
        return None
    if keys is None:
        raise ValueError(
            "shapes needs keys= (each request's length): the grid length a request is "
            "padded to comes from it"
        )
    for i, key in enumerate(keys):
        if key > grid.max_length:
            grid.length_for(math.ceil(key), item=f"request {i} (keys[{i}])")  # raises
    return grid


def _check_group_options(
    groups: GroupsLike | None, max_groups_per_batch: int | None, batcher: Batcher | None
) -> None:
    """Group options that need another one, or that belong on the batcher given."""
    if groups is None and max_groups_per_batch is not None:
        raise ValueError(
            f"max_groups_per_batch={max_groups_per_batch!r} needs groups= (each request's "
            "group, or how many groups to draw them from)"
        )
    if batcher is None:
        return
    if max_groups_per_batch is not None:
        raise ValueError(
            "max_groups_per_batch is set on the batcher given (group=, "
            "max_groups_per_batch=), not here"
        )
    if groups is not None and batcher.group is None:
        raise ValueError(
            f"groups= needs a grouped batcher: the {type(batcher).__name__} given has no "
            "group= (give it group= and max_groups_per_batch=, or let simulate build it)"
        )
    if groups is None and batcher.group is not None:
        raise ValueError(
            f"the {type(batcher).__name__} given has group=: pass groups= (each "
            "request's group, or how many groups to draw them from) to simulate it"
        )


def _request_groups(
    groups: GroupsLike | None, group_skew: float | None, count: int, seed: int
) -> list[Hashable] | None:
    """Each request's group, in the order of the arrivals given; None without groups."""
    is_count = isinstance(groups, numbers.Integral) and not isinstance(groups, bool)
    if group_skew is not None and not is_count:
        given = "None" if groups is None else type(groups).__name__
        raise ValueError(
            f"group_skew={group_skew!r} is the Zipf exponent of groups=N (a number of "
            f"groups to draw from), not of groups of type {given}"
        )
    skew = 0.0 if group_skew is None else group_skew
    if groups is None:
        return None
    if isinstance(groups, Mapping):
        return sample_groups(groups, count, seed, skew=skew)
    if isinstance(groups, numbers.Integral) and not isinstance(groups, bool):
        return sample_groups(int(groups), count, seed, skew=skew)
    if isinstance(groups, (str, bytes)) or not isinstance(groups, (Sequence, np.ndarray)):
        raise TypeError(
            "groups must be a number of groups, a mapping of group -> weight or a "
            f"sequence of each request's group, got {type(groups).__name__}"
        )
    if len(groups) != count:
        raise ValueError(f"groups has {len(groups)} entries for {count} arrivals")
    listed: list[Hashable] = groups.tolist() if isinstance(groups, np.ndarray) else list(groups)
    for i, group in enumerate(listed):
        try:
            hash(group)
        except TypeError:
            raise TypeError(f"groups[{i}] must be hashable, got {type(group).__name__}") from None
    return listed


def _group_summaries(
    groups: Sequence[Hashable], latencies_s: np.ndarray, batches: dict[Hashable, int]
) -> dict[Hashable, GroupSummary]:
    """Each group's requests, batches and latency, the most requested first (ties in
    the order their first requests arrived)."""
    members: dict[Hashable, list[int]] = {}
    for i, group in enumerate(groups):
        members.setdefault(group, []).append(i)
    summaries = {}
    for group, indices in sorted(members.items(), key=lambda m: -len(m[1])):
        latencies = latencies_s[indices]
        served = latencies[~np.isnan(latencies)]
        summaries[group] = GroupSummary(
            requests=len(indices),
            served=int(served.size),
            batches=batches.get(group, 0),
            latency=LatencySummary.of_seconds(served),
        )
    return summaries


class SimulationWarning(UserWarning):
    """A setting that makes a simulated run meaningless, such as a latency target
    shorter than the quickest batch (`SimResult.warnings` holds the same text)."""


def _target_warnings(
    model: LatencyModel,
    policy: Batcher,
    keys: Sequence[float] | None,
    max_latency_ms: float | None,
    goodput_ms: float | None,
) -> tuple[str, ...]:
    """A warning for each threshold shorter than the quickest batch: one request alone,
    the cheapest there is. Below it nothing can be in time, whatever the load."""
    cheapest = 0.0 if keys is None else _run_cost(policy, [min(keys)])
    quickest_ms = model.seconds(policy.padded_size(1), cheapest) * 1e3
    found = []
    for name, what, value in (
        ("max_latency_ms", "the latency target", max_latency_ms),
        ("goodput_ms", "the goodput threshold", goodput_ms),
    ):
        if value is not None and value < quickest_ms:
            found.append(
                f"{what} {name}={value:g} is shorter than one batch's time "
                f"({quickest_ms:.4g} ms for a batch of one): no request can be answered in time"
            )
    return tuple(found)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class _BatchShape(NamedTuple):
    """One batch as the function is called with it."""

    size: int  # its batch size, dummy rows included
    length: int  # the length it is padded to
    rows: int  # its real requests
    real_tokens: float  # their keys, summed


@dataclass
class _Replay:
    """What the event loop recorded."""

    done_at: np.ndarray  # per request: when its batch ended (NaN: never ran)
    started_at: np.ndarray  # per request: when its batch started
    log: list[tuple[float, float, int]]  # (start, end, size) per batch
    costs: list[float]  # per batch: its cost by the policy's cost (with keys only)
    batch_groups: list[int]  # per batch: its distinct groups (with groups only)
    group_batches: dict[Hashable, int]  # per group: the batches that held it
    shapes: list[_BatchShape]  # per batch: its shape and real rows and tokens (keys only)


class _Joins:
    """Coalescing in the replay, as `@batched(coalesce=...)` does it: a request whose
    key is waiting or running joins that request instead of being added.

    Args:
        keys: each request's coalescing key (with its group), in arrival order.
    """

    def __init__(self, keys: Sequence[Hashable]) -> None:
        self.keys = keys
        self.leader_of: dict[int, int] = {}  # request -> the request it joined
        self._open: dict[Hashable, Request] = {}  # key -> its latest added request

    def joins(self, i: int) -> bool:
        """Whether request `i` joins one of its key still waiting or running."""
        leader = self._open.get(self.keys[i])
        if leader is None or leader.state not in (WAITING, RUNNING):
            return False
        self.leader_of[i] = leader.item
        return True

    def added(self, req: Request) -> None:
        """`req` (its item is its index) was added: later ones of its key may join it."""
        self._open[self.keys[req.item]] = req

    def settle(self, replay: _Replay) -> int:
        """Give each request that joined its leader's start and end; returns how many
        joined a request that never ran (shed)."""
        done_at, started_at = replay.done_at, replay.started_at
        lost = 0
        for i, leader in self.leader_of.items():
            done_at[i], started_at[i] = done_at[leader], started_at[leader]
            lost += bool(np.isnan(done_at[leader]))
        return lost


def _replay(
    sched: Scheduler,
    times: np.ndarray,
    model: LatencyModel,
    keys: Sequence[float] | None,
    groups: Sequence[Hashable] | None,
    joins: _Joins | None = None,
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
    batch_groups: list[int] = []
    group_batches: dict[Hashable, int] = {}
    shapes: list[_BatchShape] = []
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
            sched.close()  # the trace ended: serve what is left, as close() would
            t = now
        now = t
        while running and running[0][0] <= now:
            _, _, batch = heapq.heappop(running)
            sched.finish(batch, now)
            for req in batch.requests:
                req.state = DONE
        while i < n and arrive[i] <= now:
            if joins is not None and joins.joins(i):
                i += 1
                continue
            key = 0.0 if keys is None else float(keys[i])
            if groups is not None:
                # As a grouped function makes it (serve/core.py, make_request).
                group = groups[i]
                bucket = group_bucket(policy, key, group)
                req = new_request(i, key, bucket, 0, None, None, arrive[i], group)
            elif keys is None:
                req = new_request(i, 0.0, None, 0, enqueued_at=arrive[i])
            else:
                req = new_request(i, key, policy.bucket_of(key), 0, enqueued_at=arrive[i])
            # A refusal and the waiting requests dropped on the way are counted by the
            # scheduler; their latency stays NaN.
            admitted = sched.add(req).refused is None
            if joins is not None and admitted:
                joins.added(req)
            i += 1
        while True:
            formed, wake_at, dropped = sched.decide(now)
            for req in dropped:  # (too late: counted as shed by the scheduler)
                if not isinstance(req.error, Overloaded):
                    raise req.error  # type: ignore[misc]  # a policy's failing select
            if formed is None:
                break
            cost = 0.0
            if keys is not None:
                batch_keys = [r.key for r in formed.requests]
                cost = _run_cost(policy, batch_keys)
                size, length = _shape_of(policy, batch_keys)
                shapes.append(_BatchShape(size, length, len(batch_keys), math.fsum(batch_keys)))
            distinct = 1
            if groups is not None:
                held = {r.group for r in formed.requests}
                distinct = len(held)
                batch_groups.append(distinct)
                for group in held:
                    group_batches[group] = group_batches.get(group, 0) + 1
            seconds = model.seconds(formed.padded_size, cost, distinct)
            end = now + seconds
            if not math.isfinite(end):  # a batch that never ends would stall the replay
                raise ValueError(
                    f"a batch of {formed.padded_size} takes {seconds * 1e3:g} ms and would "
                    f"end at {end:g} s: the latency model overflows"
                )
            heapq.heappush(running, (end, next(order), formed))
            log.append((now, end, len(formed.requests)))
            if keys is not None:
                costs.append(cost)
            for req in formed.requests:
                started_at[req.item] = now
                done_at[req.item] = end
        # A wake-up never lies in the past, even when float rounding says the due time is now.
        wake = inf if wake_at is None else max(wake_at, math.nextafter(now, inf))
    return _Replay(
        np.array(done_at), np.array(started_at), log, costs, batch_groups, group_batches, shapes
    )


def _shape_of(policy: Batcher, keys: Sequence[float]) -> tuple[int, int]:
    """The `(batch size, length)` a batch of these keys is called with: its grid cell,
    or its (padded) size and its longest key rounded up, as `pad` lays it out."""
    longest = math.ceil(max(keys, default=0.0))
    size = policy.padded_size(len(keys))
    return size, longest if policy.shapes is None else policy.shapes.length_for(longest)


def _run_cost(policy: Batcher, keys: Sequence[float]) -> float:
    """What the latency model's cost term counts for a batch of these keys: the
    policy's cost, or under a grid its cell's area (what the function computes over,
    padding and dummy rows included)."""
    if policy.shapes is None:
        return policy.cost.of(keys)
    size, length = _shape_of(policy, keys)
    return float(size * length)


def _shape_cost(grid: ShapeBuckets | None, batches: Sequence[_BatchShape]) -> ShapeCost:
    """The shapes and padding of the batches run."""
    called: dict[tuple[int, int], int] = {}
    for b in batches:
        called[b.size, b.length] = called.get((b.size, b.length), 0) + 1
    return ShapeCost(
        grid=grid,
        shapes=dict(sorted(called.items())),
        real_tokens=math.fsum(b.real_tokens for b in batches),
        padded_tokens=sum(b.size * b.length for b in batches),
        dummy_rows=sum(b.size - b.rows for b in batches),
    )


def _full_batch_seconds(
    model: LatencyModel, policy: Batcher, keys: Sequence[float] | None
) -> float:
    """A full batch's time; with a cost term, at the mean cost of the full batches the
    keys make in arrival order within each bucket (as full batches leave online)."""
    full = policy.padded_size(policy.max_batch_size)
    if keys is None or not model.per_cost_ms:
        return model.seconds(full)
    by_bucket: dict[Hashable, list[float]] = {}
    for key in keys:
        by_bucket.setdefault(policy.bucket_of(key), []).append(key)
    size = policy.max_batch_size
    chunks = [
        group[lo : lo + size]
        for group in by_bucket.values()
        for lo in range(0, len(group) - size + 1, size)
    ] or [list(keys)]  # fewer than a full batch of keys: all of them
    return model.seconds(full, statistics.fmean(_run_cost(policy, c) for c in chunks))


def _summarise(
    sched: Scheduler,
    times: np.ndarray,
    replay: _Replay,
    model: LatencyModel,
    policy: Batcher,
    keys: Sequence[float] | None,
    max_latency_ms: float | None,
    goodput_ms: float | None,
) -> SimResult:
    done_at, started_at, log = replay.done_at, replay.started_at, replay.log
    served_mask = ~np.isnan(done_at)
    latencies = done_at - times
    served = int(served_mask.sum())
    # Until the last arrival at least: when the tail is refused, the last answer comes
    # early, and dividing by that span would make a few answers look like a high rate.
    end = max(float(np.nanmax(done_at)), float(times[-1])) if served else float(times[-1])
    duration = max(end - float(times[0]), 1e-12)
    span = float(times[-1] - times[0])
    # Arrivals at one instant have no rate: NaN, not inf (which read as overload).
    offered = (len(times) - 1) / span if span > 0 else math.nan
    busy = sum(e - s for s, e, _ in log)
    slots = sched.max_concurrent_batches
    full_seconds = _full_batch_seconds(model, policy, keys)
    stats = sched.stats
    if goodput_ms is None:
        on_time = served
    else:
        # (A hair of slack: an answer exactly at the target is in time, whatever the rounding.)
        on_time = int((latencies[served_mask] <= goodput_ms / 1e3 * (1 + 1e-9)).sum())
    return SimResult(
        requests=len(times),
        served=served,
        rejected=stats.rejected,
        overloaded=stats.overloaded,
        shed=stats.shed,
        on_time=on_time,
        goodput=on_time / duration,
        goodput_fraction=on_time / len(times),
        max_latency_ms=max_latency_ms,
        goodput_ms=goodput_ms,
        duration_s=duration,
        offered_rate=offered,
        throughput=served / duration,
        capacity=slots * policy.max_batch_size / full_seconds if full_seconds else math.inf,
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
        learned_latency=None if sched.target is None else sched.target.model(),
        max_concurrent_batches=slots,
        latencies_s=latencies,
        batch_log=log,
        shape_cost=None if keys is None else _shape_cost(policy.shapes, replay.shapes),
    )
