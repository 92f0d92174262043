"""Streaming batch functions: every caller gets exactly the chunks its item would get
in a batch of one, whatever shares its batch, and leaving early costs nobody else."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import batchkit
from batchkit import END, DynamicBatcher, RequestTimeout


@dataclass(frozen=True)
class Spec:
    """What the emulated model streams for one item."""

    name: int
    chunks: int  # chunks before the item ends by itself
    end_with_marker: bool  # END at the end (else: the generator's return ends it)
    error_at: int | None  # an Exception entry at this step
    leave_after: int | None  # the caller stops reading after this many chunks


class Boom(Exception):
    pass


def entry(spec: Spec, step: int) -> Any:
    """What the model yields for ``spec`` at ``step`` (once it is done: END)."""
    if step >= spec.chunks:
        return END
    if spec.error_at == step:
        return Boom(f"item {spec.name} failed at step {step}")
    return f"{spec.name}:{step}"


def solo(spec: Spec) -> tuple[list[str], str | None]:
    """The chunks (and error) of ``spec`` in a batch of one, read up to leave_after."""
    chunks: list[str] = []
    for step in range(spec.chunks):
        if spec.leave_after is not None and len(chunks) == spec.leave_after:
            return chunks, None
        value = entry(spec, step)
        if isinstance(value, Boom):
            return chunks, str(value)
        chunks.append(value)
    return chunks, None


class Model:
    """A generator batch function over specs; counts generators closed early.

    It runs as many steps as the longest item needs, then returns: items that end
    before that get END, the longest ones end by the return, or by a final all-END
    yield when one of them asks for the marker."""

    def __init__(self) -> None:
        self.closed_early = 0
        self.lock = threading.Lock()

    def __call__(self, specs: list[Spec]) -> Iterator[list[Any]]:
        try:
            for step in range(max(s.chunks for s in specs)):
                yield [entry(s, step) for s in specs]
            if any(s.end_with_marker for s in specs):
                yield [END for _ in specs]
        except GeneratorExit:
            with self.lock:
                self.closed_early += 1
            raise


specs_strategy = st.lists(
    st.tuples(
        st.integers(0, 5),
        st.booleans(),
        st.none() | st.integers(0, 5),
        st.none() | st.integers(0, 4),
    ),
    min_size=1,
    max_size=8,
).map(lambda rows: [Spec(i, *row) for i, row in enumerate(rows)])


def one_batch_of(size: int) -> DynamicBatcher:
    """A policy whose batch leaves only when ``size`` requests wait: the streams made
    one after another share one batch, however the worker thread is scheduled."""
    return DynamicBatcher(max_batch_size=size, max_wait_ms=60_000, eager=False)


def read_in_thread(
    f: batchkit.BatchedFunction[Any, Any], spec: Spec
) -> tuple[list[str], str | None]:
    chunks: list[str] = []
    stream = f.stream(spec)
    try:
        while spec.leave_after is None or len(chunks) < spec.leave_after:
            chunk = next(stream, None)
            if chunk is None:
                break
            chunks.append(chunk)
    except Boom as exc:
        return chunks, str(exc)
    finally:
        stream.close()  # type: ignore[attr-defined]
    return chunks, None


@given(specs_strategy, st.integers(1, 4))
def test_thread_callers_get_exactly_their_solo_chunks(specs: list[Spec], batch: int) -> None:
    model = Model()
    before = set(threading.enumerate())
    f = batchkit.batched(max_batch_size=batch, max_wait_ms=2)(model)
    results: dict[int, tuple[list[str], str | None]] = {}

    def reader(spec: Spec) -> None:
        results[spec.name] = read_in_thread(f, spec)

    threads = [threading.Thread(target=reader, args=(s,)) for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a reader hung"
    f.close()
    for spec in specs:
        assert results[spec.name] == solo(spec), spec
    left = [t for t in threading.enumerate() if t not in before and t.name.startswith("batchkit")]
    assert not left  # close() leaves no thread of this function behind
    stats = f.stats()
    assert stats.requests == len(specs) == stats.items_run + stats.cancelled


@given(specs_strategy, st.integers(1, 4), st.booleans())
def test_asyncio_callers_get_exactly_their_solo_chunks(
    specs: list[Spec], batch: int, async_generator: bool
) -> None:
    model = Model()

    async def agen(items: list[Spec]) -> Any:
        for entries in model(items):
            await asyncio.sleep(0)
            yield entries

    f = batchkit.batched(max_batch_size=batch, max_wait_ms=2)(
        agen if async_generator else model
    )

    async def reader(spec: Spec) -> tuple[list[str], str | None]:
        chunks: list[str] = []
        stream = f.astream(spec)
        try:
            while spec.leave_after is None or len(chunks) < spec.leave_after:
                chunk = await anext(stream, None)
                if chunk is None:
                    break
                chunks.append(chunk)
        except Boom as exc:
            return chunks, str(exc)
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return chunks, None

    async def main() -> list[tuple[list[str], str | None]]:
        out = await asyncio.wait_for(asyncio.gather(*(reader(s) for s in specs)), 10)
        await f.aclose()
        await asyncio.sleep(0)  # let finished batch tasks run their last callbacks
        assert asyncio.all_tasks() == {asyncio.current_task()}  # no task left behind
        return list(out)

    results = asyncio.run(main())
    for spec, got in zip(specs, results):
        assert got == solo(spec), spec
    assert f.stats().requests == len(specs)


def test_once_every_caller_has_left_the_generator_is_closed_and_the_slot_freed() -> None:
    closed = threading.Event()

    @batchkit.batched(batcher=one_batch_of(2))
    def endless(xs: list[int]) -> Iterator[list[int]]:
        try:
            step = 0
            while True:
                yield [x * 100 + step for x in xs]
                step += 1
        finally:
            closed.set()

    a, b = endless.stream(1), endless.stream(2)
    assert [next(a), next(b)] == [100, 200]
    a.close()  # type: ignore[attr-defined]
    assert next(b) == 201 and not closed.is_set()  # one caller still reads
    b.close()  # type: ignore[attr-defined]
    assert closed.wait(5)  # GeneratorExit at its current yield
    endless.configure(max_wait_ms=0)  # a batch of one may leave now
    assert next(endless.stream(3)) == 300  # the slot is free again
    endless.close(timeout=0.1)


def test_a_yield_of_the_wrong_length_fails_the_open_streams_with_both_lengths() -> None:
    @batchkit.batched(batcher=one_batch_of(2))
    def short(xs: list[int]) -> Iterator[list[int]]:
        yield xs
        yield xs[:1]

    streams = [short.stream(1), short.stream(2)]
    for s, first in zip(streams, (1, 2)):
        assert next(s) == first
    for s in streams:
        with pytest.raises(ValueError, match="yielded 1 entries for a batch of 2 items"):
            next(s)
    short.close()


def test_a_raising_generator_fails_every_open_stream_with_its_own_exception() -> None:
    error = Boom("the model broke")

    @batchkit.batched(batcher=one_batch_of(3))
    def breaks(xs: list[int]) -> Iterator[list[Any]]:
        yield [END if x == 1 else x for x in xs]
        raise error

    streams = [breaks.stream(x) for x in (1, 2, 3)]
    assert list(streams[0]) == []  # ended by END before the failure
    for s, x in zip(streams[1:], (2, 3)):
        assert next(s) == x
        with pytest.raises(Boom) as info:
            next(s)
        # Its own copy of the generator's exception, not a wrapper.
        assert type(info.value) is Boom and info.value.args == error.args
    breaks.close()
    assert breaks.stats().failed == 2


def test_a_malformed_item_fails_only_its_own_stream() -> None:
    def collate(items: list[str]) -> list[str]:
        if any(not isinstance(x, str) for x in items):
            raise TypeError("items must be str")
        return items

    @batchkit.batched(batcher=one_batch_of(3), collate=collate)
    def echo(xs: list[str]) -> Iterator[list[str]]:
        yield [x.upper() for x in xs]

    good, bad, other = echo.stream("a"), echo.stream(7), echo.stream("c")
    assert list(good) == ["A"] and list(other) == ["C"]
    with pytest.raises(TypeError, match="must be str"):
        list(bad)
    echo.close()


def test_a_stream_times_out_while_waiting_for_a_busy_batcher() -> None:
    gate = threading.Event()

    @batchkit.batched(max_batch_size=1, max_wait_ms=0)
    def slow(xs: list[int]) -> Iterator[list[int]]:
        gate.wait()
        yield xs

    first = slow.stream(1)
    late = slow.stream(2, timeout=0.05)
    with pytest.raises(RequestTimeout):
        next(late)
    gate.set()
    assert list(first) == [1]
    slow.close()
    assert slow.stats().timeouts == 1


def test_the_wrong_call_for_the_function_kind_is_a_type_error_naming_the_right_one() -> None:
    @batchkit.batched
    def streams(xs: list[int]) -> Iterator[list[int]]:
        yield xs

    @batchkit.batched
    def plain(xs: list[int]) -> list[int]:
        return xs

    @batchkit.batched
    async def astreams(xs: list[int]) -> Any:
        yield xs

    with pytest.raises(TypeError, match=r"streams\.stream\(x\)"):
        streams(1)
    with pytest.raises(TypeError, match=r"streams\.stream\(x\)"):
        streams.map([1])
    with pytest.raises(TypeError, match=r"plain\(x\)"):
        plain.stream(1)
    with pytest.raises(TypeError, match=r"astreams\.astream\(x\)"):
        astreams.stream(1)

    async def main() -> None:
        with pytest.raises(TypeError, match=r"astream"):
            await streams.acall(1)
        with pytest.raises(TypeError, match=r"acall"):
            plain.astream(1)
        assert [c async for c in astreams.astream(5)] == [5]
        await astreams.aclose()

    asyncio.run(main())
    for f in (streams, plain):
        f.close()


def test_stats_time_a_stream_to_its_first_chunk_and_its_batch_to_the_last() -> None:
    ticks = iter(range(1000))

    @batchkit.batched(max_batch_size=1, max_wait_ms=0, clock=lambda: float(next(ticks)))
    def three(xs: list[int]) -> Iterator[list[int]]:
        for i in range(3):
            yield [i for _ in xs]

    assert list(three.stream(0)) == [0, 1, 2]
    three.close()
    stats = three.stats()
    assert stats.time_to_first_chunk.count == 1 == stats.batch_latency.count
    assert 0 < stats.time_to_first_chunk.max < stats.batch_latency.max


class Abort(BaseException):
    """A BaseException that is not an Exception, as a generator may raise."""


def test_an_async_generator_base_exception_reaches_its_streams_as_itself(caplog) -> None:
    @batchkit.batched(max_batch_size=4, max_wait_ms=1)
    async def gen(xs):
        yield [x * 10 for x in xs]
        if 2 in xs:
            raise Abort("stop")

    async def read(x):
        got = []
        try:
            async for chunk in gen.astream(x):
                got.append(chunk)
        except Abort as exc:
            return got, exc
        return got, None

    async def main():
        first = await asyncio.gather(read(1), read(2))
        return first, await read(3)  # serving goes on

    with caplog.at_level("ERROR"):
        ((got1, err1), (got2, err2)), (got3, err3) = asyncio.run(main())
        import gc

        gc.collect()  # an unretrieved task exception is logged when the task is freed
    assert (got1, got2) == ([10], [20])
    assert isinstance(err1, Abort) and err1 is err2 and str(err1) == "stop"
    assert (got3, err3) == ([30], None)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_a_sync_generator_exit_reaches_its_streams_as_batch_interrupted() -> None:
    @batchkit.batched(max_batch_size=4, max_wait_ms=1)
    def gen(xs):
        yield list(xs)
        raise SystemExit(2)

    async def read(x):
        got = []
        with pytest.raises(batchkit.BatchInterrupted) as info:
            async for chunk in gen.astream(x):
                got.append(chunk)
        return got, info.value

    got, error = asyncio.run(read("a"))  # the loop is not stopped
    assert got == ["a"] and isinstance(error.__cause__, SystemExit)
    with pytest.raises(batchkit.BatchInterrupted):
        list(gen.stream("b"))
    gen.close()
