"""demo: the one-at-a-time baseline serves callers in arrival order."""

from __future__ import annotations

import threading

import pytest

from batchkit.tools.demo import BASELINE, ArrivalOrder, DemoResult, DemoRow
from tests.cli._helpers import within


def _wait_until(condition: object, seconds: float = 10.0) -> None:
    """Poll until ``condition()`` holds (a guard against a hang, not a timing bound)."""
    event = threading.Event()
    for _ in range(int(seconds / 0.001)):
        if condition():  # type: ignore[operator]
            return
        event.wait(0.001)
    pytest.fail("condition never held")


def test_callers_are_served_in_the_order_they_arrived() -> None:
    release, holding = threading.Event(), threading.Event()
    served: list[int] = []

    def model(item: int) -> int:
        if item == -1:  # the first request holds the worker while the others queue up
            holding.set()
            release.wait(10)
        served.append(item)
        return item * 10

    answers: dict[int, int] = {}
    with ArrivalOrder(model) as server:
        first = threading.Thread(target=lambda: answers.setdefault(-1, server(-1)))
        first.start()
        assert holding.wait(10)
        callers = []
        for i in range(6):  # each one queued before the next arrives
            t = threading.Thread(target=lambda i=i: answers.setdefault(i, server(i)))
            t.start()
            callers.append(t)
            _wait_until(lambda i=i: server.waiting == i + 1)
        release.set()
        for t in [first, *callers]:
            t.join(10)
    assert served == [-1, 0, 1, 2, 3, 4, 5]  # a lock would let any waiting thread win
    assert answers == {i: i * 10 for i in range(-1, 6)}


def test_a_failing_request_fails_only_its_own_caller() -> None:
    def model(item: int) -> int:
        if item == 2:
            raise ValueError("bad item 2")
        return item

    with ArrivalOrder(model) as server:
        with pytest.raises(ValueError, match="bad item 2"):
            server(2)
        assert server(3) == 3


def test_a_closed_server_refuses_and_close_twice_is_harmless() -> None:
    server = ArrivalOrder(lambda x: x)
    assert within(10, lambda: server(1)) == 1
    server.close()
    server.close()
    with pytest.raises(RuntimeError, match="closed"):
        server(1)


def test_the_report_says_what_the_baseline_is() -> None:
    rows = [DemoRow("one at a time", 8, 1.0, 1.0, 2.0, 1.0, 1.0)]
    table = DemoResult(8, 2, 4, 47, rows, 0.0, {"idle": 1}).table()
    assert BASELINE in table
    assert "in arrival order (FIFO)" in table
