"""Grouped batching online: one adapter a batch, batchkit against its peers, same run.

A service with many adapters (LoRA weights, task heads) on one device wants each batch
to hold one adapter's requests: a call that mixes adapters pays to switch between them.
Requests come for every adapter at once, a few hot, most rare. This benchmark offers
such traffic open loop and counts what comes back, how late, per adapter.

Emulated device: one device, one ``threading.Lock``; a call of n items of g groups
(adapters) holds it for ``time.sleep(2 ms + 0.2 ms * n + 3 ms * (g - 1))`` (async rows
send the call through ``loop.run_in_executor``). Max batch 16, max wait 5 ms for every
system. The *one-group capacity* C is what full one-group batches allow: 16 items per
5.2 ms, about 3077 items/s. Traffic: 12 adapters, each request's adapter drawn from
Zipf(1.1) (the hottest 35.5% of requests, the rarest 2.3%), Poisson arrivals at 0.5x
and 0.9x C, seeded, the same for every row.

Rows (a fresh instance and a fresh device per load):

- ``batchkit group``       ``@batchkit.batched(group=adapter, max_groups_per_batch=1)``:
  every batch one adapter, the oldest waiting request's adapter first;
- ``batchkit group x4``    the same with ``max_groups_per_batch=4``: a batch of one
  adapter that leaves short is filled from the next oldest adapters, paying 3 ms for
  each one added;
- ``batchkit per group``   one ungrouped ``@batched`` per adapter, all sharing the device
  (each its own worker thread, meeting at the device's lock);
- ``batchkit split``       one ungrouped ``@batched`` whose batch function splits each
  batch by adapter and calls the device once per adapter (the naive fix);
- ``ray-serve per group``  a Ray Serve deployment (``@serve.deployment``) holding one
  ``@serve.batch`` function per adapter, each request routed to its adapter's;
- ``ray-serve multiplexed`` a deployment with Ray's batching by multiplexed model id: one
  ``@serve.batch`` method serves every adapter and reads
  ``serve.get_multiplexed_model_id()``; Ray splits each batch by model id itself
  (``_BatchQueue._split_batch_by_model_id``) and runs the parts concurrently, each its
  own device call. ``@serve.multiplexed`` (the model loader) is left out: in local
  testing mode its first load calls ``ray.init`` (a local Ray cluster, ~30 s here, the
  driver stalled meanwhile) to report its models to a controller that is not there,
  then retries ten times a second. Its loader would return the adapter's name and cost
  nothing here;
- ``device (ref)``         no batcher: the device called back to back on full
  one-group batches for a few seconds: what this machine's sleeps and lock allow (a
  sleep overshoots, more on a busy machine), as items/s over C.

How the Ray rows are reached (``--ray-via``):

- ``direct`` (the default): the deployment's class (``deployment.func_or_class``) is
  made in the driver's loop and its ``__call__`` awaited there, as ``_peers.py`` serves
  Ray to the other benchmarks: Ray's batching code, without its handle;
- ``handle``: ``serve.run(deployment.bind(), _local_testing_mode=True)`` and every
  request through the returned handle (``handle.options(multiplexed_model_id=adapter)``
  for the multiplexed row). Local testing mode runs the replica on its own thread of
  this process, and its handle path costs 0.4-0.6 ms of CPU a request here (an
  identity deployment peaks at 1.0-1.7 k requests/s on this 2-core machine): at these
  rates the driver falls seconds behind and most requests come after the drain, so the
  rows then measure the handle, not the batching. A deployed replica runs in its own
  process.

Two things a replica does and the script does for it: it installs the replica context
``@serve.batch`` reads (as ``_peers.py`` does; local testing mode sets none, and a
batched call then raises ``RayServeException``), and the deployment's ``__call__`` sets
the request's multiplexed model id (a replica takes it from the handle's option; local
testing mode does not, and ``get_multiplexed_model_id()`` would be empty). Ray pickles
a deployment and its arguments even in local testing mode and builds the replica from
the copies, so the replica reaches this process's device through this module, by name.

A request's latency runs from its call (the moment the driver called the system) to its
answer; its queue wait, from its call to the moment its device call took the lock. After
the last arrival a drain period (1 s; ``--quick`` 0.2 s) lets the backlog be answered;
then what is left is cancelled, and a request the driver comes to only after it (a row
whose own work holds the loop makes the driver that late) is never made. Reported per
row and load: answered (within the run and the drain) over offered; the worst adapter's
p99 latency and the overall p99 (answered requests only: read them beside the answered
fraction); the longest queue wait (of requests that reached the device); items and
adapters per device call; how busy the device was while requests arrived; and the mean
gap, the time it stood idle between two calls while the second one's requests were
already waiting (the hand-over from one batch to the next). Every answer is checked
(each caller gets its own number back) and every device call of a row is checked
against its row's group limit before a number is printed.

Beside the rows: ``device (ref)``, and the least max wait any scheduler could keep on the
same arrivals: for a bound W, each adapter needs at least the batches a greedy cover of
its arrivals by windows of W (at most 16 a batch) takes, each costing 2 ms + 0.2 ms an
item by the formula alone (a call mixing adapters costs more than separate calls:
3 ms a switch against 2 ms a call, so mixing never lowers it); the least W whose device
time fits between the first arrival and the window's end plus W (plus one call) is
printed: by the formula, a bound (no scheduler keeps
every wait below it on this device); and with ``device (ref)``'s overshoot (what its
full calls took beyond 5.2 ms) added to every call, an estimate of the same on this
machine (the overshoot moves with the machine's load).

Goals at 0.9x (PASS/MISS lines; exit status 1 on a MISS), for ``batchkit group``:
answered >= 0.97 of offered; worst adapter's p99 <= 200 ms and <= 0.2x ``batchkit per
group``'s; longest queue wait <= max wait + 3 full-batch times (20.6 ms). Each line gives
the bound and the other rows beside it. For ``batchkit group x4`` an info line says what
the switching cost buys, against ``batchkit group``, at each load.

Usage::

    python benchmarks/grouped.py            # ~2.5 min on 2 cores (10 s a row a load)
    python benchmarks/grouped.py --quick    # ~10 s: 0.5 s a row a load, noisier
    python benchmarks/grouped.py --systems group,group4,per-group,split --quick
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import dataclasses
import gc
import itertools
import logging
import math
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import chosen_systems  # noqa: E402
from _load import issue, poisson_arrivals  # noqa: E402
from _report import check, percentile, rotated  # noqa: E402

import batchkit  # noqa: E402

MAX_BATCH = 16
MAX_WAIT_S = 0.005
CALL_S = 0.002  # every device call's own cost
ITEM_S = 0.0002  # each item's
SWITCH_S = 0.003  # each adapter past the first in one call
GROUPS = 12
ZIPF_S = 1.1
ADAPTERS = tuple(f"adapter-{k:02d}" for k in range(1, GROUPS + 1))  # hottest first
LOADS = (0.5, 0.9)
JUDGED_LOAD = 0.9
ANSWERED_GOAL = 0.97
P99_GOAL_S = 0.200
P99_RATIO_GOAL = 0.2


def call_seconds(items: int, groups: int) -> float:
    """Seconds the device holds its lock for one call of ``items`` items of ``groups``
    adapters: its own cost, each item's, and each switch to another adapter."""
    return CALL_S + ITEM_S * items + SWITCH_S * (groups - 1)


