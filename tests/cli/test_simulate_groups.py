"""simulate with groups: every batch within max_groups_per_batch, the switching cost of a
batch's extra groups, each group's latency, drawn and traced groups, the command."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchkit.batchers import DynamicBatcher
from batchkit.tools.simulate import (
    POLICIES,
    LatencyModel,
    SimResult,
    poisson_arrivals,
    read_trace_groups,
    read_trace_lengths,
    sample_groups,
    simulate,
)
from tests.cli._helpers import assert_one_line_error, run

MS = 1e-3


def first(item: tuple[str, int]) -> Hashable:
    return item[0]


# -- the switching cost ---------------------------------------------------------------
def test_a_batch_of_g_groups_runs_switch_ms_longer_for_each_group_past_the_first() -> None:
    # Four requests of four groups at once; a batch takes 1 ms + 2 ms x extra group.
    arrivals, groups = np.zeros(4), ["a", "b", "c", "d"]
    mixed = simulate((1.0, 0.0, 0.0, 2.0), arrivals=arrivals, groups=groups, max_groups_per_batch=4)
    assert [n for _, _, n in mixed.batch_log] == [4] and mixed.batch_groups == [4]
    assert mixed.latencies_s / MS == pytest.approx([7.0] * 4)  # 1 + 2 x 3
    # One group a batch (the default): four batches of 1 ms, one after another.
    alone = simulate((1.0, 0.0, 0.0, 2.0), arrivals=arrivals, groups=groups)
    assert alone.batch_groups == [1, 1, 1, 1] and alone.max_groups_per_batch == 1
    assert alone.latencies_s / MS == pytest.approx([1.0, 2.0, 3.0, 4.0])
    # Without a switching cost, mixing is free.
    free = simulate((1.0, 0.0), arrivals=arrivals, groups=groups, max_groups_per_batch=4)
    assert free.latencies_s / MS == pytest.approx([1.0] * 4)


def test_the_latency_model_prices_each_group_past_the_first() -> None:
    model = LatencyModel.linear(2.0, 0.5, switch_ms=3.0)
    assert model.seconds(4) == model.seconds(4, groups=1) == pytest.approx(4e-3)
    assert model.seconds(4, groups=3) == pytest.approx(10e-3)
    assert model.description == "2 ms + 0.5 ms x batch size + 3 ms x extra group"
    profile = LatencyModel.from_points([1, 8], [2.0, 9.0], per_cost_ms=0.1, switch_ms=1.5)
    assert profile.seconds(8, cost=10, groups=2) == pytest.approx((9.0 + 1.0 + 1.5) / 1e3)
    assert profile.description.endswith("+ 0.1 ms x batch cost + 1.5 ms x extra group")
    assert LatencyModel.linear(1.0, 0.0).switch_ms == 0.0
    with pytest.raises(ValueError, match="switch_ms must be a finite number >= 0, got -1"):
        LatencyModel.linear(1.0, 0.0, switch_ms=-1)
    tupled = simulate((1.0, 0.0, 0.0, 2.0), arrivals=np.zeros(1), groups=["a"])
    assert "2 ms x extra group" in tupled.latency_model


def test_with_a_high_switching_cost_more_groups_per_batch_raise_the_latency() -> None:
    # 12 adapters (Zipf 1.1) at 600 req/s, 5 ms + 0.5 ms x n + 5 ms x extra group: a
    # mixed batch costs more than the batching it gains.
    arrivals = poisson_arrivals(600, 5000, seed=0)
    model = LatencyModel.linear(5.0, 0.5, switch_ms=5.0)
    runs = [
        simulate(model, arrivals=arrivals, groups=12, group_skew=1.1, max_groups_per_batch=k)
        for k in (1, 4, 12)
    ]
    p99s = [r.latency.p99 for r in runs]
    assert p99s == sorted(p99s) and p99s[-1] > 1.5 * p99s[0]
    means = [r.mean_groups_per_batch for r in runs]
    assert means[0] == 1.0 and means == sorted(means)


def test_without_a_switching_cost_more_groups_per_batch_lower_the_latency() -> None:
    # The same traffic: one group a batch splits it into batches that queue behind each
    # other's fixed 5 ms.
    arrivals = poisson_arrivals(600, 5000, seed=0)
    one, four = (
        simulate((5.0, 0.5), arrivals=arrivals, groups=12, group_skew=1.1, max_groups_per_batch=k)
        for k in (1, 4)
    )
    assert one.utilization > 0.99 and four.utilization < one.utilization
    assert four.mean_groups_per_batch > 2 and four.latency.p99 < 0.5 * one.latency.p99


# -- every batch within the limit, through the scheduler --------------------------------
@given(
    gaps=st.lists(st.sampled_from([0.0, 0.2, 1.0, 3.0]), min_size=1, max_size=40),
    data=st.data(),
    limit=st.integers(1, 4),
    policy=st.sampled_from(POLICIES),
    max_batch_size=st.integers(1, 6),
)
def test_every_batch_holds_at_most_max_groups_per_batch_and_runs_its_switching_time(
    gaps: list[float], data: st.DataObject, limit: int, policy: str, max_batch_size: int
) -> None:
    count = len(gaps)
    groups = data.draw(st.lists(st.sampled_from("abcde"), min_size=count, max_size=count))
    keys = data.draw(st.lists(st.integers(1, 50), min_size=count, max_size=count))
    r = simulate(
        (1.0, 0.0, 0.0, 0.5),
        arrivals=np.cumsum(gaps) * MS,
        groups=groups,
        keys=keys,
        policy=policy,
        max_batch_size=max_batch_size,
        max_groups_per_batch=limit,
    )
    assert r.served == count and sum(n for _, _, n in r.batch_log) == count
    assert len(r.batch_groups) == r.batches and max(r.batch_groups) <= limit
    for (start, end, _), g in zip(r.batch_log, r.batch_groups):
        assert (end - start) / MS == pytest.approx(1.0 + 0.5 * (g - 1))
    assert {g: s.requests for g, s in r.groups.items()} == Counter(groups)
    assert sum(s.batches for s in r.groups.values()) == sum(r.batch_groups)


def test_the_oldest_group_leaves_first_as_online() -> None:
    # As tests/serve/test_groups.py drives the scheduler: b alone on an idle device, then
    # (10 ms later) the oldest waiting group, a, whole, then b's two.
    arrivals = [0.0, 0.001, 0.002, 0.003, 0.004, 0.005]
    groups = ["b", "a", "a", "b", "a", "b"]
    r = simulate((10.0, 0.0), arrivals=arrivals, groups=groups, max_batch_size=8)
    assert [n for _, _, n in r.batch_log] == [1, 3, 2]
    assert r.latencies_s / MS == pytest.approx([10, 19, 18, 27, 16, 25])


def test_a_grouped_batcher_given_brings_its_limit() -> None:
    batcher = DynamicBatcher(8, 5, group=first, max_groups_per_batch=2)
    r = simulate((1.0, 0.0), arrivals=np.zeros(6), batcher=batcher, groups=list("abcabc"))
    assert r.max_groups_per_batch == 2 and r.batch_groups == [2, 1]
    assert "max_groups_per_batch=2" in r.batcher


# -- each group's latency ---------------------------------------------------------------
def test_each_group_has_its_latency_and_the_worst_is_named() -> None:
    # a, a, b at once, one group a batch of 1 ms: a's end at 1 ms, b's at 2 ms.
    r = simulate((1.0, 0.0), arrivals=np.zeros(3), groups=["a", "b", "a"])
    assert list(r.groups) == ["a", "b"]  # the most requested first
    assert r.groups["a"].requests == 2 and r.groups["a"].batches == 1
    assert r.groups["a"].latency.p99 == pytest.approx(1.0)
    assert r.worst_group == "b" and r.worst_group_p99 == pytest.approx(2.0)
    assert r.mean_groups_per_batch == 1.0 and r.groups_per_batch == {1: 2}


def test_the_worst_group_p99_is_the_highest_of_the_groups_own() -> None:
    arrivals = poisson_arrivals(800, 3000, seed=2)
    groups = sample_groups({"chat": 8, "code": 3, "sql": 1}, 3000, seed=2)
    r = simulate((5.0, 0.5), arrivals=arrivals, groups=groups, max_groups_per_batch=2)
    lat = r.latencies_s
    own = {
        g: float(np.percentile(lat[[i for i, x in enumerate(groups) if x == g]] / MS, 99))
        for g in ("chat", "code", "sql")
    }
    assert {g: s.latency.p99 for g, s in r.groups.items()} == pytest.approx(own)
    assert r.worst_group == max(own, key=own.__getitem__)
    assert list(r.groups) == ["chat", "code", "sql"]


def test_an_ungrouped_run_has_no_group_results() -> None:
    r = simulate((1.0, 0.0), arrivals=np.zeros(3))
    assert r.groups == {} and r.batch_groups == [] and r.max_groups_per_batch is None
    assert r.worst_group is None and np.isnan(r.worst_group_p99)
    assert np.isnan(r.mean_groups_per_batch) and "group" not in r.batcher


# -- drawn groups -----------------------------------------------------------------------
def test_drawn_groups_repeat_with_the_seed_and_follow_the_zipf_weights() -> None:
    drawn = sample_groups(4, 40_000, seed=5, skew=1.0)
    assert drawn == sample_groups(4, 40_000, seed=5, skew=1.0)
    assert drawn != sample_groups(4, 40_000, seed=6, skew=1.0)
    weights = np.array([1, 1 / 2, 1 / 3, 1 / 4])
    shares = np.bincount(np.asarray(drawn, dtype=np.int64), minlength=4) / len(drawn)
    assert shares == pytest.approx(weights / weights.sum(), abs=0.01)
    even = np.bincount(np.asarray(sample_groups(4, 40_000), dtype=np.int64), minlength=4) / 40_000
    assert even == pytest.approx([0.25] * 4, abs=0.01)
    named = Counter(sample_groups({"x": 3, "y": 1, "z": 0}, 20_000, seed=1))
    assert set(named) == {"x", "y"} and named["x"] / 20_000 == pytest.approx(0.75, abs=0.01)


def test_a_drawn_run_repeats_with_the_seed() -> None:
    def once(seed: int) -> SimResult:
        return simulate(
            (2.0, 0.5, 0.0, 1.0), rate=1000, num_requests=2000, seed=seed, groups=6,
            group_skew=1.2, max_groups_per_batch=2,
        )  # fmt: skip

    a, b = once(3), once(3)
    assert a.batch_log == b.batch_log and a.batch_groups == b.batch_groups
    assert a.groups == b.groups and once(4).batch_log != a.batch_log


# -- traced groups ----------------------------------------------------------------------
def test_a_trace_gives_each_request_its_group(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,length,Group\n0.3,30,b\n0.1,10, a  # first\n0.2,20,b\n0.1,11,c\n")
    times, groups = read_trace_groups(path)
    assert times.tolist() == pytest.approx([0.0, 0.0, 0.1, 0.2])
    assert groups == ["a", "c", "b", "b"]  # ties keep the file's order
    assert read_trace_lengths(path)[1] == [10, 11, 20, 30]  # lined up with the groups
    r = simulate((1.0, 0.0), arrivals=times, groups=groups, max_groups_per_batch=2)
    assert r.batch_groups[0] == 2 and set(r.groups) == {"a", "b", "c"}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("0.0,a\n", "no 'group' column: the trace has no header row"),
        ("time,len\n0.0,5\n", "no 'group' column: the trace header 'time,len'"),
        ("time,group\n0.0,a\n0.1\n", "t.csv:3: no group in column 2 ('group')"),
        ("time,group\n0.0,\n", "t.csv:2: no group in column 2"),
    ],
)
def test_a_trace_without_groups_is_a_clear_error(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        read_trace_groups(path)


# -- refused values ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"max_groups_per_batch": 2}, ValueError, "max_groups_per_batch=2 needs groups="),
        ({"groups": ["a"]}, ValueError, "groups has 1 entries for 3 arrivals"),
        ({"groups": 0}, ValueError, "groups must be a number of groups >= 1, got 0"),
        ({"groups": {}}, ValueError, "groups is an empty mapping"),
        ({"groups": {"a": -1}}, ValueError, "group 'a': its weight must be a finite number"),
        ({"groups": {"a": 0}}, ValueError, "every group's weight is 0"),
        ({"groups": "abc"}, TypeError, "groups must be a number of groups, a mapping"),
        ({"groups": True}, TypeError, "got bool"),
        ({"groups": [["a"], "b", "c"]}, TypeError, r"groups\[0\] must be hashable"),
        ({"groups": list("abc"), "group_skew": 1.0}, ValueError, "group_skew=1.0 is the Zipf"),
        ({"group_skew": 1.0}, ValueError, "group_skew=1.0 is the Zipf exponent of groups=N"),
        ({"groups": 3, "group_skew": -1}, ValueError, "group_skew must be a finite number"),
        ({"groups": 3, "max_groups_per_batch": 0}, ValueError, "max_groups_per_batch must be"),
        ({"groups": 3, "batcher": DynamicBatcher(4)}, ValueError, "groups= needs a grouped"),
        ({"batcher": DynamicBatcher(4, group=first)}, ValueError, "has group=: pass groups="),
        ({"groups": 3, "max_groups_per_batch": 2, "batcher": DynamicBatcher(4, group=first)},
         ValueError, "max_groups_per_batch is set on the batcher given"),
    ],
)  # fmt: skip
def test_bad_group_values_are_clear_errors(
    kwargs: dict[str, Any], error: type[Exception], needle: str
) -> None:
    options = {"latency": (1.0, 0.0), **kwargs}
    with pytest.raises(error, match=needle):
        simulate(options.pop("latency"), arrivals=np.zeros(3), **options)


# -- the command ------------------------------------------------------------------------
GROUPED = ("simulate", "--rate", "600", "--requests", "2000", "--groups", "12",
           "--group-skew", "1.1", "--switch-ms", "2")  # fmt: skip


def test_simulate_command_reports_the_groups(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *GROUPED, "--max-groups-per-batch", "3")
    assert code == 0, err
    assert "latency model 5 ms + 0.5 ms x batch size + 2 ms x extra group" in out
    assert "groups drawn from 12 groups (Zipf skew 1.1): 12 groups, the most requested 0" in out
    assert "DynamicBatcher(max_batch_size=32, max_wait_ms=5, max_groups_per_batch=3)" in out
    groups = next(line for line in out.splitlines() if line.startswith("groups   "))
    assert groups.startswith("groups        12, at most 3 a batch; per batch mean ")
    worst = next(line for line in out.splitlines() if line.startswith("group p99 ms"))
    assert "worst " in worst and "best " in worst and "(group " in worst


def test_simulate_command_sweeps_max_groups_per_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, *GROUPED, "--max-groups-per-batch", "1,2,4")
    assert code == 0
    head, *rows = out.splitlines()[2:6]
    assert head.split()[:4] == ["max_batch", "wait", "ms", "slots"]
    assert head.split()[4] == "groups" and head.split()[-4:] == ["grp/b", "worst", "p99", "group"]
    assert [row.split()[3] for row in rows] == ["1", "2", "4"]
    assert float(rows[0].split()[-3]) == 1.0  # one group a batch
    assert all(float(row.split()[-3]) <= limit for row, limit in zip(rows, (1, 2, 4)))


def test_simulate_command_weights_and_no_eager(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "--rate", "300", "--requests", "500",
                       "--groups", "chat=6,code=3,sql=1", "--max-groups-per-batch", "2",
                       "--no-eager")  # fmt: skip
    assert code == 0
    assert "groups drawn from chat=6,code=3,sql=1: 3 groups, the most requested chat" in out
    assert "max_groups_per_batch=2" in out and "at most 2 a batch" in out


def test_simulate_command_groups_from_the_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "t.csv"
    rows = "".join(f"{i / 100},{8 if i % 3 else 64},{'ab'[i % 2]}\n" for i in range(60))
    trace.write_text("time,length,group\n" + rows)
    code, out, err = run(capsys, "simulate", "--trace", str(trace), "--trace-groups",
                         "--trace-lengths", "--policy", "bucketed", "--buckets", "2")  # fmt: skip
    assert code == 0, err
    assert f"groups from the group column of {trace}: 2 groups" in out
    assert "boundaries=[8, 64], max_groups_per_batch=1" in out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--groups", "0"), "argument --groups: expected a number of groups such as 12"),
        (("--groups", "x"), "argument --groups: expected a number of groups"),
        (("--groups", "a=-1"), "argument --groups: group 'a': its weight must be a number >= 0"),
        (("--groups", "a=1,a=2"), "argument --groups: group 'a' is given twice"),
        (("--groups", "a=0,b=0"), "argument --groups: every group's weight is 0"),
        (("--group-skew", "1"), "--group-skew is the Zipf skew of --groups N: give --groups N"),
        (("--groups", "a=1", "--group-skew", "1"), "--group-skew is for --groups N"),
        (("--groups", "3", "--group-skew", "-1"), "argument --group-skew: expected a number >= 0"),
        (("--max-groups-per-batch", "2"),
         "--max-groups-per-batch needs --groups or --trace-groups"),
        (("--groups", "3", "--max-groups-per-batch", "0"),
         "argument --max-groups-per-batch: expected a positive integer"),
        (("--switch-ms", "1"), "--switch-ms prices a batch's groups past the first"),
        (("--groups", "3", "--switch-ms", "-1"), "argument --switch-ms: expected a number >= 0"),
        (("--trace-groups",), "--trace-groups reads the groups from --trace FILE"),
        (("--groups", "3", "--trace-groups"), "not allowed with argument --groups"),
    ],
)  # fmt: skip
def test_simulate_command_group_errors(
    capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], needle: str
) -> None:
    code, _, err = run(capsys, "simulate", "--rate", "100", "--requests", "10", *extra)
    assert_one_line_error(code, err, needle)


def test_simulate_command_a_trace_without_a_group_column(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("0.0\n0.1\n")
    code, _, err = run(capsys, "simulate", "--trace", str(trace), "--trace-groups")
    assert_one_line_error(code, err, "no 'group' column: the trace has no header row")
