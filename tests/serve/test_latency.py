"""The learned batch-time model: what it predicts from the batches it has seen."""

from __future__ import annotations

import random

import pytest

from batchkit.serve.targets import MIN_SAMPLES, BatchTimeLearner


def device(size: int, cost: float = 0.0, per_item: float = 0.001) -> float:
    return 0.010 + per_item * size + 0.00001 * cost


def learned(samples: list[tuple[int, float, float]]) -> BatchTimeLearner:
    learner = BatchTimeLearner()
    for size, cost, seconds in samples:
        learner.observe(size, cost, seconds)
    return learner


def test_it_predicts_nothing_until_it_has_seen_enough_batches() -> None:
    learner = learned([(4, 0.0, device(4))] * (MIN_SAMPLES - 1))
    assert not learner.ready and learner.snapshot() is None
    learner.observe(4, 0.0, device(4))
    assert learner.ready and learner.snapshot() is not None


def test_exact_times_are_fitted_exactly() -> None:
    learner = learned([(n, 0.0, device(n)) for n in (1, 4, 9, 16) * 4])
    model = learner.snapshot()
    assert model is not None
    assert model.fixed_ms == pytest.approx(10.0, abs=1e-6)
    assert model.per_item_ms == pytest.approx(1.0, abs=1e-6)
    assert model.margin_ms == pytest.approx(0.0, abs=1e-6)
    assert learner.predict(8) == pytest.approx(device(8))


def test_the_cost_term_is_learned_beside_the_size() -> None:
    rng = random.Random(0)
    samples = []
    for _ in range(64):
        size = rng.randint(1, 16)
        cost = size * rng.randint(10, 500)
        samples.append((size, float(cost), device(size, cost)))
    model = learned(samples).snapshot()
    assert model is not None
    assert model.per_cost_ms == pytest.approx(0.01, rel=1e-3)
    assert model.per_item_ms == pytest.approx(1.0, rel=1e-3)


def test_one_stalled_batch_hardly_moves_the_prediction() -> None:
    rng = random.Random(1)
    samples = [(n, 0.0, device(n) + rng.uniform(0, 0.0005)) for n in [1, 8, 16] * 30]
    learner = learned(samples)
    before = learner.predict(16)
    learner.observe(16, 0.0, 0.300)  # a garbage collection, ten times the usual
    assert learner.predict(16) - before < 0.002


def test_a_batch_is_told_a_stall_while_stalls_stay_rare() -> None:
    learner = learned([(n, 0.0, device(n)) for n in [4, 8, 16] * 40])
    learner.snapshot()  # fitted (admission's predictions fit it)
    assert not learner.observe(16, 0.0, 1.9 * device(16))  # slow, within the ratio
    assert learner.observe(16, 0.0, 10 * device(16))  # a stall
    # One batch in four stalling is no longer rare: the device is like that.
    times = [device(16) * (10 if k % 4 == 0 else 1) for k in range(128)]
    verdicts = [learner.observe(16, 0.0, seconds) for seconds in times]
    assert verdicts[-8:] == [False] * 8
    assert not learned([(4, 0.0, 1.0)]).observe(4, 0.0, 10.0)  # no fit yet: no verdict


def test_a_slower_device_is_followed_within_a_few_batches() -> None:
    learner = learned([(n, 0.0, device(n)) for n in [4, 8, 16] * 40])
    for _ in range(3):
        learner.observe(16, 0.0, device(16, per_item=0.002))
    assert learner.predict(16) >= device(16, per_item=0.002) - 1e-6


def test_a_prediction_is_an_upper_estimate_of_noisy_times() -> None:
    rng = random.Random(2)
    samples = [(n, 0.0, device(n) + rng.uniform(0, 0.002)) for n in [2, 8, 16] * 40]
    learner = learned(samples)
    late = sum(1 for n, _, seconds in samples[-40:] if seconds > learner.predict(n))
    assert late <= 4  # the margin is the residuals' 95th percentile


def test_sizes_never_seen_are_not_predicted_faster_than_proportional() -> None:
    learner = learned([(2, 0.0, device(2))] * MIN_SAMPLES)
    # Only batches of 2 so far: a batch of 1 is not assumed faster, one of 16 takes
    # at least 8 times as long (the fixed time may scale too, as far as it knows).
    assert learner.predict(1) == pytest.approx(device(2))
    assert learner.predict(16) == pytest.approx(8 * device(2))
    assert learner.predict(16) >= device(16)


def test_negative_slopes_are_never_fitted() -> None:
    # Noise that makes larger batches look faster must not make them predicted faster.
    samples = [(16, 0.0, 0.020), (1, 0.0, 0.021)] * 8
    model = learned(samples).snapshot()
    assert model is not None
    assert model.per_item_ms >= 0 and model.fixed_ms >= 0


def test_one_or_two_slow_first_batches_are_left_out_of_the_margin() -> None:
    # A GPU's first batches (context, autotuning): 20x their usual time.
    sizes = (1, 4, 9, 16, 2, 8, 12, 6)
    slow = [(n, 0.0, 20 * device(n)) for n in sizes[:2]]
    learner = learned(slow + [(n, 0.0, device(n)) for n in sizes[2:]])
    model = learner.snapshot()
    assert model is not None and model.stalls == 2
    assert model.margin_ms < 1.0
    assert learner.predict(8) < 1.1 * device(8)


def test_stalls_that_are_the_rule_count_in_the_margin() -> None:
    # Every other batch 3x: that is how the device behaves, not a stall to set aside.
    learner = learned([(8, 0.0, device(8) * (3 if k % 2 else 1)) for k in range(32)])
    model = learner.snapshot()
    assert model is not None and model.stalls <= 3
    assert learner.predict(8) >= 2.5 * device(8)


def test_a_model_that_batches_keep_beating_is_learned_again() -> None:
    learner = learned([(8, 0.0, 0.150)] * MIN_SAMPLES)  # a slow warm-up, fitted
    assert learner.predict(8) == pytest.approx(0.150)
    learner.observe(8, 0.0, 0.002)  # one fast batch: could be luck
    assert learner.ready and learner.refuted == 0
    learner.observe(8, 0.0, 0.002)  # two: the slow model is wrong
    assert learner.relearning and learner.refuted == 1 and learner.samples == 2
    # Until it has seen enough batches again it predicts with the refuted model,
    # which overestimates: admission stays bounded meanwhile, never blind.
    assert learner.predict(8) == pytest.approx(0.150)
    for _ in range(MIN_SAMPLES - 2):
        learner.observe(8, 0.0, 0.002)
    assert not learner.relearning
    assert learner.predict(8) == pytest.approx(0.002)