FULL_BATCH_S = call_seconds(MAX_BATCH, 1)
CAPACITY = MAX_BATCH / FULL_BATCH_S  # one-group capacity, items/s
MAX_WAIT_GOAL_S = MAX_WAIT_S + 3 * FULL_BATCH_S


def zipf_shares(groups: int = GROUPS, s: float = ZIPF_S) -> list[float]:
    """Each adapter's share of the requests, hottest first: k^-s, normalised.

    Args:
        groups: How many adapters.
        s: The Zipf exponent.
    """
    weights = [k**-s for k in range(1, groups + 1)]
    total = sum(weights)
    return [w / total for w in weights]


SYSTEMS = {  # command-line name: row label
    "group": "batchkit group",
    "group4": "batchkit group x4",
    "per-group": "batchkit per group",
    "split": "batchkit split",
    "ray-per-group": "ray-serve per group",
    "ray-multiplexed": "ray-serve multiplexed",
}
RAY_ROWS = ("ray-per-group", "ray-multiplexed")
GROUP_LIMIT = {"group4": 4}  # adapters one device call may hold; 1 for every other row
JUDGED, SWITCHING, PER_GROUP = "group", "group4", "per-group"
REFERENCE = "device (ref)"
LATE_NOTE_MS = 20.0  # a row whose driver ran later than this at p99 gets a note
WARMUP_S = 0.3  # the first batchkit row serves this long before anything is counted


class Item(NamedTuple):
    """One request: its number in the arrival stream (its expected answer) and its adapter."""

    number: int
    adapter: str


def adapter_of(item: Item) -> str:
    """The group of a request: its adapter."""
    return item.adapter


# --------------------------------------------------------------------------- the device


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceCall:
    """One call the device ran: when it took the lock, when it let go, what it held."""

    start: float
    end: float
    numbers: tuple[int, ...]  # its requests
    groups: int

    @property
    def items(self) -> int:
        """How many requests it held."""
        return len(self.numbers)


class Device:
    """One emulated device: one call at a time (a ``threading.Lock``), each a
    ``time.sleep`` of :func:`call_seconds`; records every call, and when each item's
    call took the lock (``time.monotonic``, the clock of asyncio's ``loop.time()``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[DeviceCall] = []
        self.started: dict[int, float] = {}

    def run(self, items: Sequence[Item]) -> list[int]:
        """Run one call; every item's answer is its number."""
        groups = len({item.adapter for item in items})
        with self._lock:
            start = time.monotonic()
            time.sleep(call_seconds(len(items), groups))
            end = time.monotonic()
        numbers = tuple(item.number for item in items)
        self.calls.append(DeviceCall(start, end, numbers, groups))
        for number in numbers:
            self.started[number] = start
        return list(numbers)

    def idle_for(self) -> float:
        """Seconds since the last call ended (infinite before any)."""
        return time.monotonic() - self.calls[-1].end if self.calls else math.inf


def device_back_to_back(seconds: float) -> float:
    """``device (ref)``: the device called back to back on full one-group batches for
    ``seconds``, no batcher; items/s."""
    device = Device()
    full = [Item(i, ADAPTERS[0]) for i in range(MAX_BATCH)]
    calls = 0
    t0 = time.monotonic()
    while calls < 10 or time.monotonic() - t0 < seconds:
        device.run(full)
        calls += 1
    return calls * MAX_BATCH / (time.monotonic() - t0)


