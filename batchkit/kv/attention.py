"""Reference paged attention in torch and numpy: slow, simple, exact.

The cache is ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer (one for
keys, one for values). `write_kv` stores this step's keys and values at
``slot_mapping``; `paged_attention` gathers each sequence's keys through its
row of ``block_tables`` and applies causal attention from its queries' positions.
It loops over sequences (never tokens) and is meant for tests, examples and checking
a real kernel, not for speed. Grouped-query attention (``num_heads`` a multiple of
``num_kv_heads``) is supported.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from batchkit.kv.layout import StepLayout


def _is_numpy(x: Any) -> bool:
    return isinstance(x, np.ndarray)


def write_kv(k_cache: Any, v_cache: Any, key: Any, value: Any, slot_mapping: Any) -> None:
    """In place: ``cache[slot] = key/value`` row by row, skipping rows whose slot is -1.

    Args:
        k_cache: The key cache, ``[num_blocks, block_size, num_kv_heads, head_dim]``
            (a numpy array or torch tensor; any strided view is written through).
        v_cache: The value cache, shaped like ``k_cache``.
        key: This step's keys, ``[T, num_kv_heads, head_dim]``, in the caches' backend.
        value: This step's values, shaped like ``key``.
        slot_mapping: Int ``[T]``, each row's slot (``StepLayout.slot_mapping``).
    """
    bs = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # (block, offset) indexing writes through any strided view of a cache; a reshape to
    # [num_blocks * block_size, ...] would silently copy a non-contiguous one.
    blocks, offsets = slots // bs, slots % bs
    k_cache[blocks, offsets] = key[keep]
    v_cache[blocks, offsets] = value[keep]


def paged_attention(
    query: Any, k_cache: Any, v_cache: Any, layout: StepLayout, *, scale: float | None = None
) -> Any:
    """Causal attention of this step's queries ``[T, num_heads, head_dim]`` over the cache.

    Sequence ``b``'s queries (rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``) sit at the last
    positions of its ``seq_lens[b]`` tokens, so query ``i`` sees keys ``0 ..
    seq_lens[b] - n_q + i``. Write this step's keys first
    ([`write_kv`][batchkit.kv.write_kv]).

    Args:
        query: This step's queries, ``[T, num_heads, head_dim]`` (numpy or torch).
        k_cache: The key cache, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        v_cache: The value cache, shaped like ``k_cache``.
        layout: The step's [`StepLayout`][batchkit.StepLayout] (numpy or torch arrays).
        scale: The softmax scale; ``None`` means ``1 / sqrt(head_dim)``.

    Returns:
        ``[T, num_heads, head_dim]``, in ``query``'s backend.

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``num_kv_heads``.
    """
    numpy = _is_numpy(query)
    heads, dim = int(query.shape[1]), int(query.shape[2])
    kv_heads, bs = int(k_cache.shape[2]), int(k_cache.shape[1])
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} is not a multiple of num_kv_heads={kv_heads}")
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    cu_q = np.asarray(_host(layout.cu_seqlens_q)).tolist()
    seq_lens = np.asarray(_host(layout.seq_lens)).tolist()
    tables = np.asarray(_host(layout.block_tables))
    outs = []
    for b, length in enumerate(seq_lens):
        q = query[cu_q[b] : cu_q[b + 1]]
        nq = int(q.shape[0])
        blocks = tables[b, : -(-length // bs)].tolist()
        k = k_cache[blocks].reshape(len(blocks) * bs, kv_heads, dim)[:length]
        v = v_cache[blocks].reshape(len(blocks) * bs, kv_heads, dim)[:length]
        q_pos = np.arange(length - nq, length)[:, None]
        masked = np.arange(length)[None, :] > q_pos  # [nq, length]: True = future key
        if numpy:
            if group > 1:
                k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
            s = np.einsum("qhd,khd->hqk", q, k) * scale
            s = np.where(masked[None], -np.inf, s)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            outs.append(np.einsum("hqk,khd->qhd", p, v))
        else:
            import torch

            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            s = torch.einsum("qhd,khd->hqk", q, k) * scale
            s = s.masked_fill(torch.from_numpy(masked).to(s.device)[None], float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(dim=-1), v))
    if numpy:
        return np.concatenate(outs) if outs else query[:0].copy()
    import torch

    return torch.cat(outs) if outs else query[:0].clone()


def _host(x: Any) -> Any:
    """A numpy view of an index array (torch tensors are brought to the CPU)."""
    if isinstance(x, np.ndarray):
        return x
    return x.detach().cpu().numpy()
