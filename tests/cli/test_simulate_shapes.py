"""simulate under a static shape grid: only grid cells are called, the padding and the
shapes are counted, a batch runs for its cell, bad grids are refused; the command
prints the grid's cost beside the run without it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchkit import ShapeBuckets
from batchkit.batchers import BucketedBatcher, DynamicBatcher
from batchkit.tools.simulate import ShapeCost, simulate
from tests.cli._helpers import assert_one_line_error, run

GRID = ShapeBuckets(batch_sizes=(1, 2, 4), lengths=(8, 32))


def test_a_grid_pads_each_batch_to_its_cell_and_counts_the_padding() -> None:
    # All at once: the 8-length bucket {3, 5} and the 32-length bucket {20}.
    r = simulate((1.0, 1.0), arrivals=[0.0, 0.0, 0.0], keys=[3, 5, 20], shapes=GRID)
    cost = r.shape_cost
    assert cost is not None and cost.grid == GRID
    assert cost.shapes == {(2, 8): 1, (1, 32): 1}
    assert (cost.real_tokens, cost.padded_tokens, cost.dummy_rows) == (28, 16 + 32, 0)
    assert cost.padding == pytest.approx(48 / 28)
    assert (cost.compiled, cost.cells) == (2, 6)


def test_dummy_rows_fill_a_batch_up_to_a_grid_batch_size() -> None:
    r = simulate((1.0, 1.0), arrivals=[0.0] * 3, keys=[3, 5, 6], shapes=GRID)
    assert r.shape_cost == ShapeCost(GRID, {(4, 8): 1}, 14.0, 32, 1)


def test_without_a_grid_each_batch_is_padded_to_its_longest_key() -> None:
    r = simulate((1.0, 1.0), arrivals=[0.0] * 3, keys=[3, 5, 19.5], max_batch_size=4)
    assert r.shape_cost == ShapeCost(None, {(3, 20): 1}, 27.5, 60, 0)
    assert r.shape_cost.cells is None
    assert simulate((1.0, 1.0), arrivals=[0.0]).shape_cost is None  # no keys, no lengths


def test_a_batch_under_a_grid_runs_for_its_cell() -> None:
    # 1 ms per unit of cost and nothing else: the batch time is its cost.
    latency = (0.0, 0.0, 1.0)
    alone = simulate(latency, arrivals=[0.0], keys=[3])
    gridded = simulate(
        latency, arrivals=[0.0], keys=[3], shapes=ShapeBuckets(batch_sizes=[2], lengths=[8])
    )
    assert alone.latency.max == pytest.approx(3.0)
    assert gridded.latency.max == pytest.approx(2 * 8)  # one dummy row, 5 padding steps
    assert gridded.mean_batch_cost == 16


def test_the_grid_sets_the_policy_and_its_largest_batch_size() -> None:
    r = simulate((1.0, 1.0), rate=500, num_requests=300, keys=[4] * 300, shapes=GRID)
    assert "shapes=[1, 2, 4]x[8, 32]" in r.batcher and "max_batch_size=4" in r.batcher
    bucketed = simulate(
        (1.0, 1.0), rate=500, num_requests=300, keys=[4] * 300, shapes=GRID, policy="bucketed"
    )
    assert bucketed.batcher.startswith("BucketedBatcher(") and "boundaries" not in bucketed.batcher
    own = DynamicBatcher(4, 5.0, shapes=GRID)
    assert simulate(
        (1.0, 1.0), rate=500, num_requests=300, keys=[4] * 300, batcher=own, shapes=GRID
    ).shape_cost == simulate(
        (1.0, 1.0), rate=500, num_requests=300, keys=[4] * 300, batcher=own
    ).shape_cost


@settings(max_examples=40, deadline=None)
@given(
    keys=st.lists(st.integers(0, 64), min_size=1, max_size=120),
    sizes=st.lists(st.integers(1, 16), min_size=1, max_size=4),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    rate=st.sampled_from([50.0, 2000.0]),
    policy=st.sampled_from(["dynamic", "bucketed"]),
)
def test_every_batch_of_a_grid_run_is_called_at_a_cell_that_holds_it(
    keys: list[int], sizes: list[int], lengths: list[int], rate: float, policy: str
) -> None:
    grid = ShapeBuckets(batch_sizes=sizes, lengths=[*lengths, 64])  # every key fits
    times = np.sort(np.random.default_rng(len(keys)).exponential(1 / rate, len(keys)))
    r = simulate((1.0, 0.1), arrivals=times, keys=keys, shapes=grid, policy=policy)
    cost = r.shape_cost
    assert cost is not None
    assert set(cost.shapes) <= set(grid.cells)
    assert sum(cost.shapes.values()) == r.batches
    assert cost.real_tokens == sum(keys)  # every request ran once
    assert cost.padded_tokens == sum(b * n * count for (b, n), count in cost.shapes.items())
    assert cost.padded_tokens >= cost.real_tokens
    assert cost.dummy_rows == sum(b * count for (b, _), count in cost.shapes.items()) - len(keys)


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        ({"shapes": GRID}, ValueError, "shapes needs keys="),
        ({"shapes": GRID, "keys": [3, 40]}, ValueError, "request 1 (keys[1]) has length 40"),
        ({"shapes": GRID, "keys": [3, 4], "policy": "static"}, ValueError, "not 'static'"),
        ({"shapes": GRID, "keys": [3, 4], "policy": "sorted"}, ValueError, "not 'sorted'"),
        (
            {"shapes": GRID, "keys": [3, 4], "policy": "bucketed", "buckets": 2},
            ValueError,
            "give shapes alone",
        ),
        (
            {"shapes": GRID, "keys": [3, 4], "batcher": DynamicBatcher(4, 5.0)},
            ValueError,
            "the batcher given has shapes=None",
        ),
        ({"shapes": (1, 2), "keys": [3, 4]}, TypeError, "shapes must be a ShapeBuckets"),
        (
            {"shapes": GRID, "keys": [3, 4], "max_batch_size": 2},
            ValueError,
            "max_batch_size=2 is below the grid's largest batch size (4)",
        ),
    ],
)
def test_a_grid_that_cannot_be_simulated_is_refused_by_name(
    kwargs: dict[str, object], error: type[Exception], needle: str
) -> None:
    with pytest.raises(error) as raised:
        simulate((1.0, 1.0), arrivals=[0.0, 0.1], **kwargs)  # type: ignore[arg-type]
    assert needle in str(raised.value)


def test_a_batcher_with_a_grid_brings_it() -> None:
    batcher = BucketedBatcher(shapes=GRID, max_batch_size=4)
    r = simulate((1.0, 1.0), arrivals=[0.0] * 3, keys=[3, 5, 20], batcher=batcher)
    assert r.shape_cost is not None and r.shape_cost.grid == GRID
    with pytest.raises(ValueError, match="keys="):
        simulate((1.0, 1.0), arrivals=[0.0], batcher=batcher)


COMMAND = ("simulate", "--rate", "800", "--requests", "3000", "--latency-ms", "4",
           "--per-item-ms", "0.2", "--per-cost-ms", "0.002",
           "--length-dist", "lognormal:100,0.5")  # fmt: skip
GRID_OPTIONS = ("--grid-batch-sizes", "1,2,4,8,16", "--grid-lengths", "64,128,256,2048")


def test_simulate_command_prints_the_grid_beside_the_run_without_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, *COMMAND, *GRID_OPTIONS)
    assert code == 0
    assert "shape grid batch sizes 1,2,4,8,16 x lengths 64,128,256,2048: 20 cells" in out
    assert "max_batch_size=16" in out  # the grid's largest batch size by default
    assert "(its cell's batch size x length)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line[:4] == "  no"}
    rows |= {line.split()[0]: line.split() for line in out.splitlines() if line[:6] == "  grid"}
    plain, grid = rows["no"], rows["grid"]
    keys = [float(k) for k in _keys()]
    alone = simulate((4.0, 0.2, 0.002), rate=800, num_requests=3000, keys=keys, max_batch_size=16)
    gridded = simulate(
        (4.0, 0.2, 0.002),
        rate=800,
        num_requests=3000,
        keys=keys,
        shapes=ShapeBuckets(batch_sizes=[1, 2, 4, 8, 16], lengths=[64, 128, 256, 2048]),
    )
    assert alone.shape_cost is not None and gridded.shape_cost is not None
    assert plain[2] == f"{alone.shape_cost.compiled:,}"
    assert plain[3] == f"{alone.shape_cost.padding:.2f}x"
    reached = str(gridded.shape_cost.compiled)
    assert grid[1:5] == [reached, "of", "20", f"{gridded.shape_cost.padding:.2f}x"]
    assert grid[5] == f"{gridded.shape_cost.dummy_rows:,}"
    assert "cells never reached: " in out and "16x2048" in out


def _keys() -> list[int]:
    from batchkit.tools.simulate import sample_lengths

    return sample_lengths("lognormal:100,0.5", 3000, 0)


def test_simulate_command_sweeps_each_setting_without_and_with_the_grid(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run(capsys, *COMMAND, *GRID_OPTIONS, "--max-concurrent-batches", "1,2")
    assert code == 0
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.lstrip().startswith("max_batch"))
    assert "grid" in lines[head] and "shapes" in lines[head] and "padded" in lines[head]
    marks = [line.split()[3] for line in lines[head + 1 : head + 5]]
    assert marks == ["no", "yes", "no", "yes"]
    assert all(line.split()[11].endswith("x") for line in lines[head + 1 : head + 5])


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (("--grid-lengths", "64"), "give --grid-batch-sizes too"),
        (("--grid-batch-sizes", "1,2"), "give --grid-lengths too"),
        (("--policy", "static", *GRID_OPTIONS), "not static"),
        (("--policy", "bucketed", "--buckets", "2", *GRID_OPTIONS), "--buckets"),
        (("--grid-lengths", "64,128", "--grid-batch-sizes", "1,2"), "has length"),
        (("--max-batch-size", "8,16", *GRID_OPTIONS), "--max-batch-size 8 is below"),
    ],
)
def test_simulate_command_refuses_a_grid_it_cannot_use(
    capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], needle: str
) -> None:
    code, _, err = run(capsys, *COMMAND, *extra)
    assert_one_line_error(code, err, needle)


def test_simulate_command_grid_needs_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "simulate", "--rate", "100", *GRID_OPTIONS)
    assert_one_line_error(code, err, "give --lengths, --length-dist or --trace-lengths")


def test_padding_of_a_run_where_nothing_ran_is_undefined(tmp_path: Path) -> None:
    assert math.isnan(ShapeCost(GRID, {}, 0.0, 0, 0).padding)
    assert ShapeCost(GRID, {(1, 8): 1}, 0.0, 8, 0).padding == math.inf