# --------------------------------------------------------------------------- traffic


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One load's arrival stream: when each request comes (seconds after the start) and
    what it is (``items[i].number == i``)."""

    arrivals: list[float]
    items: list[Item]


def make_schedule(load: float, seconds: float, rng: random.Random) -> Schedule:
    """Poisson arrivals at ``load`` times C for ``seconds``, adapters drawn from Zipf.

    Args:
        load: The offered rate over the one-group capacity C.
        seconds: The arrival window.
        rng: The seeded generator (the same seed gives the same stream).
    """
    arrivals = poisson_arrivals(rng, load * CAPACITY, 0.0, seconds)
    cum = list(itertools.accumulate(zipf_shares()))
    adapters = rng.choices(ADAPTERS, cum_weights=cum, k=len(arrivals))
    return Schedule(arrivals, [Item(i, a) for i, a in enumerate(adapters)])


def device_seconds_within(schedule: Schedule, wait_s: float, overshoot_s: float = 0.0) -> float:
    """The least device time (by :func:`call_seconds`, plus ``overshoot_s`` a call) that
    answers every request of ``schedule`` after a wait of at most ``wait_s``, whatever
    the scheduler.

    Per adapter, a greedy cover: the first request not yet served must be in a call that
    starts within ``wait_s`` of it, which can hold only what has arrived by then (16 at
    most); starting it as late as allowed takes the most. A call mixing adapters costs
    at least their separate calls (a switch costs more than a call), so the sum over
    adapters bounds every schedule.

    Args:
        schedule: The arrivals.
        wait_s: The bound on every request's wait.
        overshoot_s: What each call takes beyond the formula (a sleep's overshoot).
    """
    by_adapter: dict[str, list[float]] = {}
    for at, item in zip(schedule.arrivals, schedule.items):
        by_adapter.setdefault(item.adapter, []).append(at)
    total = 0.0
    for times in by_adapter.values():
        k = 0
        while k < len(times):
            reach = bisect.bisect_right(times, times[k] + wait_s, k, min(len(times), k + MAX_BATCH))
            total += call_seconds(reach - k, 1) + overshoot_s
            k = reach
    return total


def least_max_wait(schedule: Schedule, seconds: float, overshoot_s: float = 0.0) -> float:
    """The least bound W on every wait whose device time (:func:`device_seconds_within`)
    fits in the time the device has, to 0.1 ms: no scheduler keeps every wait under it.

    Every call starts by its first request's arrival plus W, so all of them run between
    the first arrival and the window's end plus W plus one full call (time that grows
    with W, while the calls W needs do not: some W always fits).

    Args:
        schedule: The arrivals.
        seconds: The arrival window.
        overshoot_s: What each call takes beyond the formula.
    """

    def fits(wait_s: float) -> bool:
        available = seconds + wait_s + FULL_BATCH_S + overshoot_s
        return device_seconds_within(schedule, wait_s, overshoot_s) <= available

    lo, hi = 0.0, max(seconds, FULL_BATCH_S)
    while not fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


# --------------------------------------------------------------------------- systems


class System(Protocol):
    """A batcher under test: ``await call(item)`` is the item's answer."""

    def call(self, item: Item) -> Awaitable[Any]: ...

    async def close(self) -> None: ...

    def note(self) -> str: ...


class BatchkitGrouped:
    """``@batchkit.batched(group=adapter_of, max_groups_per_batch=k)`` on the device."""

    def __init__(self, device: Device, max_groups: int) -> None:
        self.f = batchkit.batched(
            max_batch_size=MAX_BATCH,
            max_wait_ms=MAX_WAIT_S * 1e3,
            group=adapter_of,
            max_groups_per_batch=max_groups,
        )(device.run)
        self.call = self.f.acall

    def note(self) -> str:
        """What ``stats().groups`` says: requests per adapter, its own worst wait."""
        groups = self.f.stats().groups
        worst = max(groups, key=lambda g: groups[g].queue_wait.max)
        return (
            f"stats().groups: {len(groups)} adapters, {sum(g.requests for g in groups.values())}"
            f" requests; longest queue wait {groups[worst].queue_wait.max * 1e3:.1f} ms"
            f" ({worst}, of its last 4096)"
        )

    async def close(self) -> None:
        """Close the function (its callers are answered or withdrawn by now)."""
        await self.f.aclose(timeout=2.0)


class BatchkitPerGroup:
    """One ungrouped ``@batched`` per adapter, all calling the same device."""

    def __init__(self, device: Device) -> None:
        self.fs = {
            a: batchkit.batched(max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_S * 1e3)(device.run)
            for a in ADAPTERS
        }

    def call(self, item: Item) -> Awaitable[Any]:
        """The request, to its adapter's function."""
        return self.fs[item.adapter].acall(item)

    def note(self) -> str:
        """Nothing to add."""
        return ""

    async def close(self) -> None:
        """Close every adapter's function."""
        await asyncio.gather(*(f.aclose(timeout=2.0) for f in self.fs.values()))


