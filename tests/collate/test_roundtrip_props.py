"""Property tests: every layout's inverse gives each item back, and layout invariants hold."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchkit
from tests.collate._helpers import (
    Batch,
    assert_items_equal,
    assert_unchanged,
    batches,
    expected_kind,
    np_of,
    scribble,
    snapshot,
)

RETURN_TENSORS = st.sampled_from([None, "np", "pt"])
MULTIPLES = st.sampled_from([None, 1, 3, 8])


def _check_dtype_follows(out: Any, batch: Batch, kind: type) -> None:
    assert isinstance(out, kind)
    if batch.backend != "list":
        assert np_of(out).dtype == batch.arrays[0].dtype


def _check_segments(cu: np.ndarray, total: int) -> np.ndarray:
    """cu_seqlens invariants; returns the segment lengths."""
    assert cu.dtype == np.int32
    assert cu[0] == 0 and cu[-1] == total
    seg = np.diff(cu)
    assert (seg >= 0).all()
    return seg


def _restarting(seg_lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([np.arange(n) for n in seg_lengths] + [np.zeros(0, int)])


# --------------------------------------------------------------------------- pad


@given(
    batch=batches(), side=st.sampled_from(["left", "right"]), multiple=MULTIPLES, rt=RETURN_TENSORS
)
def test_pad_round_trip_and_invariants(
    batch: Batch, side: str, multiple: int | None, rt: str | None
) -> None:
    before = snapshot(batch.items)
    pv = batch.pad_value()
    padded = batchkit.pad(
        batch.items, pad_value=pv, side=side, pad_to_multiple_of=multiple, return_tensors=rt
    )
    kind = expected_kind(batch.backend, rt)
    _check_dtype_follows(padded.data, batch, kind)
    lengths = np.asarray(batch.lengths)
    longest = int(lengths.max())
    width = padded.data.shape[1]
    assert padded.data.shape == (len(lengths), width, *batch.feat)
    if multiple is None:
        assert width == longest
    else:
        assert width % multiple == 0 and longest <= width < longest + multiple
    mask, lens = np_of(padded.mask), np_of(padded.lengths)
    assert isinstance(padded.mask, kind) and isinstance(padded.lengths, kind)
    assert mask.dtype == bool and mask.shape == (len(lengths), width)
    assert lens.dtype == np.int64 and lens.tolist() == lengths.tolist()
    assert mask.sum(axis=1).tolist() == lengths.tolist()
    steps = np.arange(width)[None, :]
    want_mask = steps < lengths[:, None] if side == "right" else steps >= width - lengths[:, None]
    np.testing.assert_array_equal(mask, want_mask)
    data = np_of(padded.data)
    assert (data[~mask] == pv).all()
    assert_items_equal(padded.unpad(padded.data), batch, kind)
    # unpad works on any output with leading [B, L]
    extra = np.stack([np.arange(width)] * len(lengths))
    for i, got in enumerate(padded.unpad(extra)):
        assert got.tolist() == extra[i][want_mask[i]].tolist()
    scribble(padded.data)
    assert_unchanged(batch.items, before)


@given(batch=batches(min_len=0, max_len=6), limit=st.integers(0, 6))
def test_pad_max_length(batch: Batch, limit: int) -> None:
    too_long = [i for i, n in enumerate(batch.lengths) if n > limit]
    if too_long:
        with pytest.raises(ValueError, match=rf"item {too_long[0]}\b"):
            batchkit.pad(batch.items, max_length=limit)
    padded = batchkit.pad(batch.items, max_length=limit, truncate=True)
    assert padded.data.shape[1] <= limit
    got = padded.unpad(padded.data)
    cut = Batch(
        batch.items, [a[:limit] for a in batch.arrays], batch.backend, batch.dtype, batch.feat
    )
    assert_items_equal(got, cut, expected_kind(batch.backend, None))


# ------------------------------------------------------------------------ varlen


@given(batch=batches(), multiple=MULTIPLES, rt=RETURN_TENSORS)
def test_varlen_round_trip_and_invariants(
    batch: Batch, multiple: int | None, rt: str | None
) -> None:
    before = snapshot(batch.items)
    pv = batch.pad_value()
    v = batchkit.pack_varlen(
        batch.items, pad_to_multiple_of=multiple, pad_value=pv, return_tensors=rt
    )
    kind = expected_kind(batch.backend, rt)
    _check_dtype_follows(v.values, batch, kind)
    for x in (v.cu_seqlens, v.position_ids, v.seq_lens):
        assert isinstance(x, kind)
    real = sum(batch.lengths)
    total = v.values.shape[0]
    assert v.values.shape[1:] == batch.feat
    if multiple is None:
        assert total == real
    else:
        assert total % multiple == 0 and real <= total < real + multiple
    cu = np_of(v.cu_seqlens)
    seg = _check_segments(cu, total)
    n = len(batch.lengths)
    assert len(cu) == n + 1 + (total > real)  # padding is one trailing segment
    assert seg[:n].tolist() == batch.lengths
    assert isinstance(v.max_seqlen, int) and v.max_seqlen == int(seg.max(initial=0))
    pos = np_of(v.position_ids)
    assert pos.dtype == np.int64 and pos.tolist() == _restarting(seg).tolist()
    assert np_of(v.seq_lens).dtype == np.int64
    assert np_of(v.seq_lens).tolist() == batch.lengths
    assert (np_of(v.values)[real:] == pv).all()
    assert_items_equal(v.unpack(v.values), batch, kind)
    scribble(v.values)
    assert_unchanged(batch.items, before)


# -------------------------------------------------------------------------- pack


def _check_pack_layout(p: batchkit.Packed, lengths: list[int], max_length: int) -> None:
    r = p.data.shape[0]
    assert p.data.shape[1] == max_length
    seg_ids, pos = np_of(p.segment_ids), np_of(p.position_ids)
    assert seg_ids.dtype == np.int32 and seg_ids.shape == (r, max_length)
    assert pos.dtype == np.int64 and pos.shape == (r, max_length)
    want_seg = np.zeros((r, max_length), np.int32)
    used = np.zeros((r, max_length), int)
    for item, parts in enumerate(p.pieces):
        assert sum(q.length for q in parts) == lengths[item]
        for q in parts:
            assert 0 <= q.row < r and q.start >= 0 and q.start + q.length <= max_length
            assert q.length <= max_length
            used[q.row, q.start : q.start + q.length] += 1
    assert used.max(initial=0) <= 1  # placements don't overlap
    for row in range(r):
        row_parts = sorted(
            (q for parts in p.pieces for q in parts if q.row == row and q.length),
            key=lambda q: q.start,
        )
        at = 0
        for k, q in enumerate(row_parts, start=1):
            assert q.start == at  # packed left to right with no gaps
            want_seg[row, q.start : q.start + q.length] = k
            at += q.length
    np.testing.assert_array_equal(seg_ids, want_seg)
    cu = np_of(p.cu_seqlens)
    seg = _check_segments(cu, r * max_length)
    assert (seg > 0).all()
    assert set(range(0, r * max_length + 1, max_length)) <= set(cu.tolist())
    assert isinstance(p.max_seqlen, int) and p.max_seqlen == int(seg.max())
    assert pos.reshape(-1).tolist() == _restarting(seg).tolist()


@given(
    batch=batches(),
    max_length=st.integers(1, 9),
    strategy=st.sampled_from(["best_fit", "first_fit", "in_order"]),
    split=st.booleans(),
    rt=RETURN_TENSORS,
)
def test_pack_round_trip_and_invariants(
    batch: Batch, max_length: int, strategy: str, split: bool, rt: str | None
) -> None:
    before = snapshot(batch.items)
    too_long = [i for i, n in enumerate(batch.lengths) if n > max_length]
    if too_long and not split:
        with pytest.raises(ValueError, match=rf"item {too_long[0]}\b"):
            batchkit.pack(batch.items, max_length, strategy=strategy)  # type: ignore[arg-type]
        return
    pv = batch.pad_value()
    p = batchkit.pack(
        batch.items,
        max_length,
        pad_value=pv,
        strategy=strategy,  # type: ignore[arg-type]
        split=split,
        return_tensors=rt,
    )
    kind = expected_kind(batch.backend, rt)
    _check_dtype_follows(p.data, batch, kind)
    for x in (p.segment_ids, p.position_ids, p.cu_seqlens):
        assert isinstance(x, kind)
    assert p.data.shape[2:] == batch.feat
    _check_pack_layout(p, batch.lengths, max_length)
    assert (np_of(p.data)[np_of(p.segment_ids) == 0] == pv).all()
    if not too_long:
        assert [len(parts) for parts in p.pieces] == [1] * len(batch.lengths)
        assert len(p.placements) == len(batch.lengths)
        if strategy == "in_order":
            order = [(q.row, q.start) for q in p.placements if q.length]
            assert order == sorted(order)
    assert_items_equal(p.unpack(p.data), batch, kind)
    scribble(p.data)
    assert_unchanged(batch.items, before)


# ------------------------------------------------------------------------- stack


LEAF = st.one_of(
    st.integers(-5, 5),
    st.floats(-1, 1, allow_nan=False),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
    st.sampled_from(["np", "pt"]),
)


@st.composite
def _structures(draw: st.DrawFn) -> tuple[Any, list[Any]]:
    """A structure template and ``n`` items following it with random leaf values."""
    template = draw(
        st.recursive(
            LEAF,
            lambda kids: st.one_of(
                st.dictionaries(st.sampled_from("abc"), kids, min_size=1, max_size=3),
                st.lists(kids, min_size=1, max_size=3).map(tuple),
                st.lists(kids, min_size=1, max_size=3),
            ),
            max_leaves=6,
        )
    )
    n = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))

    def fill(t: Any, i: int) -> Any:
        if isinstance(t, dict):
            return {k: fill(v, i) for k, v in t.items()}
        if isinstance(t, (list, tuple)):
            return type(t)(fill(v, i) for v in t)
        if t == "np":
            return rng.standard_normal(shape)
        if t == "pt":
            return torch.from_numpy(rng.standard_normal(shape))
        if isinstance(t, bool) or t is None or isinstance(t, str):
            return t
        return type(t)(t + i)

    return template, [fill(template, i) for i in range(n)]


def _assert_struct_equal(a: Any, b: Any) -> None:
    if isinstance(b, dict):
        assert isinstance(a, dict) and a.keys() == b.keys()
        for k in b:
            _assert_struct_equal(a[k], b[k])
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_struct_equal(x, y)
    elif isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and torch.equal(a, b)
    elif isinstance(b, np.ndarray):
        # a 0-d array comes back as a numpy scalar (stacked numbers and 0-d arrays look alike)
        assert isinstance(a, np.ndarray) or (b.ndim == 0 and isinstance(a, np.generic))
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


@given(data=_structures())
def test_stack_unstack_round_trip(data: tuple[Any, list[Any]]) -> None:
    template, items = data
    if not isinstance(template, (dict, list, tuple)):
        items = [{"x": it} for it in items]
    back = batchkit.unstack(batchkit.stack(items))
    assert len(back) == len(items)
    for a, b in zip(back, items, strict=True):
        _assert_struct_equal(a, b)


@pytest.mark.parametrize("rt", ["np", "pt"])
def test_stack_return_tensors(rt: str) -> None:
    items = [{"x": torch.arange(3) + i, "y": np.ones(2) * i, "s": i} for i in range(3)]
    out = batchkit.stack(items, return_tensors=rt)  # type: ignore[arg-type]
    kind = torch.Tensor if rt == "pt" else np.ndarray
    assert all(isinstance(out[k], kind) for k in ("x", "y", "s"))
    assert np_of(out["x"]).tolist() == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert np_of(out["s"]).tolist() == [0, 1, 2]
