"""A `SystemExit` or `KeyboardInterrupt` from the user's own code around a batch
(`collate`, `split`, an async batch function, a streaming `collate`, closing a
streaming generator, the `on_oom` hook, a listener, `key` and `group`) reaches the
callers it concerns as a `BatchInterrupted` caused by it; their event loop goes on,
and so does the worker.

Each case runs in a child process with a timeout: passed on as it is, the exit would
stop the callers' loop (or the test run itself, for a `KeyboardInterrupt`), and a
worker it killed would leave every later call hanging.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import asyncio, sys
import batchkit
from batchkit import BatchInterrupted

EXITS = [SystemExit(3), KeyboardInterrupt()]

def interrupted(error, raised):
    assert isinstance(error, BatchInterrupted), repr(error)
    assert error.__cause__ is raised, repr(error.__cause__)

async def first_of(coro):
    (outcome,) = await asyncio.gather(coro, return_exceptions=True)
    return outcome
"""

PLAIN = """
RAISED = None  # raised where WHERE says, by any batch holding "bad"

def collate(xs):
    if WHERE == "collate" and "bad" in xs:
        raise RAISED
    return list(xs)

def split(out):
    if WHERE == "split" and "BAD" in out:
        raise RAISED
    return out

def forward(xs):
    return [x.upper() for x in xs]

async def aforward(xs):
    if WHERE == "async function" and "bad" in xs:
        raise RAISED
    return [x.upper() for x in xs]

f = batchkit.batched(max_batch_size=4, max_wait_ms=1, collate=collate, split=split)(
    aforward if WHERE == "async function" else forward
)

async def main():
    error = await first_of(f.acall("bad"))  # the loop is not stopped...
    interrupted(error, RAISED)
    assert await f.acall("good") == "GOOD"  # ...and serving goes on

for RAISED in EXITS:
    asyncio.run(main())
    if WHERE != "async function":  # a thread caller gets the same
        try:
            f("bad")
        except BatchInterrupted as error:
            interrupted(error, RAISED)
        assert f("fine") == "FINE"
print("served")
"""

STREAM = """
RAISED = None

def collate(xs):
    if WHERE == "collate" and "bad" in xs:
        raise RAISED
    return list(xs)

def gen(xs):
    try:
        while True:
            yield [x.upper() for x in xs]
    finally:
        if WHERE == "close" and "bad" in xs:
            raise RAISED  # closed by batchkit, once its caller left

async def agen(xs):
    yield [x.upper() for x in xs]

fn = agen if ASYNC else gen
f = batchkit.batched(max_batch_size=4, max_wait_ms=1, collate=collate)(fn)

async def first_chunk(x):
    async for chunk in f.astream(x):
        return chunk

for RAISED in EXITS:
    if WHERE == "collate":
        error = asyncio.run(first_of(first_chunk("bad")))
        interrupted(error, RAISED)
        if not ASYNC:
            try:
                next(iter(f.stream("bad")))
            except BatchInterrupted as error:
                interrupted(error, RAISED)
    else:  # the caller leaves after one chunk; the generator's closing raises
        assert asyncio.run(first_chunk("bad")) == "BAD"
    assert asyncio.run(first_chunk("good")) == "GOOD"  # the worker serves on
    if not ASYNC:
        assert next(iter(f.stream("fine"))) == "FINE"
print("served")
"""

OOM = """
calls = []

def on_oom():
    raise RAISED

@batchkit.batched(max_batch_size=4, max_wait_ms=1, on_oom=on_oom)
def forward(xs):
    calls.append(len(xs))
    if len(xs) > 1:
        raise MemoryError("too big")
    return [x * 2 for x in xs]

for RAISED in EXITS:
    assert forward.map([1, 2]) == [2, 4]  # the hook's exit is logged; the retry runs
    async def main():
        return await asyncio.gather(forward.acall(1), forward.acall(2))
    assert asyncio.run(main()) == [2, 4]
print("served")
"""

KEY = """
RAISED = None

def pick(x):
    if x == "bad":
        raise RAISED
    return len(x)

policy = batchkit.DynamicBatcher(max_batch_size=4, max_wait_ms=1, **{WHERE: pick})
f = batchkit.batched(batcher=policy)(lambda xs: [x.upper() for x in xs])

@batchkit.batched(batcher=policy)
async def af(xs):
    return [x.upper() for x in xs]

async def main(g):
    error = await first_of(g.acall("bad"))  # raised in the caller's task: its loop goes on
    interrupted(error, RAISED)
    assert await g.acall("good") == "GOOD"

for RAISED in EXITS:
    asyncio.run(main(f))
    asyncio.run(main(af))
    try:
        f("bad")
    except BatchInterrupted as error:
        interrupted(error, RAISED)
    assert f("fine") == "FINE"
    try:  # offline too: the caller's own loop over the batches
        list(policy.batches(["ok", "bad"]))
    except BatchInterrupted as error:
        interrupted(error, RAISED)
print("served")
"""

LISTENER = """
class Exiting:
    def on_batch(self, event):
        raise RAISED

    def on_drop(self, event):
        raise RAISED

f = batchkit.batched(max_batch_size=4, max_wait_ms=1)(lambda xs: [x * 2 for x in xs])

@batchkit.batched(max_batch_size=4, max_wait_ms=1)
async def af(xs):
    return [x * 2 for x in xs]

async def main(g):
    assert await g.acall(1) == 2  # the listener's exit is logged...
    assert await g.acall(2) == 4  # ...and the worker (or the loop) serves on

for RAISED in EXITS:
    for g in (f, af):
        g.add_listener(Exiting())
        asyncio.run(main(g))
    assert f(3) == 6 and f(4) == 8
print("served")
"""


def run_child(body: str, **names: object) -> None:
    settings = "".join(f"{name} = {value!r}\n" for name, value in names.items())
    script = textwrap.dedent(PRELUDE) + settings + textwrap.dedent(body)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the child hung: a worker died, and a later call waited forever")
    assert done.returncode == 0 and done.stdout.strip() == "served", (
        f"exit code {done.returncode}\n{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize("where", ["collate", "split", "async function"])
def test_an_exit_from_collate_split_or_an_async_function_reaches_callers_as_interrupted(
    where: str,
) -> None:
    run_child(PLAIN, WHERE=where)


@pytest.mark.parametrize("is_async", [False, True], ids=["generator", "async generator"])
def test_an_exit_from_a_streaming_collate_fails_its_streams_and_later_streams_run(
    is_async: bool,
) -> None:
    run_child(STREAM, WHERE="collate", ASYNC=is_async)


def test_an_exit_while_closing_a_left_stream_generator_does_not_kill_the_worker() -> None:
    run_child(STREAM, WHERE="close", ASYNC=False)


def test_an_exit_from_the_on_oom_hook_is_logged_and_the_split_retry_runs() -> None:
    run_child(OOM)


@pytest.mark.parametrize("where", ["key", "group"])
def test_an_exit_from_key_or_group_reaches_its_caller_as_interrupted(where: str) -> None:
    run_child(KEY, WHERE=where)


def test_an_exit_from_a_listener_is_logged_and_serving_goes_on() -> None:
    run_child(LISTENER)
