"""An async batched function serves one event loop at a time, even when threads race."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import batchkit
from batchkit import BatcherClosed, DynamicBatcher


def test_two_threads_with_their_own_loops_never_cross_answers() -> None:
    """Each call either gets its own result on its own loop or is refused as busy."""
    loops_seen: list[tuple[int, int]] = []

    @batchkit.batched(max_batch_size=4, max_wait_ms=0.5)
    async def ident(xs: list[int]) -> list[int]:
        loops_seen.append((id(asyncio.get_running_loop()), len(xs)))
        await asyncio.sleep(0)
        return xs

    barrier = threading.Barrier(2)
    outcomes: dict[str, list[str]] = {"a": [], "b": []}

    def worker(tag: str) -> None:
        async def once(i: int) -> str:
            try:
                got = await asyncio.wait_for(ident.acall(i), timeout=10)
            except RuntimeError as exc:
                assert "another event loop" in str(exc)
                return "busy"
            assert got == i
            return "ok"

        for i in range(150):
            barrier.wait()
            outcomes[tag].append(asyncio.run(once(i)))

    threads = [threading.Thread(target=worker, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a caller hung"
    for tag in "ab":
        assert len(outcomes[tag]) == 150
    # Both threads got through at least sometimes; none got a wrong result (asserted above).
    assert outcomes["a"].count("ok") + outcomes["b"].count("ok") >= 150
    stats = ident.stats()
    assert stats.requests == stats.items_run == sum(n for _, n in loops_seen)


def test_admission_rechecks_the_loop_under_the_lock() -> None:
    """The interleaving the stress test above can only hit by chance, made explicit:
    thread A passes bind() while the batcher is idle, thread B binds its own loop and
    enqueues, then A enqueues: A must be refused, not served by B's loop."""
    from batchkit.serve.request import new_request

    @batchkit.batched(max_batch_size=4, max_wait_ms=0.5)
    async def ident(xs: list[int]) -> list[int]:
        return xs

    loop_a, loop_b = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        runtime = ident.runtime
        runtime.bind(loop_a)  # A's check passes: nothing is waiting
        req_b = new_request(1, 0.0, None, 0, loop_b)
        runtime.bind(loop_b)  # B rebinds the idle batcher...
        runtime.core.submit(req_b)  # ...and enqueues
        req_a = new_request(2, 0.0, None, 0, loop_a)
        try:
            runtime.core.submit(req_a)
        except RuntimeError as exc:
            assert "another event loop" in str(exc)
        else:
            raise AssertionError("a request from loop A was queued on a batcher serving loop B")
        assert loop_b.run_until_complete(asyncio.wait_for(req_b.future, 5)) == 1  # type: ignore[arg-type]
    finally:
        loop_a.close()
        loop_b.close()


def test_an_idle_batcher_stays_with_its_loop_while_that_loop_runs() -> None:
    """Its callers are admitted without the lock while their loop runs, so another
    loop is refused then, even with nothing queued; once the loop stops, it may move."""

    @batchkit.batched(max_batch_size=4, max_wait_ms=0.5)
    async def ident(xs: list[int]) -> list[int]:
        return xs

    first_served = threading.Event()
    release = threading.Event()

    def serve_on_first_loop() -> None:
        async def main() -> None:
            assert await ident.acall(1) == 1
            first_served.set()
            while not release.is_set():  # the loop keeps running, the batcher idle
                await asyncio.sleep(0.001)

        asyncio.run(main())

    thread = threading.Thread(target=serve_on_first_loop)
    thread.start()
    try:
        assert first_served.wait(10)
        try:
            asyncio.run(ident.acall(2))
        except RuntimeError as exc:
            assert "still running" in str(exc)
        else:
            raise AssertionError("a second loop was served while the first still ran")
    finally:
        release.set()
        thread.join(10)
    assert asyncio.run(ident.acall(3)) == 3  # the first loop ended: this one is served
    assert ident.stats().requests == 2


def test_stats_count_a_caller_admitted_before_its_scheduling_pass_once() -> None:
    """A loop's callers are admitted without the lock and placed by the loop's next
    scheduling pass; f.stats() in between counts them (once), from any thread."""

    @batchkit.batched(max_batch_size=8, max_wait_ms=1)
    async def ident(xs: list[int]) -> list[int]:
        return xs

    async def main() -> None:
        assert await ident.acall(1) == 1  # binds the loop
        call = asyncio.ensure_future(ident.acall(7))
        await asyncio.sleep(0)  # the call is admitted; the scheduling pass comes next
        stats = await asyncio.to_thread(ident.stats)
        assert (stats.requests, stats.queue_depth) == (2, 1)
        assert await call == 7

    asyncio.run(main())
    stats = ident.stats()
    assert stats.requests == stats.items_run == 2