class BatchkitSplit:
    """One ungrouped ``@batched`` whose batch function calls the device once per adapter
    of its batch (in the order the adapters first appear)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.formed: list[tuple[int, int]] = []  # per batch: items, adapters
        self.f = batchkit.batched(max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_S * 1e3)(
            self.run_split
        )
        self.call = self.f.acall

    def run_split(self, items: list[Item]) -> list[int]:
        """The batch function: one device call per adapter of the batch."""
        by_adapter: dict[str, list[Item]] = {}
        for item in items:
            by_adapter.setdefault(item.adapter, []).append(item)
        self.formed.append((len(items), len(by_adapter)))
        answers: dict[int, int] = {}
        for part in by_adapter.values():
            answers.update(zip((item.number for item in part), self.device.run(part)))
        return [answers[item.number] for item in items]

    def note(self) -> str:
        """What its batches held before the split."""
        if not self.formed:
            return ""
        items = statistics.fmean(n for n, _ in self.formed)
        groups = statistics.fmean(g for _, g in self.formed)
        return (
            f"its batches held {items:.1f} items of {groups:.2f} adapters, one device call"
            " per adapter"
        )

    async def close(self) -> None:
        """Close the function."""
        await self.f.aclose(timeout=2.0)


# Ray Serve pickles a deployment's class when it is declared and its arguments when it
# is bound, and in local testing mode builds the replica from those copies: a device
# captured in the class or passed to bind() would be a copy with its own lock. The
# replica finds the live one here instead, through this module by name (the copy's
# code looks it up at run time).
_RAY_DEVICE: Device | None = None
_MODULE = __name__


def ray_device() -> Device:
    """The device of the Ray row being measured (set before its deployment is made)."""
    # (No isinstance: in a pickled copy of this function `Device` would be a copy too.)
    device = sys.modules[_MODULE]._RAY_DEVICE
    if device is None:
        raise RuntimeError("no device set for the Ray row")
    return cast("Device", device)


def ray_unavailable() -> str | None:
    """Why Ray Serve cannot run here, or None: it imports, and its replica context (what
    ``@serve.batch`` reads; local testing mode sets none) can be installed."""
    try:
        from _peers import fake_ray_replica_context

        fake_ray_replica_context()
    except Exception as exc:  # noqa: BLE001 - any reason is the row's reason
        return f"{type(exc).__name__}: {exc}"
    return None


def ray_per_group_deployment() -> Any:
    """One Serve deployment with one ``@serve.batch`` function per adapter."""
    from ray import serve

    @serve.deployment(max_ongoing_requests=1_000_000)
    class PerAdapter:
        def __init__(self) -> None:
            device = ray_device()

            def queue() -> Callable[[Item], Awaitable[int]]:
                @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=MAX_WAIT_S)
                async def run(items: list[Item]) -> list[int]:
                    loop = asyncio.get_running_loop()
                    return await loop.run_in_executor(None, device.run, items)

                return run

            self.queues = {a: queue() for a in ADAPTERS}

        async def __call__(self, item: Item) -> int:
            return await self.queues[item.adapter](item)

    return PerAdapter


def ray_multiplexed_deployment() -> Any:
    """One Serve deployment whose one ``@serve.batch`` serves every adapter: Ray splits
    each batch by the requests' multiplexed model id."""
    from ray import serve
    from ray.serve import context

    @serve.deployment(max_ongoing_requests=1_000_000)
    class Multiplexed:
        def __init__(self) -> None:
            self.device = ray_device()

        @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=MAX_WAIT_S)
        async def run(self, items: list[Item]) -> list[int]:
            adapter = serve.get_multiplexed_model_id()
            if any(item.adapter != adapter for item in items):
                raise RuntimeError(f"a batch of model {adapter!r} holds another's request")
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, self.device.run, items)

        async def __call__(self, item: Item) -> int:
            # What a replica does with the request's multiplexed_model_id (the
            # handle's option), and neither local testing mode nor a direct call does
            # (see the module's docstring).
            context._set_request_context(multiplexed_model_id=item.adapter)
            return await self.run(item)

    return Multiplexed


class RayRow:
    """A Ray Serve deployment's class made in this loop and called directly
    (``via="direct"``: Ray's batching without its handle path, as ``_peers.py`` serves
    Ray to the other benchmarks); or the deployment run by ``serve.run`` in local
    testing mode and called through its handle (``via="handle"``)."""

    _apps = itertools.count()

    def __init__(self, name: str, device: Device, via: str) -> None:
        from ray import serve

        global _RAY_DEVICE
        _RAY_DEVICE = device
        deployment = (
            ray_multiplexed_deployment()
            if name == "ray-multiplexed"
            else ray_per_group_deployment()
        )
        self.replica: Any = None
        if via == "direct":
            self.replica = deployment.func_or_class()
            self.call = self.replica.__call__
            return
        handle = serve.run(
            deployment.bind(),
            name=f"{name}-{next(self._apps)}",
            route_prefix=None,
            _local_testing_mode=True,
        )
        # (serve.run sets up its logger anew: one line per replica started.)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        if name == "ray-multiplexed":
            handles = {a: handle.options(multiplexed_model_id=a) for a in ADAPTERS}
        else:
            handles = dict.fromkeys(ADAPTERS, handle)
        self.call = lambda item: handles[item.adapter].remote(item)

    def note(self) -> str:
        """Nothing to add."""
        return ""

    async def close(self) -> None:
        """Stop what of Ray runs on this loop (a direct row's batch queues)."""
        # A local replica cannot be shut down: its callers are cancelled by now, and
        # settle() waits for its device to go quiet. A direct one's batch queues run on
        # this loop: their collecting tasks are cancelled here.
        if self.replica is None:
            return
        queues = getattr(self.replica, "queues", None)
        for fn in queues.values() if queues is not None else [type(self.replica).run]:
            lazy = getattr(getattr(fn, "_get_max_batch_size", None), "__self__", None)
            task = getattr(getattr(lazy, "_queue", None), "_handle_batch_task", None)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def make_system(name: str, device: Device, ray_via: str = "direct") -> System:
    """A fresh instance of row ``name`` serving ``device`` (inside the running loop).

    Args:
        name: The row (a ``SYSTEMS`` name).
        device: Its device.
        ray_via: For the Ray rows, ``"direct"`` (the deployment's class called in this
            loop) or ``"handle"`` (``serve.run`` in local testing mode).
    """
    if name == "group":
        return BatchkitGrouped(device, 1)
    if name == "group4":
        return BatchkitGrouped(device, GROUP_LIMIT["group4"])
    if name == "per-group":
        return BatchkitPerGroup(device)
    if name == "split":
        return BatchkitSplit(device)
    if name in RAY_ROWS:
        return RayRow(name, device, ray_via)
    raise ValueError(f"unknown system {name!r}")


# --------------------------------------------------------------------------- one load


@dataclasses.dataclass(frozen=True)
class Config:
    """One run's settings.

    Attributes:
        systems: The rows to run (``SYSTEMS`` names), in table order.
        loads: Offered rates over the one-group capacity C.
        seconds: Each row's arrival window at each load.
        drain_s: How long after the last arrival answers still count.
        reference_s: How long ``device (ref)`` runs.
        seed: The arrivals' seed (every row sees the same stream).
        ray_via: How the Ray rows are called: ``"direct"`` or ``"handle"``
            (see :class:`RayRow`).
    """

    systems: tuple[str, ...] = tuple(SYSTEMS)
    loads: tuple[float, ...] = LOADS
    seconds: float = 10.0
    drain_s: float = 1.0
    reference_s: float = 3.0
    seed: int = 1234
    ray_via: str = "direct"


