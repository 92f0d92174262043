"""simulate: hand-computable cases exactly, monotonic sanity, determinism, speed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchkit.tools.simulate as sim
from batchkit.batchers import BucketedBatcher, DynamicBatcher, StaticBatcher
from batchkit.serve.request import Request
from batchkit.serve.scheduler import FormedBatch, Scheduler
from batchkit.tools.simulate import LatencyModel, poisson_arrivals, read_trace, simulate
from tests.cli._helpers import assert_one_line_error, run, within

MS = 1e-3


def sizes(result: object) -> list[int]:
    return [n for _, _, n in result.batch_log]  # type: ignore[attr-defined]


def test_deterministic_arrivals_one_slot() -> None:
    # Arrivals every 1 ms; a batch takes 2.2 + 0.5 n ms; one batch at a time.
    # t=0: [0] alone (idle) -> ends 2.7; [1, 2] -> 5.9; [3, 4, 5] -> 9.6; [6, 7] -> 12.8.
    r = simulate((2.2, 0.5), arrivals=np.arange(8) * MS, max_batch_size=32)
    assert sizes(r) == [1, 2, 3, 2]
    starts_ends = np.array([(s, e) for s, e, _ in r.batch_log]) / MS
    assert starts_ends == pytest.approx(np.array([(0, 2.7), (2.7, 5.9), (5.9, 9.6), (9.6, 12.8)]))
    expected_ms = [2.7, 4.9, 3.9, 6.6, 5.6, 4.6, 6.8, 5.8]
    assert r.latencies_s / MS == pytest.approx(expected_ms)
    assert r.batch_sizes == {1: 1, 2: 2, 3: 1}
    assert r.dispatch_reasons == {"idle": 4}
    assert r.latency.max == pytest.approx(6.8)
    assert r.throughput == pytest.approx(8 / (12.8 * MS))
    assert r.served == r.requests == 8


def test_max_wait_with_two_slots() -> None:
    # 10 ms batches, two slots, max_wait 1.5 ms, at most 3 per batch.
    # t=0 [0] idle -> 10; t=2.5 [1, 2] max_wait (1 waited 1.5 ms) -> 12.5;
    # t=3, 4 wait for a slot; t=10 [3, 4] max_wait -> 20.
    r = simulate(
        (10.0, 0.0),
        arrivals=np.arange(5) * MS,
        max_batch_size=3,
        max_wait_ms=1.5,
        max_concurrent_batches=2,
    )
    assert sizes(r) == [1, 2, 2]
    assert [s / MS for s, _, _ in r.batch_log] == pytest.approx([0, 2.5, 10])
    assert r.latencies_s / MS == pytest.approx([10, 11.5, 10.5, 17, 16])
    assert r.dispatch_reasons == {"idle": 1, "max_wait": 2}


def test_steady_state_batch_size_is_hand_computable() -> None:
    # One request per ms, batches of n take 2 + 0.5 n ms: the fixed point n = 2 / (1 - 0.5) = 4.
    r = simulate((2.0, 0.5), arrivals=np.arange(2000) * MS + 0.1 * MS, max_batch_size=64)
    assert sizes(r)[-100:-1] == [4] * 99


def test_full_batches_and_static_tail_served_at_close() -> None:
    r = simulate((1.0, 0.0), arrivals=np.zeros(10), batcher=StaticBatcher(4))
    assert sizes(r) == [4, 4, 2]
    assert r.dispatch_reasons == {"full": 2, "closing": 1}
    assert r.latencies_s / MS == pytest.approx([1] * 4 + [2] * 4 + [3] * 2)


def test_queue_limit_rejects() -> None:
    r = simulate((10.0, 0.0), arrivals=np.zeros(10), max_batch_size=2, max_queue_size=3)
    assert r.rejected == 7 and r.served == 3
    assert np.isnan(r.latencies_s).sum() == 7


def test_bucketed_policy_with_keys() -> None:
    batcher = BucketedBatcher([8, 16], max_batch_size=8)
    r = simulate((1.0, 0.0), arrivals=np.zeros(6), batcher=batcher, keys=[4, 12, 5, 13, 6, 14])
    assert sorted(sizes(r)) == [3, 3]


@pytest.mark.parametrize("slots", [1, 2])
def test_more_load_means_bigger_batches(slots: int) -> None:
    means, p50s = [], []
    for rate in (100, 500, 1500, 3000):
        r = simulate(
            (2.0, 0.25), rate=rate, num_requests=4000, seed=1, max_concurrent_batches=slots
        )
        means.append(r.mean_batch_size)
        p50s.append(r.latency.p50)
        assert r.throughput == pytest.approx(rate, rel=0.1)  # under capacity: all of it served
    assert means == sorted(means) and means[-1] > 3 * means[0]


def test_bigger_max_batch_size_raises_capacity() -> None:
    arrivals = poisson_arrivals(5000, 5000, seed=0)
    small = simulate((2.0, 0.25), arrivals=arrivals, max_batch_size=4)
    big = simulate((2.0, 0.25), arrivals=arrivals, max_batch_size=32)
    assert small.capacity == pytest.approx(4 / 3e-3)  # 4 items per 3 ms
    assert small.offered_rate > small.capacity  # overloaded: the queue grows
    assert big.latency.p99 < small.latency.p99
    assert big.throughput > small.throughput


def test_seeded_runs_repeat_and_are_fast() -> None:
    start = time.perf_counter()
    a = simulate((2.0, 0.25), rate=2000, num_requests=100_000, seed=7)
    assert time.perf_counter() - start < 10
    b = simulate((2.0, 0.25), rate=2000, num_requests=100_000, seed=7)
    assert a.batch_sizes == b.batch_sizes and a.latency == b.latency
    assert sum(n * c for n, c in a.batch_sizes.items()) == 100_000


def test_profile_latency_model_interpolates() -> None:
    model = LatencyModel.from_points([1, 4, 8], [2.0, 2.0, 4.0])
    assert model.seconds(2) == pytest.approx(2e-3)
    assert model.seconds(6) == pytest.approx(3e-3)
    assert model.seconds(12) == pytest.approx(6e-3)  # the last slope beyond the profile


def test_trace_file(tmp_path: object) -> None:
    path = tmp_path / "trace.txt"  # type: ignore[operator]
    path.write_text("# seconds\n10.002\n10.000\n\n10.001, extra\n")
    assert read_trace(path) == pytest.approx([0, 0.001, 0.002])
    path.write_text("1.0\nsoon\n")
    with pytest.raises(ValueError, match="trace.txt:2"):
        read_trace(path)


@pytest.mark.parametrize(
    "kwargs",
    [{"rate": 0}, {"rate": -1.0}, {}, {"rate": 10, "policy": "fifo"}, {"arrivals": []}],
)
def test_bad_arguments_raise_value_error(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        simulate((1.0, 0.1), **kwargs)  # type: ignore[arg-type]


def test_keys_are_sorted_with_unsorted_arrivals() -> None:
    # t=0 key 5 runs alone (10 ms); t=1 ms key 6 and t=2 ms key 100 wait in different
    # buckets, so three batches of one. Pairing keys by position after sorting the times
    # put 5 and 6 together (one batch of two).
    policy = BucketedBatcher([8, 128], max_batch_size=4)
    r = simulate((10.0, 0.0), arrivals=[0.002, 0.0, 0.001], keys=[100, 5, 6], batcher=policy)
    assert r.batch_sizes == {1: 3}


def test_profile_with_a_repeated_batch_size_is_averaged() -> None:
    model = LatencyModel.from_points([1, 8, 8], [1.0, 2.0, 3.0])
    assert model.seconds(8) == pytest.approx(2.5e-3)
    slope = (2.5 - 1.0) / 7
    assert model.seconds(16) == pytest.approx((2.5 + 8 * slope) / 1e3)


def test_simulate_with_a_duplicate_size_profile_finishes(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text(
        '{"points": [{"batch_size": 1, "latency_ms": 1.0}, {"batch_size": 8, "latency_ms": 2.0},'
        ' {"batch_size": 8, "latency_ms": 3.0}]}'
    )
    r = within(5, lambda: simulate(str(path), arrivals=np.arange(40) * 1e-4, max_batch_size=32))
    assert r.served == 40
    assert np.isfinite(r.latencies_s).all()


def test_overflowing_batch_latency_is_an_error() -> None:
    # [0] ends at 1e305 s; [1, 2] would end at infinity with [3] still waiting.
    with pytest.raises(ValueError, match=r"a batch of 2 takes inf ms"):
        within(5, lambda: simulate((5.0, 1e308), arrivals=[0, 1e-3, 2e-3, 3e-3], max_batch_size=2))


def test_requests_the_scheduler_never_dispatches_are_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Stuck(Scheduler):
        def decide(self, now: float) -> tuple[FormedBatch | None, float | None, list[Request]]:
            return None, None, []

    monkeypatch.setattr(sim, "Scheduler", Stuck)
    with pytest.raises(RuntimeError, match="1 requests left waiting"):
        within(5, lambda: simulate((1.0, 0.0), arrivals=[0.0]))


@pytest.mark.parametrize(
    ("slots", "error"), [(0, ValueError), (-1, ValueError), (1.5, ValueError), (True, TypeError)]
)
def test_simulate_rejects_bad_max_concurrent_batches(slots: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="max_concurrent_batches"):
        within(5, lambda: simulate(rate=10, num_requests=5, max_concurrent_batches=slots))


def test_offered_rate_of_simultaneous_arrivals_is_undefined(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert np.isnan(simulate((1.0, 0.0), arrivals=[0.0, 0.0]).offered_rate)
    code, out, _ = run(capsys, "simulate", "--rate", "1000", "--requests", "1")
    assert code == 0
    assert "offered n/a" in out
    assert "warning" not in out


def test_trace_csv_with_a_header(tmp_path: Path) -> None:
    """docs/cli.md says a CSV's first column works: with a header row too."""
    path = tmp_path / "t.csv"
    path.write_text("# exported\ntimestamp,len\n0.5,5\n0.1,7\n")
    assert read_trace(path).tolist() == pytest.approx([0.0, 0.4])


