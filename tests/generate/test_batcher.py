"""ContinuousBatcher's driver: threads and asyncio, streaming, cancel, timeout, close,
errors, refusal at submit, scheduling order and stats."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import batchkit.errors as errors
from batchkit.generate import ContinuousBatcher, StepBatch
from batchkit.kv import BlockAllocator
from tests.generate._toy import PagedToy, SlottedToy, solo

PROMPTS = [[i % 23, (3 * i) % 23, 1] for i in range(12)]


@pytest.mark.parametrize("paged", [False, True])
def test_generate_offline_matches_solo(paged: bool) -> None:
    alloc = BlockAllocator(16, 4) if paged else None
    step = PagedToy(16, 4) if paged else SlottedToy()
    with ContinuousBatcher(step, max_num_seqs=4, max_num_batched_tokens=8, allocator=alloc) as b:
        got = b.generate(PROMPTS, max_new_tokens=9)
        stats = b.stats()
    assert got == [solo(p, 9) for p in PROMPTS]
    assert stats.finished == 12 and stats.tokens_generated == 9 * 12
    assert stats.running == 0 and stats.waiting == 0
    assert 0 < stats.slot_utilisation <= 1 and 0 < stats.token_budget_utilisation <= 1
    assert stats.time_to_first_token.count == 12 and stats.inter_token_latency.count == 8 * 12
    if paged:
        assert 0 < stats.mean_kv_usage <= 1 and 0 <= stats.mean_kv_waste < 1


def test_eos_and_stop_tokens_end_and_are_included() -> None:
    full = solo([4, 2], 30)
    eos, stop = full[3], full[1]
    with ContinuousBatcher(SlottedToy(), max_num_seqs=2, eos_token_id=eos) as b:
        h1 = b.submit([4, 2], max_new_tokens=30)
        h2 = b.submit([4, 2], max_new_tokens=30, stop_token_ids=[stop])
        r1, r2 = h1.result(timeout=10), h2.result(timeout=10)
    assert r1 == full[: full.index(eos) + 1] and h1.finish_reason == "stop"
    assert r2 == full[: min(full.index(stop), full.index(eos)) + 1]


def test_refuses_requests_that_can_never_fit() -> None:
    b = ContinuousBatcher(SlottedToy(), allocator=BlockAllocator(4, 4))
    with pytest.raises(ValueError, match=r"request 0 can never fit.*need 5 KV blocks of 4.*has 4"):
        b.submit(list(range(10)), max_new_tokens=11)
    b.submit(list(range(10)), max_new_tokens=7).result(timeout=10)  # 16 tokens computed: fits
    with pytest.raises(ValueError, match="empty"):
        b.submit([], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        b.submit([1], max_new_tokens=0)
    b.close()
    with pytest.raises(errors.BatcherClosed):
        b.submit([1], max_new_tokens=1)


class Gated:
    """A step function that blocks until released, to act while a step runs."""

    def __init__(self) -> None:
        self.inner = SlottedToy()
        self.entered = threading.Semaphore(0)
        self.go = threading.Semaphore(0)
        self.batches: list[list[int]] = []

    def __call__(self, batch: StepBatch) -> list[int | None]:
        self.batches.append([s.request_id for s in batch.seqs])
        self.entered.release()
        self.go.acquire()
        return self.inner(batch)


def test_cancel_during_a_step_drops_its_token_and_frees_the_row() -> None:
    step = Gated()
    b = ContinuousBatcher(step, max_num_seqs=1)
    h = b.submit([1, 2], max_new_tokens=10)
    other = b.submit([3], max_new_tokens=2)
    for _ in range(2):  # two steps: one token
        step.go.release()
        step.entered.acquire()
    step.entered.acquire()  # third step running
    assert h.cancel()
    assert h.result(timeout=1) == solo([1, 2], 10)[:2]  # the running step's token dropped
    assert h.finish_reason == "cancelled" and not h.cancel()
    for _ in range(10):
        step.go.release()
    assert other.result(timeout=10) == solo([3], 2)  # it got the freed row
    b.close()
    assert b.stats().cancelled == 1


def test_streaming_from_a_thread_and_cancel_while_waiting() -> None:
    step = Gated()
    b = ContinuousBatcher(step, max_num_seqs=1)
    h = b.submit([5], max_new_tokens=4)
    queued = b.submit([6], max_new_tokens=4)
    assert queued.cancel() and queued.result() == []
    got: list[int] = []
    t = threading.Thread(target=lambda: got.extend(h))
    t.start()
    for _ in range(4):
        step.go.release()
    t.join(10)
    assert got == solo([5], 4) == h.result()
    b.close()


def test_priority_and_first_come_first_served() -> None:
    step = Gated()
    b = ContinuousBatcher(step, max_num_seqs=1)
    first = b.submit([1], max_new_tokens=1)
    step.entered.acquire()  # it runs; the rest queue up
    low = b.submit([2], max_new_tokens=1, priority=1)
    a = b.submit([3], max_new_tokens=1)
    c = b.submit([4], max_new_tokens=1)
    urgent = b.submit([5], max_new_tokens=1, priority=-1)
    for _ in range(5):
        step.go.release()
    for h in (first, low, a, c, urgent):
        h.result(timeout=10)
    b.close()
    ids = [batch[0] for batch in step.batches]
    assert ids == [first.request_id, urgent.request_id, a.request_id, c.request_id, low.request_id]


def test_timeout_before_start_raises_request_timeout() -> None:
    step = Gated()
    b = ContinuousBatcher(step, max_num_seqs=1)
    h = b.submit([1], max_new_tokens=3)
    late = b.submit([2], max_new_tokens=1, timeout=0.01)
    time.sleep(0.05)
    for _ in range(5):
        step.go.release()
    assert h.result(timeout=10) == solo([1], 3)
    with pytest.raises(errors.RequestTimeout):
        late.result(timeout=10)
    b.close()
    assert b.stats().timeouts == 1


def test_step_errors_reach_their_requests_and_the_batcher_survives() -> None:
    calls = {"n": 0}
    inner = SlottedToy()

    def flaky(batch: StepBatch) -> list[int | None]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return inner(batch)

    with ContinuousBatcher(flaky, max_num_seqs=4) as b:
        h = b.submit([1], max_new_tokens=2)
        with pytest.raises(RuntimeError, match="boom"):
            h.result(timeout=10)
        assert b.submit([1], max_new_tokens=2).result(timeout=10) == solo([1], 2)

    for bad, message in (
        (lambda batch: [], "0 results for 1 sequences"),
        (lambda batch: [None], "must sample"),
    ):
        with ContinuousBatcher(bad, max_num_seqs=4) as b, pytest.raises(ValueError, match=message):
            b.submit([1], max_new_tokens=2).result(timeout=10)


def test_queue_full_and_close_timeout() -> None:
    step = Gated()
    b = ContinuousBatcher(step, max_num_seqs=1, max_queue_size=1)
    running = b.submit([1], max_new_tokens=50)
    step.entered.acquire()
    waiting = b.submit([2], max_new_tokens=1)
    with pytest.raises(errors.QueueFull):
        b.submit([3], max_new_tokens=1)
    closer = threading.Thread(target=b.close, kwargs={"timeout": 0.05})
    closer.start()
    time.sleep(0.2)
    for _ in range(60):
        step.go.release()
    closer.join(10)
    for h in (running, waiting):
        with pytest.raises(errors.BatcherClosed):
            h.result(timeout=10)


def test_preemption_by_recompute_keeps_results_exact() -> None:
    alloc = BlockAllocator(6, 2)
    step = PagedToy(6, 2)
    prompts = [[i, i + 1, i + 2] for i in range(6)]
    with ContinuousBatcher(step, max_num_seqs=6, max_num_batched_tokens=64, allocator=alloc) as b:
        got = b.generate(prompts, max_new_tokens=6)
        assert b.stats().preemptions > 0
    assert got == [solo(p, 6) for p in prompts]


def test_asyncio_step_function_streaming_and_await() -> None:
    inner = SlottedToy()

    async def step(batch: StepBatch) -> list[int | None]:
        await asyncio.sleep(0)
        return inner(batch)

    async def main() -> None:
        async with ContinuousBatcher(step, max_num_seqs=3, max_num_batched_tokens=4) as b:
            handles = [b.submit(p, max_new_tokens=5) for p in PROMPTS[:5]]
            streamed = [tok async for tok in handles[0]]
            results = [await h for h in handles]
            assert streamed == results[0]
            assert results == [solo(p, 5) for p in PROMPTS[:5]]
            assert await b.agenerate(PROMPTS[:2], max_new_tokens=3) == [
                solo(p, 3) for p in PROMPTS[:2]
            ]

    asyncio.run(main())


def test_sync_step_function_awaited_from_asyncio() -> None:
    async def main() -> None:
        with ContinuousBatcher(SlottedToy(), max_num_seqs=2) as b:
            h = b.submit([1, 2], max_new_tokens=6)
            streamed = [tok async for tok in h]
            assert streamed == await h == solo([1, 2], 6)

    asyncio.run(main())


def test_an_urgent_request_preempts_a_running_one_and_both_stay_exact() -> None:
    step = Gated()
    b = ContinuousBatcher(step, max_num_seqs=1, max_prefill_chunk=2)
    background = b.submit([1, 2, 3], max_new_tokens=8, priority=1)
    step.entered.acquire()  # it runs: the only row is taken
    urgent = b.submit([4, 5], max_new_tokens=2, priority=0)
    for _ in range(40):
        step.go.release()
    assert urgent.result(timeout=10) == solo([4, 5], 2)
    assert background.result(timeout=10) == solo([1, 2, 3], 8)
    b.close()
    # the urgent one ran in the step right after the one it arrived in
    assert step.batches[1] == [urgent.request_id]
    assert b.stats().preemptions == 1