@dataclasses.dataclass(frozen=True)
class Cell:
    """What one row did at one load.

    Attributes:
        offered: Requests offered.
        answered: Of those, answered within the run and the drain period.
        errors: Requests that failed, by exception type name.
        worst_group: The adapter with the highest p99.
        worst_group_p99_ms: Its p99 latency, of its answered requests (inf when it has
            offered requests and none was answered).
        p99_ms: The p99 latency of every answered request.
        max_wait_ms: The longest queue wait of a request that reached the device.
        items_per_call: Mean items per device call started while requests arrived.
        groups_per_call: Mean adapters per such call.
        busy: The fraction of the arrival window the device ran.
        gap_ms: The mean time the device stood idle between two calls while the
            second one's requests were already waiting (the hand-over).
        overshoot_ms: The mean time a call held the device beyond the formula.
        call_lateness_p99_ms: How late the driver made its calls, p99.
        not_called: Requests the driver came to only after the drain period (so late
            that it never called the row for them; not answered).
        note: What the row adds about itself (batchkit's own stats, a split's batches).
    """

    offered: int
    answered: int
    errors: dict[str, int]
    worst_group: str
    worst_group_p99_ms: float
    p99_ms: float
    max_wait_ms: float
    items_per_call: float
    groups_per_call: float
    busy: float
    gap_ms: float
    overshoot_ms: float
    call_lateness_p99_ms: float
    not_called: int
    note: str


class WrongAnswer(AssertionError):
    """A row answered a request with another's result, or broke its group limit."""


async def settle(device: Device, limit_s: float = 3.0) -> None:
    """Wait (up to ``limit_s``) until no task but this one is left on the loop and the
    device has been idle for 50 ms: what a closed row left behind (a peer's batches of
    cancelled callers) is done before the next row is measured."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + limit_s
    while loop.time() < give_up and (len(asyncio.all_tasks()) > 1 or device.idle_for() < 0.05):
        await asyncio.sleep(0.01)


async def run_point(name: str, config: Config, schedule: Schedule) -> Cell:
    """One fresh instance of row ``name`` serves ``schedule`` on a fresh device."""
    loop = asyncio.get_running_loop()
    n = len(schedule.items)
    called = [0.0] * n
    latency: list[float | None] = [None] * n
    lateness = [0.0] * n
    errors: Counter[str] = Counter()
    wrong: list[int] = []
    device = Device()
    system = make_system(name, device, config.ray_via)
    t0 = loop.time() + 0.005
    deadline = t0 + config.seconds + config.drain_s  # then what is left is cancelled

    async def one(i: int, scheduled: float) -> None:
        called[i] = loop.time()
        lateness[i] = called[i] - scheduled
        if called[i] >= deadline:
            return  # the driver is that late: a call now could not count
        try:
            answer = await system.call(schedule.items[i])
        except Exception as exc:  # noqa: BLE001 - counted by type, printed as a note
            if loop.time() < deadline:  # (a peer may turn a cancellation into its error)
                errors[type(exc).__name__] += 1
            return
        latency[i] = loop.time() - called[i]
        if answer != i:
            wrong.append(i)

    try:
        running = await issue(schedule.arrivals, one, t0)
        if running:
            await asyncio.wait(list(running), timeout=max(deadline - loop.time(), 0.0))
        left = list(running)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        note = system.note()
    finally:
        await system.close()
        await settle(device)
    if wrong:
        raise WrongAnswer(f"{SYSTEMS[name]}: request {wrong[0]} got another's result")
    limit = GROUP_LIMIT.get(name, 1)
    if over := [c for c in device.calls if c.groups > limit]:
        raise WrongAnswer(
            f"{SYSTEMS[name]}: {len(over)} device calls held more than {limit} adapters "
            f"(the first {over[0].groups})"
        )
    return summarize(schedule, config, t0, called, latency, lateness, device, dict(errors), note)


def summarize(
    schedule: Schedule,
    config: Config,
    t0: float,
    called: list[float],
    latency: list[float | None],
    lateness: list[float],
    device: Device,
    errors: dict[str, int],
    note: str,
) -> Cell:
    """One row's cell from what its requests and its device recorded."""
    by_group: dict[str, list[float]] = {a: [] for a in ADAPTERS}
    offered_by_group: Counter[str] = Counter()
    for item, t in zip(schedule.items, latency):
        offered_by_group[item.adapter] += 1
        if t is not None:
            by_group[item.adapter].append(t)
    p99s = {
        a: percentile(ts, 0.99) if ts else math.inf
        for a, ts in by_group.items()
        if offered_by_group[a]
    }
    worst = max(p99s, key=p99s.__getitem__)
    served = [t for t in latency if t is not None]
    waits = [start - called[i] for i, start in device.started.items()]
    not_called = sum(t0 + config.seconds + config.drain_s <= c for c in called)
    end = t0 + config.seconds
    window = [c for c in device.calls if t0 <= c.start < end]
    busy = sum(max(0.0, min(c.end, end) - max(c.start, t0)) for c in device.calls)
    # The device idle between two calls while the second one's requests were waiting:
    # the hand-over from one batch to the next (results out, next batch in, threads).
    gaps = [
        b.start - a.end
        for a, b in itertools.pairwise(device.calls)
        if t0 <= b.start < end and min(called[n] for n in b.numbers) < a.end
    ]
    return Cell(
        offered=len(schedule.items),
        answered=len(served),
        errors=errors,
        worst_group=worst,
        worst_group_p99_ms=p99s[worst] * 1e3,
        p99_ms=percentile(served, 0.99) * 1e3,
        max_wait_ms=max(waits) * 1e3 if waits else math.nan,
        items_per_call=statistics.fmean(c.items for c in window) if window else math.nan,
        groups_per_call=statistics.fmean(c.groups for c in window) if window else math.nan,
        busy=busy / config.seconds,
        gap_ms=statistics.fmean(gaps) * 1e3 if gaps else math.nan,
        overshoot_ms=statistics.fmean(
            c.end - c.start - call_seconds(c.items, c.groups) for c in window
        )
        * 1e3
        if window
        else math.nan,
        call_lateness_p99_ms=percentile(lateness, 0.99) * 1e3,
        not_called=not_called,
        note=note,
    )


