"""Waiting in tests for a batcher to reach a state (another thread moves it there)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``condition`` every millisecond; fail the test if it is not true in ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout}s: {condition}")
        time.sleep(0.001)
