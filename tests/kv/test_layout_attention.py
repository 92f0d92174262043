"""The step layout's fields; reference paged attention == dense attention; write_kv."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from batchkit.kv import (
    BlockAllocator,
    BlockTable,
    build_decode_layout,
    build_layout,
    paged_attention,
    write_kv,
)


def test_layout_fields() -> None:
    tokens = [[10, 11, 12, 13, 14], [20, 21], [30, 31, 32]]
    starts, counts = [3, 0, 2], [2, 2, 1]  # a decode-ish chunk, a prefill, a decode
    blocks = [[5, 1, 4], [0], [2, 7]]
    lay = build_layout(tokens, starts, counts, blocks, block_size=2)
    assert lay.input_ids.tolist() == [13, 14, 20, 21, 32]
    assert lay.positions.tolist() == [3, 4, 0, 1, 2]
    assert lay.slot_mapping.tolist() == [1 * 2 + 1, 4 * 2 + 0, 0, 1, 7 * 2 + 0]
    assert lay.slot_mapping.dtype == np.int64 and lay.positions.dtype == np.int64
    assert lay.cu_seqlens_q.tolist() == [0, 2, 4, 5] and lay.cu_seqlens_q.dtype == np.int32
    assert lay.seq_lens.tolist() == [5, 2, 3] and lay.seq_lens.dtype == np.int32
    assert lay.cu_seqlens_k.tolist() == [0, 5, 7, 10] and lay.cu_seqlens_k.dtype == np.int32
    assert lay.block_tables.tolist() == [[5, 1, 4], [0, -1, -1], [2, 7, -1]]
    assert lay.block_tables.dtype == np.int32
    assert (lay.max_seqlen_q, lay.max_seqlen_k) == (2, 5)
    assert type(lay.max_seqlen_q) is int
    assert lay.logits_indices.tolist() == [1, 3, 4]
    assert (lay.num_tokens, lay.num_seqs) == (5, 3)
    torch = pytest.importorskip("torch")
    t = lay.to_torch("cpu")
    assert t.slot_mapping.dtype == torch.int64 and t.block_tables.dtype == torch.int32
    assert t.max_seqlen_k == 5
    with pytest.raises(ValueError, match="fewer blocks"):
        build_layout([[1, 2, 3]], [0], [3], [[0]], block_size=2)


@given(
    st.lists(st.integers(0, 40), min_size=0, max_size=6),  # each sequence's position
    st.sampled_from([1, 2, 3, 16]),
    st.integers(0, 3),  # extra table columns (tables kept wider than the step needs)
    st.booleans(),  # pass block_tables, or let it be built from block_ids
    st.randoms(use_true_random=False),
)
@settings(max_examples=100)
@example([40] * 6, 1, 0, False, random.Random(0))  # needs more blocks than CI's failing pool had
def test_decode_layout_equals_general(
    positions: list, block_size: int, extra: int, pass_tables: bool, rnd: object
) -> None:
    """Every sequence computing one token: the decode layout equals the general one."""
    needs = [-(-(p + 1) // block_size) for p in positions]
    pool = list(range(sum(needs) + 8))  # sized to the need: 6 x 41 blocks overflow a fixed pool
    rnd.shuffle(pool)  # type: ignore[attr-defined]
    block_ids, tokens = [], []
    for p, n in zip(positions, needs):
        block_ids.append([pool.pop() for _ in range(n)])
        tokens.append([rnd.randrange(1000) for _ in range(p + 1)])  # type: ignore[attr-defined]
    width = max([len(b) for b in block_ids] + [1]) + extra
    tables = np.full((len(positions), width), -1, dtype=np.int32)
    for row, blocks in zip(tables, block_ids):
        row[: len(blocks)] = blocks
    kw = {"block_tables": tables} if pass_tables else {}
    want = build_layout(tokens, positions, [1] * len(positions), block_ids, block_size, **kw)
    got = build_decode_layout([t[-1] for t in tokens], positions, block_ids, block_size, **kw)
    for name in want.__dataclass_fields__:
        a, b = getattr(got, name), getattr(want, name)
        assert type(a) is type(b) and np.array_equal(a, b), name
        assert getattr(a, "dtype", None) == getattr(b, "dtype", None), name


def test_decode_layout_errors() -> None:
    with pytest.raises(ValueError, match="fewer blocks"):
        build_decode_layout([1], [4], [[0, 1]], block_size=2)
    with pytest.raises(ValueError, match="start >= 0"):
        build_decode_layout([1], [-1], [[0]], block_size=2)
    with pytest.raises(ValueError, match="one entry per sequence"):
        build_decode_layout([1, 2], [0], [[0]], block_size=2)
    with pytest.raises(ValueError, match="too small"):
        build_decode_layout([1], [3], [[0, 1]], 2, block_tables=np.zeros((1, 1), np.int32))


def _dense(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention over one whole sequence [L, H, D] (queries = last rows)."""
    n, length, d = q.shape[0], k.shape[0], q.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    mask = np.arange(length)[None, :] > np.arange(length - n, length)[:, None]
    s[:, mask] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)


