"""demo: the one-at-a-time baseline serves callers in arrival order; the report gives
an equality verdict with its tolerance, says what dispatch reasons mean, and says why
one caller gets about 1.0x; the numpy model runs without torch."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from batchkit.tools.demo import BASELINE, TOLERANCE, ArrivalOrder, DemoResult, DemoRow, run_demo
from batchkit.tools.encoder import NumpyEncoder
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


def test_the_report_gives_a_verdict_with_its_tolerance_and_words_for_reasons() -> None:
    rows = [DemoRow("one at a time", 8, 1.0, 1.0, 2.0, 1.0, 1.0)]
    table = DemoResult(8, 2, 4, 47, rows, 2.4e-7, {"idle": 50, "full": 2}).table()
    assert (
        f"results: equal (largest |batched - alone| = 2.4e-07, tolerance {TOLERANCE:.0e})" in table
    )
    assert "50 idle (the model was free, so waiting requests went at once)" in table
    assert "2 full (a bucket held a full batch)" in table
    assert "one caller" not in table
    wrong = DemoResult(8, 2, 4, 47, rows, 1.0, {"idle": 1})
    assert not wrong.ok and "results: DIFFERENT" in wrong.table()


def test_one_caller_is_told_why_about_1x_is_expected() -> None:
    rows = [DemoRow("one at a time", 8, 1.0, 1.0, 2.0, 1.0, 1.0)]
    table = DemoResult(8, 1, 4, 47, rows, 0.0, {"idle": 8}).table()
    assert "8 requests from 1 thread," in table
    assert "nothing can be batched; about 1.0x is the expected speed-up" in table


def test_a_row_of_the_numpy_encoder_does_not_depend_on_its_batch_mates_or_padding() -> None:
    encode = NumpyEncoder()
    ids = np.array([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=bool)
    together = encode(ids, mask)
    alone = encode(ids[:1, :3], mask[:1, :3])
    assert together.shape == (2, 64) and together.dtype == np.float32
    np.testing.assert_allclose(together[0], alone[0], atol=TOLERANCE)
    assert not np.allclose(together[0], together[1])


def test_the_numpy_demo_times_both_servers_the_same_number_of_rounds() -> None:
    result = run_demo(48, 8, rounds=2, warmup=8, backend="numpy")
    assert result.ok and result.model == "built-in numpy encoder"
    assert [r.name for r in result.rows] == ["one at a time", "@batched (bucketed)"]
    assert sum(result.dispatch_reasons.values()) * result.rows[1].mean_batch_size == 48 * 2
    assert "2 timed rounds in alternating order" in result.table()
