"""Issue 6: out-of-memory recovery, poison isolation, malformed items, backpressure,
hanging functions. Every caller ends with exactly its own outcome."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import batchkit
from batchkit import (
    BatcherClosed,
    BatchTimeout,
    BucketedBatcher,
    DynamicBatcher,
    RequestTimeout,
    StaticBatcher,
)
from tests.serve._wait import wait_until


class OOMAbove:
    """A fake model that runs out of memory on batches larger than ``limit``."""

    def __init__(self, limit: int, error: type[BaseException] = MemoryError) -> None:
        self.limit, self.error, self.sizes = limit, error, []
        self.lock = threading.Lock()

    def __call__(self, xs):
        with self.lock:
            self.sizes.append(len(xs))
        if len(xs) > self.limit:
            raise self.error(f"batch of {len(xs)} does not fit")
        return [x * 10 for x in xs]


def burst(f, items, threads=64):
    """Submit everything at once behind a gate so that full batches form."""
    gate = threading.Event()

    def one(x):
        gate.wait()
        return f(x)

    with ThreadPoolExecutor(threads) as pool:
        futs = [pool.submit(one, x) for x in items]
        time.sleep(0.05)
        gate.set()
        return [fu.result(10) for fu in futs]


def test_oom_splits_batches_learns_the_size_and_answers_everyone() -> None:
    model = OOMAbove(5)
    f = batchkit.batched(max_batch_size=32, max_wait_ms=50)(model)
    items = list(range(64))
    assert f.map(items) == [x * 10 for x in items]
    s = f.stats()
    assert s.oom_splits > 0 and s.failed == 0
    assert s.effective_max_batch_size == {"default": 4}  # 32 -> 16 -> 8 -> 4 fit
    calls_before = len(model.sizes)
    assert f.map(items) == [x * 10 for x in items]
    assert all(n <= 4 for n in model.sizes[calls_before:])  # no more failed attempts
    f.close()


def test_an_item_that_fails_alone_gets_the_oom_error() -> None:
    def fn(xs):
        if "huge" in xs:
            raise MemoryError("huge item")
        return [x.upper() for x in xs]

    f = batchkit.batched(max_batch_size=8, max_wait_ms=50)(fn)
    results = []
    for out in burst(lambda x: _catch(f, x), ["a", "b", "huge", "c", "d"]):
        results.append(out)
    assert results[:2] == ["A", "B"] and results[3:] == ["C", "D"]
    assert isinstance(results[2], MemoryError)
    f.close()


def _catch(f, x):
    try:
        return f(x)
    except Exception as exc:  # noqa: BLE001
        return exc


def test_oom_recovery_can_be_turned_off_or_extended() -> None:
    class DeviceOOM(RuntimeError):
        pass

    off = batchkit.batched(max_batch_size=8, oom_errors=())(OOMAbove(1))
    with pytest.raises(MemoryError):
        off.map([1, 2, 3])
    assert off.stats().oom_splits == 0
    custom = batchkit.batched(max_batch_size=8, oom_errors=(DeviceOOM,))(OOMAbove(1, DeviceOOM))
    assert custom.map([1, 2, 3]) == [10, 20, 30]
    with pytest.raises(TypeError, match="exception types"):
        batchkit.batched(oom_errors=(int,))


def test_oom_caps_are_per_bucket() -> None:
    def fn(xs):
        if len(xs) > 2 and len(xs[0]) > 4:
            raise MemoryError
        return xs

    policy = BucketedBatcher([4, 100], max_batch_size=8, max_wait_ms=50)
    f = batchkit.batched(batcher=policy)(fn)
    items = ["ab"] * 8 + ["abcdefg"] * 8
    assert f.map(items) == items
    assert f.stats().effective_max_batch_size == {"1": 2}  # the long bucket only


def test_isolate_errors_fails_only_the_poison_items_with_bounded_calls() -> None:
    calls = []

    def fn(xs):
        calls.append(len(xs))
        bad = [x for x in xs if x % 17 == 3]
        if bad:
            raise ValueError(f"poison {bad}")
        return [x + 1 for x in xs]

    f = batchkit.batched(batcher=StaticBatcher(32), isolate_errors=True)(fn)  # one batch
    outs = burst(lambda x: _catch(f, x), list(range(32)))
    for x, out in zip(range(32), outs):
        if x % 17 == 3:
            assert isinstance(out, ValueError) and str(out) == f"poison [{x}]"
        else:
            assert out == x + 1
    poison = 2  # 3 and 20
    assert len(calls) <= 1 + 2 * poison * math.ceil(math.log2(32))
    assert f.stats().isolated == poison


def test_without_isolation_the_whole_batch_fails() -> None:
    f = batchkit.batched(batcher=StaticBatcher(4))(
        lambda xs: (_ for _ in ()).throw(ValueError("boom")) if 3 in xs else xs
    )
    outs = burst(lambda x: _catch(f, x), [1, 2, 3, 4])
    assert all(isinstance(o, ValueError) for o in outs)


def test_malformed_item_fails_only_its_own_caller() -> None:
    def collate(items):
        return batchkit.pad(items, return_tensors="np")

    def model(padded):
        return [row[mask].sum() for row, mask in zip(padded.data, padded.mask)]

    f = batchkit.batched(max_batch_size=8, max_wait_ms=50, collate=collate)(model)
    items = [[1, 2], [3], "not tokens", [4, 5, 6], None, [[1, 2], [3]]]
    outs = burst(lambda x: _catch(f, x), items)
    assert outs[0] == 3 and outs[1] == 3 and outs[3] == 15
    assert isinstance(outs[2], TypeError) and "item 0" in str(outs[2])
    assert isinstance(outs[4], TypeError)
    assert isinstance(outs[5], (TypeError, ValueError))  # ragged nested list, named
    assert f.stats().failed == 3


def test_block_mode_waits_for_room_instead_of_rejecting() -> None:
    gate = threading.Event()
    f = batchkit.batched(max_batch_size=2, max_queue_size=2, when_full="block")(
        lambda xs: (gate.wait(5), [x * 2 for x in xs])[1]
    )
    with ThreadPoolExecutor(12) as pool:
        futs = [pool.submit(f, i) for i in range(10)]
        time.sleep(0.1)
        assert f.stats().queue_depth <= 2 and f.stats().rejected == 0
        gate.set()
        assert [fu.result(5) for fu in futs] == [i * 2 for i in range(10)]
    with pytest.raises(ValueError, match="max_queue_size"):
        batchkit.batched(when_full="block")


def test_block_mode_timeout_and_close_answer_blocked_callers() -> None:
    gate = threading.Event()
    f = batchkit.batched(max_batch_size=1, max_queue_size=1, when_full="block")(
        lambda xs: (gate.wait(5), xs)[1]
    )
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(f, "r")
        wait_until(lambda: f.stats().in_flight > 0)
        queued = pool.submit(f, "q")
        wait_until(lambda: f.stats().queue_depth > 0)
        with pytest.raises(RequestTimeout):
            f("blocked", timeout=0.05)
        blocked = pool.submit(f, "late")
        time.sleep(0.05)
        closer = pool.submit(f.close, 0.1)
        with pytest.raises(BatcherClosed):
            blocked.result(5)
        gate.set()
        closer.result(5)
        for fu, item in ((running, "r"), (queued, "q")):
            out = _catch(fu.result, 5)  # the close timed out: a result or BatcherClosed
            assert out == item or isinstance(out, BatcherClosed)


def test_block_mode_from_asyncio() -> None:
    @batchkit.batched(max_batch_size=4, max_queue_size=4, when_full="block")
    async def f(xs):
        await asyncio.sleep(0.005)
        return [x + 1 for x in xs]

    async def main():
        out = await asyncio.gather(*(f(i) for i in range(50)))
        assert out == [i + 1 for i in range(50)]
        assert await f.amap(range(10)) == list(range(1, 11))
        await f.aclose()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert f.stats().rejected == 0


def test_deadlines_fire_while_the_function_hangs() -> None:
    release = threading.Event()
    f = batchkit.batched(max_batch_size=1)(lambda xs: (release.wait(), xs)[1])
    with ThreadPoolExecutor(8) as pool:
        hung = pool.submit(f, "hang")
        wait_until(lambda: f.stats().in_flight > 0)
        late = [pool.submit(_catch_timeout, f, i) for i in range(5)]
        # Answered while the function still hangs (it does until `release` is set).
        assert all(isinstance(x.result(30), RequestTimeout) for x in late)
        assert f.stats().timeouts == 5
        f.close(timeout=0.05)  # the hung batch's caller is answered too
        with pytest.raises(BatcherClosed):
            hung.result(5)
    release.set()


def _catch_timeout(f, x):
    try:
        return f(x, timeout=0.05)
    except Exception as exc:  # noqa: BLE001
        return exc


def test_numpy_outputs_split_per_row() -> None:
    f = batchkit.batched(max_batch_size=4)(lambda xs: np.asarray(xs) * 2)
    assert f.map([1, 2, 3]) == [2, 4, 6]


def test_strict_sizes_cap_is_learned_in_padded_sizes_and_probed_upward() -> None:
    policy = DynamicBatcher(8, 5, preferred_batch_sizes=(1, 2, 4, 8), strict_sizes=True)
    seen = []

    def fn(xs):
        seen.append(len(xs))
        if len(xs) > 4:
            raise MemoryError
        return xs

    f = batchkit.batched(batcher=policy)(fn)
    assert f.map(range(6)) == list(range(6))
    assert f.stats().effective_max_batch_size == {"default": 4}
    seen.clear()
    for _ in range(40):
        f.map(range(8))
    # Full batches of 4 at the cap, then a probe at the next allowed size (8), which runs
    # out of memory and is split back into 4s; nothing else is ever tried.
    assert 8 in seen and set(seen) == {4, 8}
    f.close()


class _LenLies:
    """A sequence whose len() is the batch size but which iterates fewer items (as a
    DataFrame iterates its columns)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(["only-one"])