@given(
    st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4)), min_size=1, max_size=4),
    st.sampled_from([1, 2, 3, 4]),
    st.sampled_from([(2, 2), (4, 2), (2, 1)]),
    st.booleans(),
)
@settings(max_examples=30)
def test_paged_attention_equals_dense(
    seqs: list, block_size: int, heads: tuple, use_torch: bool
) -> None:
    """Sequences computed in chunks over several steps, in shuffled blocks, match dense."""
    num_heads, kv_heads = heads
    d = 4
    rng = np.random.default_rng(0)
    alloc = BlockAllocator(64, block_size)
    alloc.allocate(5)  # so that the blocks in use are not simply 0, 1, 2...
    full = [
        rng.normal(size=(3, length, h, d)) for (length, _), h in zip(seqs, [num_heads] * len(seqs))
    ]
    kvs = [(x[1][:, :kv_heads], x[2][:, :kv_heads]) for x in full]
    tables = [BlockTable(alloc) for _ in seqs]
    kc = np.zeros((64, block_size, kv_heads, d))
    vc = np.zeros_like(kc)
    if use_torch:
        import torch

        kc, vc = torch.from_numpy(kc), torch.from_numpy(vc)
    done = [0] * len(seqs)
    while any(done[i] < seqs[i][0] for i in range(len(seqs))):
        live = [i for i in range(len(seqs)) if done[i] < seqs[i][0]]
        counts = [min(seqs[i][1], seqs[i][0] - done[i]) for i in live]
        for i, n in zip(live, counts):
            tables[i].append(n)
        lay = build_layout(
            [list(range(seqs[i][0])) for i in live],
            [done[i] for i in live],
            counts,
            [tables[i].block_ids for i in live],
            block_size,
        )
        q = np.concatenate([full[i][0][done[i] : done[i] + n] for i, n in zip(live, counts)])
        k = np.concatenate([kvs[i][0][done[i] : done[i] + n] for i, n in zip(live, counts)])
        v = np.concatenate([kvs[i][1][done[i] : done[i] + n] for i, n in zip(live, counts)])
        if use_torch:
            q, k, v = (torch.from_numpy(a) for a in (q, k, v))
            lay = lay.to_torch()
        write_kv(kc, vc, k, v, lay.slot_mapping)
        out = paged_attention(q, kc, vc, lay)
        out = out.numpy() if use_torch else out
        for b, (i, n) in enumerate(zip(live, counts)):
            end = done[i] + n
            want = _dense(full[i][0][:end], kvs[i][0][:end], kvs[i][1][:end])[done[i] :]
            got = out[int(lay.cu_seqlens_q[b]) : int(lay.cu_seqlens_q[b + 1])]
            np.testing.assert_allclose(got, want, atol=1e-12)
        for i, n in zip(live, counts):
            done[i] += n


def test_write_kv_skips_minus_one() -> None:
    kc = np.zeros((2, 2, 1, 1))
    vc = np.zeros_like(kc)
    write_kv(kc, vc, np.ones((3, 1, 1)), np.full((3, 1, 1), 2.0), np.array([3, -1, 0]))
    assert kc.reshape(-1).tolist() == [1, 0, 0, 1] and vc.reshape(-1).tolist() == [2, 0, 0, 2]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_write_kv_writes_through_a_non_contiguous_cache(lib: str) -> None:
    both = np.zeros((3, 2, 4, 1, 2))  # [num_blocks, k/v, block_size, heads, dim]
    if lib == "torch":
        torch = pytest.importorskip("torch")
        both = torch.zeros(3, 2, 4, 1, 2, dtype=torch.float64)
        ones = torch.ones(2, 1, 2, dtype=torch.float64)
        slots = torch.tensor([5, -1, 9])
        key = torch.cat([ones[:1], ones[:1] * 9, ones[1:]])
    else:
        ones = np.ones((2, 1, 2))
        slots = np.array([5, -1, 9])
        key = np.concatenate([ones[:1], ones[:1] * 9, ones[1:]])
    k_cache, v_cache = both[:, 0], both[:, 1]  # strided views of one buffer
    write_kv(k_cache, v_cache, key, key * 2, slots)
    assert float(k_cache.sum()) == 4.0 and float(v_cache.sum()) == 8.0  # was 0: a copy
    assert float(k_cache[1, 1].sum()) == 2.0 and float(k_cache[2, 1].sum()) == 2.0
