"""Through `@batched`, a function whose `collate` builds one of batchkit's layouts
returns batch-wide arrays (per-token, pooled, or a mapping of both), and every
caller gets exactly what the function gives its item alone: the layout's inverse is
applied, whatever the item was batched with."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchkit

FEATURES = 7  # wider than any item, so no width is mistaken for a padded length
MAX_LENGTH = 6


def tokens(x: np.ndarray) -> np.ndarray:
    """Per-token and elementwise: no step sees another item's."""
    return x * 2 + 1


def alone(item: np.ndarray, output: str) -> object:
    """What the function means for one item on its own."""
    per_token, scores, pooled = tokens(item), item.sum(-1), item.sum(0)
    return {
        "tokens": per_token,
        "pooled": pooled,
        "both": {"tokens": per_token, "scores": scores, "pooled": pooled},
    }[output]


def pad_model(batch: batchkit.Padded) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    masked = batch.data * batch.mask[..., None]  # padding counts for nothing
    return tokens(batch.data), batch.data.sum(-1), masked.sum(1)


def varlen_model(batch: batchkit.Varlen) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cu = np.asarray(batch.cu_seqlens)
    pooled = np.stack([batch.values[s:e].sum(0) for s, e in zip(cu[:-1], cu[1:])])
    return tokens(batch.values), batch.values.sum(-1), pooled


def pack_model(batch: batchkit.Packed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Pooled per input item: sum each item's segment (a split item's pieces together).
    pooled = np.stack(
        [sum(batch.data[p.row, p.start : p.start + p.length].sum(0) for p in parts)
         for parts in batch.pieces]
    )  # fmt: skip
    return tokens(batch.data), batch.data.sum(-1), pooled


LAYOUTS = {
    "pad_right": (lambda xs: batchkit.pad(xs), pad_model),
    "pad_left": (lambda xs: batchkit.pad(xs, side="left"), pad_model),
    "pack_varlen": (batchkit.pack_varlen, varlen_model),
    "pack_best_fit": (lambda xs: batchkit.pack(xs, 8), pack_model),
    "pack_in_order": (lambda xs: batchkit.pack(xs, 8, strategy="in_order"), pack_model),
}


def batch_function(model, output: str):
    def fn(batch):
        per_token, scores, pooled = model(batch)
        if output == "tokens":
            return per_token
        if output == "pooled":
            return pooled
        return {"tokens": per_token, "scores": scores, "pooled": pooled}

    return fn


@st.composite
def cases(draw):
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    # Varlen items of two steps or more: with every item one step long, a varlen
    # output has as many tokens as items and its shape cannot tell (tests/collate).
    shortest = 2 if layout == "pack_varlen" else 1
    lengths = draw(st.lists(st.integers(shortest, MAX_LENGTH), min_size=1, max_size=12))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    items = [rng.integers(-50, 50, size=(n, FEATURES)) for n in lengths]
    order = draw(st.permutations(range(len(items))))
    return layout, [items[i] for i in order]


@settings(max_examples=40, deadline=None)
@given(
    cases(),
    st.sampled_from(["tokens", "pooled", "both"]),
    st.integers(1, 5),
    st.booleans(),
)
def test_every_caller_gets_its_result_alone(case, output, size, strict) -> None:
    layout, items = case
    collate, model = LAYOUTS[layout]
    # Strict sizes pad each batch up by repeating its last item: dropped again here.
    preferred = [s for s in (1, 3, 5) if s <= size]
    sizes = {"preferred_batch_sizes": preferred, "strict_sizes": True} if strict else {}
    policy = batchkit.DynamicBatcher(size, 0, **sizes)
    f = batchkit.batched(batcher=policy, collate=collate)(batch_function(model, output))
    try:
        results = f.map(items)
    finally:
        f.close()
    for item, got in zip(items, results, strict=True):
        want = alone(item, output)
        if output == "both":
            assert isinstance(got, dict) and got.keys() == want.keys()
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
        else:
            np.testing.assert_array_equal(got, want)


def test_a_padded_caller_gets_its_own_steps_not_the_padding() -> None:
    f = batchkit.batched(batcher=batchkit.StaticBatcher(2), collate=batchkit.pad)(
        lambda batch: batch.data * 2
    )
    try:
        long, short = f.map([[1, 2, 3, 4, 5], [7]])
    finally:
        f.close()
    assert long.tolist() == [2, 4, 6, 8, 10] and short.tolist() == [14]


def test_a_list_with_one_entry_per_item_is_taken_as_it_is() -> None:
    f = batchkit.batched(batcher=batchkit.StaticBatcher(2), collate=batchkit.pad)(
        lambda batch: batch.unpad(batch.data * 2)
    )
    try:
        assert [r.tolist() for r in f.map([[1, 2], [3]])] == [[2, 4], [6]]
    finally:
        f.close()


def test_an_ambiguous_output_fails_its_batch_naming_the_leaf() -> None:
    # Hidden [B, 3, 3] beside pooled [B, 3]: the pooled width equals the padded length.
    f = batchkit.batched(batcher=batchkit.StaticBatcher(2), collate=batchkit.pad)(
        lambda batch: {
            "hidden": np.ones((2, 3, 3)),
            "pooled": np.ones((2, 3)),
        }
    )
    try:
        with pytest.raises(ValueError, match=r"'pooled'.*shape \(2, 3\).*per_token="):
            f.map([[1, 2, 3], [4]])
    finally:
        f.close()


def test_a_stream_of_per_token_chunks_is_cut_per_caller() -> None:
    @batchkit.batched(batcher=batchkit.StaticBatcher(2), collate=batchkit.pad)
    def steps(batch):
        yield batch.data * 10
        yield [batchkit.END] * batch.batch_size

    try:
        with ThreadPoolExecutor(2) as pool:  # (a static batch of 2 waits for both)
            long, short = pool.map(
                lambda x: [c.tolist() for c in steps.stream(x)], [[1, 2, 3], [4]]
            )
    finally:
        steps.close()
    assert long == [[10, 20, 30]] and short == [[40]]
