"""Open-loop load for the benchmarks: seeded Poisson arrival times, and a driver that
starts one request at each of them on the running event loop without waiting for any
answer (callers that do not slow down when the server does, as on a real service);
`issue_from_threads` does the same with blocking callers on threads.

```python
arrivals = poisson_arrivals(random.Random(7), rate=500.0, start=0.0, end=2.0)
tasks = await issue(arrivals, one, loop.time() + 0.005)  # one(i, scheduled_time)
await asyncio.gather(*list(tasks))  # or cancel what is left after a deadline
```
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any


def poisson_arrivals(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    """Arrival times in ``[start, end)`` of a Poisson process of ``rate`` per second.

    Args:
        rng: The seeded generator the gaps are drawn from.
        rate: Mean arrivals per second (> 0).
        start: The first instant of the interval, in seconds.
        end: The end of the interval (excluded), in seconds.

    Returns:
        The arrival times, increasing.
    """
    times: list[float] = []
    t = start + rng.expovariate(rate)
    while t < end:
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def issue(
    arrivals: Sequence[float], request: Callable[[int, float], Coroutine[Any, Any, None]], t0: float
) -> set[asyncio.Task[None]]:
    """Start ``request(i, t0 + arrivals[i])`` as a task at each arrival, in loop time.

    The driver never waits for an answer; it always yields to the loop between
    arrivals (even when behind), so the requests it started make progress. Only
    running tasks are kept: thousands of finished ones would make full GC pauses that
    show up as every system's tail latency.

    Args:
        arrivals: Arrival times in seconds after ``t0``, increasing.
        request: Makes one request; given its index and its scheduled loop time (the
            task starts at or just after it: it can measure how late it was).
        t0: The loop time (``loop.time()``) the arrival times count from.

    Returns:
        The requests' tasks still running when the last one has started; a live set
        (a task leaves it when it finishes), for the caller to await or cancel.
    """
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[None]] = set()
    for i, offset in enumerate(arrivals):
        scheduled = t0 + offset
        await asyncio.sleep(max(scheduled - loop.time(), 0.0))
        task = loop.create_task(request(i, scheduled))
        running.add(task)
        task.add_done_callback(running.discard)
    return running


def issue_from_threads(
    arrivals: Sequence[float], request: Callable[[int, float], None], threads: int
) -> None:
    """Make ``request(i, t0 + arrivals[i])`` at each arrival from ``threads`` blocking
    caller threads, in ``time.perf_counter()`` time; return when every one returned.

    Thread ``k`` makes arrivals ``k``, ``k + threads``, ...: a caller still blocked
    when its next arrival comes makes it late (give enough threads that the mean gap
    of one thread's arrivals, ``threads`` / rate, is well above the latency).

    Args:
        arrivals: Arrival times in seconds after the start, increasing.
        request: Makes one blocking request; given its index and its scheduled
            ``perf_counter`` time (it can measure how late it was).
        threads: How many caller threads.

    Raises:
        BaseException: The first error a request raised (after all threads ended).
    """
    errors: list[BaseException] = []
    ready = threading.Barrier(threads + 1)
    t0: list[float] = []

    def caller(k: int) -> None:
        ready.wait()
        try:
            for i in range(k, len(arrivals), threads):
                scheduled = t0[0] + arrivals[i]
                time.sleep(max(scheduled - time.perf_counter(), 0.0))
                request(i, scheduled)
        except BaseException as exc:  # noqa: BLE001 - reported after the others end
            errors.append(exc)

    pool = [threading.Thread(target=caller, args=(k,), daemon=True) for k in range(threads)]
    for thread in pool:
        thread.start()
    t0.append(time.perf_counter() + 0.005)
    ready.wait()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
