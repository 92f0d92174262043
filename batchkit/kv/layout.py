"""The per-step input layout that paged-attention kernels read (vLLM/FlashAttention style).

One step computes ``T`` tokens from ``B`` sequences, each a contiguous chunk: sequence
``b``'s queries are rows ``cu_seqlens_q[b] : cu_seqlens_q[b+1]`` and it attends to its
first ``seq_lens[b]`` tokens (earlier chunks, read from the cache through
``block_tables[b]``, plus this chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Host (numpy) arrays for one step; :meth:`to_torch` moves them to a device.

    - ``input_ids``, ``positions``: int64 ``[T]``, the tokens computed this step and
      their positions in their sequences;
    - ``slot_mapping``: int64 ``[T]``, the cache row each token's key/value goes to
      (``-1`` = do not write, e.g. padding);
    - ``cu_seqlens_q``: int32 ``[B+1]``, query boundaries (0 first, ``T`` last);
    - ``cu_seqlens_k``: int32 ``[B+1]``, cumulative key lengths (``seq_lens`` summed);
    - ``seq_lens``: int32 ``[B]``, tokens each sequence attends to (cached + new);
    - ``block_tables``: int32 ``[B, max_blocks]``, each row its sequence's blocks,
      padded with ``-1``;
    - ``max_seqlen_q``, ``max_seqlen_k``: Python ints, for kernel tiling;
    - ``logits_indices``: int64 ``[B]``, the row of each sequence's last token (where
      its next-token logits come from).
    """

    input_ids: Any
    positions: Any
    slot_mapping: Any
    cu_seqlens_q: Any
    cu_seqlens_k: Any
    seq_lens: Any
    block_tables: Any
    max_seqlen_q: int
    max_seqlen_k: int
    logits_indices: Any

    @property
    def num_tokens(self) -> int:
        """T, the tokens computed this step."""
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        """B, the sequences in this step."""
        return int(self.seq_lens.shape[0])

    def to_torch(self, device: Any = None) -> StepLayout:
        """The same layout as torch tensors on ``device`` (dtypes kept)."""
        import torch

        def move(a: Any) -> Any:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        return StepLayout(
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            slot_mapping=move(self.slot_mapping),
            cu_seqlens_q=move(self.cu_seqlens_q),
            cu_seqlens_k=move(self.cu_seqlens_k),
            seq_lens=move(self.seq_lens),
            block_tables=move(self.block_tables),
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            logits_indices=move(self.logits_indices),
        )


def build_layout(
    token_ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    num_tokens: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    *,
    block_tables: np.ndarray | None = None,
) -> StepLayout:
    """The layout of a step computing ``token_ids[b][starts[b] : starts[b] + num_tokens[b]]``.

    ``block_ids[b]`` are sequence ``b``'s blocks (enough for ``starts[b] + num_tokens[b]``
    tokens). Work is per sequence, never per token. A caller that keeps its block
    tables as an int32 array already (the scheduler does) passes it as
    ``block_tables`` (``[B, >= max blocks]``, ``-1`` padded); ``block_ids`` is then unused.
    """
    nseq = len(starts)
    if not (len(token_ids) == len(num_tokens) == len(block_ids) == nseq):
        raise ValueError(
            "token_ids, starts, num_tokens and block_ids must have one entry per sequence"
        )
    n = np.asarray(num_tokens, dtype=np.int64).reshape(nseq)
    s = np.asarray(starts, dtype=np.int64).reshape(nseq)
    if nseq and (n.min() < 1 or s.min() < 0):
        raise ValueError("every sequence computes at least one token from a start >= 0")
    total = int(n.sum())
    seq_lens = s + n
    cu_k = np.zeros(nseq + 1, dtype=np.int64)
    np.cumsum(seq_lens, out=cu_k[1:])
    if total == nseq:  # all decode, the common step: one token each, fewer array ops
        ids = np.fromiter((t[st] for t, st in zip(token_ids, starts)), dtype=np.int64, count=nseq)
        cu_q = np.arange(nseq + 1, dtype=np.int64)
        row_seq = cu_q[:-1]
        positions = s
    else:
        # input ids: one pass over the chunks (list slices are C-level copies)
        ids = np.fromiter(
            chain.from_iterable(t[st : st + k] for t, st, k in zip(token_ids, starts, num_tokens)),
            dtype=np.int64,
            count=total,
        )
        cu_q = np.zeros(nseq + 1, dtype=np.int64)
        np.cumsum(n, out=cu_q[1:])
        # positions: start + 0, 1, ... restarting per sequence
        row_seq = np.repeat(np.arange(nseq), n)
        positions = np.arange(total, dtype=np.int64) - cu_q[row_seq] + s[row_seq]

    if block_tables is not None:
        tables = block_tables
        if tables.shape[0] != nseq or tables.shape[1] * block_size < int(seq_lens.max(initial=0)):
            raise ValueError(f"block_tables of shape {tables.shape} is too small for this step")
    else:
        held = np.fromiter(map(len, block_ids), dtype=np.int64, count=nseq)
        if (held * block_size < seq_lens).any():
            raise ValueError("a sequence has fewer blocks than its tokens need")
        max_blocks = max(int(held.max(initial=0)), 1)
        tables = np.full((nseq, max_blocks), -1, dtype=np.int32)
        flat = np.fromiter(chain.from_iterable(block_ids), dtype=np.int32, count=int(held.sum()))
        tables[np.arange(max_blocks)[None, :] < held[:, None]] = flat  # row-major = concat order
    token_blocks = tables[row_seq, positions // block_size].astype(np.int64)
    if total and token_blocks.min() < 0:
        raise ValueError("a sequence has fewer blocks than its tokens need")
    slot_mapping = token_blocks * block_size + positions % block_size
    return StepLayout(
        input_ids=ids,
        positions=positions,
        slot_mapping=slot_mapping,
        cu_seqlens_q=cu_q.astype(np.int32),
        cu_seqlens_k=cu_k.astype(np.int32),
        seq_lens=seq_lens.astype(np.int32),
        block_tables=tables,
        max_seqlen_q=int(n.max(initial=0)),
        max_seqlen_k=int(seq_lens.max(initial=0)),
        logits_indices=cu_q[1:] - 1,
    )