def test_an_output_that_iterates_fewer_results_than_its_len_fails_its_callers() -> None:
    """Not a silent shift of results between callers: every caller of the batch fails."""

    @batchkit.batched(max_batch_size=3, max_wait_ms=50)
    def f(xs: list[int]) -> _LenLies:
        return _LenLies(len(xs))

    with pytest.raises(ValueError, match="yielded 1"):
        f.map([0, 1, 2])  # one batch of three
    stats = f.stats()
    assert stats.batches == 1 and stats.failed == 3
    f.close()


# -- what a sync batch function's SystemExit / KeyboardInterrupt does ---------------
@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt()], ids=repr)
def test_an_exit_from_a_sync_batch_function_does_not_stop_the_callers_loop(raised) -> None:
    def forward(xs):
        if "bad" in xs:
            raise raised
        return [x.upper() for x in xs]

    f = batchkit.batched(max_batch_size=4, max_wait_ms=1)(forward)

    async def main():
        (error,) = await asyncio.gather(f.acall("bad"), return_exceptions=True)
        return error, await f.acall("good")  # the loop, and serving, go on

    error, after = asyncio.run(main())
    assert isinstance(error, batchkit.BatchInterrupted) and error.__cause__ is raised
    assert after == "GOOD"
    with pytest.raises(batchkit.BatchInterrupted, match=type(raised).__name__):
        f("bad")  # a thread caller gets the same
    assert f("fine") == "FINE"
    f.close()


