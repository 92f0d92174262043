"""Callers admitted at the same time from an event loop and from other threads: every
request is admitted once, through the one locked path, and answered once with its own
result; none is lost, none runs twice."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import Counter

import batchkit
from batchkit import RequestTimeout

LOOP_CALLERS = 1200


def test_loop_callers_meet_withdrawals_and_settings_from_other_threads() -> None:
    ran: Counter[int] = Counter()

    @batchkit.batched(max_batch_size=8, max_wait_ms=1)
    async def double(xs: list[int]) -> list[int]:
        ran.update(xs)
        await asyncio.sleep(0)
        return [2 * x for x in xs]

    outcomes: dict[int, str] = {}
    done = threading.Event()

    def change_settings() -> None:  # takes the lock, as admissions from the loop do
        size = 4
        # (A pause between changes: Python's locks are not fair, and a thread retaking
        # the lock at once could starve the loop's thread on a busy machine.)
        while not done.wait(0.0005):
            double.configure(max_batch_size=size)
            double.stats()
            size = 12 - size

    async def one(i: int) -> None:
        # Every third caller may time out before its batch starts: withdrawn under the
        # lock from a timer, while others are admitted.
        timeout = 0.0 if i % 3 == 0 else None
        try:
            result = await double.acall(i, timeout=timeout)
        except RequestTimeout:
            outcomes[i] = "timeout"
        except asyncio.CancelledError:
            outcomes[i] = "cancelled"
        else:
            assert result == 2 * i
            outcomes[i] = "result"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        changer = threading.Thread(target=change_settings)
        changer.start()
        try:
            tasks = [asyncio.ensure_future(one(i)) for i in range(LOOP_CALLERS)]
            await asyncio.sleep(0)  # every caller has made and submitted its request
            # Another thread cancels every sixth caller (none with a timeout) while the
            # others are served.
            canceller = threading.Thread(
                target=lambda: [
                    loop.call_soon_threadsafe(tasks[i].cancel)
                    for i in range(4, LOOP_CALLERS, 6)
                ]
            )
            canceller.start()
            await asyncio.gather(*tasks)
            await asyncio.to_thread(canceller.join)
        finally:
            done.set()
            await asyncio.to_thread(changer.join)
        await double.aclose()

    asyncio.run(main())
    assert sorted(outcomes) == list(range(LOOP_CALLERS))  # each caller ended once
    served = {i for i, outcome in outcomes.items() if outcome == "result"}
    cancelled = {i for i, outcome in outcomes.items() if outcome == "cancelled"}
    assert all(count == 1 for count in ran.values())  # nothing ran twice
    ran_anyway = set(ran) - served  # cancelled while their batch ran
    assert served <= set(ran) and ran_anyway <= cancelled
    stats = double.stats()
    assert stats.requests == LOOP_CALLERS
    assert stats.timeouts == sum(1 for o in outcomes.values() if o == "timeout")
    assert stats.cancelled == len(cancelled - ran_anyway)
    assert stats.queue_depth == 0 and stats.in_flight == 0


def test_thread_and_asyncio_callers_of_a_sync_function_each_get_their_own_result() -> None:
    @batchkit.batched(max_batch_size=16, max_wait_ms=1)
    def double(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    per_caller = 300
    results: dict[str, list[int]] = {}

    def thread_caller(name: str, base: int) -> None:
        results[name] = [double(base + i) for i in range(per_caller)]

    def loop_caller(name: str, base: int) -> None:
        async def calls() -> list[int]:
            return list(
                await asyncio.gather(*(double.acall(base + i) for i in range(per_caller)))
            )

        results[name] = asyncio.run(calls())

    callers = [(thread_caller, f"thread {k}", k * per_caller) for k in range(3)]
    callers += [(loop_caller, f"loop {k}", (3 + k) * per_caller) for k in range(2)]
    with concurrent.futures.ThreadPoolExecutor(len(callers)) as pool:
        for future in [pool.submit(fn, name, base) for fn, name, base in callers]:
            future.result(timeout=60)
    for _, name, base in callers:
        assert results[name] == [2 * (base + i) for i in range(per_caller)], name
    assert double.stats().requests == len(callers) * per_caller
    double.close()
