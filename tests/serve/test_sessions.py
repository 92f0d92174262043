"""Stateful sessions (`@batched(state=...)`): each session's requests run in the order
they were made, one at a time, each with its session's state; a failed or cancelled
request leaves the state as it was; states are freed when a session ends."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections import Counter
from collections.abc import Hashable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit
from batchkit import BatcherClosed, QueueFull, RequestTimeout, TooManySessions

from ._wait import wait_until

History = tuple[int, ...]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Watch:
    """What the batch function saw: two requests of one session in one batch, or in
    flight together, are violations."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: Counter[Hashable] = Counter()
        self.violations: list[str] = []

    def enter(self, keys: list[Hashable]) -> None:
        with self.lock:
            if len(set(keys)) != len(keys):
                self.violations.append(f"one batch holds a session twice: {keys}")
            for key in keys:
                if self.in_flight[key]:
                    self.violations.append(f"session {key!r} in flight twice")
                self.in_flight[key] += 1

    def leave(self, keys: list[Hashable]) -> None:
        with self.lock:
            self.in_flight.subtract(keys)


class ItemFailure(Exception):
    pass


class BatchFailure(Exception):
    pass


def history_model(watch: Watch) -> Any:
    """A session's state is the tuple of its chunks' numbers applied so far; a chunk's
    result is the history before it. Chunks are `(key, number, kind)`: kind "fail"
    fails that item alone, "poison" fails its whole batch."""

    def step(chunks: list[tuple[Hashable, int, str]], states: list[History]) -> Any:
        keys = [c[0] for c in chunks]
        watch.enter(keys)
        try:
            if any(kind == "poison" for _, _, kind in chunks):
                raise BatchFailure("poisoned batch")
            results: list[Any] = []
            new_states: list[History] = []
            for (_, number, kind), state in zip(chunks, states):
                results.append(ItemFailure(number) if kind == "fail" else state)
                new_states.append((*state, number))
            return results, new_states
        finally:
            watch.leave(keys)

    return step


def check_session(
    outcomes: dict[int, Any], final: History, chunk_count: int, *, in_order: bool
) -> None:
    """Every success saw exactly the successes before it; failures left no trace;
    cancelled requests either never ran or settled before their caller left. With
    `in_order`, the chunks were queued in their numbers' order, and so ran."""
    assert len(set(final)) == len(final), final
    if in_order:
        assert list(final) == sorted(final), final
    for number in range(chunk_count):
        outcome = outcomes.get(number, "cancelled")  # (a task cancelled before it ran)
        if isinstance(outcome, tuple):  # succeeded
            assert number in final, (number, final)
            assert outcome == final[: final.index(number)], (number, outcome, final)
        elif outcome == "cancelled":
            continue
        else:
            assert number not in final, (number, outcome, final)


kinds = st.sampled_from(["ok", "ok", "ok", "ok", "fail", "poison"])
sessions_strategy = st.lists(st.lists(kinds, max_size=6), min_size=1, max_size=5)


