"""profile: a tiny numpy function with a known knee; recommendations; the JSON round trip."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from batchkit.cli.profile import format_profile
from batchkit.tools.profile import (
    ProfilePoint,
    ProfileResult,
    find_knee,
    find_knee_range,
    profile,
    recommend,
)
from batchkit.tools.simulate import LatencyModel, simulate
from tests.cli._helpers import assert_one_line_error, run
from tests.cli.models import broken, saturating

TARGET = f"{Path(__file__).with_name('models.py')}:saturating"


def points(latency_ms: dict[int, float]) -> list[ProfilePoint]:
    return [ProfilePoint(b, ms, ms, ms) for b, ms in latency_ms.items()]


def test_knee_and_recommendation_from_hand_made_points() -> None:
    # Throughput: 1/ms, 2/ms, 4/ms, 7.8/ms, 8/ms: the knee is 8 (within 5% of 8/ms).
    pts = points({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.025, 16: 2.0})
    assert find_knee(pts) == 8
    rec = recommend(pts)
    assert (rec.max_batch_size, rec.max_wait_ms, rec.meets_sla) == (8, 1.0, True)
    tight = recommend(pts, sla_ms=2.5)  # 2 x 1.025 fits, wait = min(2.5 - 2.05, 1.025)
    assert (tight.max_batch_size, tight.max_wait_ms) == (8, 0.4)
    tighter = recommend(points({1: 1.0, 2: 1.5, 4: 2.0, 8: 4.0}), sla_ms=5)
    assert tighter.max_batch_size == 4 and tighter.max_wait_ms == 1.0
    impossible = recommend(pts, sla_ms=1.5)
    assert not impossible.meets_sla and impossible.max_batch_size == 1


def test_profile_numpy_function_finds_knee(tmp_path: Path) -> None:
    result = profile(saturating, (16,), batch_sizes=[1, 2, 4, 8, 16, 32], warmup=1, repeats=3,
                     sla_ms=20)  # fmt: skip
    assert [p.batch_size for p in result.points] == [1, 2, 4, 8, 16, 32]
    assert all(p.latency_ms >= 3.0 for p in result.points)
    assert result.knee == 8
    rec = result.recommendation
    assert rec.max_batch_size == 8 and rec.meets_sla
    assert 0 < rec.max_wait_ms <= result.points[3].latency_ms  # capped at one batch run
    fixed, per_item = result.fit()
    assert per_item > 0
    # The saved profile drives the simulator.
    path = tmp_path / "p.json"
    result.save(path)
    model = LatencyModel.from_profile(path)
    assert model.seconds(8) == pytest.approx(result.points[3].latency_ms / 1e3)
    sim = simulate(path, rate=1000, num_requests=500)
    assert sim.served == 500


def test_profile_torch_function() -> None:
    torch = pytest.importorskip("torch")
    result = profile(lambda x: torch.relu(x).sum(), (8,), batch_sizes=[1, 4], framework="torch",
                     warmup=0, repeats=1)  # fmt: skip
    assert result.device in ("cpu", "cuda") and len(result.points) == 2


def test_profile_reports_failing_function() -> None:
    with pytest.raises(RuntimeError, match=r"broken failed on a batch of shape \(1, 4\)"):
        profile(broken, (4,), batch_sizes=[1], warmup=0, repeats=1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"framework": "jax"},
        {"dtype": "float99"},
        {"dtype": "str"},
        {"batch_sizes": []},
        {"batch_sizes": [0, 1]},
        {"repeats": 0},
    ],
)
def test_profile_bad_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        profile(saturating, (4,), **kwargs)  # type: ignore[arg-type]


class FakeDevice:
    """A batch function on a fake clock: each call advances the clock by the next latency
    scripted for its batch size, so a profile's numbers are exact, whatever the machine."""

    def __init__(self, script_ms: dict[int, list[float]]) -> None:
        self.now = 0.0
        self.pending = {size: iter(times) for size, times in script_ms.items()}

    def clock(self) -> float:
        return self.now

    def __call__(self, batch: object) -> None:
        self.now += next(self.pending[len(batch)]) / 1e3  # type: ignore[arg-type]


