"""benchmarks/slo.py on a tiny configuration: every offered request is counted exactly
once (in time, late, or refused), the arrival stream is what the method says, and a
batchkit without ``max_latency_ms`` gives an "n/a (feature missing)" row and a MISS
instead of a crash."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import batchkit
from tests.benchmarks._scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "slo.py"


@pytest.fixture(scope="module")
def slo() -> ModuleType:
    return load_script("slo", "slo_bench_under_test")


def tiny(
    slo: ModuleType,
    systems: tuple[str, ...],
    loads: tuple[float, ...],
    streams: tuple[str, ...] = ("shift",),
) -> Any:
    return slo.Config(
        systems, loads=loads, warm_s=0.05, segment_s=0.25, grace_s=0.15, streams=streams
    )


def assert_accounted(slo: ModuleType, res: Any, config: Any) -> None:
    """Every cell: in time + late + refused = offered, and the figures derive from it."""
    for name, columns in res.cells.items():
        assert set(columns) == {
            slo.column(seg, load) for seg in config.measured() for load in config.loads
        }
        for col, cells in columns.items():
            assert len(cells) == config.repeats
            phase = col.split()[0]
            for cell, offered in zip(cells, res.offered[col]):
                where = f"{name} {col}: {cell}"
                assert cell.offered == offered > 0, where
                assert cell.in_time + cell.late + cell.refused == cell.offered, where
                assert 0 <= cell.unanswered <= cell.late, where
                assert sum(cell.refusals.values()) == cell.refused, where
                assert cell.goodput == pytest.approx(
                    cell.in_time / config.segment_s / slo.capacity(phase)
                ), where


def test_every_offered_request_is_counted_once_as_in_time_late_or_refused(
    slo: ModuleType,
) -> None:
    config = tiny(slo, ("queue-bound", "minimal"), (0.5, 2.0))
    res = asyncio.run(slo.run(config))
    assert res.missing == {}
    assert_accounted(slo, res, config)
    bound, minimal = res.cells["queue-bound"], res.cells["minimal"]
    # At twice the capacity the bounded queue fills and refuses; the minimal batcher
    # queues everything, so its backlog (hundreds of device-bound items) outlasts
    # the grace period: those requests are late, never answered, not refused.
    assert bound["light 2x"][0].refused > 0
    assert set(bound["light 2x"][0].refusals) == {"QueueFull"}
    assert all(cell.refused == 0 for cells in minimal.values() for cell in cells)
    assert minimal["heavy 2x"][0].unanswered > 0
    assert minimal["light 0.5x"][0].in_time > 0
    assert all(x > 0 for xs in res.device.values() for x in xs)


@pytest.mark.skipif(not hasattr(batchkit, "Overloaded"), reason="no max_latency_ms here")
def test_the_target_row_refuses_with_overloaded_and_accounts_for_every_request(
    slo: ModuleType,
) -> None:
    config = tiny(slo, ("target",), (2.0,))
    res = asyncio.run(slo.run(config))
    assert res.missing == {}
    assert_accounted(slo, res, config)
    for cells in res.cells["target"].values():
        assert set(cells[0].refusals) <= {"Overloaded"}


def test_without_max_latency_ms_the_target_row_reads_n_a_and_its_goals_miss(
    slo: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = batchkit.batched

    def batched_of_old(*args: Any, **options: Any) -> Any:
        if "max_latency_ms" in options:
            raise TypeError("batched() got an unexpected keyword argument 'max_latency_ms'")
        return real(*args, **options)

    monkeypatch.setattr(slo.batchkit, "batched", batched_of_old)
    config = tiny(slo, ("target",), (1.0,))
    res = asyncio.run(slo.run(config))
    assert "max_latency_ms" in res.missing["target"]
    assert res.cells == {}
    assert slo.report(res, config) is False
    out = capsys.readouterr().out
    assert "batchkit max_latency_ms  n/a (feature missing)" in out
    assert "MISS  batchkit max_latency_ms goals: n/a (feature missing" in out


def test_each_segment_brings_its_phase_items_at_its_rate_from_a_seeded_stream(
    slo: ModuleType,
) -> None:
    config = slo.Config(("minimal",), warm_s=0.5, segment_s=3.0)
    schedule = slo.make_schedule(config, 1.5, random.Random("s"))
    assert schedule == slo.make_schedule(config, 1.5, random.Random("s"))
    assert schedule.arrivals == sorted(schedule.arrivals)
    assert [i for i, _ in schedule.items] == list(range(len(schedule.items)))
    for seg, phase, start, end in config.segments():
        ids = [i for i, s in enumerate(schedule.segment) if s == seg]
        assert all(start <= schedule.arrivals[i] < end for i in ids)
        assert {schedule.items[i][1] for i in ids} == {slo.ITEM_COST_S[phase]}
        expected = 1.5 * slo.capacity(phase) * (end - start)
        assert abs(len(ids) - expected) < 5 * expected**0.5  # Poisson: within 5 sigma


def test_the_simulated_reference_answers_all_below_capacity_and_about_c_past_it(
    slo: ModuleType,
) -> None:
    config = slo.Config(("target",), warm_s=0.5, segment_s=3.0)
    half = slo.make_schedule(config, 0.5, random.Random("s"))
    for seg, good in slo.simulated_goodput(config, half, "shift").items():
        offered = half.offered(seg) / config.segment_s / slo.capacity(seg)
        assert good == pytest.approx(offered)  # every request in time
    double = slo.simulated_goodput(
        config, slo.make_schedule(config, 2.0, random.Random("s")), "shift"
    )
    assert set(double) == {"light", "heavy"}
    assert all(0.95 <= good <= 1.02 for good in double.values())  # full batches, no more
    stall = slo.make_schedule(config, 1.0, random.Random("s"), "stall")
    assert slo.simulated_goodput(config, stall, "stall") == {}  # not simulated


def test_the_light_queue_bound_is_what_full_batches_drain_within_the_target(
    slo: ModuleType,
) -> None:
    assert slo.QUEUE_BOUND == 45  # floor((100 / 26 - 1) * 16)


def test_unknown_system_is_refused_by_name() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--systems", "fixed,triton"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2
    assert "unknown systems: ['triton']" in done.stderr


def test_the_warmup_and_stall_streams_slow_their_devices_as_the_method_says(
    slo: ModuleType,
) -> None:
    assert [slo.slowdown("warmup", k) for k in range(4)] == [20, 20, 1, 1]
    stalls = [k for k in range(200) if slo.slowdown("stall", k) != 1]
    assert stalls == [49, 99, 149, 199] and slo.slowdown("stall", 49) == 10
    assert slo.capacity("stall") == pytest.approx(16 * 50 / (0.026 * (49 + 10)))
    config = tiny(slo, ("target",), (1.0,), streams=("warmup", "stall"))
    assert config.measured() == ["warmup", "stall"]
    assert config.segments("warmup")[1][2] == slo.WARMUP_UNCOUNTED_S  # the first second


@pytest.mark.skipif(not hasattr(batchkit, "Overloaded"), reason="no max_latency_ms here")
def test_the_warmup_and_stall_streams_account_for_every_request(slo: ModuleType) -> None:
    config = tiny(slo, ("target",), (1.5,), streams=("warmup", "stall"))
    res = asyncio.run(slo.run(config))
    assert_accounted(slo, res, config)
    # Once the slow first batches are over, a target that refused everything after
    # them (the model locked on their time) would answer nothing in time here.
    assert res.cells["target"]["warmup 1.5x"][0].in_time > 0
