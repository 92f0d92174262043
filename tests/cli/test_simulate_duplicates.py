"""simulate with identical requests: a request whose key is waiting or running joins it
(as `@batched(coalesce=...)`), drawn and traced keys, the command."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchkit.tools.simulate import read_trace_keys, sample_duplicates, simulate
from tests.cli._helpers import assert_one_line_error, run

MS = 1e-3


def test_a_request_joins_its_key_while_it_waits_or_runs_and_not_after() -> None:
    # Batches of 1 ms + 1 ms per row, one at a time. At 0, a, b, a arrive: one batch of
    # rows a, b (0-3 ms), which the second a joins; the a of 1 ms joins it running; the
    # a of 5 ms comes after its end and runs again (5-7 ms).
    arrivals = [0.0, 0.0, 0.0, 0.001, 0.005]
    keys = ["a", "b", "a", "a", "a"]
    r = simulate((1.0, 1.0), arrivals=arrivals, duplicates=keys, max_wait_ms=0)
    assert r.coalesced == 2 and r.served == 5
    assert [n for _, _, n in r.batch_log] == [2, 1]  # rows: a, b; then a
    assert r.latencies_s / MS == pytest.approx([3.0, 3.0, 3.0, 2.0, 2.0])
    plain = simulate((1.0, 1.0), arrivals=arrivals, max_wait_ms=0)
    assert plain.coalesced == 0 and sum(n for _, _, n in plain.batch_log) == 5


def test_the_key_includes_the_group() -> None:
    groups = ["x", "y", "x", "y"]
    r = simulate((1.0, 0.0), arrivals=np.zeros(4), duplicates=[1, 1, 1, 1], groups=groups)
    assert r.coalesced == 2 and sum(n for _, _, n in r.batch_log) == 2


def test_a_request_that_joined_a_shed_one_is_counted_as_shed() -> None:
    # Under a 20 ms target with a device of 15 ms a batch: taught first, then a burst
    # whose tail waits too long; every request is counted once.
    times = np.concatenate([np.arange(10) * 0.05, 1.0 + np.zeros(40)])
    keys = list(range(10)) + [10 + i // 2 for i in range(40)]
    r = simulate((15.0, 0.0), arrivals=times, duplicates=keys, max_latency_ms=20, max_batch_size=2)
    assert r.served + r.overloaded + r.shed + r.rejected == r.requests
    assert r.coalesced > 0


def test_duplicates_of_another_length_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicates has 2 entries for 3 arrivals"):
        simulate((1.0, 1.0), arrivals=[0.0, 1.0, 2.0], duplicates=[1, 2])


def test_drawn_keys_follow_zipf_and_the_seed() -> None:
    drawn = sample_duplicates(50, 4000, seed=3, skew=1.0)
    assert drawn == sample_duplicates(50, 4000, seed=3, skew=1.0)
    assert drawn.count(0) > drawn.count(1) > drawn.count(10) and max(drawn) < 50
    with pytest.raises(ValueError, match="skew must be a finite number >= 0"):
        sample_duplicates(5, 10, skew=-1.0)


def test_traced_keys_are_read_by_their_column(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("time,length,key\n0.2,5,q1\n0.0,7,q2\n0.1,5,q1\n")
    times, keys = read_trace_keys(trace)
    assert times.tolist() == pytest.approx([0.0, 0.1, 0.2]) and keys == ["q2", "q1", "q1"]
    plain = tmp_path / "plain.csv"
    plain.write_text("time,length\n0.0,5\n")
    with pytest.raises(ValueError, match="no 'key' column"):
        read_trace_keys(plain)


def test_the_command_prints_the_device_work_saved(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["simulate", "--rate", "2000", "--requests", "2000", "--duplicates", "20"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "keys drawn from 20 keys (Zipf skew 1): 20 distinct in 2,000 requests" in out
    assert "requests joined one of their key waiting or running: device rows saved" in out
    trace = tmp_path / "trace.csv"
    trace.write_text("time,key\n0.0,a\n0.0,a\n0.0,b\n")
    code, out, _ = run(capsys, "simulate", "--trace", str(trace), "--trace-keys")
    assert code == 0 and "coalesced     1 requests joined" in out
    code, _, err = run(capsys, "simulate", "--rate", "10", "--duplicate-skew", "2")
    assert_one_line_error(code, err, "--duplicate-skew", "--duplicates N")