def spread(p10: float, median: float, p90: float) -> list[float]:
    """11 repeats whose 10th, 50th and 90th percentiles are exactly these (in a shuffled
    order: the percentiles must not depend on the order the repeats came in)."""
    return [median, p90, median, p10, median, p90, median, median, p10, median, median]


def fake_profile(script_ms: dict[int, list[float]]) -> ProfileResult:
    device = FakeDevice(script_ms)
    return profile(device, (4,), batch_sizes=sorted(script_ms), warmup=0, repeats=11,
                   max_repeats=11, clock=device.clock, name="fake")  # fmt: skip


def test_each_size_reports_its_p10_p90_spread() -> None:
    result = fake_profile({1: spread(0.9, 1.0, 1.5), 2: spread(1.0, 1.0, 1.0)})
    first, second = result.points
    assert (first.p10_ms, first.latency_ms, first.p90_ms) == pytest.approx((0.9, 1.0, 1.5))
    assert (first.min_ms, first.max_ms) == pytest.approx((0.9, 1.5))
    assert first.throughput_range == pytest.approx((1 / 1.5e-3, 1 / 0.9e-3))
    assert second.p10_ms == pytest.approx(second.p90_ms)
    saved = result.to_json()
    assert saved["points"][0]["p90_ms"] == pytest.approx(1.5)
    assert saved["knee_range"] == [2, 2] and saved["knee_determined"] is True


def test_a_tight_spread_leaves_one_knee_and_no_warning() -> None:
    # 1, 2, 4 items/ms, then 4.1: the knee is 4 whatever each size's 2% jitter.
    result = fake_profile({
        1: spread(0.99, 1.0, 1.01), 2: spread(0.99, 1.0, 1.01), 4: spread(0.99, 1.0, 1.01),
        8: spread(1.94, 1.95, 1.96),
    })  # fmt: skip
    assert result.knee == 4 and result.knee_range == (4, 4) and result.knee_determined
    report = format_profile(result)
    assert "p10-p90 ms" in report and "0.990-1.010" in report
    assert "warning" not in report and "no recommendation" not in report


def test_a_wide_spread_that_moves_the_knee_is_a_warning() -> None:
    # Medians: 64, 80 and 85.3 items/ms: the knee is 256 (80 is not within 5% of 85.3).
    # Within the spreads, 64's best run (80/ms) is within 5% of the lowest the peak can
    # be (256's worst, 75.3/ms), and no size's worst run is surely within 5% of every
    # other's best: the knee could be 64, 128 or 256, as two runs of one model found.
    result = fake_profile({
        64: spread(0.8, 1.0, 1.2), 128: spread(1.5, 1.6, 1.8), 256: spread(2.9, 3.0, 3.4),
    })  # fmt: skip
    assert result.knee == 256
    assert result.knee_range == (64, 256) and not result.knee_determined
    report = format_profile(result)
    assert (
        "no recommendation: with each median anywhere in its 95% confidence interval,\n"
        "  the knee could be any size from 64 to 256"
    ) in report
    assert "recommended" not in report  # no advice the timings do not support


def test_knee_range_from_hand_made_points() -> None:
    def point(size: int, p10: float, median: float, p90: float) -> ProfilePoint:
        return ProfilePoint(size, median, p10, p90, p10, p90)

    # 8 is surely within 5% of 16 (its worst 8/ms vs 16's best 8.33/ms); 4 cannot be.
    sure = [point(4, 0.9, 1.0, 1.1), point(8, 0.95, 1.0, 1.0), point(16, 1.92, 2.0, 2.0)]
    assert find_knee_range(sure) == (8, 8)
    # 8's worst is 5.7/ms, under 95% of 16's best: 16 is the only size surely there.
    unsure = [point(4, 0.9, 1.0, 1.1), point(8, 1.0, 1.0, 1.4), point(16, 1.92, 2.0, 2.0)]
    assert find_knee_range(unsure) == (8, 16)
    assert find_knee_range(points({1: 1.0, 2: 1.0})) == (2, 2)  # no spread: the knee itself


def test_profile_awaits_an_async_function() -> None:
    """Its body runs inside the timing (a bare coroutine object takes no time to make),
    on one event loop for the whole run."""
    loops: set[int] = set()
    device = FakeDevice({})

    async def fn(batch: np.ndarray) -> np.ndarray:
        loops.add(id(asyncio.get_running_loop()))
        await asyncio.sleep(0)
        device.now += 0.005  # 5 ms on the fake clock, only if the body runs
        return batch

    r = profile(fn, [2], batch_sizes=[1, 2], warmup=1, repeats=1, clock=device.clock)
    assert [p.latency_ms for p in r.points] == pytest.approx([5.0, 5.0])
    assert len(loops) == 1