@pytest.mark.parametrize(
    ("text", "line"), [("0.1\ntimestamp\n", 2), ("time\nlen\n0\n", 2), ("1.2.3\n0\n", 1)]
)
def test_trace_only_a_first_header_row_is_skipped(tmp_path: Path, text: str, line: int) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=f":{line}: not an arrival time"):
        read_trace(path)


def test_simulated_latencies_come_in_the_order_of_the_arrivals_given() -> None:
    result = simulate(
        (1000.0, 0.0), arrivals=[0.1, 0.0], max_batch_size=1, max_concurrent_batches=1
    )  # 1 s per batch: the request at 0.0 runs first, the one at 0.1 waits for it
    assert result.latencies_s.tolist() == pytest.approx([1.9, 1.0])  # was [1.0, 1.9]


def test_not_eager_waits_when_idle() -> None:
    # Arrivals 4 ms apart, 1 ms batches, max_wait 2 ms: eager, each runs alone at once
    # (1 ms latency); not eager, each waits its 2 ms first (3 ms), alone all the same.
    arrivals = np.arange(5) * 4 * MS
    eager = simulate((1.0, 0.0), arrivals=arrivals, max_wait_ms=2)
    waits = simulate((1.0, 0.0), arrivals=arrivals,
                     batcher=DynamicBatcher(32, 2, eager=False))  # fmt: skip
    assert eager.latencies_s / MS == pytest.approx([1.0] * 5)
    assert waits.latencies_s / MS == pytest.approx([3.0] * 5)
    assert waits.dispatch_reasons == {"max_wait": 5}
    # Arrivals 1 ms apart: the wait fills batches (eager, the first leaves alone).
    close = np.arange(4) * MS
    assert sizes(simulate((1.0, 0.0), arrivals=close, max_wait_ms=3)) == [1, 1, 1, 1]
    fuller = simulate((1.0, 0.0), arrivals=close, batcher=DynamicBatcher(32, 3, eager=False))
    assert sizes(fuller) == [4]


