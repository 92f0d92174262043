"""A `SystemExit` or `KeyboardInterrupt` from the user's code a continuous batcher runs:
from the step function, its requests fail with a `BatchInterrupted` caused by it (as
`@batched` does) and the callers' loop goes on; from a listener, it is logged and the
driver goes on.

Each case runs in a child process with a timeout: passed on as it is, the exit would
stop the callers' loop (or the test run itself, for a `KeyboardInterrupt`), and a
driver it killed would leave `result()` waiting forever.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import asyncio
from batchkit import BatchInterrupted
from batchkit.generate import ContinuousBatcher

EXITS = [SystemExit(3), KeyboardInterrupt()]

def tokens(batch):
    if any(s.token_ids[0] == 99 for s in batch.seqs):
        raise RAISED
    return [7 if s.sample else None for s in batch.seqs]

if ASYNC:
    async def step(batch):
        return tokens(batch)
else:
    def step(batch):
        return tokens(batch)

b = ContinuousBatcher(step, max_num_seqs=4, max_num_batched_tokens=64)

async def awaited(prompt):
    (outcome,) = await asyncio.gather(b.submit(prompt, max_new_tokens=2), return_exceptions=True)
    return outcome
"""

STEP = """
for RAISED in EXITS:
    error = asyncio.run(awaited([99]))  # the loop is not stopped
    assert isinstance(error, BatchInterrupted), repr(error)
    assert error.__cause__ is RAISED and "the step function raised" in str(error)
    assert asyncio.run(awaited([1, 2])) == [7, 7]  # the driver goes on
    if not ASYNC:  # a thread caller gets the same
        try:
            b.submit([99], max_new_tokens=2).result(timeout=10)
        except BatchInterrupted as error:
            assert error.__cause__ is RAISED
        assert b.submit([1], max_new_tokens=2).result(timeout=10) == [7, 7]
print("served")
"""

LISTENER = """
RAISED = None

class Exits:
    def on_step(self, event):
        if WHERE == "on_step":
            raise RAISED

    def on_finish(self, event):
        if WHERE == "on_finish":
            raise RAISED

b.add_listener(Exits())
for RAISED in EXITS:
    assert asyncio.run(awaited([1, 2])) == [7, 7]
    if not ASYNC:
        assert b.submit([3], max_new_tokens=2).result(timeout=10) == [7, 7]
print("served")
"""


def run_child(body: str, **names: object) -> None:
    settings = "".join(f"{name} = {value!r}\n" for name, value in names.items())
    script = settings + textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the child hung: the driver died, and result() waited forever")
    assert done.returncode == 0 and done.stdout.strip() == "served", (
        f"exit code {done.returncode}\n{done.stderr[-3000:]}"
    )


@pytest.mark.parametrize("is_async", [False, True], ids=["sync step", "async step"])
def test_an_exit_from_the_step_function_fails_its_requests_as_interrupted(is_async: bool) -> None:
    run_child(STEP, ASYNC=is_async, RAISED=None)


@pytest.mark.parametrize("where", ["on_step", "on_finish"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync step", "async step"])
def test_an_exit_from_a_listener_is_logged_and_the_driver_goes_on(
    is_async: bool, where: str
) -> None:
    run_child(LISTENER, ASYNC=is_async, WHERE=where, RAISED=None)
