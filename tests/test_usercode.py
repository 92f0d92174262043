"""The rule for what the user's own code raises: an exit, a Ctrl-C or a cancellation
as a `BatchInterrupted` caused by it, anything else as it is, a hook's failure logged;
only the awaiting task's own cancellation is raised."""

from __future__ import annotations

import asyncio
import logging

import pytest

from batchkit import BatchInterrupted
from batchkit.usercode import arun, contained, run, run_hook


class Custom(BaseException):
    pass


@pytest.mark.parametrize("raised", [ValueError("boom"), Custom("x"), GeneratorExit()], ids=repr)
def test_an_exception_or_another_base_exception_is_what_its_requests_get(raised) -> None:
    assert contained(raised, "f") is raised


@pytest.mark.parametrize(
    "raised", [SystemExit(3), KeyboardInterrupt(), asyncio.CancelledError()], ids=repr
)
def test_an_exit_ctrl_c_or_cancellation_becomes_interrupted_naming_the_code(raised) -> None:
    error = contained(raised, "embed", "collate")
    assert isinstance(error, BatchInterrupted) and error.__cause__ is raised
    assert str(error).startswith(f"embed: collate raised {type(raised).__name__}")


def raise_(exc: BaseException):
    raise exc


def test_run_returns_what_the_code_returned_or_what_its_requests_get() -> None:
    assert run(lambda x: x * 2, 21, "f", "split") == (True, 42)
    ok, error = run(lambda _: raise_(SystemExit(2)), None, "f", "split")
    assert not ok and isinstance(error, BatchInterrupted)
    assert isinstance(error.__cause__, SystemExit)


def test_arun_contains_an_exit_but_raises_its_own_tasks_cancellation() -> None:
    async def exits(_):
        raise KeyboardInterrupt

    async def waits(_):
        await asyncio.sleep(3600)

    async def main():
        ok, error = await arun(exits, None, "f", "the batch function")
        assert not ok and isinstance(error.__cause__, KeyboardInterrupt)
        task = asyncio.ensure_future(arun(waits, None, "f", "the batch function"))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_hooks_exit_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="batchkit"):
        run_hook(raise_, SystemExit(5), what="listener L on on_step")
    (record,) = caplog.records
    assert "listener L on on_step failed" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is SystemExit