# --------------------------------------------------------------------------- the run


@dataclasses.dataclass(frozen=True)
class Simulated:
    """batchkit's own scheduler on the same arrivals, in ``batchkit.simulate`` (no
    threads, no sleeps): what the policy does on a device that keeps the formula, or
    one whose every call takes ``extra_ms`` longer.

    Attributes:
        extra_ms: What each call took beyond the formula.
        worst_group_p99_ms: The worst adapter's p99 latency (arrival to batch end).
        max_wait_ms: The longest queue wait (arrival to dispatch).
    """

    extra_ms: float
    worst_group_p99_ms: float
    max_wait_ms: float


def simulated(schedule: Schedule, max_groups: int, extra_ms: float) -> Simulated:
    """``batchkit.simulate`` of ``@batched(group=..., max_groups_per_batch=max_groups)``
    on ``schedule``, each call ``extra_ms`` longer than :func:`call_seconds`.

    Args:
        schedule: The arrivals and their adapters.
        max_groups: The row's ``max_groups_per_batch``.
        extra_ms: What each call takes beyond the formula (0: the formula).
    """
    model = batchkit.LatencyModel.linear(
        CALL_S * 1e3 + extra_ms, ITEM_S * 1e3, switch_ms=SWITCH_S * 1e3
    )
    sim = batchkit.simulate(
        model,
        arrivals=schedule.arrivals,
        groups=[item.adapter for item in schedule.items],
        max_batch_size=MAX_BATCH,
        max_wait_ms=MAX_WAIT_S * 1e3,
        max_groups_per_batch=max_groups,
    )
    return Simulated(extra_ms, sim.worst_group_p99, sim.queue_wait.max)


@dataclasses.dataclass
class Results:
    """Everything one run measured.

    Attributes:
        cells: Row name -> load -> its cell.
        missing: Row name -> why it did not run.
        offered: Load -> requests offered (the same for every row).
        reference: ``device (ref)``: items/s of full one-group batches back to back.
        least_wait_s: Load -> the least max wait any scheduler could keep, by the
            formula alone.
        least_wait_measured_s: Load -> the same with each call's overshoot as
            ``device (ref)`` measured it.
        simulated: Grouped row name -> load -> ``batchkit.simulate`` of its policy on
            the same arrivals: on the formula, then with the row's own overshoot and
            gap added to every call.
    """

    cells: dict[str, dict[float, Cell]]
    missing: dict[str, str]
    offered: dict[float, int]
    reference: float
    least_wait_s: dict[float, float]
    least_wait_measured_s: dict[float, float]
    simulated: dict[str, dict[float, tuple[Simulated, Simulated]]] = dataclasses.field(
        default_factory=dict
    )

    @property
    def overshoot_s(self) -> float:
        """What a full one-group call took beyond the formula in ``device (ref)``."""
        return max(0.0, MAX_BATCH / self.reference - FULL_BATCH_S)


async def run(config: Config) -> Results:
    """The device reference, a short warm-up of the first row, then every load: each row
    (order rotated per load) on the same arrivals, then ``batchkit.simulate`` of the
    grouped rows' policy on them."""
    missing: dict[str, str] = {}
    if any(name in RAY_ROWS for name in config.systems) and (why := ray_unavailable()):
        missing.update(dict.fromkeys((n for n in config.systems if n in RAY_ROWS), why))
    res = Results(
        cells={name: {} for name in config.systems if name not in missing},
        missing=missing,
        offered={},
        reference=device_back_to_back(config.reference_s),
        least_wait_s={},
        least_wait_measured_s={},
    )
    # Not counted: a short load on the first batchkit row (imports, first threads).
    if first := next((n for n in config.systems if n not in RAY_ROWS), None):
        warm = dataclasses.replace(config, seconds=WARMUP_S, drain_s=WARMUP_S)
        await run_point(first, warm, make_schedule(config.loads[0], WARMUP_S, random.Random(0)))
    for k, load in enumerate(config.loads):
        schedule = make_schedule(load, config.seconds, random.Random(f"{config.seed}/{load}"))
        res.offered[load] = len(schedule.items)
        res.least_wait_s[load] = least_max_wait(schedule, config.seconds)
        res.least_wait_measured_s[load] = least_max_wait(schedule, config.seconds, res.overshoot_s)
        for name in rotated([n for n in config.systems if n not in res.missing], k):
            gc.collect()
            try:
                res.cells[name][load] = await run_point(name, config, schedule)
            except WrongAnswer:
                raise
            except Exception as exc:  # noqa: BLE001 - a peer that cannot start here
                if name not in RAY_ROWS:
                    raise
                res.missing[name] = f"{type(exc).__name__}: {exc}"
                res.cells.pop(name, None)
        for name, max_groups in ((JUDGED, 1), (SWITCHING, GROUP_LIMIT[SWITCHING])):
            if name in res.cells:
                c = res.cells[name][load]
                extra = sum(x for x in (c.overshoot_ms, c.gap_ms) if not math.isnan(x))
                res.simulated.setdefault(name, {})[load] = (
                    simulated(schedule, max_groups, 0.0),
                    simulated(schedule, max_groups, max(0.0, extra)),
                )
    return res


# --------------------------------------------------------------------------- report


def ms(x: float) -> str:
    """Milliseconds as printed: whole ms from 10 on, '-' for none (NaN), 'inf' for a p99
    of nothing answered."""
    if math.isnan(x):
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.0f} ms" if x >= 10 else f"{x:.1f} ms"


