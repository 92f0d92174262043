"""The timer thread of a sync function: alarms called at the times set, under the
lock, each once; moved or cancelled; nothing after stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from batchkit.serve.timer import Alarm, Timer
from tests.serve._wait import wait_until


@pytest.fixture
def lock() -> threading.RLock:
    return threading.RLock()


@pytest.fixture
def timer(lock: threading.RLock) -> Iterator[Timer]:
    """A timer on the real clock, stopped and its thread joined after the test."""
    timer = Timer(lock, time.monotonic, "f")
    yield timer
    with lock:
        timer.stop_locked()
    timer.join()


def test_callbacks_run_once_each_in_time_order_under_the_lock(
    lock: threading.RLock, timer: Timer
) -> None:
    calls: list[tuple[str, bool]] = []
    with lock:
        now = time.monotonic()
        late = Alarm(lambda: calls.append(("late", lock._is_owned())))  # type: ignore[attr-defined]
        soon = Alarm(lambda: calls.append(("soon", lock._is_owned())))  # type: ignore[attr-defined]
        timer.set_locked(late, now + 0.04)
        timer.set_locked(soon, now + 0.01)
    wait_until(lambda: len(calls) == 2)
    time.sleep(0.05)  # and neither is called again
    assert calls == [("soon", True), ("late", True)]
    assert not timer.is_set(soon) and not timer.is_set(late)


def test_an_alarm_set_again_moves_and_a_cancelled_one_is_not_called(
    lock: threading.RLock, timer: Timer
) -> None:
    calls: list[str] = []
    passes, watch = Alarm(lambda: calls.append("pass")), Alarm(lambda: calls.append("watch"))
    with lock:
        now = time.monotonic()
        timer.set_locked(passes, now + 30.0)
        timer.set_locked(passes, now)  # sooner: wakes it
        timer.set_locked(watch, now + 0.01)
        timer.cancel_locked(watch)
        assert timer.is_set(passes) and not timer.is_set(watch)
    wait_until(lambda: calls == ["pass"])
    time.sleep(0.03)
    assert calls == ["pass"]


def test_an_alarm_may_set_itself_again(lock: threading.RLock, timer: Timer) -> None:
    calls: list[int] = []

    def again() -> None:
        calls.append(len(calls))
        if len(calls) < 3:
            timer.set_locked(alarm, time.monotonic())

    alarm = Alarm(again)
    with lock:
        timer.set_locked(alarm, time.monotonic())
    wait_until(lambda: len(calls) == 3)
    with lock:
        timer.stop_locked()
    timer.join()
    assert calls == [0, 1, 2] and not timer.is_set(alarm)


def test_once_stopped_nothing_is_set_or_called(lock: threading.RLock, timer: Timer) -> None:
    calls: list[str] = []
    with lock:
        timer.set_locked(Alarm(lambda: calls.append("a")), time.monotonic() + 0.02)
        timer.stop_locked()
        b = Alarm(lambda: calls.append("b"))
        timer.set_locked(b, time.monotonic())
        assert not timer.is_set(b)
    timer.join()
    time.sleep(0.03)
    assert calls == []
