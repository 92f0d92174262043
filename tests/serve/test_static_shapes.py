"""Under `@batched(shapes=...)` every call of the function sees a batch whose shape is
a cell of the grid, and every caller still gets exactly what the function gives its
item alone, whatever it was batched with and in whatever order the items came; the
per-token or pooled reading of an output is declared once, with `per_token=`."""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit
from batchkit import ShapeBuckets

FEATURES = 3  # a pooled width that may equal a grid length: the declaration decides


def tokens(x: np.ndarray) -> np.ndarray:
    return x * 2 + 1


def alone(item: np.ndarray, output: str) -> object:
    per_token, pooled = tokens(item), item.sum(0)
    return {"tokens": per_token, "pooled": pooled, "both": {"t": per_token, "p": pooled}}[output]


def pad_model(batch: batchkit.Padded, shapes: list) -> tuple[np.ndarray, np.ndarray]:
    shapes.append(batch.data.shape[:2])
    return tokens(batch.data), (batch.data * batch.mask[..., None]).sum(1)


def varlen_model(batch: batchkit.Varlen, shapes: list) -> tuple[np.ndarray, np.ndarray]:
    cu = np.asarray(batch.cu_seqlens)
    rows = (len(cu) - 1) // 2  # a cell's 2B segments
    shapes.append((rows, batch.max_seqlen))
    assert batch.values.shape[0] == rows * batch.max_seqlen
    pooled = np.stack([batch.values[s:e].sum(0) for s, e in zip(cu[:-1], cu[1:])])
    return tokens(batch.values), pooled


def collator_model(batch: batchkit.collate.FeatureBatch, shapes: list) -> tuple:
    ids = batch["input_ids"]
    shapes.append(ids.shape[:2])
    return tokens(ids), (ids * batch["attention_mask"][..., None]).sum(1)


LAYOUTS = {
    "pad": (batchkit.pad, pad_model, lambda x: x),
    "pad_left": (functools.partial(batchkit.pad, side="left"), pad_model, lambda x: x),
    "pack_varlen": (batchkit.pack_varlen, varlen_model, lambda x: x),
    "PadCollator": (batchkit.PadCollator(), collator_model, lambda x: {"input_ids": x}),
}
DECLARED = {"tokens": True, "pooled": False, "both": ["t"]}


@st.composite
def cases(draw):
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    batch_sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))
    lengths = draw(st.lists(st.integers(1, 7), min_size=1, max_size=3))
    grid = ShapeBuckets(batch_sizes=batch_sizes, lengths=lengths)
    item_lengths = draw(st.lists(st.integers(1, grid.max_length), min_size=1, max_size=10))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    items = [rng.integers(-9, 9, size=(n, FEATURES)) for n in item_lengths]
    order = draw(st.permutations(range(len(items))))
    return layout, grid, [items[i] for i in order]


@settings(max_examples=50, deadline=None)
@given(cases(), st.sampled_from(sorted(DECLARED)), st.booleans())
def test_every_call_is_a_grid_cell_and_every_caller_gets_its_result_alone(
    case, output, bucketed
) -> None:
    layout, grid, items = case
    collate, model, as_item = LAYOUTS[layout]
    seen: list[tuple[int, int]] = []

    def fn(batch):
        per_token, pooled = model(batch, seen)
        return {"tokens": per_token, "pooled": pooled, "both": {"t": per_token, "p": pooled}}[
            output
        ]

    policy = batchkit.BucketedBatcher(shapes=grid, max_wait_ms=0) if bucketed else None
    options = {"batcher": policy} if bucketed else {"shapes": grid, "max_wait_ms": 0}
    f = batchkit.batched(collate=collate, per_token=DECLARED[output], **options)(fn)
    try:
        results = f.map([as_item(x) for x in items])
    finally:
        f.close()
    assert set(seen) <= set(grid.cells)
    for item, got in zip(items, results, strict=True):
        want = alone(item, output)
        if output == "both":
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
        else:
            np.testing.assert_array_equal(got, want)


def test_an_item_longer_than_the_grid_fails_its_call_naming_its_length() -> None:
    grid = ShapeBuckets(batch_sizes=[2], lengths=[4])
    f = batchkit.batched(shapes=grid, collate=batchkit.pad)(lambda batch: batch.data)
    try:
        with pytest.raises(ValueError, match=r"length 5, longer than .* \(4\)"):
            f([1, 2, 3, 4, 5])
        assert f([1, 2]).tolist() == [1, 2]  # the function still serves
    finally:
        f.close()


def test_a_pooled_output_as_wide_as_the_padded_length_is_read_as_declared() -> None:
    # [B, 4] from a batch padded to 4: pooled here, though its shape fits per token.
    grid = ShapeBuckets(batch_sizes=[2], lengths=[4])

    def pooled(batch):
        return np.repeat(batch.data.sum(1, keepdims=True), 4, axis=1)

    declared = batchkit.batched(shapes=grid, collate=batchkit.pad, per_token=False)(pooled)
    undeclared = batchkit.batched(shapes=grid, collate=batchkit.pad)(pooled)
    try:
        assert declared([1, 2]).tolist() == [3, 3, 3, 3]
        with pytest.warns(batchkit.AmbiguousOutputWarning, match="per_token="):
            undeclared([1, 2])
    finally:
        declared.close()
        undeclared.close()