def test_a_caller_arriving_while_another_loop_takes_over_is_served_or_refused() -> None:
    """A race forced step by step: loop A is stopped, not closed; thread T2 checks,
    under the lock, that the idle batcher may move to loop B, and in that window A is
    run again and its caller submits. It waits for the lock, so it sees the move done:
    it is refused (B still runs) or, if B has closed meanwhile, served on A. Either
    way nothing is lost and B's caller gets its result."""
    from batchkit.serve.scheduler import Scheduler

    @batchkit.batched(max_batch_size=4, max_wait_ms=1)
    async def ident(xs: list[int]) -> list[int]:
        return xs

    loop_a = asyncio.new_event_loop()
    loop_a.set_debug(True)
    assert loop_a.run_until_complete(ident(0)) == 0  # bound to A; A now stopped, idle
    in_window, a_waits = threading.Event(), threading.Event()
    taker: list[threading.Thread] = []
    core = ident.runtime.core
    lock = core.lock

    class PausingScheduler(Scheduler):
        @property
        def drained(self) -> bool:  # type: ignore[override]
            value: bool = Scheduler.drained.fget(self)  # type: ignore[attr-defined]
            if taker and threading.current_thread() is taker[0] and not in_window.is_set():
                in_window.set()  # T2 has read "drained": hold it here while A submits
                assert a_waits.wait(5)
            return value

    class SignallingLock:
        """The core's lock; tells when loop A's thread asks for it."""

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            if in_window.is_set() and threading.current_thread() is threading.main_thread():
                a_waits.set()  # (T2 holds the lock: A's caller now waits for it)
            return lock.acquire(blocking, timeout)

        def release(self) -> None:
            lock.release()

        __enter__ = acquire

        def __exit__(self, *exc: object) -> None:
            lock.release()

    core.lock = SignallingLock()  # type: ignore[assignment]
    core.sched.__class__ = PausingScheduler
    b_result: list[object] = []

    def take_over() -> None:
        loop_b = asyncio.new_event_loop()
        try:
            b_result.append(loop_b.run_until_complete(asyncio.wait_for(ident(1), 5)))
        except BaseException as exc:  # noqa: BLE001
            b_result.append(exc)
        finally:
            loop_b.close()

    thread = threading.Thread(target=take_over)
    taker.append(thread)
    thread.start()
    try:
        assert in_window.wait(5)

        async def call_on_a() -> object:
            try:
                return await asyncio.wait_for(ident(10), 5)
            except RuntimeError as refused:
                return refused

        a_result = loop_a.run_until_complete(call_on_a())
    finally:
        a_waits.set()
        thread.join(10)
        loop_a.close()
    assert a_waits.is_set() and b_result == [1]
    stats = ident.stats()
    if isinstance(a_result, RuntimeError):
        assert "another event loop" in str(a_result)
        assert stats.requests == stats.items_run == 2
    else:
        assert a_result == 10 and stats.requests == stats.items_run == 3


