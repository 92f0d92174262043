"""BatchkitPredictor on single Ray-format batches, without a Ray cluster."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip(
    "ray", reason='the Ray tests need the ray extra: pip install -e ".[test,ray]"'
)

import batchkit  # noqa: E402
from batchkit.integrations.ray import BatchkitPredictor  # noqa: E402
from batchkit.integrations.ray.data import to_column  # noqa: E402

pytestmark = pytest.mark.ray


def ragged(rows: list[list[int]]) -> np.ndarray:
    """A column as Ray Data hands it over: an object array of 1-D arrays."""
    return to_column([np.asarray(r, dtype=np.int64) for r in rows])


def cumsum_model() -> object:
    """Per-token outputs: a running sum, unaffected by right padding."""
    return lambda p: p.unpad(np.cumsum(p.data, axis=1))


def test_rows_come_back_in_order_with_less_padding() -> None:
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 100, size=int(n)).tolist() for n in rng.integers(1, 64, 200)]
    batch = {"id": np.arange(200), "input_ids": ragged(rows)}
    predictor = BatchkitPredictor(
        cumsum_model, policy=batchkit.SortedBatcher(batch_size=16), collate=batchkit.pad
    )
    out = predictor(batch)
    assert list(out) == ["id", "input_ids", "output"]
    assert (out["id"] == np.arange(200)).all()
    for row, got in zip(rows, out["output"]):
        assert np.array_equal(got, np.cumsum(row))
    in_order = batchkit.DynamicBatcher(16, key=len)  # Ray's fixed slices, with a key to measure
    naive = BatchkitPredictor(cumsum_model, policy=in_order, collate=batchkit.pad)
    assert np.array_equal(naive(batch)["output"][5], out["output"][5])
    assert predictor.model_calls == 13 and predictor.rows == 200
    assert predictor.padding_waste < naive.padding_waste / 4


def test_dict_items_and_dict_results() -> None:
    batch = {"input_ids": ragged([[1, 2, 3], [4], [5, 6]]), "scale": np.array([1, 10, 100])}

    def model() -> object:
        def run(items: list[dict[str, np.ndarray]]) -> list[dict[str, object]]:
            return [
                {"total": it["input_ids"].sum() * it["scale"], "n": len(it["input_ids"])}
                for it in items
            ]

        return run

    predictor = BatchkitPredictor(
        model,
        policy=batchkit.BucketedBatcher([2, 4], key=lambda it: len(it["input_ids"])),
        columns=["input_ids", "scale"],
        keep_columns=False,
    )
    out = predictor(batch)
    assert set(out) == {"total", "n"}
    assert out["total"].tolist() == [6, 40, 1100] and out["n"].tolist() == [3, 1, 2]


def test_wrong_result_count_and_policy_type() -> None:
    batch = {"input_ids": ragged([[1], [2, 3]])}
    predictor = BatchkitPredictor(lambda: lambda items: [0], policy=batchkit.SortedBatcher())
    with pytest.raises(ValueError, match="1 results for 2 items"):
        predictor(batch)
    with pytest.raises(TypeError, match="Batcher"):
        BatchkitPredictor(lambda: print, policy=object())  # type: ignore[arg-type]


def test_to_column_stacks_equal_shapes_and_keeps_ragged_rows() -> None:
    assert to_column([np.zeros(3), np.ones(3)]).shape == (2, 3)
    col = to_column([np.zeros(2), np.zeros(3)])
    assert col.dtype == object and [len(x) for x in col] == [2, 3]
    assert to_column([1, 2]).tolist() == [1, 2]
