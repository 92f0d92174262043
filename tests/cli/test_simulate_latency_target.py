"""simulate under a latency target, with a cost term, for every policy: goodput,
refusals and sheds counted once each, hand-computable batch times, clear errors."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchkit
from batchkit.batchers import DynamicBatcher
from batchkit.serve import LearnedLatency
from batchkit.tools.simulate import (
    POLICIES,
    LatencyModel,
    read_trace_lengths,
    sample_lengths,
    simulate,
)
from tests.cli._helpers import assert_one_line_error, run, within

MS = 1e-3
# The device: 10 ms + 1 ms per item, batches of at most 16: 16 / 26 ms.
DEVICE = (10.0, 1.0)
CAPACITY = 16 / 26e-3  # 615.4 requests/s
TARGET_MS = 100.0


def overloaded_run(max_latency_ms: float | None, load: float = 2.0) -> Any:
    return simulate(
        DEVICE,
        rate=load * CAPACITY,
        num_requests=3000,
        seed=3,
        max_batch_size=16,
        max_latency_ms=max_latency_ms,
        goodput_ms=TARGET_MS,
    )


def test_a_target_keeps_goodput_near_capacity_at_twice_the_load() -> None:
    targeted = overloaded_run(TARGET_MS)
    assert targeted.goodput >= 0.9 * CAPACITY
    assert targeted.latency.p99 <= TARGET_MS
    assert targeted.overloaded + targeted.shed >= 0.4 * targeted.requests  # the excess
    assert targeted.learned_latency is not None
    # Without a target every request is served, ever later: the queue grows all along.
    untargeted = overloaded_run(None)
    assert untargeted.served == untargeted.requests
    assert untargeted.latency.p99 > 5 * TARGET_MS
    assert untargeted.goodput < 0.2 * CAPACITY
    assert untargeted.overloaded == untargeted.shed == 0


def test_under_capacity_a_target_refuses_nothing() -> None:
    r = overloaded_run(TARGET_MS, load=0.5)
    assert r.overloaded == r.shed == 0
    assert r.goodput_fraction == 1.0
    assert r.latency.p99 <= TARGET_MS


@pytest.mark.parametrize("target", [None, 60.0])
@pytest.mark.parametrize("queue", [None, 20])
def test_every_offered_request_is_counted_exactly_once(
    target: float | None, queue: int | None
) -> None:
    r = simulate(
        DEVICE,
        rate=2 * CAPACITY,
        num_requests=2000,
        seed=1,
        max_batch_size=16,
        max_latency_ms=target,
        max_queue_size=queue,
    )
    assert r.served + r.overloaded + r.shed + r.rejected == r.requests
    assert int(np.isnan(r.latencies_s).sum()) == r.requests - r.served
    assert sum(n * c for n, c in r.batch_sizes.items()) == r.served
    if queue is not None:
        assert r.rejected > 0
    if target is not None:
        assert r.overloaded > 0


def test_goodput_counts_the_answers_within_the_threshold() -> None:
    # The hand-computed run of test_simulate.py: latencies 2.7, 4.9, 3.9, 6.6, 5.6, 4.6,
    # 6.8, 5.8 ms over 12.8 ms; four are within 5 ms.
    r = simulate((2.2, 0.5), arrivals=np.arange(8) * MS, goodput_ms=5.0)
    assert r.on_time == 4
    assert r.goodput_fraction == 0.5
    assert r.goodput == pytest.approx(4 / (12.8 * MS))
    assert r.max_latency_ms is None and r.goodput_ms == 5.0


def test_without_a_threshold_every_answer_counts() -> None:
    r = simulate((2.2, 0.5), arrivals=np.arange(8) * MS)
    assert r.goodput_ms is None
    assert r.on_time == r.served == 8
    assert r.goodput == pytest.approx(r.throughput)


def ends_ms(result: Any) -> list[float]:
    return [end / MS for _, end, _ in result.batch_log]


def test_the_cost_term_lengthens_a_batch_by_its_cost() -> None:
    # Two requests at 0, lengths 4 and 10, one batch: 2 + 0.5 x 2 = 3 ms, plus 0.1 ms per
    # unit of cost: padded (2 x 10 = 20) 2 ms more, sum (14) 1.4 ms more.
    keys = [4, 10]
    plain = simulate((2.0, 0.5), arrivals=[0.0, 0.0], keys=keys)
    padded = simulate((2.0, 0.5, 0.1), arrivals=[0.0, 0.0], keys=keys)
    summed = simulate((2.0, 0.5, 0.1), arrivals=[0.0, 0.0], keys=keys, cost="sum")
    assert ends_ms(plain) == pytest.approx([3.0])
    assert ends_ms(padded) == pytest.approx([5.0])
    assert ends_ms(summed) == pytest.approx([4.4])


def test_seconds_adds_the_cost_term_to_the_size_part() -> None:
    model = LatencyModel.linear(2.0, 0.5, per_cost_ms=0.01)
    assert model.seconds(4) == pytest.approx(4e-3)
    assert model.seconds(4, cost=100) == pytest.approx(5e-3)
    assert model.per_cost_ms == 0.01
    assert "0.01 ms x batch cost" in model.description
    assert "cost" not in LatencyModel.linear(2.0, 0.5).description


def test_capacity_counts_the_cost_of_full_batches() -> None:
    # Every length 10, batches of 4: padded cost 40, 2 + 0.5 x 4 + 0.1 x 40 = 8 ms.
    r = simulate((2.0, 0.5, 0.1), arrivals=np.arange(40) * MS, keys=[10] * 40, max_batch_size=4)
    assert r.capacity == pytest.approx(4 / 8e-3)
    # Bucketed, full batches stay within a bucket: of 8s (cost 32) and of 200s (800),
    # 2 + 0.5 x 4 + 0.1 x 416 ms on average; mixed in arrival order each would cost 800.
    keys = [8, 200] * 8
    bucketed = simulate((2.0, 0.5, 0.1), arrivals=np.arange(16) * MS, keys=keys,
                        policy="bucketed", buckets=[8, 200], max_batch_size=4)  # fmt: skip
    assert bucketed.capacity == pytest.approx(4 / 45.6e-3)


def test_a_profile_carries_no_cost_term_unless_one_is_given() -> None:
    model = LatencyModel.from_points([1, 8], [2.0, 4.0])
    assert model.per_cost_ms == 0 and model.seconds(8, cost=1e6) == pytest.approx(4e-3)
    priced = LatencyModel.from_points([1, 8], [2.0, 4.0], per_cost_ms=0.001)
    assert priced.seconds(8, cost=1000) == pytest.approx(5e-3)


def test_a_learned_model_simulates_its_fit_and_optionally_its_margin() -> None:
    learned = LearnedLatency(
        fixed_ms=10.0, per_item_ms=1.0, per_cost_ms=0.01, margin_ms=2.0, samples=64
    )
    fit = LatencyModel.from_learned(learned)
    assert fit.seconds(16, cost=100) == pytest.approx(27e-3)
    pessimistic = LatencyModel.from_learned(learned, with_margin=True)
    assert pessimistic.seconds(16, cost=100) == pytest.approx(29e-3)
    assert fit.description.startswith("learned ")
    # simulate() takes one as it is.
    r = simulate(learned, arrivals=[0.0], keys=[100])
    assert ends_ms(r) == pytest.approx([10 + 1 + 0.01 * 100])


def test_fit_online_then_simulate_reproduces_the_batches() -> None:
    keys = sample_lengths("uniform:8,256", 3000, seed=2)
    device = (10.0, 1.0, 0.01)
    first = simulate(
        device, rate=400, num_requests=3000, seed=2, keys=keys, max_batch_size=16,
        max_latency_ms=200,
    )  # fmt: skip
    learned = first.learned_latency
    assert learned is not None
    assert (learned.fixed_ms, learned.per_item_ms, learned.per_cost_ms) == pytest.approx(
        device, rel=1e-3
    )
    again = simulate(
        LatencyModel.from_learned(learned), rate=400, num_requests=3000, seed=2, keys=keys,
        max_batch_size=16, max_latency_ms=200,
    )  # fmt: skip
    assert ends_ms(again) == pytest.approx(ends_ms(first), rel=1e-3)


def test_a_missing_learned_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no learned latency model yet"):
        LatencyModel.from_learned(None)


def test_a_model_still_warming_up_is_a_clear_error() -> None:
    f = batchkit.batched(max_latency_ms=100)(lambda xs: xs)
    f(1)  # one batch: the target's model is warming up
    with pytest.raises(ValueError, match="no learned latency model yet.*'warming'"):
        LatencyModel.from_learned(f.stats().latency_model)
    f.close()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("target", [None, 100.0])
def test_every_policy_runs_and_serves_a_light_load(policy: str, target: float | None) -> None:
    keys = sample_lengths("lognormal:64,0.7", 1500, seed=4)
    r = simulate(
        (5.0, 0.5, 0.005), rate=200, num_requests=1500, seed=4, policy=policy, keys=keys,
        max_batch_size=8, max_latency_ms=target,
    )  # fmt: skip
    assert r.served + r.overloaded + r.shed == r.requests
    assert r.served >= 0.99 * r.requests
    assert r.batcher.startswith(
        {"dynamic": "Dynamic", "static": "Static", "bucketed": "Bucketed", "sorted": "Sorted"}[
            policy
        ]
    )


def test_a_bucketed_policy_cuts_buckets_of_equal_tokens_from_the_keys() -> None:
    keys = [8] * 50 + [200] * 50
    r = simulate((1.0, 0.0), arrivals=np.zeros(100), keys=keys, policy="bucketed", buckets=2,
                 max_batch_size=64)  # fmt: skip
    assert "boundaries=[8, 200]" in r.batcher
    assert sorted(r.batch_sizes.items()) == [(50, 2)]  # never a mix of the two lengths


class _PicksNothing(DynamicBatcher):
    def select(self, candidates: Sequence[Any]) -> list[Any]:
        return []


def test_a_select_that_picks_nothing_is_an_error_not_a_hang() -> None:
    with pytest.raises(ValueError, match=r"_PicksNothing.select\(\) chose no request"):
        within(5, lambda: simulate((1.0, 0.1), arrivals=[0.0, 0.0], batcher=_PicksNothing(4)))


LATENCY_RULE = "max_latency_ms must be a finite number of milliseconds > 0"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_latency_ms": 0}, LATENCY_RULE),
        ({"max_latency_ms": -5.0}, LATENCY_RULE),
        ({"max_latency_ms": float("nan")}, LATENCY_RULE),
        ({"goodput_ms": float("inf")}, "goodput_ms must be a positive number"),
        ({"policy": "sorted"}, "policy='sorted' groups requests by length: pass keys="),
        ({"policy": "bucketed"}, "policy='bucketed' groups requests by length"),
        ({"policy": "fifo"}, "policy must be one of 'dynamic', 'static'"),
        ({"buckets": 3}, "buckets is for policy='bucketed'"),
        ({"latency": (1.0, 0.1, 0.0, 2.0, 1.0)}, "got 5 values"),
        ({"latency": (1.0, 0.1, 0.0, -2.0)}, "switch_ms must be a finite number >= 0"),
        ({"latency": (1.0, 0.1, -0.5)}, "per_cost_ms must be a finite number >= 0"),
        ({"latency": (0.0, 0.0, 0.1)}, "a batch without keys would take 0 ms"),
        ({"latency": (0.0, 0.0, 0.0)}, "0 ms for every batch size"),
        ({"keys": [3, 4], "policy": "static", "max_tokens": 8}, "not for policy='static'"),
        ({"keys": [3, 3], "policy": "bucketed", "buckets": 2}, "num_buckets=2"),
    ],
)
def test_bad_values_are_clear_value_errors(kwargs: dict[str, Any], needle: str) -> None:
    latency = kwargs.pop("latency", (1.0, 0.1))
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        simulate(latency, arrivals=[0.0, 0.001], **kwargs)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("normal:5,1", "unknown length distribution 'normal'"),
        ("uniform:5", "takes two numbers"),
        ("uniform:9,3", "0 <= LO <= HI"),
        ("uniform:1.5,3", "0 <= LO <= HI"),
        ("lognormal:0,1", "MEDIAN > 0"),
        ("lognormal:100,nan", "SIGMA >= 0"),
    ],
)
def test_bad_length_distributions_are_clear_errors(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        sample_lengths(spec, 10)


def test_length_distributions_draw_in_range_and_repeat_with_the_seed() -> None:
    uniform = sample_lengths("uniform:3,7", 2000, seed=1)
    assert min(uniform) == 3 and max(uniform) == 7
    assert uniform == sample_lengths("uniform:3,7", 2000, seed=1)
    tail = sample_lengths("lognormal:200,0.8", 4000, seed=1)
    assert float(np.median(tail)) == pytest.approx(200, rel=0.05)
    assert min(tail) >= 1 and max(tail) > 3 * 200  # a long tail


def test_a_trace_gives_each_request_its_length(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("timestamp,len\n10.2,300\n10.0,5  # first\n10.1,40\n")
    times, lengths = read_trace_lengths(path)
    assert times.tolist() == pytest.approx([0.0, 0.1, 0.2])
    assert lengths == [5, 40, 300]
    path.write_text("0.0,5\n0.1\n")
    with pytest.raises(ValueError, match=r"t.csv:2: second column: not a length"):
        read_trace_lengths(path)


# -- the command ------------------------------------------------------------------------
SCENARIO = ("simulate", "--rate", "1230", "--requests", "3000", "--latency-ms", "10",
            "--per-item-ms", "1", "--max-batch-size", "16")  # fmt: skip


def test_simulate_command_reports_refusals_sheds_and_goodput(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, *SCENARIO, "--max-latency-ms", "100")
    assert code == 0
    assert "latency target 100 ms" in out
    assert "refused" in out and "shed" in out and "(Overloaded)" in out
    goodput = float(out.split("goodput ")[1].split()[0].replace(",", ""))
    assert goodput >= 0.9 * CAPACITY
    assert "of offered)" in out and "learned model 10.00 ms + 1.000 ms x size" in out
    assert "the latency target refuses or sheds the excess" in out


def test_simulate_command_goodput_of_an_untargeted_sweep(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, *SCENARIO[:-1], "8,16", "--goodput-ms", "100")
    assert code == 0
    head, *rows = out.splitlines()[1:4]
    assert head.split()[-4:] == ["goodput", "good", "refused", "shed"]
    assert all(row.split()[-3:-1] == ["0", "0"] for row in rows)  # nothing refused or shed


def test_simulate_command_cost_term(capsys: pytest.CaptureFixture[str]) -> None:
    common = ("simulate", "--rate", "10", "--requests", "500", "--length-dist",
              "uniform:100,300", "--latency-ms", "2", "--per-item-ms", "0.5")  # fmt: skip
    code, plain, _ = run(capsys, *common)
    assert code == 0 and "lengths drawn from uniform:100,300" in plain
    code, priced, _ = run(capsys, *common, "--per-cost-ms", "0.01")
    assert code == 0 and "+ 0.01 ms x batch cost" in priced

    def p50(out: str) -> float:
        return float(out.split("p50 ")[1].split()[0])

    # Batches of one at this load: 0.01 ms x the median 200 tokens more.
    assert p50(priced) == pytest.approx(p50(plain) + 2.0, abs=0.5)


@pytest.mark.parametrize("policy", POLICIES)
def test_simulate_command_runs_every_policy(
    capsys: pytest.CaptureFixture[str], policy: str
) -> None:
    code, out, err = run(capsys, "simulate", "--rate", "500", "--requests", "500",
                         "--policy", policy, "--length-dist", "lognormal:64,0.5",
                         "--max-latency-ms", "50")  # fmt: skip
    assert code == 0, err
    assert "served" in out and "batch sizes" in out


def test_simulate_command_lengths_from_the_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("time,len\n" + "".join(f"{i / 100},{8 if i % 2 else 64}\n" for i in range(50)))
    code, out, _ = run(capsys, "simulate", "--trace", str(trace), "--trace-lengths",
                       "--policy", "bucketed", "--buckets", "2")  # fmt: skip
    assert code == 0
    assert f"the second column of {trace}: mean 36.0" in out
    assert "boundaries=[8, 64]" in out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--policy", "sorted"), "--policy sorted groups requests by length"),
        (("--per-cost-ms", "0.1"), "--per-cost-ms prices a batch's cost"),
        (("--trace-lengths",), "give --trace"),
        (("--buckets", "3"), "--buckets is for --policy bucketed"),
        (("--length-dist", "gamma:1,2"), "argument --length-dist: unknown length distribution"),
        (("--max-latency-ms", "0"), "expected a positive number"),
        (("--goodput-ms", "-1"), "expected a positive number"),
        (("--length-dist", "uniform:1,9", "--policy", "static", "--max-tokens", "64"),
         "--max-tokens is not for --policy static"),
        (("--length-dist", "uniform:4,4", "--policy", "bucketed", "--buckets", "2"),
         "num_buckets=2 needs at least that many distinct lengths"),
        (("--lengths", "x.txt", "--length-dist", "uniform:1,2"), "not allowed with"),
    ],
)  # fmt: skip
def test_simulate_command_target_and_length_errors(
    capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], needle: str
) -> None:
    code, _, err = run(capsys, "simulate", "--rate", "100", "--requests", "10", *extra)
    assert_one_line_error(code, err, needle)