def test_batch_tasks_are_created_outside_the_batcher_lock() -> None:
    """With an eager task factory (Python 3.12+) a task's first step runs inside
    create_task: the batch function would start under the batcher's lock, and every
    other thread's f.stats() (or enqueue) would wait for it. A factory that asks for the
    stats from another thread while the task is created checks that it never waits."""
    blocked: list[bool] = []

    @batchkit.batched(max_batch_size=4, max_wait_ms=1)
    async def ident(xs: list[int]) -> list[int]:
        await asyncio.sleep(0)
        return xs

    def factory(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
        probe = threading.Thread(target=ident.stats)
        probe.start()
        probe.join(timeout=2)
        blocked.append(probe.is_alive())
        probe.join()
        return asyncio.Task(coro, loop=loop)

    async def main() -> list[int]:
        callers = [asyncio.ensure_future(ident.acall(i)) for i in range(10)]
        asyncio.get_running_loop().set_task_factory(factory)  # only batch tasks from here
        return list(await asyncio.gather(*callers))

    assert asyncio.run(main()) == list(range(10))
    assert blocked and not any(blocked)


def test_a_batch_whose_task_cannot_be_made_fails_only_its_callers() -> None:
    """A task factory that raises for one batch: that batch's callers get a clear
    BatcherClosed, the batches polled with it still start, and its slot is freed (later
    calls are served, nothing hangs)."""

    @batchkit.batched(max_batch_size=2, max_wait_ms=50, max_concurrent_batches=3)
    async def ident(xs: list[int]) -> list[int]:
        await asyncio.sleep(0.01)
        return xs

    refused: list[bool] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
        if not refused:  # the first batch task
            refused.append(True)
            coro.close()
            raise RuntimeError("no task for you")
        return asyncio.Task(coro, loop=loop)

    async def main() -> tuple[list[Any], int]:
        loop = asyncio.get_running_loop()
        callers = [asyncio.ensure_future(ident.acall(i)) for i in range(6)]
        later_call = ident.acall(99)
        loop.set_task_factory(factory)  # only batch tasks are created from here on
        loop.set_exception_handler(lambda loop, context: None)  # the raise is reported
        outcomes = await asyncio.wait_for(asyncio.gather(*callers, return_exceptions=True), 5)
        loop.set_task_factory(None)
        later = await asyncio.wait_for(later_call, 5)
        await ident.aclose()
        return outcomes, later

    outcomes, later = asyncio.run(main())
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert later == 99
    assert len(failed) == 2  # exactly the first batch's two callers
    assert all(isinstance(e, batchkit.BatcherClosed) for e in failed)
    assert "no task for you" in str(failed[0])
    assert [o for o in outcomes if not isinstance(o, BaseException)] == [2, 3, 4, 5]
    assert ident.stats().in_flight == 0


def test_callers_cancelled_while_their_batch_runs_do_not_cost_the_others() -> None:
    """A cancelled caller's future refuses its result as the batch's futures are
    resolved; every other caller (before and after it) still gets its own."""
    release = asyncio.Event()

    @batchkit.batched(max_batch_size=8, max_wait_ms=1)
    async def ident(xs: list[int]) -> list[int]:
        await release.wait()
        return xs

    async def main() -> list[Any]:
        tasks = [asyncio.ensure_future(ident.acall(i)) for i in range(8)]
        while ident.stats().in_flight == 0:
            await asyncio.sleep(0.001)
        for i in (0, 3, 7):  # first, middle and last of the running batch
            tasks[i].cancel()
        await asyncio.sleep(0)
        release.set()
        out = await asyncio.gather(*tasks, return_exceptions=True)
        await ident.aclose()
        return out

    out = asyncio.run(main())
    for i, got in enumerate(out):
        if i in (0, 3, 7):
            assert isinstance(got, asyncio.CancelledError)
        else:
            assert got == i


def test_concurrent_acloses_both_return() -> None:
    @batchkit.batched(max_batch_size=1)
    async def f(xs):
        await asyncio.sleep(0.05)
        return xs

    async def main():
        task = asyncio.create_task(f(1))
        await asyncio.sleep(0.01)
        closers = [asyncio.create_task(f.aclose()) for _ in range(2)]
        assert await task == 1
        done, pending = await asyncio.wait(closers, timeout=2)
        assert not pending

    asyncio.run(main())


def test_a_batch_left_on_a_closed_loop_does_not_block_the_next_loop() -> None:
    @batchkit.batched(max_batch_size=1)
    async def f(xs):
        await asyncio.sleep(0.5)
        return xs

    first = asyncio.new_event_loop()
    task = first.create_task(f(1))
    first.run_until_complete(asyncio.sleep(0.05))
    first.close()
    assert asyncio.run(asyncio.wait_for(f(2), 5)) == 2
    del task


def test_refused_aclose_changes_nothing() -> None:
    @batchkit.batched(max_batch_size=1)
    async def f(xs):
        await asyncio.sleep(0.2)
        return xs

    results = []

    def other_thread() -> None:
        with pytest.raises(RuntimeError, match="loop it serves"):
            asyncio.run(f.aclose())

    async def main():
        task = asyncio.create_task(f(1))
        await asyncio.sleep(0.02)
        await asyncio.to_thread(other_thread)
        results.append(await task)
        results.append(await f(2))  # still open
        await f.aclose()

    asyncio.run(main())
    assert results == [1, 2]


def test_stop_iteration_from_collate_fails_its_callers_and_not_the_batcher() -> None:
    def collate(items):
        if "bad" in items:
            raise StopIteration("bad item")
        return items

    @batchkit.batched(max_batch_size=4, max_wait_ms=1, collate=collate)
    async def f(xs):
        return xs

    async def main() -> None:
        with pytest.raises(RuntimeError, match="raised StopIteration: bad item") as info:
            await asyncio.wait_for(f("bad"), 2)  # hung: a future refuses StopIteration
        assert isinstance(info.value.__cause__, StopIteration)
        assert await asyncio.wait_for(f("ok"), 2) == "ok"  # hung: the poll flag stayed set
        await asyncio.wait_for(f.aclose(), 2)

    asyncio.run(main())


def test_a_policy_failing_once_answers_its_candidates_and_serves_later_arrivals() -> None:
    class Flaky(DynamicBatcher):
        calls = 0

        def select(self, candidates):
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("transient")
            return super().select(candidates)

    @batchkit.batched(batcher=Flaky(max_batch_size=4, max_wait_ms=1))
    async def f(xs):
        return xs

    async def main() -> None:
        first = asyncio.ensure_future(f(1))
        await asyncio.sleep(0.05)
        assert await asyncio.wait_for(f(2), 2) == 2  # the pump was not silenced
        with pytest.raises(RuntimeError, match="transient"):  # its caller has the error
            await asyncio.wait_for(first, 2)
        await f.aclose()

    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda loop, ctx: None)  # the one failing pump is logged
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def test_a_cancelled_batch_task_answers_its_callers_and_frees_its_slot() -> None:
    @batchkit.batched(max_batch_size=4, max_wait_ms=1)
    async def f(xs):
        return xs

    async def main() -> None:
        first = asyncio.ensure_future(f(1))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        runs = asyncio.all_tasks() - {asyncio.current_task(), first}  # the batch's task
        assert runs
        for t in runs:
            t.cancel()  # before its first step: its batch was never settled
        with pytest.raises(BatcherClosed, match="task running this batch was cancelled"):
            await asyncio.wait_for(first, 2)
        assert await asyncio.wait_for(f(2), 2) == 2  # hung: the slot stayed busy
        assert f.stats().failed == 1
        await f.aclose()

    asyncio.run(main())
