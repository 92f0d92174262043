"""Regressions from a review of the continuous batcher: each test failed before its fix.

Bad step results, bad submit arguments, the async driver's life across event loops,
close() from the step function, generate() refusing one prompt, a failing scheduler.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from batchkit.generate import ContinuousBatcher, StepBatch
from batchkit.kv import BlockAllocator
from batchkit.errors import BatcherClosed
from tests.generate._toy import PagedToy, SlottedToy, solo


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("bad", ["oops", float("inf"), 1.5, -3, 2**70])
def test_a_bad_step_result_fails_only_its_own_request(paged: bool, bad: object) -> None:
    entered, gate = threading.Event(), threading.Event()
    steps: list[list[int]] = []

    def step(batch: StepBatch) -> list[object]:
        entered.set()
        gate.wait(10)  # the first step (request 0 alone) holds until 1 and 2 wait
        steps.append([s.request_id for s in batch.seqs])
        return [bad if s.request_id == 2 else 1 for s in batch.seqs]

    alloc = BlockAllocator(16, 4) if paged else None
    with ContinuousBatcher(step, max_num_seqs=4, max_num_batched_tokens=64, allocator=alloc) as b:
        first = b.submit([9], max_new_tokens=1)
        assert entered.wait(10)
        ok = b.submit([5, 6, 7], max_new_tokens=1)
        victim = b.submit([5, 6, 8], max_new_tokens=3)
        gate.set()  # now 1 and 2 share a step
        assert first.result(timeout=10) == [1]
        assert ok.result(timeout=10) == [1]
        with pytest.raises(ValueError, match="request 2: the step function returned"):
            victim.result(timeout=10)
        assert victim.finish_reason == "error"
        assert steps[:2] == [[0], [1, 2]]
        # the driver lives on and serves the next request
        assert b.submit([1], max_new_tokens=2).result(timeout=10) == [1, 1]
        assert b.stats().failed == 1
    if alloc is not None:
        assert alloc.num_free == alloc.num_blocks


def test_numpy_tokens_from_the_step_are_accepted() -> None:
    toy = SlottedToy()

    def step(batch: StepBatch) -> list[object]:
        return [None if t is None else np.int64(t) for t in toy(batch)]

    with ContinuousBatcher(step, max_num_seqs=2, max_num_batched_tokens=4) as b:
        got = b.generate([[3, 4, 5, 6, 7], [1]], max_new_tokens=5)
    assert got == [solo([3, 4, 5, 6, 7], 5), solo([1], 5)]
    assert all(type(t) is int for out in got for t in out)


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ([1, 2**70], ValueError, r"prompt_ids\[1\] is 1180591620717411303424, outside"),
        ([1, -1], ValueError, r"prompt_ids\[1\] is -1"),
        ([1.0], TypeError, r"prompt_ids\[0\] is 1.0 \(float\), not an integer"),
        (["7"], TypeError, r"prompt_ids\[0\] is '7' \(str\)"),
    ],
)
def test_bad_prompt_ids_are_refused_at_submit(prompt: list, error: type, match: str) -> None:
    alloc = BlockAllocator(16, 4, prefix_caching=True)  # hashing the prompt broke the worker
    with ContinuousBatcher(
        SlottedToy(), max_num_seqs=2, max_num_batched_tokens=16, allocator=alloc
    ) as b:
        good = b.submit([1, 2, 3, 4, 5], max_new_tokens=2)
        with pytest.raises(error, match=match):
            b.submit(prompt, max_new_tokens=2)
        with pytest.raises(TypeError, match=r"stop_token_ids\[0\]"):
            b.submit([1], max_new_tokens=2, stop_token_ids=[None])  # type: ignore[list-item]
        assert good.result(timeout=10) == solo([1, 2, 3, 4, 5], 2)


def test_numpy_prompt_and_max_new_tokens_are_accepted() -> None:
    with ContinuousBatcher(SlottedToy(), max_num_seqs=2) as b:
        h = b.submit(np.array([4, 2]), max_new_tokens=np.int64(3))
        assert h.result(timeout=10) == solo([4, 2], 3)


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, "1"])
def test_a_bad_timeout_is_refused(timeout: object) -> None:
    with ContinuousBatcher(SlottedToy(), max_num_seqs=2) as b:
        with pytest.raises(ValueError, match="timeout must be None or a number"):
            b.submit([1], max_new_tokens=1, timeout=timeout)  # type: ignore[arg-type]
        assert b.stats().requests == 0


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


def test_generate_refusing_one_prompt_cancels_the_others_and_names_it() -> None:
    alloc = BlockAllocator(4, 4)
    with ContinuousBatcher(
        PagedToy(4, 4), max_num_seqs=4, max_num_batched_tokens=8, allocator=alloc
    ) as b:
        with pytest.raises(ValueError, match=r"^prompt 2: request 2 can never fit"):
            b.generate([[1, 2, 3], [4, 5], list(range(40))], max_new_tokens=3)
        stats = b.stats()
        assert stats.running == stats.waiting == 0  # nothing left running for nobody
        assert stats.cancelled + stats.finished == 2  # (either may have finished already)
        # ids are not reused: the refused request used up id 2
        assert b.submit([1], max_new_tokens=1).request_id == 3
    assert alloc.num_free == alloc.num_blocks


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


def test_deadlines_of_started_requests_do_not_pile_up() -> None:
    from batchkit.generate.scheduler import Scheduler
    from batchkit.generate.sequence import Sequence

    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    for i in range(500):  # long timeouts, each request served before the next arrives
        sched.add(Sequence(i, [1], max_new_tokens=1, deadline=1e9))
        batch = sched.schedule()
        sched.update(batch, [1])
    assert len(sched._deadlines) <= 2 * len(sched.waiting) + 65  # was 500
