"""profile: a tiny numpy function with a known knee; recommendations; the JSON round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchkit.tools.profile import ProfilePoint, find_knee, profile, recommend
from batchkit.tools.simulate import LatencyModel, simulate
from tests.cli.models import broken, saturating


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
