"""benchmarks/grouped.py: its quick run of the batchkit rows (no Ray) prints every row at
every load and its goal lines, and without Ray the other rows still run; the device's
time formula is what the method says, and the bound on any scheduler's max wait holds
against batchkit's own scheduler (``batchkit.simulate``) on random arrivals."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import ModuleType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.benchmarks._scripts import load_script, run_script

ROWS = ("batchkit group", "batchkit group x4", "batchkit per group", "batchkit split")


@pytest.fixture(scope="module")
def grouped() -> ModuleType:
    return load_script("grouped", "grouped_bench_under_test")


def test_quick_run_of_the_batchkit_rows_prints_every_row_at_every_load() -> None:
    done = run_script("grouped", "--quick", "--systems", "group,group4,per-group,split")
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode in (0, 1), done.stderr  # 1: a goal missed
    lines = done.stdout.splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("## ")]
    assert [lines[i].split(":")[0] for i in tables] == ["## 0.5x C", "## 0.9x C"]
    for i in tables:
        assert lines[i + 1].startswith("system ")
        body = lines[i + 2 : i + 2 + len(ROWS) + 1]
        assert [line[:22].strip() for line in body] == [*ROWS, "device (ref)"], body
        for line in body[:-1]:
            answered = float(line[22:].split()[0])
            assert 0.0 < answered <= 1.0, line
    assert not any(line.startswith("ray: not available") for line in lines)
    verdicts = [line for line in lines if line.startswith(("PASS", "MISS"))]
    assert len(verdicts) == 3, lines


def test_unknown_system_is_refused_by_name() -> None:
    done = run_script("grouped", "--systems", "group,triton")
    assert done.returncode == 2
    assert "unknown systems: ['triton']" in done.stderr


def test_a_call_costs_its_own_time_each_items_and_each_switch(grouped: ModuleType) -> None:
    assert grouped.call_seconds(16, 1) == pytest.approx(0.0052)
    assert grouped.call_seconds(10, 4) == pytest.approx(0.002 + 0.002 + 0.009)
    capacity, wait_goal = grouped.CAPACITY, grouped.MAX_WAIT_GOAL_S
    assert capacity == pytest.approx(16 / 0.0052)  # items/s of full one-group batches
    assert wait_goal == pytest.approx(0.005 + 3 * 0.0052)
    shares = grouped.zipf_shares()
    assert len(shares) == 12 and sum(shares) == pytest.approx(1.0)
    assert shares == sorted(shares, reverse=True)
    assert shares[0] / shares[1] == pytest.approx(2**1.1)


def test_the_schedule_is_seeded_and_numbers_its_requests(grouped: ModuleType) -> None:
    first = grouped.make_schedule(0.5, 1.0, random.Random("s"))
    assert first == grouped.make_schedule(0.5, 1.0, random.Random("s"))
    assert [item.number for item in first.items] == list(range(len(first.items)))
    assert first.arrivals == sorted(first.arrivals)
    assert {item.adapter for item in first.items} <= set(grouped.ADAPTERS)


@given(
    arrivals=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(0, 3)), min_size=1, max_size=60),
    wait=st.floats(0.0, 0.2),
)
def test_the_device_time_any_schedule_needs_shrinks_as_waits_may_grow(
    grouped: ModuleType, arrivals: list[tuple[float, int]], wait: float
) -> None:
    arrivals.sort()
    items = [grouped.Item(i, grouped.ADAPTERS[g]) for i, (_, g) in enumerate(arrivals)]
    schedule = grouped.Schedule([t for t, _ in arrivals], items)
    need = grouped.device_seconds_within(schedule, wait)
    # Every item's own cost, plus a call's for at least each adapter's full batches and
    # at most one call per request.
    counts = Counter(item.adapter for item in items)
    calls = (need - grouped.ITEM_S * len(items)) / grouped.CALL_S
    assert sum(-(-n // 16) for n in counts.values()) - 1e-6 <= calls <= len(items) + 1e-6
    assert grouped.device_seconds_within(schedule, wait + 0.05) <= need + 1e-12
    # An overshoot adds to every call.
    assert grouped.device_seconds_within(schedule, wait, 0.001) == pytest.approx(
        need + 0.001 * round(calls)
    )


def test_the_least_max_wait_is_where_the_device_time_first_fits(grouped: ModuleType) -> None:
    # One adapter, a request every 1 ms for 1 s: waits of up to W take calls of
    # floor(W / 1 ms) + 1 items, each call 2 ms + 0.2 ms an item. W = 2 ms: 334 calls of
    # 3, 0.87 s, which fits in the 1 s (plus W and a call) the device has; below it, 500
    # calls of 2: 1.2 s, which does not.
    items = [grouped.Item(i, grouped.ADAPTERS[0]) for i in range(1000)]
    schedule = grouped.Schedule([i * 0.001 for i in range(1000)], items)
    least = grouped.least_max_wait(schedule, 1.0)
    assert 0.002 <= least <= 0.0021
    assert grouped.device_seconds_within(schedule, least) <= 1.0
    assert grouped.device_seconds_within(schedule, least - 0.0002) > 1.0


def test_without_ray_the_other_rows_run_and_the_ray_rows_say_why(
    grouped: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        grouped, "ray_unavailable", lambda: "ModuleNotFoundError: No module named 'ray'"
    )
    config = grouped.Config(
        ("group", "ray-per-group", "ray-multiplexed"), seconds=0.2, drain_s=0.2, reference_s=0.05
    )
    res = asyncio.run(grouped.run(config))
    assert set(res.cells) == {"group"} and set(res.cells["group"]) == set(config.loads)
    assert set(res.missing) == {"ray-per-group", "ray-multiplexed"}
    for cell in res.cells["group"].values():
        assert cell.offered > 0 and cell.answered + sum(cell.errors.values()) <= cell.offered
        assert cell.groups_per_call == 1.0
    grouped.report(res, config)
    out = capsys.readouterr().out
    assert "ray: not available (ModuleNotFoundError: No module named 'ray')" in out
    assert "ray-serve per group    n/a: ModuleNotFoundError" in out


@given(
    arrivals=st.lists(
        st.tuples(st.floats(0.0, 1.0, exclude_max=True), st.integers(0, 11)),
        min_size=1,
        max_size=300,
    ),
    seconds=st.sampled_from([0.05, 0.5]),  # overloaded, or not
    max_groups=st.sampled_from([1, 4]),
)
def test_batchkits_own_scheduler_never_waits_less_than_the_bound(
    grouped: ModuleType, arrivals: list[tuple[float, int]], seconds: float, max_groups: int
) -> None:
    arrivals.sort()
    items = [grouped.Item(i, grouped.ADAPTERS[g]) for i, (_, g) in enumerate(arrivals)]
    schedule = grouped.Schedule([t * seconds for t, _ in arrivals], items)
    sim = grouped.simulated(schedule, max_groups, 0.0)
    least = grouped.least_max_wait(schedule, seconds)
    assert sim.max_wait_ms >= (least - 1e-4) * 1e3
