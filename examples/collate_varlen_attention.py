"""Attention over packed sequences equals attention over each sequence alone.

``pack_varlen`` concatenates the items into one ``[T, D]`` buffer with
``cu_seqlens`` boundaries (the FlashAttention varlen layout). A block-diagonal mask
built from those boundaries keeps every token inside its own sequence, so one
attention call over the packed buffer gives each sequence exactly what attention
over that sequence alone gives: checked below, bidirectional and causal, and the
same for ``pack`` (fixed-length rows with ``segment_ids``).

Run: python examples/collate_varlen_attention.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import batchkit

torch.manual_seed(0)
D = 16  # model width
lengths = [5, 1, 12, 7, 3]
hidden = [torch.randn(n, D, dtype=torch.float64) for n in lengths]  # per-sequence inputs
w_q, w_k, w_v = (torch.randn(D, D, dtype=torch.float64) / D**0.5 for _ in range(3))


def attention(
    x: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False
) -> torch.Tensor:
    """Single-head self-attention over x [..., L, D]; mask [..., L, L] True = may attend."""
    q, k, v = x @ w_q, x @ w_k, x @ w_v
    if causal:
        n = x.shape[-2]
        tri = torch.ones(n, n, dtype=torch.bool).tril()
        mask = tri if mask is None else mask & tri
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def block_diagonal(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T, T] bool: token i may attend to token j iff both lie in the same segment."""
    segment = torch.bucketize(torch.arange(total), cu_seqlens[1:].long(), right=True)
    return segment[:, None] == segment[None, :]


for causal in (False, True):
    reference = [attention(x, causal=causal) for x in hidden]  # one call per sequence

    # Varlen: one [T, D] buffer, one attention call, block-diagonal mask.
    varlen = batchkit.pack_varlen(hidden, pad_to_multiple_of=8)  # T rounded up: 28 -> 32
    assert varlen.total_length == 32 and varlen.cu_seqlens.tolist() == [0, 5, 6, 18, 25, 28, 32]
    mask = block_diagonal(varlen.cu_seqlens, varlen.total_length)
    # Positions restart at 0 in every segment, as a rotary/learned embedding needs.
    assert varlen.position_ids[:6].tolist() == [0, 1, 2, 3, 4, 0]
    out = attention(varlen.values, mask, causal=causal)
    for got, want in zip(varlen.unpack(out), reference, strict=True):
        assert torch.allclose(got, want, atol=1e-12), (got - want).abs().max()

    # Without the block-diagonal mask, sequences would see each other: the check matters.
    leaky = varlen.unpack(attention(varlen.values, causal=causal))
    assert not torch.allclose(leaky[2], reference[2])

    # Pack: rows of max_length, segment_ids per row (0 = padding). Same-segment
    # mask per row; padding attends to padding only, and its outputs are dropped.
    packed = batchkit.pack(hidden, max_length=16)
    seg = packed.segment_ids
    row_mask = seg[:, :, None] == seg[:, None, :]  # [R, 16, 16]
    out_rows = attention(packed.data, row_mask, causal=causal)  # [R, 16, D]
    for got, want in zip(packed.unpack(out_rows), reference, strict=True):
        assert torch.allclose(got, want, atol=1e-12)
    print(
        f"causal={causal}: varlen T={varlen.total_length} and pack {packed.num_rows}x"
        f"{packed.max_length} both equal per-sequence attention for {len(hidden)} sequences"
    )

print("ok")
