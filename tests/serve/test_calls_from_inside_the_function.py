"""A batch function that closes, or calls, its own batched function: a close returns
(the calling batch is served, later calls get `BatcherClosed`), and a call that
could only wait for the batch it is made from raises `RuntimeError` at once, for
threads and asyncio alike.

Each case runs in a child process with a timeout: before, each of them hung forever.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import asyncio, threading, time
import batchkit
from batchkit import BatcherClosed

def refused(call):
    try:
        call()
    except BatcherClosed:
        return True
    return False

async def arefused(call):
    try:
        await call()
    except BatcherClosed:
        return True
    return False
"""

CLOSE = """
@batchkit.batched(max_batch_size=2, max_wait_ms=1)
def fn(xs):
    if "close" in xs:
        fn.close()  # returns: the batch it is called from is served
    return [x.upper() for x in xs]

assert fn("close") == "CLOSE"
assert refused(lambda: fn("later"))
deadline = time.monotonic() + 10
while any(t.name.startswith("batchkit-") for t in threading.enumerate()):
    assert time.monotonic() < deadline, threading.enumerate()  # its threads exit
    time.sleep(0.01)
print("served")
"""

ACLOSE = """
@batchkit.batched(max_batch_size=2, max_wait_ms=1)
async def fn(xs):
    if "close" in xs:
        await fn.aclose()  # returns: the batch it is awaited from is served
    return [x.upper() for x in xs]

async def main():
    assert await fn.acall("close") == "CLOSE"
    assert await arefused(lambda: fn.acall("later"))

asyncio.run(main())
print("served")
"""

CALL = """
def reentrant(slots):
    @batchkit.batched(max_batch_size=2, max_wait_ms=1, max_concurrent_batches=slots)
    def fn(xs):
        if xs == ["outer"]:
            try:
                return [fn("inner")]
            except RuntimeError as error:
                assert "inside its own batch function" in str(error), error
                return ["refused"]
        return [x.upper() for x in xs]
    return fn

fn = reentrant(1)
assert fn("outer") == "refused"  # at once: one worker cannot serve its own call
assert fn("after") == "AFTER"
assert reentrant(2)("outer") == "INNER"  # another worker serves it
print("served")
"""

ACALL = """
def reentrant(slots):
    @batchkit.batched(max_batch_size=2, max_wait_ms=1, max_concurrent_batches=slots)
    async def fn(xs):
        if xs == ["outer"]:
            try:
                return [await fn.acall("inner")]
            except RuntimeError as error:
                assert "inside its own batch function" in str(error), error
                return ["refused"]
        return [x.upper() for x in xs]
    return fn

async def main():
    fn = reentrant(1)
    assert await fn.acall("outer") == "refused"
    assert await fn.acall("after") == "AFTER"
    assert await reentrant(2).acall("outer") == "INNER"

asyncio.run(main())
print("served")
"""


def run_child(body: str) -> None:
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the child hung: the function waited for itself")
    assert done.returncode == 0 and done.stdout.strip() == "served", (
        f"exit code {done.returncode}\n{done.stderr[-3000:]}"
    )


def test_close_from_inside_a_sync_function_returns_and_serves_its_batch() -> None:
    run_child(CLOSE)


def test_aclose_from_inside_an_async_function_returns_and_serves_its_batch() -> None:
    run_child(ACLOSE)


def test_a_sync_function_calling_itself_on_its_only_worker_is_refused() -> None:
    run_child(CALL)


def test_an_async_function_awaiting_itself_in_its_only_slot_is_refused() -> None:
    run_child(ACALL)