def test_profile_awaits_an_awaitable_result() -> None:
    device = FakeDevice({})

    async def work(batch: np.ndarray) -> np.ndarray:
        await asyncio.sleep(0)
        device.now += 0.005
        return batch

    r = profile(lambda batch: work(batch), [2], batch_sizes=[1], warmup=0, repeats=1,
                clock=device.clock)  # fmt: skip
    assert r.points[0].latency_ms == pytest.approx(5.0)


def _cpu_only_torch() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return not torch.cuda.is_available()


@pytest.mark.skipif(not _cpu_only_torch(), reason="needs a torch without CUDA")
def test_profile_cuda_on_a_cpu_torch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="device 'cuda' is not available"):
        profile(lambda b: b, [2], framework="torch", device="cuda", batch_sizes=[1])
    code, _, err = run(capsys, "profile", TARGET, "--input-shape", "2",
                       "--framework", "torch", "--device", "cuda")  # fmt: skip
    assert_one_line_error(code, err, "device 'cuda' is not available")


@pytest.mark.skipif(not hasattr(np, "float128"), reason="numpy has no float128 here")
def test_profile_torch_float128(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    code, _, err = run(capsys, "profile", TARGET, "--input-shape", "2", "--framework", "torch",
                       "--dtype", "float128", "--device", "cpu")  # fmt: skip
    assert_one_line_error(code, err, "dtype float128 is not supported by torch")


def test_profile_input_too_large_for_memory(capsys: pytest.CaptureFixture[str]) -> None:
    # 10**18 elements: no machine allocates that.
    code, _, err = run(capsys, "profile", TARGET, "--input-shape", "1000000,1000000,1000000",
                       "--batch-sizes", "1")  # fmt: skip
    assert_one_line_error(code, err, "not enough memory for a batch of shape (1, 1000000")


def test_profile_refuses_to_await_inside_a_running_loop() -> None:
    async def fn(batch: np.ndarray) -> np.ndarray:
        return batch

    async def caller() -> None:
        profile(fn, [2], batch_sizes=[1], warmup=0, repeats=1)

    with pytest.raises(RuntimeError, match="running event loop"):
        asyncio.run(caller())



class NoisyDevice:
    """A batch function on a fake clock whose calls take ``true_ms(size)`` times a seeded
    lognormal jitter; ``slow_calls`` (counted from the first call) take 20x as long, as
    when the machine is busy for a moment."""

    def __init__(
        self,
        true_ms: dict[int, float],
        sigma: float = 0.0,
        slow_calls: range = range(0),
        seed: int = 0,
    ) -> None:
        self.now, self.calls = 0.0, 0
        self.true_ms, self.sigma, self.slow_calls = true_ms, sigma, slow_calls
        self.rng = np.random.default_rng(seed)

    def clock(self) -> float:
        return self.now

    def __call__(self, batch: np.ndarray) -> None:
        ms = self.true_ms[len(batch)] * float(np.exp(self.sigma * self.rng.standard_normal()))
        if self.calls in self.slow_calls:
            ms *= 20
        self.calls += 1
        self.now += ms / 1e3

    def profile(self, **kwargs: object) -> ProfileResult:
        options: dict[str, object] = {"warmup": 0, "clock": self.clock, "name": "noisy"}
        options.update(kwargs)
        return profile(self, (4,), batch_sizes=sorted(self.true_ms), **options)  # type: ignore[arg-type]


# 1 ms up to 8 items, then 1 ms per 8: throughput peaks from 8 on, so the knee is 8.
SATURATING = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 2.0, 32: 4.0}


def test_steady_timings_stop_after_the_fewest_rounds() -> None:
    result = NoisyDevice(SATURATING).profile(repeats=5)
    assert result.repeats == 5 and result.knee == 8 and result.knee_determined
    assert result.elapsed_s == pytest.approx(5 * sum(SATURATING.values()) / 1e3)


