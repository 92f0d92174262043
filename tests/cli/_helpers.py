"""Running the ``batchkit`` command in-process, what its failures must look like, and a
guard for calls that used to hang."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from batchkit.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``batchkit *argv``: its exit status, stdout and stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """Exit status 2 and one ``error:`` line holding every needle, no traceback."""
    assert code == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "error:" in last
    for needle in needles:
        assert needle in last, last


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result (or its exception, raised here); fails if it runs past ``seconds``.

    For calls that used to hang: run in a daemon thread, a regression fails the test
    instead of stalling the run (the deadline is a guard, not a timing bound)."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box.append((False, exc))

    thread = threading.Thread(target=target, daemon=True)  # a hung one dies with the process
    thread.start()
    thread.join(seconds)
    if not box:
        pytest.fail(f"still running after {seconds} s (the hang is back)")
    ok, value = box[0]
    if not ok:
        raise value
    return value

