"""The drivers' lives: an async driver across event loops (cancelled with its loop, a second
loop), close() and aclose() from the step function, a failing scheduler.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from batchkit.errors import BatcherClosed
from batchkit.generate import ContinuousBatcher, StepBatch


def _in_thread(fn, timeout: float = 10.0) -> None:
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it does not return."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "hung"
    if errors:
        raise errors[0]


def test_async_driver_cancelled_with_its_loop_answers_everyone() -> None:
    async def step(batch: StepBatch) -> list[int]:
        await asyncio.sleep(0.02)
        return [7] * len(batch.seqs)

    b = ContinuousBatcher(step, max_num_seqs=1, max_num_batched_tokens=64)
    handles = []

    async def main() -> None:
        handles.append(b.submit([1, 2, 3], max_new_tokens=50))  # running when the loop ends
        handles.append(b.submit([4], max_new_tokens=5))  # waiting behind it
        await asyncio.sleep(0.01)

    _in_thread(lambda: asyncio.run(main()))
    for h in handles:
        with pytest.raises(BatcherClosed, match="driver task was cancelled"):
            h.result(timeout=5)
    assert b.stats().running == b.stats().waiting == 0


def test_async_batcher_serves_a_second_event_loop() -> None:
    async def step(batch: StepBatch) -> list[int]:
        return [7] * len(batch.seqs)

    b = ContinuousBatcher(step, max_num_seqs=4, max_num_batched_tokens=64)

    async def once() -> list[int]:
        return await asyncio.wait_for(b.submit([1, 2, 3], max_new_tokens=2), 5)

    assert asyncio.run(once()) == [7, 7]
    assert asyncio.run(once()) == [7, 7]  # hung: the first loop's dead driver was "woken"


def test_close_from_the_step_function_returns_and_drains() -> None:
    b: ContinuousBatcher

    def step(batch: StepBatch) -> list[int]:
        if batch.step == 0:
            b.close()  # deadlocked: close() waited for the thread running it
        return [1] * len(batch.seqs)

    b = ContinuousBatcher(step, max_num_seqs=2, max_num_batched_tokens=16)
    h = b.submit([1, 2], max_new_tokens=3)
    assert h.result(timeout=10) == [1, 1, 1]
    with pytest.raises(BatcherClosed):
        b.submit([1], max_new_tokens=1)


def test_async_aclose_from_the_step_function_returns() -> None:
    b: ContinuousBatcher

    async def step(batch: StepBatch) -> list[int]:
        if batch.step == 0:
            await b.aclose()
        return [1] * len(batch.seqs)

    b = ContinuousBatcher(step, max_num_seqs=2, max_num_batched_tokens=16)

    async def main() -> list[int]:
        return await asyncio.wait_for(b.submit([1, 2], max_new_tokens=3), 5)

    assert asyncio.run(main()) == [1, 1, 1]


@pytest.mark.parametrize("is_async", [False, True])
def test_a_failing_scheduler_fails_requests_instead_of_the_driver(is_async: bool) -> None:
    def step(batch: StepBatch) -> list[int]:
        return [1] * len(batch.seqs)

    async def astep(batch: StepBatch) -> list[int]:
        return step(batch)

    b = ContinuousBatcher(astep if is_async else step, max_num_seqs=2)
    real = b.sched.schedule
    calls = {"n": 0}

    def flaky() -> StepBatch:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("scheduler bug")
        return real()

    b.sched.schedule = flaky  # type: ignore[method-assign]

    async def run() -> None:
        with pytest.raises(RuntimeError, match="scheduler bug"):
            await asyncio.wait_for(b.submit([1], max_new_tokens=2), 5)
        assert await asyncio.wait_for(b.submit([2], max_new_tokens=2), 5) == [1, 1]
        await b.aclose()

    if is_async:
        asyncio.run(run())
    else:
        with pytest.raises(RuntimeError, match="scheduler bug"):
            b.submit([1], max_new_tokens=2).result(timeout=5)
        assert b.submit([2], max_new_tokens=2).result(timeout=5) == [1, 1]
        b.close()
