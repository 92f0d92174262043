"""benchmarks/compare_inprocess.py: a revision loaded under another package name is a
separate, working batchkit (its own modules, its own imports), beside this one; the
realistic load's rounds are counted as documented."""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path

import pytest

import batchkit
from tests.benchmarks._scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_a_tree_loaded_under_another_name_serves_with_its_own_modules(tmp_path: Path) -> None:
    script = load_script("compare_inprocess")
    copy = script.load_as(ROOT, "batchkit_copy_for_test", tmp_path)
    try:
        core = sys.modules["batchkit_copy_for_test.serve.core"]
        assert core is not sys.modules["batchkit.serve.core"]
        double = copy.batched(max_batch_size=4)(lambda xs: [2 * x for x in xs])
        try:
            assert [double(i) for i in range(3)] == [0, 2, 4]
        finally:
            double.close()
        for path in (tmp_path / "batchkit_copy_for_test").rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"^\s*(from|import) batchkit\b", text, re.MULTILINE), path
        assert batchkit.batched is not copy.batched
    finally:
        for name in [n for n in sys.modules if n.startswith("batchkit_copy_for_test")]:
            del sys.modules[name]
        sys.path.remove(str(tmp_path))


def test_a_load_round_counts_answers_until_the_last_and_those_within_the_budget() -> None:
    script = load_script("compare_inprocess")
    arrivals = [0.0, 0.1, 0.2, 0.3]
    latencies = [0.01, 0.02, 0.5, 0.1]  # the last answer comes at 0.7 s
    r = script.summary(latencies, arrivals, c=10.0, budget=0.1)
    assert r.throughput == pytest.approx(4 / 0.7 / 10.0)
    assert r.goodput == pytest.approx(3 / 0.7 / 10.0)  # 0.5 s is past the budget
    assert (r.p50, r.p99) == (0.1, 0.5)  # nearest rank


def test_thread_callers_make_each_request_once_and_never_before_its_time() -> None:
    load = load_script("_load")
    arrivals = [0.001 * i for i in range(40)]
    made: list[tuple[int, float, float]] = []
    lock = threading.Lock()

    def request(i: int, scheduled: float) -> None:
        with lock:
            made.append((i, scheduled, time.perf_counter()))

    load.issue_from_threads(arrivals, request, threads=4)
    assert sorted(i for i, _, _ in made) == list(range(40))
    assert all(at >= scheduled for _, scheduled, at in made)
    starts = {scheduled - arrivals[i] for i, scheduled, _ in made}
    assert max(starts) - min(starts) < 1e-9  # one start for every thread's arrivals