# -- os.fork(): the child serves with fresh workers ---------------------------------
FORK_SCRIPT = """
import asyncio, os, sys, threading, time
import batchkit

@batchkit.batched(max_batch_size=4, max_wait_ms=1)
def double(xs):
    return [x * 2 for x in xs]

@batchkit.batched(max_batch_size=4, max_wait_ms=1, batch_timeout=5)
def watched(xs):
    return [x * 2 for x in xs]

@batchkit.batched(max_batch_size=4, max_wait_ms=1)
async def adouble(xs):
    return [x * 2 for x in xs]

release = threading.Event()

@batchkit.batched(max_batch_size=4, max_wait_ms=1)
def slow(xs):
    release.wait(5)
    return [x * 2 for x in xs]

@batchkit.batched(max_batch_size=4, max_wait_ms=1)
async def served(xs):
    return [x * 2 for x in xs]

assert double(1) == 2 and watched(1) == 2 and asyncio.run(adouble.acall(1)) == 2
running = threading.Thread(target=lambda: slow(1))  # its batch runs while we fork
running.start()
while slow.stats().in_flight == 0:
    time.sleep(0.001)
# An async function serving a loop that runs on another thread at the fork.
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
assert asyncio.run_coroutine_threadsafe(served.acall(1), loop).result(5) == 2
pid = os.fork()
if pid == 0:
    code = 1
    try:
        assert double(21) == 42
        assert asyncio.run(double.acall(21)) == 42
        assert watched(21) == 42
        assert asyncio.run(adouble.acall(21)) == 42
        assert asyncio.run(served.acall(21)) == 42  # the parent's loop is not here
        release.set()  # (the child's event: nobody waits on it here)
        assert slow(21) == 42  # the parent's running batch does not hold the slot here
        code = 0
    finally:
        os._exit(code)
release.set()
running.join()
assert asyncio.run_coroutine_threadsafe(served.acall(2), loop).result(5) == 4
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_serves_with_fresh_workers() -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=30,  # a hang in the child fails here
    )
    assert done.returncode == 0, done.stderr


# -- each thread caller of a failed batch raises its own exception ---------------------
class Unbuildable(Exception):
    """An exception its own constructor cannot rebuild from `args`."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


