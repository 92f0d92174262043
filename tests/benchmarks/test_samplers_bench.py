"""benchmarks/samplers.py: its peers pack as their sources do (multipack: full steps of
8 bins within the budget, the tail dropped; first fit: the first bin with room), and
its figures are computed as its docstring says."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from tests.benchmarks._scripts import load_script


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script("samplers", "samplers_bench_under_test")


def test_multipack_fills_steps_of_eight_bins_and_drops_the_tail(script: ModuleType) -> None:
    lengths = np.random.default_rng(0).integers(1, 3000, 2000)
    bins = script.multipack(lengths, 4096)
    assert bins and len(bins) % script.RANKS == 0
    assert all(lengths[b].sum() <= 4096 for b in bins)
    seen = np.concatenate(bins)
    assert len(np.unique(seen)) == len(seen) < len(lengths)  # no repeat; a tail left out


def test_first_fit_puts_each_item_in_the_first_bin_with_room(script: ModuleType) -> None:
    lengths = np.array([5, 4, 3, 9, 2, 1], dtype=np.int64)
    bin_of = script._first_fit(lengths, 9)
    assert bin_of.tolist() == [0, 0, 1, 2, 1, 1]  # 5+4; 3 opens one; 9 alone; 2, 1 join 3
    bins = script.first_fit(np.random.default_rng(1).integers(1, 500, 400), 1000)
    assert sorted(np.concatenate(bins).tolist()) == list(range(400))


def test_figures_count_a_missing_batch_as_an_empty_slot(script: ModuleType) -> None:
    lengths = np.array([8, 8, 4, 6, 8, 8, 8, 8, 8], dtype=np.int64)
    # two steps of 8 ranks, the second with one batch: 9 batches of 16 slots
    batches = [np.array([i]) for i in range(9)]
    row = script.pack_figures(batches, lengths, budget=8, seconds=1.0, peak=0.0)
    assert row.efficiency == pytest.approx(lengths.sum() / (16 * 8))
    first = (8 - 4) / 8  # the first step: 8 most, 4 fewest
    assert row.imbalance == pytest.approx((first + 1.0) / 2)  # the second: 8 against 0
    assert row.coverage == 1.0