def test_a_declared_per_token_output_raises_no_warning() -> None:
    grid = ShapeBuckets(batch_sizes=[2], lengths=[4])
    f = batchkit.batched(shapes=grid, collate=batchkit.pad, per_token=True)(
        lambda batch: batch.data * 2
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert f([1, 2]).tolist() == [2, 4]
    finally:
        f.close()


def test_dict_features_take_their_length_from_the_collator() -> None:
    # No key=: the policy buckets a feature dict by its input_ids, as the collator pads.
    f = batchkit.batched(
        batcher=batchkit.BucketedBatcher([4, 8], max_wait_ms=0),
        collate=batchkit.PadCollator(),
        per_token=True,
    )(lambda batch: batch["input_ids"])
    try:
        out = f.map([{"input_ids": [1, 2, 3, 4, 5], "label": 1}, {"input_ids": [7], "label": 0}])
    finally:
        f.close()
    assert [x.tolist() for x in out] == [[1, 2, 3, 4, 5], [7]]
    assert f.options.policy.key_of({"input_ids": [1] * 6, "label": 1}) == 6
    varlen = batchkit.batched(
        batcher=batchkit.BucketedBatcher([4, 8]), collate=batchkit.VarlenCollator()
    )(lambda batch: batch["input_ids"])
    varlen.close()
    assert varlen.options.policy.key_of({"input_ids": [1] * 7, "labels": [1] * 7}) == 7


def test_shapes_that_disagree_with_the_batchers_or_the_collators_are_refused() -> None:
    grid = ShapeBuckets(batch_sizes=[2], lengths=[4])
    other = ShapeBuckets(batch_sizes=[2], lengths=[8])
    with pytest.raises(ValueError, match="give the grid to the batcher alone"):
        batchkit.batched(batcher=batchkit.BucketedBatcher(shapes=other), shapes=grid)
    with pytest.raises(ValueError, match="give the grid once"):
        batchkit.batched(shapes=grid, collate=batchkit.PadCollator(shapes=other))
    with pytest.raises(ValueError, match="VarlenCollator does not pad to a shape grid"):
        batchkit.batched(shapes=grid, collate=batchkit.VarlenCollator())


def test_a_compiled_model_compiles_once_per_cell_and_never_after_every_cell_was_seen() -> None:
    torch = pytest.importorskip("torch")
    dynamo = pytest.importorskip("torch._dynamo")

    compiled_shapes: list[tuple[int, ...]] = []

    def counting_backend(graph, example_inputs):  # a backend that counts, then runs eagerly
        ids = next(x for x in example_inputs if not x.dtype.is_floating_point)
        compiled_shapes.append(tuple(ids.shape))
        return graph.forward

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 4)).eval()
    rng = np.random.default_rng(0)
    warm_up = [int(n) for n in rng.integers(1, 17, size=40)]
    later = [int(n) for n in rng.integers(1, 17, size=40) if n not in warm_up[:8]]
    grid = ShapeBuckets(batch_sizes=[2, 4], lengths=[8, 16])

    def serve(shapes: ShapeBuckets | None) -> tuple[int, int, set]:
        dynamo.reset()
        compiled_shapes.clear()
        compiled = torch.compile(model, backend=counting_backend, dynamic=False)
        options = {"shapes": shapes} if shapes else {"max_batch_size": 4}
        f = batchkit.batched(
            collate=functools.partial(batchkit.pad, return_tensors="pt"),
            max_wait_ms=0,
            per_token=True,
            **options,
        )(lambda batch: compiled(batch.data).detach())
        try:
            for cell in grid.cells if shapes else []:  # every cell compiled up front
                compiled(torch.zeros(cell, dtype=torch.int64))
            warm = len(compiled_shapes)
            for lengths in (warm_up, later):
                items = [torch.randint(0, 50, (n,)) for n in lengths]
                for item, got in zip(items, f.map(items), strict=True):
                    torch.testing.assert_close(got, model(item[None])[0].detach())
        finally:
            f.close()
        return warm, len(compiled_shapes), set(compiled_shapes)

    warm, total, shapes_seen = serve(grid)
    assert warm == len(grid.cells) and total == warm  # none after every cell was seen
    assert shapes_seen == set(grid.cells)
    _, total_without, _ = serve(None)
    assert total_without > len(grid.cells)  # each new (batch, length) recompiles


def test_a_batch_size_past_the_grid_cannot_be_configured() -> None:
    grid = ShapeBuckets(batch_sizes=[2, 4], lengths=[4])
    f = batchkit.batched(batcher=batchkit.BucketedBatcher(shapes=grid), collate=batchkit.pad)(
        lambda batch: batch.unpad(batch.data)
    )
    try:
        with pytest.raises(ValueError, match=r"max_batch_size=8 exceeds .*\[2, 4\]"):
            f.configure(max_batch_size=8)
        f.configure(max_batch_size=2)
        assert [x.tolist() for x in f.map([[1], [2, 3], [4]])] == [[1], [2, 3], [4]]
    finally:
        f.close()