def test_noisy_timings_are_repeated_until_the_knee_settles() -> None:
    result = NoisyDevice(SATURATING, sigma=0.05).profile(repeats=3)
    assert result.repeats > 3  # three noisy runs could not tell 4, 8 and 16 apart
    assert result.knee_determined and result.knee == 8
    for point in result.points:  # each median's interval holds the truth
        assert point.ci_low_ms <= SATURATING[point.batch_size] <= point.ci_high_ms  # type: ignore[operator]
    report = format_profile(result)
    assert "the knee settled" in report
    assert "recommended (no --sla-ms given): max_batch_size=8" in report


def test_a_knee_the_timings_cannot_settle_ends_at_the_budget_with_no_advice() -> None:
    # 8 gives exactly 95% of 16's throughput: it is on the edge of being the knee, and no
    # number of noisy runs can say on which side.
    edge = {4: 1.0, 8: 1 / 0.95, 16: 2.0}
    result = NoisyDevice(edge, sigma=0.1).profile(repeats=5, time_budget_s=2.0)
    assert not result.knee_determined
    round_s = sum(edge.values()) * 1.5 / 1e3  # one round, with room for the jitter
    assert 2.0 <= result.elapsed_s < 2.0 + round_s  # stopped by the fake clock's budget
    report = format_profile(result)
    assert "the 2 s budget ran out before the knee settled" in report
    assert "no recommendation:" in report and "recommended" not in report


def test_max_repeats_bounds_a_run_without_a_budget() -> None:
    edge = {4: 1.0, 8: 1 / 0.95, 16: 2.0}
    result = NoisyDevice(edge, sigma=0.1).profile(repeats=5, max_repeats=40, time_budget_s=None)
    assert result.repeats == 40 and not result.knee_determined


def test_a_slow_moment_costs_every_size_one_run_not_one_size_every_run() -> None:
    # Five calls in a row 20x slower: timed size after size, they were all of the third
    # size's runs (its median 20 ms, the knee moved); timed in turn, one run of each.
    result = NoisyDevice(SATURATING, slow_calls=range(10, 15)).profile(repeats=5, max_repeats=5)
    assert [p.latency_ms for p in result.points] == pytest.approx(list(SATURATING.values()))
    assert result.knee == 8


def test_the_fit_is_robust_to_a_few_outlying_sizes() -> None:
    # 0.3 ms + 0.015 ms x B, but two sizes caught at 7.9 ms by a busy moment: least
    # squares gave a flat line through them (3.066 ms + 0.0000 ms x B, as one run did).
    true = {b: 0.3 + 0.015 * b for b in (1, 2, 4, 8, 16, 32, 64, 128)}
    noisy = {**true, 2: 7.9, 4: 7.9}
    result = ProfileResult("fit", (4,), "numpy", "float32", "cpu", 0, 1, points(noisy), 8,
                           recommend(points(noisy)))  # fmt: skip
    fixed, per_item = result.fit()
    assert fixed == pytest.approx(0.3, abs=0.05) and per_item == pytest.approx(0.015, rel=0.05)
    clean = ProfileResult("fit", (4,), "numpy", "float32", "cpu", 0, 1, points(true), 8,
                          recommend(points(true)))  # fmt: skip
    assert clean.fit() == pytest.approx((0.3, 0.015))


def test_the_medians_confidence_interval_narrows_with_more_runs() -> None:
    from batchkit.tools.profile import median_ci

    assert median_ci([5.0, 1.0, 3.0, 2.0, 4.0]) == (1.0, 5.0)  # few runs: the whole range
    assert median_ci([float(i) for i in range(1, 101)]) == (40.0, 61.0)  # ranks 50 -+ 9.8


def test_profile_command_refuses_max_repeats_below_repeats(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = run(capsys, "profile", TARGET, "--input-shape", "2", "--repeats", "9",
                       "--max-repeats", "3")  # fmt: skip
    assert_one_line_error(code, err, "--max-repeats 3 is below --repeats 9")


def test_profile_bad_budget_and_repeat_bounds_are_value_errors() -> None:
    with pytest.raises(ValueError, match="time_budget_s"):
        profile(saturating, (4,), batch_sizes=[1], time_budget_s=-1)
    with pytest.raises(ValueError, match="repeats <= max_repeats"):
        profile(saturating, (4,), batch_sizes=[1], repeats=5, max_repeats=2)
