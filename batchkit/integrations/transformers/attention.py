"""Attention over a whole step's packed sequences at once, through batchkit's paged pool.

A step computes ``T`` tokens of ``B`` sequences (a
[`StepLayout`][batchkit.StepLayout]). Looping over the sequences, as the reference
[`paged_attention`][batchkit.kv.paged_attention] does, costs a few small kernels per
sequence per layer; here a [`StepPlan`][batchkit.integrations.transformers.StepPlan],
built once per step on the host, turns the layout into gather indices and masks so
that each layer runs a few batched attentions: over the decoding sequences (one query
each), in up to four groups of similar lengths so that little is padded, and over
every prefilling sequence (their chunks padded to the longest). Keys and values are
read straight from the pool's blocks; the pool layout is batchkit's (``[num_blocks,
block_size, num_kv_heads, head_dim]`` per layer), so the reference kernel reads the
same cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from batchkit.kv.layout import StepLayout


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Sequences attended together: their queries padded to ``Q`` rows, keys to ``L``.

    Attributes:
        query_rows: Int64 ``[G * Q]``, the step row of each padded query (padding
            repeats a real row; its output is dropped).
        key_slots: Int64 ``[G, L]``, the pool slot of each key (padding reads the
            sequence's own first key, masked out: never another sequence's slot,
            whose stale NaN would reach this one through the masked product).
        mask: Bool ``[G, 1, Q, L]``, True where a query may see a key.
        valid: Int64 ``[n]``, the padded query positions (in ``[0, G * Q)``) that are
            real, in step-row order...
        rows: Int64 ``[n]``, ...and the step rows they answer.
    """

    query_rows: torch.Tensor
    key_slots: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's attention work, on the device: where keys go, and who attends to what.

    Attributes:
        slot_mapping: Int64, the pool slot each new key/value is written to, one per
            written token.
        written: Int64, the tokens (rows of this step's keys) that are written, in
            the order of ``slot_mapping``; None when every token is (a step padded to
            a fixed size has rows that write nothing: slot -1).
        groups: The batched attentions of each layer: decoding sequences in up to
            four groups of similar lengths (see
            [`by_length`][batchkit.integrations.transformers.by_length]),
            then prefilling ones; a group with no sequence is left out.
        num_tokens: ``T``.
    """

    slot_mapping: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    num_tokens: int
    written: torch.Tensor | None = None


def plan_step(
    layout: StepLayout, block_size: int, device: Any = None, *, min_saved_keys: int = 2048
) -> StepPlan:
    """The [`StepPlan`][batchkit.integrations.transformers.StepPlan] of a step's layout.

    Work is per sequence and a few array operations per group; nothing per token in
    Python.

    Args:
        layout: The step's layout, host (numpy) arrays.
        block_size: Tokens per block of the pool.
        device: Where the plan's tensors go (the model's device).
        min_saved_keys: Decoding sequences are split into another group only if that
            pads at least this many fewer keys (see
            [`by_length`][batchkit.integrations.transformers.by_length]).

    Returns:
        The plan.
    """
    cu_q = np.asarray(layout.cu_seqlens_q, dtype=np.int64)
    seq_lens = np.asarray(layout.seq_lens, dtype=np.int64)
    tables = np.asarray(layout.block_tables, dtype=np.int64)
    num_q = cu_q[1:] - cu_q[:-1]
    decode = np.flatnonzero(num_q == 1)
    prefill = np.flatnonzero(num_q > 1)
    groups = tuple(
        _group(members, cu_q, num_q, seq_lens, tables, block_size, device)
        for members in (*by_length(decode, seq_lens[decode], min_saved=min_saved_keys), prefill)
        if len(members)
    )
    slot_mapping = np.asarray(layout.slot_mapping, dtype=np.int64)
    written = None
    if (slot_mapping < 0).any():  # padding rows (step_sizes): computed, never stored
        rows = np.flatnonzero(slot_mapping >= 0)
        written = torch.from_numpy(rows).to(device)
        slot_mapping = slot_mapping[rows]
    slots = torch.from_numpy(slot_mapping).to(device)
    return StepPlan(slot_mapping=slots, groups=groups, num_tokens=int(cu_q[-1]), written=written)


def by_length(
    members: np.ndarray, lengths: np.ndarray, *, most: int = 4, min_saved: int = 2048
) -> list[np.ndarray]:
    """``members`` split into at most ``most`` groups of similar ``lengths``.

    A group pads every key row to its longest sequence; with long-tailed lengths one
    group for all would read about twice the keys there are. Sorted by length, the
    sequences are cut where a cut saves the most padded keys, again and again, while a
    cut saves at least an eighth of its part's padded keys and ``min_saved`` keys
    (another group is a few more kernel launches per layer: a small saving does not
    pay for them).

    Args:
        members: Sequence indices.
        lengths: Their key counts (``seq_lens``), in the same order.
        most: The most groups.
        min_saved: The fewest padded keys a cut must save.

    Returns:
        The groups, each an index array (their union is ``members``).
    """
    order = np.argsort(lengths, kind="stable")
    parts = [(members[order], lengths[order])]
    while len(parts) < most:
        # cut the part whose best cut saves the most
        best = None
        for p, (_, ln) in enumerate(parts):
            n = len(ln)
            if n < 2:
                continue
            cut = np.arange(1, n)
            area = cut * ln[cut - 1] + (n - cut) * ln[-1]  # sorted: a part's longest is its last
            i = int(np.argmin(area))
            saved = n * int(ln[-1]) - int(area[i])
            enough = saved * 8 >= n * int(ln[-1]) and saved >= min_saved
            if enough and (best is None or saved > best[0]):
                best = (saved, p, int(cut[i]))
        if best is None:
            break
        _, p, i = best
        m, ln = parts.pop(p)
        parts[p:p] = [(m[:i], ln[:i]), (m[i:], ln[i:])]
    return [m for m, _ in parts]


def _group(
    members: np.ndarray,
    cu_q: np.ndarray,
    num_q: np.ndarray,
    seq_lens: np.ndarray,
    tables: np.ndarray,
    block_size: int,
    device: Any,
) -> AttentionGroup:
    nq, lens, first = num_q[members], seq_lens[members], cu_q[members]
    width_q, width_k = int(nq.max()), int(lens.max())
    i = np.arange(width_q)
    j = np.arange(width_k)
    real_q = i[None, :] < nq[:, None]  # [G, Q]
    query_rows = first[:, None] + np.where(real_q, i[None, :], 0)
    # key j of a sequence sits in its block j // block_size, at offset j % block_size
    blocks = tables[members][:, j // block_size]  # [G, L]; -1 past its last block
    # Padding points at the sequence's own key 0: a masked key still enters the product
    # (0 * NaN is NaN), so a slot another request left NaN would poison this one.
    slots = blocks * block_size + j % block_size
    key_slots = np.where(j[None, :] < lens[:, None], slots, slots[:, :1])
    # query i sees the keys up to its own position, lens - nq + i
    last_key = (lens - nq)[:, None] + i[None, :]  # [G, Q]
    mask = j[None, None, :] <= last_key[:, :, None]
    mask[~real_q] = False
    mask[~real_q, 0] = True  # a padded query sees one key: no all-masked row (NaN)
    valid = np.flatnonzero(real_q.reshape(-1))
    rows = query_rows.reshape(-1)[valid]

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return AttentionGroup(
        query_rows=put(query_rows.reshape(-1)),
        key_slots=put(key_slots),
        mask=put(mask[:, None]),
        valid=put(valid),
        rows=put(rows),
    )


def write_step_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    plan: StepPlan,
) -> None:  # fmt: skip
    """In place: store this step's keys and values ``[T, num_kv_heads, head_dim]`` at
    their slots of the pool (``[num_blocks, block_size, num_kv_heads, head_dim]``).

    Args:
        k_cache: One layer's key pool (contiguous).
        v_cache: Its value pool, shaped like ``k_cache``.
        key: This step's keys, one row per token.
        value: This step's values, shaped like ``key``.
        plan: The step's plan.
    """
    if plan.written is not None:
        key, value = key.index_select(0, plan.written), value.index_select(0, plan.written)
    flat = (-1, *k_cache.shape[2:])
    k_cache.view(flat).index_copy_(0, plan.slot_mapping, key.to(k_cache.dtype))
    v_cache.view(flat).index_copy_(0, plan.slot_mapping, value.to(v_cache.dtype))


def packed_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: StepPlan,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries over the pool, every sequence at once.

    Equal to [`paged_attention`][batchkit.kv.paged_attention] on the same layout (up
    to float rounding); write this step's keys first
    ([`write_step_kv`][batchkit.integrations.transformers.write_step_kv]).

    Args:
        query: ``[T, num_heads, head_dim]``.
        k_cache: One layer's key pool, ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        v_cache: Its value pool, shaped like ``k_cache``.
        plan: The step's plan.
        scale: The softmax scale; ``None``: ``1 / sqrt(head_dim)``.

    Returns:
        ``[T, num_heads, head_dim]``.

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``num_kv_heads``.
    """
    heads, kv_heads = int(query.shape[1]), int(k_cache.shape[2])
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} is not a multiple of num_kv_heads={kv_heads}")
    flat = (-1, *k_cache.shape[2:])
    keys, values = k_cache.view(flat), v_cache.view(flat)
    out = query.new_empty(query.shape)
    dim = int(query.shape[2])
    for g in plan.groups:
        size, width_k = g.key_slots.shape
        q = query.index_select(0, g.query_rows).view(size, -1, heads, dim)
        # index_select, not k[slots]: on CPU the advanced-indexing kernel is ~5x slower;
        # heads-major and contiguous, the layout the CPU attention kernel runs fastest on
        slots = g.key_slots.view(-1)
        k = keys.index_select(0, slots).view(size, width_k, kv_heads, dim)
        v = values.index_select(0, slots).view(size, width_k, kv_heads, dim)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2).contiguous().to(k.dtype), k.transpose(1, 2).contiguous(),
            v.transpose(1, 2).contiguous(), attn_mask=g.mask, scale=scale,
            enable_gqa=heads != kv_heads,
        )  # fmt: skip
        o = o.transpose(1, 2).reshape(-1, heads, dim)  # [G * Q, H, D]
        out.index_copy_(0, g.rows, o.index_select(0, g.valid).to(out.dtype))
    return out
