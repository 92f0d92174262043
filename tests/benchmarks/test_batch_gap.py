"""benchmarks/batch_gap.py: the gap between device calls, and its parts, from the
recorded times."""

from __future__ import annotations

import pytest

from tests.benchmarks._scripts import load_script


def test_the_gap_and_its_parts_come_from_each_calls_neighbours() -> None:
    rec = load_script("batch_gap").Recorder()
    # Three device calls of 10 s; each handed over 1 s before it starts, and its
    # coroutine resumed 2 s after it ends; the next handed over 3 s after that.
    rec.calls = [(0.0, 10.0), (16.0, 26.0), (32.0, 42.0)]
    rec.handed = [-1.0, 15.0, 31.0]
    rec.resumed = [12.0, 28.0, 44.0]
    row = rec.row()
    assert row["gap"] == pytest.approx(6.0)
    assert (row["return hop"], row["between calls"], row["start hop"]) == (2.0, 3.0, 1.0)
    assert row["busy"] == pytest.approx(20.0 / 32.0)  # the two calls after a gap, and both gaps


def test_a_sync_row_has_the_gap_alone() -> None:
    rec = load_script("batch_gap").Recorder()
    rec.calls = [(0.0, 1.0), (1.5, 2.5)]
    assert set(rec.row()) == {"gap", "busy"}