def print_load(res: Results, config: Config, load: float) -> None:
    """One load's table: a line per row, then the bounds."""
    offered = res.offered[load]
    print(
        f"\n## {load:g}x C: {load * CAPACITY:.0f} requests/s offered, {offered} over "
        f"{config.seconds:g} s, {config.drain_s:g} s drain"
    )
    print(
        f"{'system':<22} {'answered':>8} {'worst adapter p99':>28} {'p99':>8} "
        f"{'max wait':>9} {'items/call':>10} {'adapters/call':>13} {'busy':>5} {'gap':>8}"
    )
    for name in config.systems:
        label = SYSTEMS[name]
        if name in res.missing:
            print(f"{label:<22} n/a: {res.missing[name]}")
            continue
        c = res.cells[name][load]
        worst = f"{ms(c.worst_group_p99_ms)} ({c.worst_group})"
        print(
            f"{label:<22} {c.answered / c.offered:>8.3f} {worst:>28} {ms(c.p99_ms):>8} "
            f"{ms(c.max_wait_ms):>9} {c.items_per_call:>10.1f} {c.groups_per_call:>13.2f} "
            f"{c.busy:>5.2f} {c.gap_ms:>5.2f} ms"
        )
    bound = min(1.0, res.reference / (load * CAPACITY))
    print(
        f"{REFERENCE:<22} {bound:>8.3f}  (bound: full one-group batches back to back, "
        f"{res.reference:.0f} items/s = {res.reference / CAPACITY:.3f} C)"
    )
    print(
        f"least max wait any scheduler could keep on these arrivals: "
        f"{ms(res.least_wait_s[load] * 1e3)} by the formula (a bound); "
        f"{ms(res.least_wait_measured_s[load] * 1e3)} with {REFERENCE}'s overshoot "
        f"({res.overshoot_s * 1e3:.2f} ms) on every call (an estimate: it moves with the load)"
    )
    for name, by_load in res.simulated.items():
        ideal, this = by_load[load]
        print(
            f"batchkit.simulate of {SYSTEMS[name]} (its scheduler, these arrivals): worst "
            f"adapter p99 {ms(ideal.worst_group_p99_ms)}, max wait {ms(ideal.max_wait_ms)} "
            f"on the formula; {ms(this.worst_group_p99_ms)}, {ms(this.max_wait_ms)} with "
            f"the row's {this.extra_ms:.2f} ms a call beyond it (overshoot and gap)"
        )


def report(res: Results, config: Config) -> bool:
    """Print the tables, the ratios, the notes and the goals; True when none is missed."""
    for load in config.loads:
        print_load(res, config, load)
    print()
    for name in (n for n in RAY_ROWS if n in res.missing):
        print(f"ray: not available ({res.missing[name]})")
        break
    for name, cells in res.cells.items():
        for load, c in cells.items():
            if c.note:
                print(f"note  {SYSTEMS[name]} {load:g}x: {c.note}")
            if c.errors:
                print(
                    f"note  {SYSTEMS[name]} {load:g}x: failed "
                    + ", ".join(f"{k} {v}" for k, v in c.errors.items())
                )
    lateness = {
        (name, load): c.call_lateness_p99_ms
        for name, cells in res.cells.items()
        for load, c in cells.items()
    }
    if lateness:
        print(
            f"note  the arrival driver made its calls late by "
            f"{statistics.median(lateness.values()):.2f} ms at p99 (median over cells); "
            "latencies count from the call"
        )
    for (name, load), late in lateness.items():
        if late > LATE_NOTE_MS:
            c = res.cells[name][load]
            never = f"; {c.not_called} came after the drain and were not made" * (c.not_called > 0)
            print(
                f"note  {SYSTEMS[name]} {load:g}x: the driver was {ms(late)} late at p99 (the"
                f" row's own work held the loop: its requests came later than offered{never})"
            )
    ratios(res, config)
    switching(res, config)
    return goals(res, config)


def ratios(res: Results, config: Config) -> None:
    """batchkit group against every other row, per load: worst adapter's p99 and answered."""
    if JUDGED not in res.cells:
        return
    for load in config.loads:
        mine = res.cells[JUDGED][load]
        parts = []
        for name, cells in res.cells.items():
            if name == JUDGED:
                continue
            other = cells[load]
            p99 = mine.worst_group_p99_ms / other.worst_group_p99_ms
            parts.append(
                f"{SYSTEMS[name]} {p99:.2f}x p99, {mine.answered / max(other.answered, 1):.2f}x"
                " answered"
            )
        if parts:
            print(f"ratio {SYSTEMS[JUDGED]} / others at {load:g}x: " + "; ".join(parts))


def switching(res: Results, config: Config) -> None:
    """What 4 adapters a batch buys against 1, per load (an info line each)."""
    if JUDGED not in res.cells or SWITCHING not in res.cells:
        return
    for load in config.loads:
        one, four = res.cells[JUDGED][load], res.cells[SWITCHING][load]
        print(
            f"info  {SYSTEMS[SWITCHING]} against {SYSTEMS[JUDGED]} at {load:g}x: "
            f"{four.items_per_call:.1f} against {one.items_per_call:.1f} items a call "
            f"({four.groups_per_call:.2f} adapters), device busy {four.busy:.2f} against "
            f"{one.busy:.2f}; worst adapter p99 {ms(four.worst_group_p99_ms)} against "
            f"{ms(one.worst_group_p99_ms)}, max wait {ms(four.max_wait_ms)} against "
            f"{ms(one.max_wait_ms)}, answered {four.answered / four.offered:.3f} against "
            f"{one.answered / one.offered:.3f}"
        )