def test_simulate_command_no_eager(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "--rate", "100", "--requests", "200",
                       "--latency-ms", "1", "--per-item-ms", "0", "--no-eager")  # fmt: skip
    assert code == 0 and "not eager: a batch waits" in out
    assert "dispatched: max_wait" in out and "idle" not in out
    code, out, _ = run(capsys, "simulate", "--rate", "100", "--requests", "200",
                       "--latency-ms", "1", "--per-item-ms", "0")  # fmt: skip
    assert code == 0 and "idle" in out and "not eager" not in out


def test_a_sum_budget_packs_more_requests_per_batch_than_padded() -> None:
    # Ten requests at once, lengths 40, 4, 4, ...; budget 79. Padded: 2 x 40 = 80 is
    # over, so the 40 goes alone, then the nine 4s (9 x 4 = 36). Sum: 40 + 9 x 4 = 76.
    keys = [40] + [4] * 9
    padded = simulate((1.0, 0.0), arrivals=np.zeros(10), keys=keys, max_tokens=79)
    summed = simulate((1.0, 0.0), arrivals=np.zeros(10), keys=keys, max_tokens=79, cost="sum")
    assert sizes(padded) == [1, 9]
    assert padded.mean_batch_cost == pytest.approx((40 + 36) / 2)
    assert sizes(summed) == [10]
    assert summed.mean_batch_cost == pytest.approx(76.0)
    assert "cost='sum'" in summed.batcher and "cost" not in padded.batcher


