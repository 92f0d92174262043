"""Batched equals unbatched: small torch models over every layout give each item its own result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchkit

D_MODEL = 8
ATOL = 1e-10
LENGTHS = st.lists(st.integers(1, 9), min_size=1, max_size=5)
LENGTHS0 = st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(any)
SEEDS = st.integers(0, 2**31 - 1)


def _seqs(lengths: list[int], seed: int, dim: int = D_MODEL) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=gen, dtype=torch.float64) for n in lengths]


@pytest.fixture(scope="module")
def encoder() -> torch.nn.TransformerEncoderLayer:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        D_MODEL, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True
    )
    return layer.double().eval()


def _attend(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Single-head self-attention of ``x [..., T, D]`` with a bool ``allowed [..., T, T]``."""
    return torch.nn.functional.scaled_dot_product_attention(x, x * 0.5, x.flip(-1), allowed)


def _alone(x: torch.Tensor) -> torch.Tensor:
    return _attend(x, torch.ones(x.shape[0], x.shape[0], dtype=torch.bool))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@given(lengths=LENGTHS0, seed=SEEDS, side=st.sampled_from(["left", "right"]))
def test_masked_mean_pooling(lengths: list[int], seed: int, side: str) -> None:
    seqs = _seqs(lengths, seed)
    padded = batchkit.pad(seqs, side=side, pad_to_multiple_of=4, pad_value=1e9)  # type: ignore[arg-type]
    mask = padded.mask.unsqueeze(-1)
    summed = torch.where(mask, padded.data, 0).sum(1)
    pooled = summed / padded.lengths.clamp(min=1).unsqueeze(-1)
    for i, s in enumerate(seqs):
        want = s.mean(0) if len(s) else torch.zeros(D_MODEL, dtype=torch.float64)
        _close(pooled[i], want)


@given(lengths=LENGTHS, seed=SEEDS, side=st.sampled_from(["left", "right"]))
def test_transformer_layer_over_pad(
    encoder: torch.nn.TransformerEncoderLayer, lengths: list[int], seed: int, side: str
) -> None:
    seqs = _seqs(lengths, seed)
    padded = batchkit.pad(seqs, side=side)  # type: ignore[arg-type]
    with torch.no_grad():
        out = encoder(padded.data, src_key_padding_mask=~padded.mask)
        per_item = padded.unpad(out)
        for i, s in enumerate(seqs):
            _close(per_item[i], encoder(s.unsqueeze(0))[0])


@given(lengths=LENGTHS0, seed=SEEDS, multiple=st.sampled_from([None, 8]))
def test_attention_over_varlen(lengths: list[int], seed: int, multiple: int | None) -> None:
    seqs = _seqs(lengths, seed)
    v = batchkit.pack_varlen(seqs, pad_to_multiple_of=multiple)
    total = v.values.shape[0]
    seg = torch.searchsorted(v.cu_seqlens[1:], torch.arange(total, dtype=torch.int32), right=True)
    out = _attend(v.values, seg[:, None] == seg[None, :])
    for i, got in enumerate(v.unpack(out)):
        _close(got, _alone(seqs[i]))


@given(
    lengths=LENGTHS0,
    seed=SEEDS,
    max_length=st.integers(9, 16),
    strategy=st.sampled_from(["best_fit", "first_fit", "in_order"]),
)
def test_attention_over_pack_rows(
    lengths: list[int], seed: int, max_length: int, strategy: str
) -> None:
    seqs = _seqs(lengths, seed)
    p = batchkit.pack(seqs, max_length, strategy=strategy)  # type: ignore[arg-type]
    seg = p.segment_ids
    # Padding (segment 0) attends to padding only, so no row is fully masked.
    by_segment = seg[:, :, None] == seg[:, None, :]
    out = _attend(p.data, by_segment)
    for i, got in enumerate(p.unpack(out)):
        _close(got, _alone(seqs[i]))
    # The same mask from cu_seqlens over the flattened rows, cut back into rows.
    r, length = seg.shape
    flat_seg = torch.searchsorted(
        p.cu_seqlens[1:], torch.arange(r * length, dtype=torch.int32), right=True
    )
    full = flat_seg[:, None] == flat_seg[None, :]
    blocks = torch.stack(
        [full[k * length : (k + 1) * length, k * length : (k + 1) * length] for k in range(r)]
    )
    assert torch.equal(blocks, by_segment)
    assert int(full.sum()) == int(blocks.sum())  # no segment crosses a row boundary
    flat_out = _attend(p.data.reshape(r * length, -1), full).reshape(r, length, -1)
    for i, got in enumerate(p.unpack(flat_out)):
        _close(got, _alone(seqs[i]))


def test_pack_split_items_attend_per_piece() -> None:
    seqs = _seqs([7, 3], 0)
    p = batchkit.pack(seqs, 4, split=True)  # type: ignore[arg-type]
    back = p.unpack(p.data)
    for got, want in zip(back, seqs, strict=True):
        assert torch.equal(got, want)
    assert np.diff(p.cu_seqlens.numpy()).max() <= 4
