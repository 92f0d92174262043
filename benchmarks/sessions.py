"""Stateful sessions benchmark: 64 streaming sessions on one emulated device.

A streaming model keeps a state per session; each request is a session's next chunk
and needs the state the previous one left. Systems (all on the same device: one call
at a time, ``time.sleep(a + b * B)`` for a batch of B chunks, a = 4 ms, b = 0.2 ms;
max batch 64, max wait 5 ms):

- ``sessions``       ``@batchkit.batched(state=...)``: batchkit keeps the states and
                     runs each session's chunks in order, one at a time;
- ``lock+batched``   the usual workaround: a stateless ``@batchkit.batched`` whose
                     items carry their state, and one ``asyncio.Lock`` per session
                     held by a caller from reading the state to storing the new one;
- ``one-at-a-time``  no batching across sessions: one chunk per device call;
- ``device (ref)``   full device calls back to back from one thread, no server: what
                     this machine's sleeps allow (a loaded machine wakes late).

Scenarios (asyncio callers; every session's chunks are checked to have run in order,
each with the state its previous chunk left):

1. saturation: every session keeps 4 chunks outstanding (it sends the next when one
   is answered: a stream that arrives faster than it is served); chunks/s in the
   steady state (each device call's chunks over the time from its start to the next
   call's: the ramp-up and the drain left out), and the fraction of the device's
   bound ``64 / (a + 64 b)`` (every call full, no gap);
2. latency: each session sends a chunk every period (random phase per session), for
   a load of 0.5x and 1x the device's bound; p50 and p99 chunk latency, from the
   chunk's arrival to its answer, in milliseconds (``one-at-a-time`` is not run:
   it serves 1/16 of the 0.5x load).

Repeats are interleaved (the order rotated each repeat); medians are reported. The
machine's load shows in every number: compare rows of one run.

Usage::

    python benchmarks/sessions.py            # ~1 min
    python benchmarks/sessions.py --quick    # ~20 s, noisier
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import check, med, percentile, rotated  # noqa: E402

import batchkit  # noqa: E402

SESSIONS = 64
MAX_BATCH = 64
MAX_WAIT_MS = 5.0
A, B = 0.004, 0.0002  # emulated device: a + b * batch_size seconds
FULL_T = A + B * MAX_BATCH  # one full batch
BOUND = MAX_BATCH / FULL_T  # chunks/s with every call full and no gap
SYSTEMS = ("sessions", "lock+batched", "one-at-a-time")
WINDOW = 4  # chunks a session has outstanding at saturation
REFERENCE = "device (ref)"

_DEVICE = threading.Lock()  # one device: a second call waits for the first


def device(batch_size: int) -> None:
    with _DEVICE:
        time.sleep(A + B * batch_size)


def model(chunks: list[int], states: list[int]) -> tuple[list[int], list[int]]:
    """The streaming model: a session's state counts its chunks; each result is the
    state before the chunk (so a caller can check it ran in order)."""
    device(len(chunks))
    return list(states), [s + 1 for s in states]


Call = Callable[[int, int], Awaitable[int]]  # (session, chunk number) -> its result


class Server:
    """One system: `call(session, number)` serves a chunk; `close()` ends it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.batches: list[int] = []  # each device call's chunks
        self.started: list[float] = []  # when each device call started
        if name == "sessions":
            self.fn = batchkit.batched(
                max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_MS, state=lambda: 0
            )(self._recorded(model))
            self.call: Call = self._sessions
        elif name == "lock+batched":
            self.fn = batchkit.batched(max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_MS)(
                self._recorded_pairs
            )
            self.locks: dict[int, asyncio.Lock] = {}
            self.states: dict[int, int] = {}
            self.call = self._locked
        else:
            self.one = asyncio.Lock()
            self.states = {}
            self.call = self._one_at_a_time

    def _recorded(self, fn: Callable[[list[int], list[int]], Any]) -> Any:
        def recorded(chunks: list[int], states: list[int]) -> Any:
            self.batches.append(len(chunks))
            self.started.append(time.perf_counter())
            return fn(chunks, states)

        return recorded

    def _recorded_pairs(self, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        self.batches.append(len(pairs))
        self.started.append(time.perf_counter())
        results, new = model([c for c, _ in pairs], [s for _, s in pairs])
        return list(zip(results, new))

    async def _sessions(self, session: int, number: int) -> int:
        result: int = await self.fn.acall(number, session=session)
        return result

    async def _locked(self, session: int, number: int) -> int:
        lock = self.locks.setdefault(session, asyncio.Lock())
        async with lock:  # (asyncio.Lock is first come, first served)
            state = self.states.get(session, 0)
            result, self.states[session] = await self.fn.acall((number, state))
            return result

    async def _one_at_a_time(self, session: int, number: int) -> int:
        async with self.one:
            state = self.states.get(session, 0)
            self.batches.append(1)
            self.started.append(time.perf_counter())
            results, new = await asyncio.to_thread(model, [number], [state])
            self.states[session] = new[0]
            return results[0]

    async def close(self) -> None:
        if hasattr(self, "fn"):
            await self.fn.aclose()


def device_alone(calls: int) -> float:
    """The reference: full device calls back to back from one thread, no server at
    all (what this machine's sleeps and wake-ups allow); chunks/s."""
    gc.collect()
    started = time.perf_counter()
    for _ in range(calls):
        device(MAX_BATCH)
    return calls * MAX_BATCH / (time.perf_counter() - started)


def in_order(results: dict[int, list[int]]) -> bool:
    """Every session's k-th chunk saw the state of k chunks before it."""
    return all(r == list(range(len(r))) for r in results.values())


async def saturation(name: str, chunks_per_session: int) -> tuple[float, float, bool]:
    """Every session keeps `WINDOW` chunks outstanding (it sends the next when one is
    answered) until it has sent `chunks_per_session`; returns (chunks/s, mean batch,
    in order)."""
    server = Server(name)
    await asyncio.gather(*(server.call(s, 0) for s in range(SESSIONS)))  # warm, untimed
    results: dict[int, list[int]] = {s: [0] for s in range(SESSIONS)}

    async def stream(session: int) -> None:
        window = asyncio.Semaphore(WINDOW)

        async def one(number: int) -> None:
            try:
                results[session].append(await server.call(session, number))
            finally:
                window.release()

        sent = []
        for number in range(1, chunks_per_session + 1):
            await window.acquire()
            # (A task's first step queues its chunk: tasks start in the order made.)
            sent.append(asyncio.ensure_future(one(number)))
        await asyncio.gather(*sent)

    del server.batches[:], server.started[:]
    gc.collect()
    await asyncio.gather(*(stream(s) for s in range(SESSIONS)))
    batches, started = list(server.batches), list(server.started)
    await server.close()
    for r in results.values():
        r.sort()  # (answers of one session may be appended out of order by the loop)
    # The steady state: each call's chunks over the time to the next call's start
    # (the ramp-up before the first call and the drain after the last left out).
    rate = sum(batches[:-1]) / (started[-1] - started[0])
    return rate, sum(batches) / len(batches), in_order(results)


async def latency(name: str, load: float, seconds: float, seed: int) -> tuple[list[float], bool]:
    """Each session sends a chunk every period (load x the bound, all sessions
    together); returns each chunk's latency (seconds) and whether all ran in order."""
    server = Server(name)
    await asyncio.gather(*(server.call(s, 0) for s in range(SESSIONS)))  # warm, untimed
    period = SESSIONS / (load * BOUND)
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.01
    results: dict[int, list[int]] = {s: [0] for s in range(SESSIONS)}
    latencies: list[float] = []
    gc.collect()
    count = max(int(seconds / period), 1)

    async def stream(session: int) -> None:
        phase = rng.random() * period
        pending = []
        for n in range(1, count + 1):
            arrival = t0 + phase + (n - 1) * period
            await asyncio.sleep(max(arrival - loop.time(), 0.0))
            pending.append(asyncio.ensure_future(chunk(session, n, arrival)))
        await asyncio.gather(*pending)

    async def chunk(session: int, number: int, arrival: float) -> None:
        result = await server.call(session, number)
        latencies.append(loop.time() - arrival)
        results[session].append(result)

    await asyncio.gather(*(stream(s) for s in range(SESSIONS)))
    await server.close()
    for r in results.values():
        r.sort()  # (answers of one session may be appended out of order by the loop)
    return latencies, in_order(results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter repeats")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    chunks = 20 if args.quick else 60
    seconds = 1.0 if args.quick else 2.0
    print(
        f"# {SESSIONS} sessions, device {A * 1e3:g} ms + {B * 1e3:g} ms/chunk (a full call "
        f"T = {FULL_T * 1e3:.1f} ms, bound {BOUND:.0f} chunks/s); max batch {MAX_BATCH}, "
        f"max wait {MAX_WAIT_MS:g} ms; {repeats} interleaved repeats, medians"
    )
    rate: dict[str, list[float]] = {s: [] for s in (*SYSTEMS, REFERENCE)}
    batch: dict[str, list[float]] = {s: [] for s in (*SYSTEMS, REFERENCE)}
    of_reference: list[float] = []  # sessions / device alone, within one repeat
    lat: dict[tuple[str, float], list[list[float]]] = {}
    ordered = True
    for r in range(repeats):
        for name in rotated(SYSTEMS, r):
            # one-at-a-time: 2 chunks a session (64 x 2 chunks take ~0.5 s already)
            n = 2 if name == "one-at-a-time" else chunks
            got, mean_batch, ok = asyncio.run(saturation(name, n))
            rate[name].append(got)
            batch[name].append(mean_batch)
            ordered &= ok
        rate[REFERENCE].append(device_alone(chunks * SESSIONS // MAX_BATCH))
        batch[REFERENCE].append(MAX_BATCH)
        of_reference.append(rate["sessions"][-1] / rate[REFERENCE][-1])
        for load in (0.5, 1.0):
            for name in rotated(SYSTEMS[:2], r):
                samples, ok = asyncio.run(latency(name, load, seconds, seed=r))
                lat.setdefault((name, load), []).append(samples)
                ordered &= ok

    print(f"\n{'system':<15} {'chunks/s':>9} {'of bound':>9} {'batch':>6}", end="")
    print(f" {'p50 @0.5x':>10} {'p99 @0.5x':>10} {'p50 @1x':>9} {'p99 @1x':>9}  (ms)")
    for name in (*SYSTEMS, REFERENCE):
        row = f"{name:<15} {med(rate[name]):>9.0f} {med(rate[name]) / BOUND:>9.3f}"
        row += f" {med(batch[name]):>6.1f}"
        for load in (0.5, 1.0):
            runs = lat.get((name, load))
            if runs is None:
                row += f" {'-':>10} {'-':>10}" if load == 0.5 else f" {'-':>9} {'-':>9}"
                continue
            p50 = med([percentile(x, 0.50) for x in runs]) * 1e3
            p99 = med([percentile(x, 0.99) for x in runs]) * 1e3
            width = 10 if load == 0.5 else 9
            row += f" {p50:>{width}.1f} {p99:>{width}.1f}"
        print(row)
    print(f"(T = {FULL_T * 1e3:.1f} ms; latency from each chunk's arrival to its answer)\n")
    share = med(rate["sessions"]) / BOUND
    print(
        f"info  sessions / {REFERENCE} (same repeat): {med(of_reference):.3f} "
        f"(what this machine's sleeps allow: {med(rate[REFERENCE]) / BOUND:.3f} of the bound)"
    )
    ok = check("every chunk of every session ran in order", ordered, "checked per chunk")
    ok &= check(
        "sessions >= 0.95 of the device's bound at saturation", share >= 0.95, f"{share:.3f}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
