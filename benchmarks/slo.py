"""Goodput under overload: answers within a 100 ms target, batchkit against its peers.

A service with a latency target is judged by its *goodput*: the answers that arrive in
time, per second. Past capacity, a batcher that queues everything answers everything
late (goodput falls to zero); one that refuses what it cannot serve in time keeps the
device busy on requests that still make it. This benchmark offers open-loop Poisson
load below, at and above capacity and counts what comes back within the target.

Emulated device: one device (one batch at a time: an ``asyncio.Lock``), a batch of n
items takes ``await asyncio.sleep(10 ms + the sum of its items' costs)``; max batch 16,
target 100 ms from the call to its answer, max wait 5 ms for every system. Four phases,
in three streams (each load point serves each stream on a fresh instance and device):

- light: every item costs 1 ms, a full batch 26 ms, capacity C = 16 / 26 ms ≈ 615
  items/s;
- heavy: items twice as heavy, 2 ms each (a full batch 42 ms, C = 16 / 42 ms ≈ 381
  items/s), and *no system is told*: same settings, same target (light, then heavy,
  back to back: the ``shift`` stream);
- warmup: light items on a fresh device whose first 2 batches take 20x (a GPU's
  context, autotuning, compilation: the first, a lone request, 220 ms; the second,
  full, 520 ms), counted after the stream's first second; C as light;
- stall: light items, one batch in 50 takes 10x (a collection, a neighbour on the
  device); C counts the stalls: 16 * 50 / (49 * 26 ms + 260 ms) ≈ 522 items/s.

Rows (a fresh instance per load point):

- ``batchkit max_latency_ms``  ``@batchkit.batched(max_latency_ms=100)``: learns how
  long batches take, refuses at admission (``Overloaded``) what it predicts would miss,
  drops waiting requests that no longer can make it, and never forms a batch so large
  that its oldest member misses. "n/a (feature missing)" where batchkit has no such
  option;
- ``batchkit fixed``           the same ``@batched`` without a target or queue bound;
- ``batchkit queue bound``     ``@batched(max_queue_size=Q)``, Q hand-tuned for the
  light phase: the queue a full-batch pipeline drains within the target,
  Q = floor((100 ms / 26 ms - 1) * 16) = 45 (printed); ``QueueFull`` past it;
- ``ray-serve``                Ray Serve's ``@serve.batch`` (no cluster, ``_peers.py``);
- ``mixedbread``               mixedbread's ``batched.aio.dynamically``;
- ``minimal``                  the blog-post asyncio batcher (``_peers.MinimalBatcher``);
- ``device (ref)``             no batcher: the device called back to back on full
  batches for a segment's length per phase, in the same run (sleep overshoot and loop
  wake-ups included), as items/s / C. A column's bound is the lesser of that and the
  offered load (a segment's last requests may be answered just after it ends, so over
  short segments a row can edge past it);
- ``simulated (ref)``          ``batchkit.simulate`` on each segment's own arrivals:
  batchkit's scheduler with the same policy and target, exact batch times (a warmup
  segment's without its slow first batches) and no overhead at all, its model
  learned at the segment's start. Near 1x, Poisson arrivals idle the device at times
  and bunch up past the target at others: this row is what the policy itself allows
  there, before the machine costs anything (the stall phase is not simulated).

Command-line names of the rows (``--systems``): ``target``, ``fixed``, ``queue-bound``,
``ray-serve``, ``mixedbread``, ``minimal``.

Load points: Poisson arrivals at 0.5x, 1x, 1.5x and 2x capacity, seeded (every system
sees the same arrivals). The ``shift`` stream is one instance serving the phases *back
to back*: a warm-up (0.5 s, light, not counted), the light segment (3 s at the load
times the light C), then at once the heavy segment (3 s at the load times the heavy
C, heavy items); ``--quick``: 0.2 s, 0.8 s, 0.8 s. A learned model has to notice the
change on its own; items queued at the switch keep their own cost. The ``warmup``
stream: 1 s not counted, then 3 s (``--quick`` 0.8 s); the ``stall`` stream: a
warm-up of 0.5 s (0.2 s), then 3 s (0.8 s). A
request belongs to the segment its scheduled arrival falls in; its latency runs from
its call (the moment the driver called the system) to its answer. After the last
arrival the stream gets a grace period (0.3 s; ``--quick`` 0.15 s; always more than
the target); requests unanswered by then are cancelled and counted as late.
Every offered request is counted exactly once:

- in time: answered within 100 ms of its call;
- late: answered later, or not at all by the end of the grace period;
- refused: failed with an error (batchkit's ``QueueFull`` / ``Overloaded``, or a
  peer's error; the types are printed). A wrong answer stops the benchmark.

Reported per system, per segment and load: goodput = in-time answers per second /
that phase's C; the fraction of offered requests answered in time; the served p99
latency (answered requests only, in time or late; refused and unanswered ones have
none); refused and late counts; mean items per batch. With ``--repeats N`` each cell
is the median over repeats (default 1: each cell is already thousands of requests).

Goals (PASS/MISS lines; exit status 1 on a MISS): ``batchkit max_latency_ms`` at every
load >= 1x in the light and heavy phases, goodput >= 0.95 with its served p99 <= 100
ms; at 0.5x, answered in time >= 0.98 of offered (light and heavy); in the warmup and
stall phases at 1x-2x, goodput >= 0.9 (their p99 is not judged: a stalled batch's own
requests are late whatever a batcher does). Each line gives the bound from ``device
(ref)`` and the best other row beside it: on a loaded machine the bound itself can be
below a goal.

Usage::

    python benchmarks/slo.py               # ~6 min on 2 cores
    python benchmarks/slo.py --quick       # ~2 min: 0.8 s segments, noisier
    python benchmarks/slo.py --systems target,fixed,minimal --json slo.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import chosen_systems  # noqa: E402
from _load import issue, poisson_arrivals  # noqa: E402
from _peers import MinimalBatcher, MxbaiAsync, RayServeBatcher  # noqa: E402
from _report import check, percentile, rotated  # noqa: E402

import batchkit  # noqa: E402

MAX_BATCH = 16
MAX_WAIT_S = 0.005
TARGET_S = 0.100
BATCH_FIXED_S = 0.010  # every batch's own cost, whatever its size
# What each item adds, per phase: warmup and stall are light items on a device that
# is slow at first, or now and then.
ITEM_COST_S = {"light": 0.001, "heavy": 0.002, "warmup": 0.001, "stall": 0.001}
PHASES = tuple(ITEM_COST_S)
LOADS = (0.5, 1.0, 1.5, 2.0)
WARMUP_BATCHES = 2  # a fresh device's first batches (a GPU's context, autotuning) ...
WARMUP_FACTOR = 20  # ... take this many times as long
WARMUP_UNCOUNTED_S = 1.0  # the warmup phase is judged after its first second
STALL_EVERY = 50  # one batch in this many (a collection, a neighbour on the device) ...
STALL_FACTOR = 10  # ... takes this many times as long
# Each load point serves these streams, each on a fresh instance and a fresh device:
# (the device's slow batches, its segments). The first segment of each is not counted.
STREAMS = ("shift", "warmup", "stall")


def full_batch_s(phase: str) -> float:
    """Seconds the device takes for a full batch of the phase's items (a usual one)."""
    return BATCH_FIXED_S + MAX_BATCH * ITEM_COST_S[phase]