def test_a_token_budget_needs_keys_and_belongs_on_the_batcher_given() -> None:
    with pytest.raises(ValueError, match="max_tokens needs keys"):
        simulate((1.0, 0.0), arrivals=np.zeros(3), max_tokens=10)
    with pytest.raises(ValueError, match="set on the batcher"):
        simulate((1.0, 0.0), arrivals=np.zeros(3), batcher=DynamicBatcher(4), cost="sum")
    with pytest.raises(ValueError, match="cost must be"):
        simulate((1.0, 0.0), arrivals=np.zeros(3), keys=[1, 2, 3], max_tokens=10, cost="area")


def test_simulate_command_cost_sum(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# tokens\n200\n8\n8\n16\n")
    common = ("simulate", "--rate", "2000", "--requests", "2000", "--lengths", str(lengths),
              "--max-tokens", "512", "--max-batch-size", "64")  # fmt: skip
    code, padded, _ = run(capsys, *common)
    assert code == 0 and "max_tokens=512)" in padded
    code, summed, _ = run(capsys, *common, "--cost", "sum")
    assert code == 0 and "max_tokens=512, cost='sum')" in summed

    def mean_size(out: str) -> float:
        return float(out.split("mean size ")[1].split(";")[0])

    assert mean_size(summed) > 2 * mean_size(padded)  # the 200s no longer pad the 8s
    assert "batch cost    mean" in summed


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--max-tokens", "64"), "--max-tokens needs --lengths"),
        (("--cost", "sum"), "give --max-tokens too"),
        (("--cost", "area"), "invalid choice"),
        (("--lengths", "missing.txt", "--max-tokens", "64"), "argument --lengths"),
    ],
)
def test_simulate_command_token_budget_errors(
    capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], needle: str
) -> None:
    code, _, err = run(capsys, "simulate", "--rate", "100", "--requests", "10", *extra)
    assert_one_line_error(code, err, needle)


def test_a_wait_for_the_static_policy_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="StaticBatcher has no max_wait_ms"):
        simulate((1.0, 0.0), arrivals=np.zeros(4), policy="static", max_wait_ms=2)
    with pytest.raises(ValueError, match="max_wait_ms, max_tokens, cost and buckets are set on"):
        simulate((1.0, 0.0), arrivals=np.zeros(4), batcher=DynamicBatcher(4), max_wait_ms=2)
    assert simulate((1.0, 0.0), arrivals=np.zeros(4), policy="static").served == 4


def test_simulate_command_refuses_a_wait_for_the_static_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--rate", "100", "--requests", "10", "--policy", "static"]
    code, _, err = run(capsys, *argv, "--max-wait-ms", "2")
    assert_one_line_error(code, err, "--max-wait-ms is not for --policy static")
    code, out, _ = run(capsys, *argv, "--max-batch-size", "2,4")
    assert code == 0
    assert [row.split()[1] for row in out.splitlines()[2:4]] == ["-", "-"]  # no wait column


def test_an_unknown_option_shows_the_commands_own_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "simulate", "--rate", "100", "--bogus")
    assert code == 2
    assert err.startswith("usage: batchkit simulate ")
    assert err.strip().splitlines()[-1] == (
        "batchkit simulate: error: unrecognized arguments: --bogus"
    )