@pytest.mark.parametrize("streaming", [False, True], ids=["call", "stream"])
def test_thread_callers_of_a_failed_batch_each_raise_their_own_exception(streaming) -> None:
    cause = KeyError("the cause")
    running = threading.Event()
    release = threading.Event()

    def failing(xs):
        if xs == ["first"]:  # holds the worker while "a" and "b" queue behind it
            running.set()
            release.wait(30)
            return xs
        try:
            raise cause
        except KeyError as exc:
            error = ValueError("the batch failed")
            error.add_note("a note")
            raise error from exc

    def failing_stream(xs):
        yield failing(xs)

    f = batchkit.batched(max_batch_size=2, max_wait_ms=60_000)(
        failing_stream if streaming else failing
    )
    errors: dict[str, BaseException] = {}

    def caller_a() -> None:
        try:
            next(iter(f.stream("a"))) if streaming else f("a")
        except ValueError as exc:
            errors["a"] = exc

    def caller_b() -> None:
        try:
            next(iter(f.stream("b"))) if streaming else f("b")
        except ValueError as exc:
            errors["b"] = exc

    first = threading.Thread(target=lambda: list(f.stream("first")) if streaming else f("first"))
    first.start()
    assert running.wait(30)
    threads = [threading.Thread(target=caller_a), threading.Thread(target=caller_b)]
    for t in threads:
        t.start()
    wait_until(lambda: f.stats().queue_depth == 2)  # one batch of both, once released
    release.set()
    for t in [first, *threads]:
        t.join(30)
    f.close()
    a, b = errors["a"], errors["b"]
    assert a is not b
    for mine, other in ((a, "caller_b"), (b, "caller_a")):
        frames = [frame.name for frame in traceback.extract_tb(mine.__traceback__)]
        assert "failing" in frames and other not in frames, frames
        assert mine.__cause__ is cause and mine.__notes__ == ["a note"]
        assert str(mine) == "the batch failed"


def test_an_error_that_cannot_be_copied_is_raised_as_it_is() -> None:
    error = Unbuildable("no copy", code=7)

    @batchkit.batched(max_batch_size=2, max_wait_ms=1)
    def failing(xs):
        raise error

    with pytest.raises(Unbuildable) as raised:
        failing("a")
    assert raised.value is error and raised.value.code == 7
    failing.close()


# -- a thread that cannot start --------------------------------------------------------
def within(seconds: float, call):
    """`call()` on a daemon thread; fail the test if it has not returned in `seconds`
    (a hang then fails fast, and the thread does not keep the test run alive)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"{call} did not return within {seconds}s"
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def refuse_threads(monkeypatch, named: str) -> None:
    """Make `Thread.start` raise as an exhausted process does, for threads whose name
    contains `named`."""
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if named in self.name:
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)


def test_a_worker_that_cannot_start_fails_its_requests_and_a_later_call_starts_one(
    monkeypatch,
) -> None:
    f = batchkit.batched(max_batch_size=4, max_wait_ms=1)(lambda xs: [x * 2 for x in xs])
    refuse_threads(monkeypatch, "batchkit-")
    with pytest.raises(BatcherClosed, match="could not start a worker thread") as info:
        within(10, lambda: f(1))
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(BatcherClosed):
        within(10, lambda: f.map([2, 3]))
    with pytest.raises(BatcherClosed):
        within(10, lambda: asyncio.run(f.acall(4)))
    assert f.stats().queue_depth == 0  # nothing stays queued
    monkeypatch.undo()
    assert within(10, lambda: f(5)) == 10  # this call starts a worker
    assert within(10, lambda: asyncio.run(f.acall(6))) == 12
    f.close()


def test_a_timer_thread_that_cannot_start_is_tried_again_and_serving_goes_on(
    monkeypatch, caplog
) -> None:
    release = threading.Event()

    def model(xs):
        if -1 in xs:
            release.wait(30)
        return [x * 2 for x in xs]

    f = batchkit.batched(max_batch_size=1, max_wait_ms=0, batch_timeout=0.2)(model)
    refuse_threads(monkeypatch, "-timer")
    with caplog.at_level("ERROR", logger="batchkit"):
        assert within(10, lambda: f(1)) == 2  # served, unwatched
    assert "the timer thread could not start" in caplog.text
    monkeypatch.undo()
    with pytest.raises(BatchTimeout):  # the next call starts the timer: it is watched
        within(10, lambda: f(-1))
    release.set()
    assert within(10, lambda: f(3)) == 6
    f.close()
