"""batch_timeout: a call that runs past it gives its batch up (BatchTimeout for its
callers), frees the slot, and serving goes on; stuck sync threads are bounded."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import batchkit
from batchkit import BatchTimeout, RequestTimeout
from tests.serve._wait import wait_until


class Hangs:
    """A sync model whose calls for items below 0 hang until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.late_results = 0

    def __call__(self, xs: list[int]) -> list[int]:
        if any(x < 0 for x in xs):
            self.release.wait(30)
            self.late_results += 1
        return [x * 10 for x in xs]


def test_a_hung_sync_call_times_out_its_batch_and_a_replacement_serves_the_rest() -> None:
    model = Hangs()
    f = batchkit.batched(max_batch_size=1, max_wait_ms=0, batch_timeout=0.2)(model)
    with pytest.raises(BatchTimeout) as info:
        f(-1)
    assert isinstance(info.value, TimeoutError) and not isinstance(info.value, RequestTimeout)
    assert f(2) == 20  # served by the replacement while the first thread is still stuck
    stats = f.stats()
    assert (stats.batch_timeouts, stats.abandoned_workers, stats.healthy) == (1, 1, True)
    model.release.set()  # the stuck call returns: its late result is dropped
    wait_until(lambda: f.stats().abandoned_workers == 0)
    assert model.late_results == 1 and f(3) == 30
    f.close()
    assert f.stats().failed == 1


def test_past_the_bound_no_thread_is_spawned_and_the_batcher_reports_unhealthy() -> None:
    model = Hangs()
    f = batchkit.batched(max_batch_size=1, max_wait_ms=0, batch_timeout=0.1)(model)
    for _ in range(2):  # max_concurrent_batches=1: one stuck thread is replaced, not two
        with pytest.raises(BatchTimeout):
            f(-1)
    stats = f.stats()
    assert (stats.abandoned_workers, stats.healthy) == (2, False)
    live = [t for t in threading.enumerate() if t.name.startswith("batchkit-Hangs")]
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(f, 5)  # queued: nobody serves it while unhealthy
        wait_until(lambda: f.stats().queue_depth == 1)
        assert [t for t in threading.enumerate() if t.name.startswith("batchkit-Hangs")] == live
        model.release.set()  # the stuck threads return; one serves again
        assert waiting.result(10) == 50
    wait_until(lambda: f.stats().healthy and f.stats().abandoned_workers == 0)
    f.close()


def test_a_hung_async_call_is_cancelled_and_its_callers_get_batch_timeout() -> None:
    cancelled = []

    @batchkit.batched(max_batch_size=4, max_wait_ms=0, batch_timeout=0.1)
    async def f(xs: list[int]) -> list[int]:
        if -1 in xs:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise
        return xs

    async def main() -> None:
        with pytest.raises(BatchTimeout):
            await asyncio.wait_for(f.acall(-1), 5)
        assert await asyncio.wait_for(f.acall(7), 5) == 7  # the slot is free again
        await f.aclose()

    asyncio.run(main())
    assert cancelled == [True]
    assert f.stats().batch_timeouts == 1


def test_an_async_call_that_raises_within_its_timeout_fails_only_its_own_items() -> None:
    @batchkit.batched(max_batch_size=4, max_wait_ms=50, batch_timeout=5, isolate_errors=True)
    async def f(xs: list[int]) -> list[int]:
        if -1 in xs:
            raise ValueError("bad item -1")
        return [x * 10 for x in xs]

    async def main() -> list[object]:
        calls = [f.acall(x) for x in (1, -1, 2, 3)]
        outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5)
        await f.aclose()
        return outcomes

    outcomes = asyncio.run(main())
    assert outcomes[0] == 10 and outcomes[2:] == [20, 30]
    assert isinstance(outcomes[1], ValueError) and str(outcomes[1]) == "bad item -1"
    assert f.stats().batch_timeouts == 0


def test_a_timed_out_part_is_not_split_and_retried() -> None:
    calls: list[int] = []
    model = Hangs()

    def fn(xs: list[int]) -> list[int]:
        calls.append(len(xs))
        return model(xs)

    f = batchkit.batched(
        max_batch_size=4, max_wait_ms=1000, batch_timeout=0.1, isolate_errors=True
    )(fn)
    with pytest.raises(BatchTimeout):
        f.map([1, -1, 2, 3])
    model.release.set()
    f.close()
    assert calls == [4]


def test_close_leaves_no_watchdog_thread_behind() -> None:
    f = batchkit.batched(max_batch_size=2, batch_timeout=5)(lambda xs: xs)
    assert f.map(range(5)) == list(range(5))
    f.close()
    assert not [t for t in threading.enumerate() if t.name.endswith("-watchdog")]


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan")])
def test_batch_timeout_must_be_a_positive_number_of_seconds(bad: object) -> None:
    with pytest.raises(ValueError, match="batch_timeout"):
        batchkit.batched(batch_timeout=bad)  # type: ignore[arg-type]