def capacity(phase: str) -> float:
    """Items per second with full batches back to back (the phase's C; with its stalls,
    for the stall phase; after its slow first batches, for the warmup phase)."""
    if phase == "stall":
        return MAX_BATCH * STALL_EVERY / (full_batch_s(phase) * (STALL_EVERY - 1 + STALL_FACTOR))
    return MAX_BATCH / full_batch_s(phase)


def slowdown(pattern: str | None, batch: int) -> float:
    """How many times its usual time the device's ``batch``-th batch (from 0) takes."""
    if pattern == "warmup":
        return WARMUP_FACTOR if batch < WARMUP_BATCHES else 1.0
    if pattern == "stall":
        return STALL_FACTOR if batch % STALL_EVERY == STALL_EVERY - 1 else 1.0
    return 1.0


# The queue a full-batch pipeline drains within the target, in the light phase: a
# request behind Q others waits Q / 16 full batches, then runs in its own.
QUEUE_BOUND = math.floor((TARGET_S / full_batch_s("light") - 1) * MAX_BATCH)

SYSTEMS = {  # command-line name: row label
    "target": "batchkit max_latency_ms",
    "fixed": "batchkit fixed",
    "queue-bound": "batchkit queue bound",
    "ray-serve": "ray-serve",
    "mixedbread": "mixedbread",
    "minimal": "minimal",
}
TARGET_ROW = "target"
REFERENCE = "device (ref)"
SIMULATED = "simulated (ref)"

Item = tuple[int, float]  # (index, seconds it adds to its batch)

# --------------------------------------------------------------------------- the device


class Device:
    """One emulated device: one batch at a time, each ``BATCH_FIXED_S`` plus the sum
    of its items' costs (an ``asyncio.sleep``, so the loop runs meanwhile), times its
    pattern's ``slowdown`` (``"warmup"``, ``"stall"``, or None)."""

    def __init__(self, pattern: str | None = None) -> None:
        self._lock = asyncio.Lock()
        self.pattern = pattern
        self.batches: list[tuple[float, int]] = []  # (loop time it started, items)
        # The stall pattern's slow batches: (loop time it started, seconds, its items).
        self.stalls: list[tuple[float, float, list[int]]] = []

    async def run(self, items: list[Item]) -> list[int]:
        async with self._lock:
            factor = slowdown(self.pattern, len(self.batches))
            started = asyncio.get_running_loop().time()
            self.batches.append((started, len(items)))
            seconds = (BATCH_FIXED_S + sum(cost for _, cost in items)) * factor
            if factor > 1 and self.pattern == "stall":
                self.stalls.append((started, seconds, [i for i, _ in items]))
            await asyncio.sleep(seconds)
        return [i for i, _ in items]