def goals(res: Results, config: Config) -> bool:
    """The goals at 0.9x for batchkit group, each with its bound and the other rows."""
    if JUDGED not in res.cells or JUDGED_LOAD not in config.loads:
        print(f"info  the goals are about {SYSTEMS[JUDGED]} at {JUDGED_LOAD:g}x, which did not run")
        return True
    load = JUDGED_LOAD
    mine = res.cells[JUDGED][load]
    others = {n: cells[load] for n, cells in res.cells.items() if n != JUDGED}

    def beside(field: Callable[[Cell], float], spec: Callable[[float], str]) -> str:
        return (
            "; ".join(f"{SYSTEMS[n]} {spec(field(c))}" for n, c in others.items()) or "no other row"
        )

    answered = mine.answered / mine.offered
    bound = min(1.0, res.reference / (load * CAPACITY))
    ok = check(
        f"{load:g}x: answered >= {ANSWERED_GOAL} of offered",
        answered >= ANSWERED_GOAL,
        f"{answered:.3f} (bound {bound:.3f}; "
        f"{beside(lambda c: c.answered / c.offered, lambda x: f'{x:.3f}')})",
    )
    ideal, this = res.simulated[JUDGED][load]
    sim = (
        f"simulated {{}} on the formula, {{}} with this run's {this.extra_ms:.2f} ms a call "
        "beyond it"
    )
    p99 = mine.worst_group_p99_ms
    p99_sim = sim.format(ms(ideal.worst_group_p99_ms), ms(this.worst_group_p99_ms))
    if PER_GROUP in res.cells:
        ratio = p99 / res.cells[PER_GROUP][load].worst_group_p99_ms
        ok &= check(
            f"{load:g}x: worst adapter's p99 <= {P99_GOAL_S * 1e3:.0f} ms and <= "
            f"{P99_RATIO_GOAL}x {SYSTEMS[PER_GROUP]}'s",
            p99 <= P99_GOAL_S * 1e3 and ratio <= P99_RATIO_GOAL,
            f"{ms(p99)} ({mine.worst_group}), {ratio:.3f}x ({p99_sim}; "
            f"{beside(lambda c: c.worst_group_p99_ms, ms)})",
        )
    else:
        ok &= check(
            f"{load:g}x: worst adapter's p99 <= {P99_GOAL_S * 1e3:.0f} ms "
            f"({SYSTEMS[PER_GROUP]} did not run: the ratio is not judged)",
            p99 <= P99_GOAL_S * 1e3,
            f"{ms(p99)} ({mine.worst_group}; {p99_sim})",
        )
    ok &= check(
        f"{load:g}x: longest queue wait <= max wait + 3 full batches ({ms(MAX_WAIT_GOAL_S * 1e3)})",
        mine.max_wait_ms <= MAX_WAIT_GOAL_S * 1e3,
        f"{ms(mine.max_wait_ms)} (least any scheduler could keep here: "
        f"{ms(res.least_wait_s[load] * 1e3)}, about {ms(res.least_wait_measured_s[load] * 1e3)}"
        f" with the overshoot; {sim.format(ms(ideal.max_wait_ms), ms(this.max_wait_ms))}; "
        f"{beside(lambda c: c.max_wait_ms, ms)})",
    )
    return ok


# --------------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="0.5 s a row a load (~10 s), noisier")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated rows to run, from {', '.join(SYSTEMS)} (the device "
        "reference always runs)",
    )
    p.add_argument("--seconds", type=float, help="arrival window a row a load (10; --quick 0.5)")
    p.add_argument(
        "--loads",
        default=",".join(f"{x:g}" for x in LOADS),
        help="comma-separated offered loads, as fractions of C (the goals are at 0.9)",
    )
    p.add_argument("--seed", type=int, default=1234, help="the arrivals' seed")
    p.add_argument(
        "--ray-via",
        choices=("direct", "handle"),
        default="direct",
        help="Ray rows as the deployment's class called in this loop (the default), or "
        "through serve.run's handle in local testing mode",
    )
    args = p.parse_args()
    systems = chosen_systems(p, args.systems, tuple(SYSTEMS))
    try:
        loads = tuple(float(x) for x in args.loads.split(","))
    except ValueError:
        p.error(f"--loads must be numbers separated by commas, got {args.loads!r}")
    if any(not 0 < x < 10 for x in loads):
        p.error(f"--loads must be above 0 and below 10, got {args.loads!r}")
    common = {"seed": args.seed, "ray_via": args.ray_via, "loads": loads}
    if args.quick:
        config = Config(systems, seconds=0.5, drain_s=0.2, reference_s=0.3, **common)
    else:
        config = Config(systems, **common)
    if args.seconds is not None:
        if args.seconds <= 0:
            p.error(f"--seconds must be above 0, got {args.seconds}")
        config = dataclasses.replace(config, seconds=args.seconds)

    t_start = time.perf_counter()
    shares = zipf_shares()
    print(
        f"# grouped batching: {GROUPS} adapters, Zipf({ZIPF_S:g}) traffic (shares "
        f"{shares[0]:.1%} hottest ... {shares[-1]:.1%} rarest); max_batch_size={MAX_BATCH}, "
        f"max_wait={MAX_WAIT_S * 1e3:g} ms for every row"
    )
    print(
        f"# device: one lock; n items of g adapters take {CALL_S * 1e3:g} ms + "
        f"{ITEM_S * 1e3:g} ms*n + {SWITCH_S * 1e3:g} ms*(g-1) (time.sleep); one-group "
        f"capacity C = {MAX_BATCH} / {FULL_BATCH_S * 1e3:.1f} ms = {CAPACITY:.0f} items/s"
    )
    print(
        f"# open-loop Poisson at {', '.join(f'{x:g}x' for x in config.loads)} C (seed "
        f"{config.seed}), {config.seconds:g} s a row a load, {config.drain_s:g} s drain"
    )
    if any(name in RAY_ROWS for name in systems):
        print(f"# Ray rows via {config.ray_via} (--ray-via)")
    res = asyncio.run(run(config))
    print(
        f"# {REFERENCE}: full one-group batches back to back, no batcher: "
        f"{res.reference:.0f} items/s = {res.reference / CAPACITY:.3f} C"
    )
    ok = report(res, config)
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