def test_a_target_shorter_than_one_batch_warns_naming_it() -> None:
    # A batch of one takes 5.5 ms: a 1 ms target can never be met.
    with pytest.warns(sim.SimulationWarning, match="max_latency_ms=1 is shorter than one batch"):
        r = simulate((5.0, 0.5), rate=1000, num_requests=500, max_latency_ms=1)
    assert r.on_time == 0 and len(r.warnings) == 1 and "5.5 ms" in r.warnings[0]
    with pytest.warns(sim.SimulationWarning, match="goodput_ms=2 is shorter"):
        simulate((5.0, 0.5), rate=100, num_requests=50, goodput_ms=2)
    # With keys, the quickest batch is the shortest request alone: 1 + 0.1 x 10 = 2 ms.
    keys = [10.0, 50.0] * 10
    with pytest.warns(sim.SimulationWarning, match=r"\(2 ms for a batch of one\)"):
        simulate((1.0, 0.0, 0.1), rate=100, num_requests=20, keys=keys, max_latency_ms=1.5)


def test_a_reachable_target_does_not_warn(recwarn: pytest.WarningsRecorder) -> None:
    r = simulate((5.0, 0.5), rate=100, num_requests=200, max_latency_ms=5.5)
    assert r.warnings == () and not [w for w in recwarn if w.category is sim.SimulationWarning]


def test_throughput_of_a_refused_tail_counts_the_whole_span_of_arrivals() -> None:
    # Every request after the first few is refused: the last answer comes early, yet the
    # throughput is over the arrivals' span (2 s here), not over the time to that answer.
    with pytest.warns(sim.SimulationWarning):
        r = simulate((5.0, 0.5), arrivals=np.arange(2000) / 1000, max_latency_ms=1)
    assert r.duration_s >= 1.999
    assert r.throughput == pytest.approx(r.served / r.duration_s)


def test_simulate_command_prints_the_warning_and_what_was_served_in_time_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "simulate", "--rate", "1000", "--requests", "500",
                         "--max-latency-ms", "1")  # fmt: skip
    assert code == 0 and "SimulationWarning" not in err  # in the report, not as a Python warning
    lines = out.splitlines()
    warning = next(i for i, line in enumerate(lines) if line.startswith("warning: the latency"))
    goodput = next(i for i, line in enumerate(lines) if line.startswith("goodput"))
    served = next(i for i, line in enumerate(lines) if line.startswith("served"))
    throughput = next(i for i, line in enumerate(lines) if line.startswith("throughput"))
    assert warning < goodput < served < throughput
    assert "max_latency_ms=1 is shorter than one batch's time (5.5 ms" in lines[warning]


def test_whole_number_float_counts_are_taken_as_ints() -> None:
    # As a YAML or JSON config gives them: 16.0 is 16, and the result reports ints.
    as_floats = simulate((2.0, 0.5), rate=500, num_requests=300, max_batch_size=16.0,
                         max_concurrent_batches=2.0, max_queue_size=100.0)  # fmt: skip
    as_ints = simulate((2.0, 0.5), rate=500, num_requests=300, max_batch_size=16,
                       max_concurrent_batches=2, max_queue_size=100)  # fmt: skip
    assert type(as_floats.max_concurrent_batches) is int
    assert as_floats.batch_log == as_ints.batch_log
    assert "max_batch_size=16," in as_floats.batcher
    with pytest.raises(ValueError, match="max_batch_size must be a positive int"):
        simulate((2.0, 0.5), rate=500, num_requests=10, max_batch_size=16.5)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (-5, ValueError),
        (0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (True, TypeError),
        ("10", TypeError),
    ],
)
def test_simulate_refuses_a_latency_target_as_batched_and_configure_do(
    bad: object, error: type[Exception]
) -> None:
    import batchkit

    with pytest.raises(error) as from_simulate:
        simulate(rate=100, num_requests=10, max_latency_ms=bad)  # type: ignore[arg-type]

    @batchkit.batched(max_batch_size=4)
    def identity(xs: list[int]) -> list[int]:
        return xs

    with pytest.raises(error) as from_configure:
        identity.configure(max_latency_ms=bad)  # type: ignore[arg-type]
    identity.close()
    with pytest.raises(error) as from_decorator:
        batchkit.batched(max_batch_size=4, max_latency_ms=bad)(lambda xs: xs)  # type: ignore[arg-type]
    assert str(from_simulate.value) == str(from_configure.value) == str(from_decorator.value)