def device_pattern(phase: str) -> str | None:
    return phase if phase in ("warmup", "stall") else None


async def device_back_to_back(phase: str, seconds: float) -> float:
    """The device run on full batches of ``phase`` items for ``seconds``, no batcher:
    items/s as a fraction of the phase's capacity (a warmup device's slow first
    batches not counted)."""
    loop = asyncio.get_running_loop()
    device = Device(device_pattern(phase))
    full = [(i, ITEM_COST_S[phase]) for i in range(MAX_BATCH)]
    if phase == "warmup":
        for _ in range(WARMUP_BATCHES):
            await device.run(full)
    batches = 0
    t0 = loop.time()
    while batches < 10 or loop.time() - t0 < seconds:
        await device.run(full)
        batches += 1
    return batches * MAX_BATCH / (loop.time() - t0) / capacity(phase)


# --------------------------------------------------------------------------- systems


class System(Protocol):
    """A batcher under test: ``await call(item)`` is the item's answer."""

    @property
    def call(self) -> Callable[[Item], Awaitable[Any]]: ...

    async def close(self) -> None: ...


class FeatureMissing(Exception):
    """This batchkit has no ``max_latency_ms`` option."""


class BatchkitRow:
    """``@batchkit.batched`` on the device's async batch function, awaited with ``acall``."""

    def __init__(self, fn: Callable[[list[Item]], Awaitable[list[int]]], **options: Any) -> None:
        self.f = batchkit.batched(
            max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_S * 1e3, **options
        )(fn)
        self.call = self.f.acall

    async def close(self) -> None:
        # Its callers are answered or cancelled (withdrawn) by now: nothing should wait.
        await self.f.aclose(timeout=1.0)


def make_system(name: str, device: Device) -> System:
    """A fresh instance of system ``name`` serving ``device`` (inside the running loop).

    Raises:
        FeatureMissing: ``name`` is the target row and ``batched()`` refuses
            ``max_latency_ms``.
    """
    fn = device.run
    if name == "target":
        try:
            return BatchkitRow(fn, max_latency_ms=TARGET_S * 1e3)
        except TypeError as exc:
            if "max_latency_ms" in str(exc):
                raise FeatureMissing(str(exc)) from None
            raise
    if name == "fixed":
        return BatchkitRow(fn)
    if name == "queue-bound":
        return BatchkitRow(fn, max_queue_size=QUEUE_BOUND)
    if name == "ray-serve":
        return RayServeBatcher(fn, MAX_BATCH, MAX_WAIT_S)
    if name == "mixedbread":
        return MxbaiAsync(fn, MAX_BATCH, MAX_WAIT_S)
    if name == "minimal":
        minimal = MinimalBatcher(fn, MAX_BATCH, MAX_WAIT_S)
        minimal.call = minimal  # type: ignore[attr-defined]
        return minimal  # type: ignore[return-value]
    raise ValueError(name)


async def feature_missing(name: str) -> str | None:
    """Why system ``name`` cannot be built here (None when it can)."""
    try:
        system = make_system(name, Device())
    except FeatureMissing as exc:
        return str(exc)
    await system.close()
    return None


# --------------------------------------------------------------------------- one load point