@settings(max_examples=25, deadline=None)
@given(sessions=sessions_strategy, batch_size=st.integers(1, 4), isolate=st.booleans())
def test_threads_each_session_runs_in_order_as_if_alone(
    sessions: list[list[str]], batch_size: int, isolate: bool
) -> None:
    watch = Watch()
    step = batchkit.batched(
        max_batch_size=batch_size,
        max_wait_ms=1,
        max_concurrent_batches=2,
        isolate_errors=isolate,
        state=lambda: (),
    )(history_model(watch))
    outcomes: dict[int, dict[int, Any]] = {k: {} for k in range(len(sessions))}

    def one(key: int, number: int, kind: str) -> None:
        try:
            outcomes[key][number] = step((key, number, kind), session=key)
        except (ItemFailure, BatchFailure) as exc:
            outcomes[key][number] = type(exc).__name__

    # A thread per chunk: a session has several requests queued at once (their order
    # is the order the threads queued them, which the histories reveal).
    threads = []
    for key, chunk_kinds in enumerate(sessions):
        for number, kind in enumerate(chunk_kinds):
            threads.append(threading.Thread(target=one, args=(key, number, kind)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    finals = {key: step.session_state(key) for key, chunks in enumerate(sessions) if chunks}
    step.close()
    assert not watch.violations
    for key, chunk_kinds in enumerate(sessions):
        check_session(outcomes[key], finals.get(key, ()), len(chunk_kinds), in_order=False)
        for number, kind in enumerate(chunk_kinds):
            # Any chunk batched with a poisoned one fails with its batch.
            allowed = {"ok": (tuple, str), "fail": (str,), "poison": (str,)}[kind]
            assert isinstance(outcomes[key][number], allowed)
            if kind != "ok" or isinstance(outcomes[key][number], str):
                expected = {"BatchFailure"} if kind != "fail" else {"ItemFailure", "BatchFailure"}
                assert outcomes[key][number] in expected, (kind, outcomes[key][number])


@settings(max_examples=20, deadline=None)
@given(
    sessions=sessions_strategy,
    cancel_after=st.lists(st.one_of(st.none(), st.integers(0, 6)), min_size=30, max_size=30),
    batch_size=st.integers(1, 4),
)
def test_asyncio_cancellations_never_advance_a_session(
    sessions: list[list[str]], cancel_after: list[int | None], batch_size: int
) -> None:
    watch = Watch()
    step = batchkit.batched(
        max_batch_size=batch_size, max_wait_ms=1, max_concurrent_batches=2, state=lambda: ()
    )(history_model(watch))

    async def main() -> dict[int, dict[int, Any]]:
        outcomes: dict[int, dict[int, Any]] = {k: {} for k in range(len(sessions))}

        async def one(key: int, number: int, kind: str) -> None:
            try:
                outcomes[key][number] = await step.acall((key, number, kind), session=key)
            except (ItemFailure, BatchFailure) as exc:
                outcomes[key][number] = type(exc).__name__
            except asyncio.CancelledError:
                outcomes[key][number] = "cancelled"

        tasks = []
        for key, chunk_kinds in enumerate(sessions):
            for number, kind in enumerate(chunk_kinds):
                tasks.append(asyncio.ensure_future(one(key, number, kind)))
        # Cancel some callers after a few loop turns: queued behind their session's
        # head, waiting in the core, or running.
        plan = sorted(
            (after, i) for i, after in enumerate(cancel_after[: len(tasks)]) if after is not None
        )
        turn = 0
        for after, i in plan:
            while turn < after:
                await asyncio.sleep(0)
                turn += 1
            tasks[i].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return outcomes

    outcomes = asyncio.run(main())
    for key, chunk_kinds in enumerate(sessions):
        try:
            final = step.session_state(key)
        except KeyError:  # (every caller of the session was cancelled before calling)
            final = ()
        check_session(outcomes[key], final, len(chunk_kinds), in_order=True)
    step.close()
    assert not watch.violations


def counter_step(chunks: list[int], states: list[int]) -> tuple[list[int], list[int]]:
    """A running sum: each result is the session's sum after its chunk."""
    sums = [s + c for c, s in zip(chunks, states)]
    return sums, sums


def test_a_request_cancelled_while_it_runs_leaves_its_session_as_before() -> None:
    started, release = threading.Event(), threading.Event()

    @batchkit.batched(max_batch_size=4, max_wait_ms=0, state=lambda: 0)
    def step(chunks: list[int], states: list[int]) -> tuple[list[int], list[int]]:
        if 100 in chunks:
            started.set()
            release.wait(5)
        return counter_step(chunks, states)

    async def main() -> None:
        assert await step.acall(1, session="s") == 1
        running = asyncio.ensure_future(step.acall(100, session="s"))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        running.cancel()  # it runs on, but its new state must not be kept
        await asyncio.wait([running])  # (the caller has left before the batch ends)
        assert running.cancelled()
        release.set()
        assert await step.acall(2, session="s") == 3

    asyncio.run(main())
    assert step.session_state("s") == 3
    step.close()


def test_an_item_whose_result_is_an_exception_keeps_its_state_others_advance() -> None:
    @batchkit.batched(max_batch_size=8, max_wait_ms=50, state=lambda: 0)
    def step(chunks: list[int], states: list[int]) -> tuple[list[Any], list[int]]:
        sums, new = counter_step(chunks, states)
        return [ValueError(c) if c < 0 else s for c, s in zip(chunks, sums)], new

    for key in "ab":
        step(10, session=key)
    out: dict[str, Any] = {}

    def call(key: str, chunk: int) -> None:
        try:
            out[key] = step(chunk, session=key)
        except ValueError as exc:
            out[key] = exc

    threads = [threading.Thread(target=call, args=a) for a in (("a", -1), ("b", 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(out["a"], ValueError) and out["b"] == 15
    assert step.session_state("a") == 10 and step.session_state("b") == 15
    step.close()


def test_a_failing_split_leaves_the_state_as_before() -> None:
    # split() fails after the function returned: the batch fails, and no new state
    # is kept.
    fail = [False]

    def split(results: list[int]) -> list[int]:
        if fail[0]:
            raise RuntimeError("split failed")
        return results

    step = batchkit.batched(max_batch_size=4, max_wait_ms=0, split=split, state=lambda: 0)(
        counter_step
    )
    assert step(5, session="s") == 5
    fail[0] = True
    with pytest.raises(RuntimeError, match="split failed"):
        step(7, session="s")
    fail[0] = False
    assert step.session_state("s") == 5
    assert step(1, session="s") == 6
    step.close()


def test_out_of_memory_splits_rerun_items_from_the_states_before() -> None:
    sizes: list[int] = []

    # A batch waits for all 6 sessions' chunks: the first one is split for sure.
    @batchkit.batched(batcher=batchkit.StaticBatcher(6), state=lambda: 0, on_oom=False)
    def step(chunks: list[int], states: list[int]) -> tuple[list[int], list[int]]:
        sizes.append(len(chunks))
        if len(chunks) > 2:
            raise MemoryError
        return counter_step(chunks, states)

    def session(key: int) -> list[int]:
        return [step(c, session=key) for c in (1, 2, 3)]

    results: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda k=k: results.__setitem__(k, session(k))) for k in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [1, 3, 6] for k in range(6)}
    assert sizes[:3] == [6, 3, 2]  # (split in halves until it fits)
    step.close()


@pytest.mark.parametrize(
    ("output", "error", "message"),
    [
        ([1], TypeError, "must return a pair"),
        (([1], [0, 0]), ValueError, "2 new states for a batch of 1"),
        (([1], 5), TypeError, "new_states of type int"),
        (([1, 2], [0]), ValueError, "2 results for a batch of 1"),
    ],
)
def test_a_wrong_output_fails_the_batch_naming_what_was_wrong(
    output: Any, error: type[Exception], message: str
) -> None:
    step = batchkit.batched(max_batch_size=1, state=lambda: 0)(lambda chunks, states: output)
    with pytest.raises(error, match=message):
        step(1, session="s")
    assert step.session_state("s") == 0
    step.close()


class State:
    """A state object a weak reference can watch."""

    def __init__(self, total: int = 0) -> None:
        self.total = total


def object_step(chunks: list[int], states: list[State]) -> tuple[list[int], list[State]]:
    new = [State(s.total + c) for c, s in zip(chunks, states)]
    return [s.total for s in new], new


def test_end_true_frees_the_state_and_a_later_call_starts_over() -> None:
    step = batchkit.batched(max_batch_size=4, state=State)(object_step)
    step(3, session="s")
    watched = weakref.ref(step.session_state("s"))
    assert step(4, session="s", end=True) == 7
    gc.collect()
    assert watched() is None
    assert step.stats().sessions == 0 and step.stats().sessions_ended == 1
    with pytest.raises(KeyError):
        step.session_state("s")
    assert step(1, session="s") == 1  # a new session
    step.close()


def test_end_session_frees_an_idle_session_at_once_and_a_busy_one_after_its_requests() -> None:
    release = threading.Event()

    @batchkit.batched(max_batch_size=4, max_wait_ms=0, state=State)
    def step(chunks: list[int], states: list[State]) -> tuple[list[int], list[State]]:
        if 100 in chunks:
            release.wait(5)
        return object_step(chunks, states)

    step(1, session="idle")
    watched = weakref.ref(step.session_state("idle"))
    assert step.end_session("idle") is True
    gc.collect()
    assert watched() is None
    assert step.end_session("idle") is False

    async def busy() -> list[int]:
        first = asyncio.ensure_future(step.acall(100, session="busy"))
        second = asyncio.ensure_future(step.acall(1, session="busy"))
        await asyncio.sleep(0)  # both queued, in that order
        assert step.end_session("busy") is True  # it ends after both
        release.set()
        return [await first, await second]

    assert asyncio.run(busy()) == [100, 101]
    assert step.stats().sessions == 0 and step.stats().sessions_ended == 2
    step.close()


def test_idle_sessions_are_evicted_on_the_clock_and_freed() -> None:
    clock = FakeClock()
    step = batchkit.batched(max_batch_size=4, state=State, session_idle_s=10.0, clock=clock)(
        object_step
    )
    step(1, session="old")
    clock.now = 5.0
    step(1, session="new")
    watched = weakref.ref(step.session_state("old"))
    clock.now = 10.5  # "old" idle for 10.5 s, "new" for 5.5 s
    stats = step.stats()
    assert (stats.sessions, stats.sessions_evicted) == (1, 1)
    gc.collect()
    assert watched() is None
    assert step(2, session="new") == 3  # kept its state
    assert step(2, session="old") == 2  # started over
    step.close()


def test_max_sessions_refuses_a_new_session_while_existing_ones_go_on() -> None:
    step = batchkit.batched(max_batch_size=4, state=lambda: 0, max_sessions=2)(counter_step)
    step(1, session="a")
    step(1, session="b")
    with pytest.raises(TooManySessions, match="max_sessions=2") as refused:
        step(1, session="c")
    assert isinstance(refused.value, QueueFull)
    assert step(1, session="a") == 2
    step.end_session("b")
    assert step(1, session="c") == 1
    assert step.stats().sessions == 2
    step.close()


def test_max_sessions_block_waits_for_a_session_to_end() -> None:
    step = batchkit.batched(
        max_batch_size=4, state=lambda: 0, max_sessions=1, when_sessions_full="block"
    )(counter_step)
    step(5, session="a")
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(step(7, session="b")))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive() and not got
    step.end_session("a")
    waiter.join(5)
    assert got == [7]
    with pytest.raises(RequestTimeout):
        step(1, session="c", timeout=0.01)
    assert step.stats().sessions == 1
    step.close()


def test_max_sessions_block_admits_a_waiting_session_when_an_idle_one_expires() -> None:
    clock = FakeClock()
    step = batchkit.batched(
        max_batch_size=4,
        state=lambda: 0,
        max_sessions=1,
        when_sessions_full="block",
        session_idle_s=0.01,
        clock=clock,
    )(counter_step)
    step(5, session="a")
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(step(7, session="b")))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()
    clock.now = 1.0  # "a" has been idle long enough: the waiting caller notices
    waiter.join(5)
    assert got == [7] and step.stats().sessions_evicted == 1
    step.close()


def test_a_request_timed_out_behind_its_sessions_head_never_runs() -> None:
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    @batchkit.batched(max_batch_size=4, max_wait_ms=0, state=lambda: 0)
    def step(chunks: list[int], states: list[int]) -> tuple[list[int], list[int]]:
        ran.extend(chunks)
        if 100 in chunks:
            started.set()
            release.wait(5)
        return counter_step(chunks, states)

    head = threading.Thread(target=step, args=(100,), kwargs={"session": "s"})
    head.start()
    started.wait(5)
    with pytest.raises(RequestTimeout):
        step(1, session="s", timeout=0.01)
    release.set()
    head.join()
    assert step(2, session="s") == 102
    assert ran == [100, 2]
    step.close()


def test_close_fails_the_requests_queued_behind_a_head() -> None:
    started, release = threading.Event(), threading.Event()

    @batchkit.batched(max_batch_size=4, max_wait_ms=0, state=lambda: 0)
    def step(chunks: list[int], states: list[int]) -> tuple[list[int], list[int]]:
        if 100 in chunks:
            started.set()
            release.wait(5)
        return counter_step(chunks, states)

    out: dict[int, Any] = {}

    def call(chunk: int) -> None:
        try:
            out[chunk] = step(chunk, session="s")
        except BatcherClosed as exc:
            out[chunk] = exc

    head = threading.Thread(target=call, args=(100,))
    head.start()
    started.wait(5)
    queued = threading.Thread(target=call, args=(1,))
    queued.start()
    queued.join(0.05)
    closer = threading.Thread(target=step.close)
    closer.start()
    wait_until(lambda: 1 in out)
    release.set()
    for t in (head, queued, closer):
        t.join(5)
    assert out[100] == 100 and isinstance(out[1], BatcherClosed)
    with pytest.raises(BatcherClosed):
        step(1, session="t")


def test_an_async_function_keeps_sessions_too() -> None:
    @batchkit.batched(max_batch_size=8, max_wait_ms=1, state=lambda key: len(key))
    async def step(chunks: list[int], states: list[int]) -> tuple[list[int], list[int]]:
        await asyncio.sleep(0)
        return counter_step(chunks, states)

    async def main() -> list[list[int]]:
        async def session(key: str) -> list[int]:
            return [await step(c, session=key) for c in range(4)]

        return await asyncio.gather(*(session("k" * n) for n in range(1, 9)))

    for n, results in enumerate(asyncio.run(main()), start=1):
        assert results == [n, n + 1, n + 3, n + 6]


def test_sessions_work_with_groups_and_a_latency_target() -> None:
    seen: list[set[str]] = []

    @batchkit.batched(
        max_batch_size=8,
        max_wait_ms=1,
        group=lambda chunk: chunk[0],
        max_latency_ms=10_000,
        state=lambda: 0,
    )
    def step(chunks: list[tuple[str, int]], states: list[int]) -> tuple[list[int], list[int]]:
        seen.append({g for g, _ in chunks})
        sums = [s + c for (_, c), s in zip(chunks, states)]
        return sums, sums

    def session(key: int) -> list[int]:
        return [step(("ab"[key % 2], c), session=key) for c in (1, 2, 3)]

    results: dict[int, list[int]] = {}
    threads = [
        threading.Thread(target=lambda k=k: results.__setitem__(k, session(k))) for k in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [1, 3, 6] for k in range(8)}
    assert all(len(groups) == 1 for groups in seen)
    assert "a" in step.stats().groups
    step.close()


def test_stacked_states_gather_and_scatter_rows_by_slot() -> None:
    shapes: list[tuple[int, ...]] = []

    @batchkit.batched(
        max_batch_size=8, max_wait_ms=1, state=lambda: np.zeros(3), stack_states=True
    )
    def step(chunks: list[float], states: np.ndarray) -> tuple[list[float], np.ndarray]:
        shapes.append(states.shape)
        new = states * 0.5 + np.asarray(chunks)[:, None]
        return list(new.sum(axis=1)), new

    def alone(chunks: list[float]) -> list[float]:
        state, out = np.zeros(3), []
        for c in chunks:
            state = state * 0.5 + c
            out.append(float(state.sum()))
        return out

    results: dict[int, list[float]] = {}
    threads = [
        threading.Thread(
            target=lambda k=k: results.__setitem__(
                k, [step(float(c + k), session=k) for c in range(5)]
            )
        )
        for k in range(20)  # more than the first buffer's rows: it grows
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(20):
        assert results[k] == pytest.approx(alone([float(c + k) for c in range(5)]))
    assert all(shape[1:] == (3,) for shape in shapes)
    step.close()


def test_stacked_states_refuse_new_states_of_the_wrong_shape() -> None:
    step = batchkit.batched(max_batch_size=1, state=lambda: np.zeros(3), stack_states=True)(
        lambda chunks, states: (chunks, np.zeros((1, 4)))
    )
    with pytest.raises(ValueError, match=r"shape \(1, 4\), expected \(1, 3\)"):
        step(1, session="s")
    step.close()


def test_stacked_states_keep_torch_states_on_their_device() -> None:
    torch = pytest.importorskip("torch")

    @batchkit.batched(
        max_batch_size=8, max_wait_ms=1, state=lambda: torch.zeros(2), stack_states=True
    )
    def step(chunks: list[float], states: Any) -> tuple[list[float], Any]:
        new = states + torch.tensor(chunks)[:, None]
        return new[:, 0].tolist(), new

    assert [step(1.0, session="a"), step(2.0, session="a"), step(5.0, session="b")] == [
        1.0,
        3.0,
        5.0,
    ]
    assert torch.equal(step.session_state("a"), torch.tensor([3.0, 3.0]))
    step.close()


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"state": 0}, TypeError, "state must be a callable"),
        ({"state": lambda a, b: 0}, TypeError, "one argument"),
        ({"max_sessions": 2}, ValueError, "need state="),
        ({"state": lambda: 0, "max_sessions": 0}, ValueError, "max_sessions"),
        ({"state": lambda: 0, "session_idle_s": -1}, ValueError, "session_idle_s"),
        ({"state": lambda: 0, "when_sessions_full": "wait"}, ValueError, "when_sessions_full"),
        ({"state": lambda: 0, "when_sessions_full": "block"}, ValueError, "needs a max_sessions"),
        (
            {"state": lambda: 0, "max_queue_size": 4, "when_full": "block"},
            ValueError,
            'when_full="block"',
        ),
        ({"state": lambda: 0, "stack_states": 1}, TypeError, "stack_states"),
    ],
)
def test_bad_session_options_are_refused_by_name(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        batchkit.batched(**options)(counter_step)


def test_calls_without_a_session_or_to_a_stateless_function_are_refused() -> None:
    step = batchkit.batched(state=lambda: 0)(counter_step)
    with pytest.raises(TypeError, match="session=key"):
        step(1)
    with pytest.raises(TypeError, match="hashable"):
        step(1, session=["list"])
    with pytest.raises(TypeError, match="once per chunk"):
        step.map([1, 2])
    step.close()
    plain = batchkit.batched(lambda xs: xs)
    with pytest.raises(TypeError, match="keeps no sessions"):
        plain(1, session="s")
    with pytest.raises(TypeError, match="keeps no sessions"):
        plain.end_session("s")
    plain.close()

    def gen(chunks: list[int], states: list[int]) -> Any:
        yield chunks

    with pytest.raises(TypeError, match="generator function"):
        batchkit.batched(state=lambda: 0)(gen)


def test_asyncio_a_request_timed_out_behind_its_sessions_head_never_runs() -> None:
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    @batchkit.batched(max_batch_size=4, max_wait_ms=0, state=lambda: 0)
    def step(chunks: list[int], states: list[int]) -> tuple[list[int], list[int]]:
        ran.extend(chunks)
        if 100 in chunks:
            started.set()
            release.wait(5)
        return counter_step(chunks, states)

    async def main() -> None:
        head = asyncio.ensure_future(step.acall(100, session="s"))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        with pytest.raises(RequestTimeout):
            await step.acall(1, session="s", timeout=0.01)
        release.set()
        assert await head == 100
        assert await step.acall(2, session="s") == 102

    asyncio.run(main())
    assert ran == [100, 2]
    step.close()


def test_a_batch_that_timed_out_keeps_no_state_even_when_it_returns_late() -> None:
    release = threading.Event()

    @batchkit.batched(max_batch_size=4, max_wait_ms=0, batch_timeout=0.05, state=lambda: 0)
    def step(chunks: list[int], states: list[int]) -> tuple[list[int], list[int]]:
        if 100 in chunks:
            release.wait(5)
        return counter_step(chunks, states)

    assert step(1, session="s") == 1
    with pytest.raises(batchkit.BatchTimeout):
        step(100, session="s")
    release.set()  # the stuck call returns now; its new state must not be kept
    wait_until(lambda: step.stats().abandoned_workers == 0)
    assert step(2, session="s") == 3
    step.close()


def test_asyncio_a_new_session_waits_for_room_when_sessions_are_full() -> None:
    step = batchkit.batched(
        max_batch_size=4, state=lambda: 0, max_sessions=1, when_sessions_full="block"
    )(counter_step)

    async def main() -> None:
        assert await step.acall(5, session="a") == 5
        waiting = asyncio.ensure_future(step.acall(7, session="b"))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        step.end_session("a")
        assert await asyncio.wait_for(waiting, 5) == 7

    asyncio.run(main())
    step.close()


@settings(max_examples=15, deadline=None)
@given(
    chunk_counts=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    max_sessions=st.integers(1, 3),
)
def test_max_sessions_holds_and_waiting_sessions_run_as_if_alone(
    chunk_counts: list[int], max_sessions: int
) -> None:
    watch = Watch()
    live_seen: list[int] = []
    model = history_model(watch)

    def step_fn(chunks: list[tuple[int, int, str]], states: list[History]) -> Any:
        live_seen.append(step.stats().sessions)
        return model(chunks, states)

    step = batchkit.batched(
        max_batch_size=4,
        max_wait_ms=1,
        state=lambda: (),
        max_sessions=max_sessions,
        when_sessions_full="block",
    )(step_fn)
    outcomes: dict[int, list[Any]] = {}

    def session(key: int, count: int) -> None:
        outcomes[key] = [
            step((key, n, "ok"), session=key, end=n == count - 1) for n in range(count)
        ]

    threads = [
        threading.Thread(target=session, args=(k, c)) for k, c in enumerate(chunk_counts)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = step.stats()
    step.close()
    assert not watch.violations
    assert max(live_seen) <= max_sessions
    for key, count in enumerate(chunk_counts):
        assert outcomes[key] == [tuple(range(n)) for n in range(count)]
    assert (stats.sessions, stats.sessions_ended) == (0, len(chunk_counts))


def test_a_request_queued_after_an_end_starts_a_new_session_in_its_turn() -> None:
    firsts: list[str] = []

    def first_state(key: str) -> int:
        firsts.append(key)
        return 0

    step = batchkit.batched(max_batch_size=4, max_wait_ms=1, state=first_state)(counter_step)

    async def main() -> list[int]:
        calls = [
            step.acall(1, session="s"),
            step.acall(2, session="s", end=True),
            step.acall(5, session="s"),  # queued behind the end: a new session
            step.acall(1, session="s"),
        ]
        return list(await asyncio.gather(*calls))

    assert asyncio.run(main()) == [1, 3, 5, 6]
    assert firsts == ["s", "s"]
    stats = step.stats()
    assert (stats.sessions, stats.sessions_ended) == (1, 1)
    step.close()


@pytest.mark.parametrize("sharing", [{"coalesce": True}, {"cache": {}}])
def test_a_stateful_function_refuses_coalescing_and_a_cache(sharing: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="equal chunks are not one request"):

        @batchkit.batched(state=lambda: 0, **sharing)
        def step(items: list[int], states: list[int]) -> tuple[list[int], list[int]]:
            return items, states


def test_printed_stats_show_the_sessions() -> None:
    @batchkit.batched(state=lambda: 0, max_wait_ms=0)
    def count(items: list[int], states: list[int]) -> tuple[list[int], list[int]]:
        new = [s + i for i, s in zip(items, states)]
        return new, new

    with count:
        count(1, session="a")
        count(2, session="b", end=True)
        rows = [" ".join(line.split()) for line in str(count.stats()).splitlines()]
        assert "sessions 1 live, 1 ended, 0 evicted" in rows