@dataclasses.dataclass(frozen=True)
class Config:
    """One run's shape.

    Attributes:
        systems: Command-line names of the systems to run, in table order.
        loads: Offered loads, as fractions of each phase's capacity.
        warm_s: Seconds of light load before the light segment, not counted.
        segment_s: Seconds of each measured segment (light, then heavy).
        grace_s: Seconds after the last arrival before unanswered requests are
            cancelled (and counted as late); more than the target.
        repeats: Runs of every load point; cells are medians over them.
        seed: Seeds the arrivals (each repeat and load its own stream).
        streams: The streams each load point serves (``STREAMS``): ``"shift"``
            (light, then heavy), ``"warmup"`` (a fresh device's first batches 20x
            slower), ``"stall"`` (one batch in 50 takes 10x).
    """

    systems: tuple[str, ...] = tuple(SYSTEMS)
    loads: tuple[float, ...] = LOADS
    warm_s: float = 0.5
    segment_s: float = 3.0
    grace_s: float = 0.3
    repeats: int = 1
    seed: int = 1234
    streams: tuple[str, ...] = STREAMS

    def __post_init__(self) -> None:
        if self.grace_s <= TARGET_S:
            raise ValueError(f"grace_s must exceed the target ({TARGET_S} s): {self.grace_s}")
        if self.segment_s <= 0 or self.warm_s < 0 or self.repeats < 1:
            raise ValueError(f"bad config: {self}")
        if not self.streams or set(self.streams) - set(STREAMS):
            raise ValueError(f"streams must be some of {STREAMS}: {self.streams}")

    def segments(self, stream: str = "shift") -> list[tuple[str, str, float, float]]:
        """(segment, phase, start, end) in seconds after the stream starts; the first
        segment is not counted, each other one is named for its phase."""
        w, d = self.warm_s, self.segment_s
        if stream == "warmup":
            u = WARMUP_UNCOUNTED_S
            return [("first second", "warmup", 0.0, u), ("warmup", "warmup", u, u + d)]
        if stream == "stall":
            return [("warm-up", "stall", 0.0, w), ("stall", "stall", w, w + d)]
        return [
            ("warm-up", "light", 0.0, w),
            ("light", "light", w, w + d),
            ("heavy", "heavy", w + d, w + 2 * d),
        ]

    def measured(self) -> list[str]:
        """The counted segments (phases) of the chosen streams, in table order."""
        return [seg for stream in self.streams for seg, *_ in self.segments(stream)[1:]]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One load point's arrival stream: when each request comes, what it is, and which
    segment it counts in."""

    arrivals: list[float]  # seconds after the stream starts
    items: list[Item]
    segment: list[str]

    def offered(self, segment: str) -> int:
        return self.segment.count(segment)


def make_schedule(
    config: Config, load: float, rng: random.Random, stream: str = "shift"
) -> Schedule:
    arrivals: list[float] = []
    segment: list[str] = []
    items: list[Item] = []
    for name, phase, start, end in config.segments(stream):
        times = poisson_arrivals(rng, load * capacity(phase), start, end)
        items += [(len(arrivals) + k, ITEM_COST_S[phase]) for k in range(len(times))]
        arrivals += times
        segment += [name] * len(times)
    return Schedule(arrivals, items, segment)


@dataclasses.dataclass(frozen=True)
class Cell:
    """What one system did with one segment of one load point.

    Attributes:
        offered: Requests whose arrival fell in the segment.
        in_time: Of those, answered within the target of the call.
        late: Answered after the target, or not at all by the end of the grace period.
        unanswered: Of ``late``, not answered at all (cancelled at the end).
        refused: Failed with an error (refused at admission, or dropped).
        refusals: ``refused`` by exception type name.
        goodput: In-time answers per second of the segment, over the phase's capacity.
        p99_ms: Served p99 latency, of answered requests (NaN when none was).
        mean_batch: Mean items per batch the device started during the segment.
        call_lateness_p99_ms: How late the driver made the calls, p99.
        stall_lost: Of ``offered``, requests the device's stalls cost whatever a
            batcher did once they came (stall phase only): a stalled batch's members,
            and the arrivals during a stall that could not be answered in time even
            alone right after it (before its end + one item's batch - the target).
    """

    offered: int
    in_time: int
    late: int
    unanswered: int
    refused: int
    refusals: dict[str, int]
    goodput: float
    p99_ms: float
    mean_batch: float
    call_lateness_p99_ms: float
    stall_lost: int = 0


class WrongResult(AssertionError):
    """A system answered a request with another request's result."""


async def run_point(
    name: str, config: Config, schedule: Schedule, stream: str = "shift"
) -> dict[str, Cell]:
    """One instance of system ``name`` serves the whole arrival stream on a fresh
    device; per measured segment, its cell."""
    loop = asyncio.get_running_loop()
    n = len(schedule.items)
    latency: list[float | None] = [None] * n
    error: list[str | None] = [None] * n
    lateness = [0.0] * n
    wrong: list[int] = []
    segments = config.segments(stream)
    device = Device(device_pattern(segments[-1][1]))
    system = make_system(name, device)

    async def one(i: int, scheduled: float) -> None:
        called = loop.time()
        lateness[i] = called - scheduled
        try:
            answer = await system.call(schedule.items[i])
        except Exception as exc:  # noqa: BLE001 - a refusal, counted by type
            error[i] = type(exc).__name__
            return
        latency[i] = loop.time() - called
        if answer != i:
            wrong.append(i)

    try:
        t0 = loop.time() + 0.005
        running = await issue(schedule.arrivals, one, t0)
        deadline = t0 + segments[-1][3] + config.grace_s
        if running:
            await asyncio.wait(list(running), timeout=max(deadline - loop.time(), 0.0))
        left = list(running)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
    finally:
        await system.close()
        await settle()
    if wrong:
        i = wrong[0]
        raise WrongResult(f"{SYSTEMS[name]}: request {i} got another's result ({len(wrong)} so)")

    lost = stall_losses(device, schedule, t0)
    cells: dict[str, Cell] = {}
    for seg, phase, start, end in segments[1:]:
        ids = [i for i in range(n) if schedule.segment[i] == seg]
        served = [t for i in ids if (t := latency[i]) is not None]
        refusals = Counter(e for i in ids if (e := error[i]) is not None)
        in_time = sum(t <= TARGET_S for t in served)
        refused = sum(refusals.values())
        batches = [size for at, size in device.batches if t0 + start <= at < t0 + end]
        cells[seg] = Cell(
            offered=len(ids),
            in_time=in_time,
            late=len(ids) - in_time - refused,
            unanswered=len(ids) - len(served) - refused,
            refused=refused,
            refusals=dict(refusals),
            goodput=in_time / (end - start) / capacity(phase),
            p99_ms=percentile(served, 0.99) * 1e3,
            mean_batch=statistics.fmean(batches) if batches else math.nan,
            call_lateness_p99_ms=percentile([lateness[i] for i in ids], 0.99) * 1e3,
            stall_lost=len(lost.intersection(ids)),
        )
    return cells


def stall_losses(device: Device, schedule: Schedule, t0: float) -> set[int]:
    """The requests the device's stalls cost whatever a batcher did once they came:
    each stalled batch's members (answered a stall's length after it started: past
    the target), and every arrival from its start to its end + the fastest batch
    (one item) - the target, which could not be answered in time even alone, first,
    right after it."""
    fastest = BATCH_FIXED_S + ITEM_COST_S["stall"]
    lost: set[int] = set()
    for started, seconds, members in device.stalls:
        lost.update(members)
        first, last = started - t0, started - t0 + seconds + fastest - TARGET_S
        lost.update(i for i, at in enumerate(schedule.arrivals) if first <= at < last)
    return lost


def simulated_goodput(config: Config, schedule: Schedule, stream: str) -> dict[str, float]:
    """Per measured segment of the usual phases (light, heavy, warmup), the goodput of
    batchkit's own scheduler with no overhead at all: ``batchkit.simulate`` on the
    segment's arrivals, the phase's exact batch times (a warmup segment's without its
    slow first batches), the same policy and target. The segment is replayed twice
    back to back and the second copy counted, so that the model has learned and the
    queue is as the load keeps it when it starts (the real row meets the heavy segment
    with a model learned on light items, not from nothing). What the policy itself
    allows on these arrivals: near 1x capacity Poisson arrivals leave the device idle
    at times and bunch up past the target at others, which no overhead explains."""
    out: dict[str, float] = {}
    for seg, phase, start, end in config.segments(stream)[1:]:
        if phase == "stall":  # (the given-its-stalls bound covers that phase)
            continue
        times = [t - start for t, s in zip(schedule.arrivals, schedule.segment) if s == seg]
        if not times:
            continue
        length = end - start
        result = batchkit.simulate(
            (BATCH_FIXED_S * 1e3, ITEM_COST_S[phase] * 1e3),
            arrivals=times + [t + length for t in times],
            max_batch_size=MAX_BATCH,
            max_wait_ms=MAX_WAIT_S * 1e3,
            max_latency_ms=TARGET_S * 1e3,
        )
        counted = result.latencies_s[len(times) :]
        on_time = int((counted <= TARGET_S * (1 + 1e-9)).sum())  # (NaN: not served)
        out[seg] = on_time / length / capacity(phase)
    return out


async def settle(limit_s: float = 1.0) -> None:
    """Wait (up to ``limit_s``) until no task but this one is left on the loop: what a
    closed system left behind (a peer's batch tasks, now with only cancelled callers)
    finishes before the next system is measured."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + limit_s
    while len(asyncio.all_tasks()) > 1 and loop.time() < give_up:
        await asyncio.sleep(0.005)


# --------------------------------------------------------------------------- the run


def column(segment: str, load: float) -> str:
    return f"{segment} {load:g}x"


@dataclasses.dataclass
class Results:
    """Everything one run measured.

    Attributes:
        cells: System name -> column (``"light 1x"``) -> one cell per repeat.
        missing: System name -> why it did not run.
        offered: Column -> offered requests, per repeat (the same for every system).
        device: Phase -> ``device (ref)``: full batches back to back, items/s over the
            phase's capacity, per repeat.
        simulated: Column -> ``simulated (ref)``: batchkit's scheduler with no
            overhead on the same arrivals (``simulated_goodput``), per repeat; light,
            heavy and warmup columns only.
    """

    cells: dict[str, dict[str, list[Cell]]]
    missing: dict[str, str]
    offered: dict[str, list[int]]
    device: dict[str, list[float]]
    simulated: dict[str, list[float]] = dataclasses.field(default_factory=dict)


async def run(config: Config) -> Results:
    """Every load point of every repeat: the device reference, then each system (order
    rotated per load point) on the same arrivals."""
    missing = {name: why for name in config.systems if (why := await feature_missing(name))}
    runnable = [name for name in config.systems if name not in missing]
    columns = [column(seg, load) for seg in config.measured() for load in config.loads]
    res = Results(
        cells={name: {c: [] for c in columns} for name in runnable},
        missing=missing,
        offered={c: [] for c in columns},
        device={phase: [] for phase in config.measured()},
    )
    for r in range(config.repeats):
        for phase in config.measured():
            res.device[phase].append(await device_back_to_back(phase, config.segment_s))
        for k, load in enumerate(config.loads):
            for stream in config.streams:
                rng = random.Random(f"{config.seed}/{r}/{load}/{stream}")
                schedule = make_schedule(config, load, rng, stream)
                for seg, *_ in config.segments(stream)[1:]:
                    res.offered[column(seg, load)].append(schedule.offered(seg))
                for seg, good in simulated_goodput(config, schedule, stream).items():
                    res.simulated.setdefault(column(seg, load), []).append(good)
                for name in rotated(runnable, r + k):
                    gc.collect()
                    cells = await run_point(name, config, schedule, stream)
                    for seg, cell in cells.items():
                        res.cells[name][column(seg, load)].append(cell)
    return res


# --------------------------------------------------------------------------- report


def med(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def median_of(res: Results, name: str, col: str, field: str) -> float:
    return med([getattr(cell, field) for cell in res.cells[name][col]])


def offered_rate(res: Results, config: Config, segment: str, load: float) -> float:
    """Offered requests per second in a column (median over repeats)."""
    return med([float(n) for n in res.offered[column(segment, load)]]) / config.segment_s


def bound_goodput(res: Results, config: Config, segment: str, load: float) -> float:
    """``device (ref)``'s goodput for a column: the offered load, or what the device
    sustains back to back, whichever is less (medians over repeats)."""
    phase = segment  # the measured segments are named for their phase
    return min(offered_rate(res, config, segment, load) / capacity(phase), med(res.device[phase]))


def bound_given_stalls(res: Results, config: Config, segment: str, load: float) -> float:
    """The target row's goodput bound once its own stalls are counted (stall phase):
    its offered requests less those its stalls cost whatever a batcher did then
    (``Cell.stall_lost``), per second over C, and at most ``bound_goodput``. A batcher
    that formed fewer, fuller batches would meet fewer stalls: a bound given these."""
    cells = res.cells[TARGET_ROW][column(segment, load)]
    kept = med([float(c.offered - c.stall_lost) for c in cells])
    return min(
        kept / config.segment_s / capacity(segment), bound_goodput(res, config, segment, load)
    )


def simulated(res: Results, segment: str, load: float) -> float:
    """``simulated (ref)``'s goodput for a column (median over repeats; NaN for the
    stall phase, which it does not simulate)."""
    return med(res.simulated.get(column(segment, load), []))


def bound_in_time(res: Results, config: Config, segment: str, load: float) -> float:
    """``device (ref)``'s fraction answered in time for a column: all, or what the
    device sustains back to back over the offered rate, whichever is less."""
    sustained = med(res.device[segment]) * capacity(segment)
    return min(1.0, sustained / offered_rate(res, config, segment, load))


Reference = tuple[str, Callable[[str, float], str]]  # a last row: label, cell(segment, load)


def print_table(
    title: str,
    res: Results,
    config: Config,
    cell: Callable[[str, str], str],
    *last_rows: Reference,
) -> None:
    """One table: rows systems, columns segment x load; ``cell(name, column)`` formats
    a system's cell, and each of ``last_rows`` adds a row that is not a system's."""
    n = len(config.loads)
    segments = config.measured()
    print(f"\n{title}")
    print(f"{'system':<24} " + " ".join(f"{seg:-^{7 * n}}" for seg in segments))
    loads = "".join(f"{load:>6g}x" for load in config.loads)
    print(f"{'':<24} " + " ".join(loads for _ in segments))

    def row(label: str, cells: list[str]) -> None:
        groups = ["".join(f"{c:>7}" for c in cells[k : k + n]) for k in range(0, len(cells), n)]
        print(f"{label:<24} " + " ".join(groups))

    for name in config.systems:
        if name in res.missing:
            print(f"{SYSTEMS[name]:<24} n/a (feature missing)")
        else:
            row(
                SYSTEMS[name],
                [cell(name, column(s, load)) for s in segments for load in config.loads],
            )
    for label, ref in last_rows:
        row(label, [ref(s, load) for s in segments for load in config.loads])


def number(x: float, spec: str) -> str:
    return "-" if math.isnan(x) else format(x, spec)


def report(res: Results, config: Config) -> bool:
    """Print the tables, the notes and the goals; True when no goal is missed."""

    def fmt(field: str, spec: str) -> Callable[[str, str], str]:
        return lambda name, col: number(median_of(res, name, col, field), spec)

    def fraction(field: str) -> Callable[[str, str], str]:
        def cell(name: str, col: str) -> str:
            return number(
                med([getattr(c, field) / max(c.offered, 1) for c in res.cells[name][col]]), ".3f"
            )

        return cell

    offered: Reference = (
        "(offered)",
        lambda seg, load: format(med([float(n) for n in res.offered[column(seg, load)]]), ".0f"),
    )
    print_table(
        "goodput: answers within 100 ms per second / capacity",
        res,
        config,
        fmt("goodput", ".3f"),
        (REFERENCE, lambda seg, load: number(bound_goodput(res, config, seg, load), ".3f")),
        (SIMULATED, lambda seg, load: number(simulated(res, seg, load), ".3f")),
    )
    print_table(
        "answered in time / offered",
        res,
        config,
        fraction("in_time"),
        (REFERENCE, lambda seg, load: number(bound_in_time(res, config, seg, load), ".3f")),
    )
    print_table("served p99 latency, ms (answered requests)", res, config, fmt("p99_ms", ".0f"))
    print_table("refused or dropped (requests)", res, config, fmt("refused", ".0f"), offered)
    print_table(
        "late: answered after 100 ms, or never (requests)", res, config, fmt("late", ".0f"), offered
    )
    print_table("mean items per batch", res, config, fmt("mean_batch", ".1f"))

    if TARGET_ROW in res.cells and "stall" in config.measured():
        print(
            f"\nnote  stall: {SYSTEMS[TARGET_ROW]}'s own stalls cost at least "
            + ", ".join(
                f"{median_of(res, TARGET_ROW, column('stall', load), 'stall_lost'):.0f}"
                for load in config.loads
            )
            + " requests (their members, and the arrivals that could not be answered "
            "in time after them); its goodput bound given them: "
            + ", ".join(
                f"{bound_given_stalls(res, config, 'stall', load):.3f}" for load in config.loads
            )
            + f" at {', '.join(f'{load:g}x' for load in config.loads)}"
        )
    print(
        "\nnote  device (ref): full batches back to back ran at "
        + ", ".join(f"{med(res.device[p]):.3f} of C ({p})" for p in config.measured())
        + "; a column's bound is that, or the offered load if less"
    )
    if res.simulated:
        print(
            f"note  {SIMULATED}: batchkit's own scheduler on the same arrivals with no "
            "overhead and exact batch times (batchkit.simulate; stall not simulated): what "
            "its policy allows before any machine cost; the device's shortfall above "
            "comes on top"
        )
    for name in res.cells:
        total: Counter[str] = Counter()
        for cells in res.cells[name].values():
            for cell in cells:
                total.update(cell.refusals)
                total["(never answered)"] += cell.unanswered
        if +total:
            print(f"note  {SYSTEMS[name]}: " + ", ".join(f"{k} {v}" for k, v in (+total).items()))
    lateness = {
        (name, col): med([c.call_lateness_p99_ms for c in cells])
        for name, columns in res.cells.items()
        for col, cells in columns.items()
    }
    if lateness:
        name, col = max(lateness, key=lateness.__getitem__)
        print(
            f"note  the arrival driver made its calls late by {med(list(lateness.values())):.2f}"
            f" ms at p99 (median over cells; worst {lateness[name, col]:.2f} ms, {SYSTEMS[name]}"
            f" {col}: a system that holds the loop delays its own callers); latencies count"
            " from the call"
        )
    return goals(res, config)


def goals(res: Results, config: Config) -> bool:
    if TARGET_ROW not in config.systems:
        print(f"info  the goals are about {SYSTEMS[TARGET_ROW]}, which did not run")
        return True
    if TARGET_ROW in res.missing:
        return check(
            f"{SYSTEMS[TARGET_ROW]} goals",
            False,
            f"n/a (feature missing: {res.missing[TARGET_ROW]})",
        )
    others = [name for name in res.cells if name != TARGET_ROW]

    def best_other(col: str, field: str) -> str:
        if not others:
            return "no other row ran"
        values = {
            name: med(
                [
                    getattr(c, field) / (max(c.offered, 1) if field == "in_time" else 1)
                    for c in cells
                ]
            )
            for name in others
            for cells in [res.cells[name][col]]
        }
        name = max(values, key=lambda k: -math.inf if math.isnan(values[k]) else values[k])
        return f"best other {SYSTEMS[name]} {values[name]:.3f}"

    ok = True
    for seg in config.measured():
        for load in config.loads:
            col = column(seg, load)
            cells = res.cells[TARGET_ROW][col]
            bound = bound_goodput(res, config, seg, load)
            good = median_of(res, TARGET_ROW, col, "goodput")
            p99 = median_of(res, TARGET_ROW, col, "p99_ms")
            sim = simulated(res, seg, load)
            beside = f"(bound {bound:.3f}, simulated {sim:.3f}; {best_other(col, 'goodput')})"
            if seg == "stall":
                stalls = bound_given_stalls(res, config, seg, load)
                beside = f"(bound {bound:.3f}, given its stalls {stalls:.3f}; " \
                    f"{best_other(col, 'goodput')})"  # fmt: skip
            if seg in ("warmup", "stall") and 1.0 <= load <= 2.0:
                # What a slow start or a stall costs: goodput after it, p99 not judged
                # (a stalled batch's own requests are late whatever a batcher does).
                ok &= check(
                    f"{col}: goodput >= 0.9",
                    good >= 0.9,
                    f"{good:.3f}, p99 {p99:.0f} ms {beside}",
                )
            elif load >= 1.0:
                ok &= check(
                    f"{col}: goodput >= 0.95, served p99 <= 100 ms",
                    good >= 0.95 and p99 <= TARGET_S * 1e3,
                    f"{good:.3f}, p99 {p99:.0f} ms {beside}",
                )
            elif load == 0.5 and seg in ("light", "heavy"):
                frac = med([c.in_time / max(c.offered, 1) for c in cells])
                ok &= check(
                    f"{col}: answered in time >= 0.98 of offered",
                    frac >= 0.98,
                    f"{frac:.3f} (bound {bound_in_time(res, config, seg, load):.3f}; "
                    f"{best_other(col, 'in_time')})",
                )
    return ok


# --------------------------------------------------------------------------- main


def without_nan(x: Any) -> Any:
    """``x`` with every NaN replaced by None (JSON has no NaN)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: without_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [without_nan(v) for v in x]
    return x


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="0.8 s segments (~1 min), noisier")
    p.add_argument("--repeats", type=int, default=1, help="runs of every load point (medians)")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated rows to run, from {', '.join(SYSTEMS)} (the device "
        "reference always runs)",
    )
    p.add_argument(
        "--streams",
        default=",".join(STREAMS),
        help=f"comma-separated streams to serve, from {', '.join(STREAMS)}",
    )
    p.add_argument("--json", metavar="PATH", help="also write every cell to PATH")
    args = p.parse_args()
    unknown = set(args.streams.split(",")) - set(STREAMS)
    if unknown:
        p.error(f"unknown streams: {sorted(unknown)} (choose from {', '.join(STREAMS)})")
    streams = tuple(s for s in STREAMS if s in args.streams.split(","))
    systems = chosen_systems(p, args.systems, SYSTEMS)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.quick:
        config = Config(
            systems,
            warm_s=0.2,
            segment_s=0.8,
            grace_s=0.15,
            repeats=args.repeats,
            streams=streams,
        )
    else:
        config = Config(systems, repeats=args.repeats, streams=streams)

    t_start = time.perf_counter()
    print(
        f"# goodput under overload: max_batch_size={MAX_BATCH}, max_wait={MAX_WAIT_S * 1e3:g} ms, "
        f"target {TARGET_S * 1e3:g} ms from call to answer; device {BATCH_FIXED_S * 1e3:g} ms "
        f"+ {ITEM_COST_S['light'] * 1e3:g} ms/item (light, C = {capacity('light'):.0f}/s), "
        f"then {ITEM_COST_S['heavy'] * 1e3:g} ms/item (heavy, C = {capacity('heavy'):.0f}/s)"
    )
    print(
        f"# per load point, one instance: {config.warm_s:g} s warm-up, {config.segment_s:g} s "
        f"light, {config.segment_s:g} s heavy back to back, {config.grace_s:g} s grace; "
        f"Poisson arrivals (seed {config.seed}); {config.repeats} repeat(s), medians"
    )
    print(
        f"# streams {', '.join(config.streams)}: warmup, a fresh device's first "
        f"{WARMUP_BATCHES} batches {WARMUP_FACTOR}x, counted after {WARMUP_UNCOUNTED_S:g} s; "
        f"stall, one batch in {STALL_EVERY} {STALL_FACTOR}x (C = {capacity('stall'):.0f}/s)"
    )
    print(
        f"# batchkit queue bound: max_queue_size={QUEUE_BOUND}, what full light batches "
        f"drain within the target: floor(({TARGET_S * 1e3:g} / {full_batch_s('light') * 1e3:g}"
        f" - 1) * {MAX_BATCH})"
    )
    res = asyncio.run(run(config))
    ok = report(res, config)
    if args.json:
        Path(args.json).write_text(json.dumps(without_nan(dataclasses.asdict(res)), indent=1))
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
