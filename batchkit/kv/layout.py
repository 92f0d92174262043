"""The per-step input layout that paged-attention kernels read (vLLM/FlashAttention style).

One step computes ``T`` tokens from ``B`` sequences, each a contiguous chunk: sequence
``b``'s queries are rows ``cu_seqlens_q[b] : cu_seqlens_q[b+1]`` and it attends to its
first ``seq_lens[b]`` tokens (earlier chunks, read from the cache through
``block_tables[b]``, plus this chunk).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class StepLayout:
    """Host (numpy) arrays for one step.

    [`build_layout`][batchkit.kv.build_layout] and
    [`build_decode_layout`][batchkit.kv.build_decode_layout] build it;
    [`to_torch`][batchkit.StepLayout.to_torch] moves it to a device.

    Attributes:
        input_ids: Int64 ``[T]``, the tokens computed this step.
        positions: Int64 ``[T]``, their positions in their sequences.
        slot_mapping: Int64 ``[T]``, the cache row each token's key/value goes to
            (``-1`` = do not write, e.g. padding).
        cu_seqlens_q: Int32 ``[B+1]``, query boundaries (0 first, ``T`` last).
        cu_seqlens_k: Int32 ``[B+1]``, cumulative key lengths (``seq_lens`` summed).
        seq_lens: Int32 ``[B]``, tokens each sequence attends to (cached + new).
        block_tables: Int32 ``[B, max_blocks]``, each row its sequence's blocks,
            padded with ``-1``.
        max_seqlen_q: The most query tokens of one sequence (a Python int, for
            kernel tiling).
        max_seqlen_k: The longest ``seq_lens`` entry (a Python int).
        logits_indices: Int64 ``[B]``, the row of each sequence's last token (where
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
        """The same layout as torch tensors on ``device`` (dtypes kept).

        Args:
            device: Anything ``Tensor.to`` takes (``"cuda"``, a ``torch.device``);
                ``None`` keeps them on the CPU.
        """
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

    Work is per sequence, never per token. See
    [`build_decode_layout`][batchkit.kv.build_decode_layout] for the cheaper
    decode-only case.

    Args:
        token_ids: Each sequence's token ids (at least up to its chunk's end).
        starts: Where each sequence's chunk starts: the tokens before it are cached.
        num_tokens: Tokens each sequence computes this step (>= 1).
        block_ids: Each sequence's blocks, enough for ``starts[b] + num_tokens[b]``
            tokens (unused when ``block_tables`` is given).
        block_size: Tokens per block.
        block_tables: The block tables as an int32 array already (``[B, >= most
            blocks]``, ``-1`` padded), as the scheduler keeps them; ``None`` builds
            it from ``block_ids``.

    Raises:
        ValueError: The per-sequence arguments differ in length, a chunk is empty
            or starts before 0, or a sequence has fewer blocks than its tokens need.
    """
    nseq = len(starts)
    if not (len(token_ids) == len(num_tokens) == len(block_ids) == nseq):
        raise ValueError(
            "token_ids, starts, num_tokens and block_ids must have one entry per sequence"
        )
    # Per-sequence checks and sums on the Python values: at tens of sequences, cheaper
    # than array reductions (each a ufunc call).
    if nseq and (min(num_tokens) < 1 or min(starts) < 0):
        raise ValueError("every sequence computes at least one token from a start >= 0")
    n = np.asarray(num_tokens, dtype=np.int64).reshape(nseq)
    s = np.asarray(starts, dtype=np.int64).reshape(nseq)
    total = int(sum(num_tokens))
    seq_lens = s + n
    longest = int(max(map(operator.add, starts, num_tokens), default=0))
    if block_tables is not None:
        tables = block_tables
        if tables.shape[0] != nseq or tables.shape[1] * block_size < longest:
            raise ValueError(f"block_tables of shape {tables.shape} is too small for this step")
    else:
        tables, held = _table_array(block_ids)
        if (held * block_size < seq_lens).any():
            raise ValueError("a sequence has fewer blocks than its tokens need")
    cu_q = np.zeros(nseq + 1, dtype=np.int32)
    if total == nseq:  # all decode: one token each, fewer array ops
        ids = np.fromiter((t[st] for t, st in zip(token_ids, starts)), dtype=np.int64, count=nseq)
        cu_q[1:] = np.arange(1, nseq + 1)
        row_seq = np.arange(nseq)
        positions = s
    else:
        # input ids: one pass over the chunks (list slices are C-level copies)
        ids = np.fromiter(
            chain.from_iterable(t[st : st + k] for t, st, k in zip(token_ids, starts, num_tokens)),
            dtype=np.int64,
            count=total,
        )
        np.add.accumulate(n, out=cu_q[1:])
        # positions: start + 0, 1, ... restarting per sequence
        row_seq = np.repeat(np.arange(nseq), n)
        positions = np.arange(total, dtype=np.int64)
        positions += (s - cu_q[:-1])[row_seq]
    cu_k = np.zeros(nseq + 1, dtype=np.int32)
    np.add.accumulate(seq_lens, out=cu_k[1:])
    slot_mapping = tables[row_seq, positions // block_size].astype(np.int64)
    if total and np.minimum.reduce(slot_mapping) < 0:
        raise ValueError("a sequence has fewer blocks than its tokens need")
    slot_mapping *= block_size
    slot_mapping += positions % block_size
    logits_indices = cu_q[1:].astype(np.int64)
    logits_indices -= 1
    return StepLayout(
        input_ids=ids,
        positions=positions,
        slot_mapping=slot_mapping,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        seq_lens=seq_lens.astype(np.int32),
        block_tables=tables,
        max_seqlen_q=int(max(num_tokens, default=0)),
        max_seqlen_k=longest,
        logits_indices=logits_indices,
    )


def build_decode_layout(
    input_ids: Sequence[int],
    positions: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    *,
    block_tables: np.ndarray | None = None,
) -> StepLayout:
    """The layout of a decode-only step: every sequence computes one token.

    Equal to [`build_layout`][batchkit.kv.build_layout] with every ``num_tokens`` 1
    and ``token_ids[b][starts[b]] == input_ids[b]``, for less: decode steps are most
    steps, and their layout sits between two kernel launches. Per-sequence values are
    computed on Python ints (at tens of sequences, cheaper than array operations),
    then nine array calls make the fields.

    Args:
        input_ids: The token each sequence computes.
        positions: Its position in its sequence (>= 0).
        block_ids: Each sequence's blocks, enough for ``positions[b] + 1`` tokens.
        block_size: Tokens per block.
        block_tables: The same blocks as ``block_ids`` as an int32 array
            (``[B, >= most blocks]``, ``-1`` padded); ``None`` builds it.

    Raises:
        ValueError: The per-sequence arguments differ in length, a position is
            negative, or a sequence has fewer blocks than its tokens need.
    """
    nseq = len(positions)
    if not len(input_ids) == len(block_ids) == nseq:
        raise ValueError("input_ids, positions and block_ids must have one entry per sequence")
    if nseq and min(positions) < 0:
        raise ValueError("every sequence computes at least one token from a start >= 0")
    longest = max(positions, default=-1) + 1
    if block_tables is None:
        block_tables = _table_array(block_ids)[0]
    elif block_tables.shape[0] != nseq or block_tables.shape[1] * block_size < longest:
        raise ValueError(f"block_tables of shape {block_tables.shape} is too small for this step")
    try:
        slots = [
            b[p // block_size] * block_size + p % block_size for b, p in zip(block_ids, positions)
        ]
    except IndexError:
        raise ValueError("a sequence has fewer blocks than its tokens need") from None
    seq_lens = np.array(positions, dtype=np.int32)
    seq_lens += 1
    cu_k = np.zeros(nseq + 1, dtype=np.int32)
    np.add.accumulate(seq_lens, out=cu_k[1:])  # the ufunc: np.cumsum's wrapper costs more
    return StepLayout(
        input_ids=np.array(input_ids, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        slot_mapping=np.array(slots, dtype=np.int64),
        cu_seqlens_q=np.arange(nseq + 1, dtype=np.int32),
        cu_seqlens_k=cu_k,
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_seqlen_q=min(nseq, 1),
        max_seqlen_k=int(longest),
        logits_indices=np.arange(nseq, dtype=np.int64),
    )


def _table_array(block_ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``block_ids`` as int32 ``[B, max(1, most blocks)]``, ``-1`` padded; and blocks held."""
    nseq = len(block_ids)
    held = np.fromiter(map(len, block_ids), dtype=np.int64, count=nseq)
    tables = np.full((nseq, max(int(held.max(initial=0)), 1)), -1, dtype=np.int32)
    flat = np.fromiter(chain.from_iterable(block_ids), dtype=np.int32, count=int(held.sum()))
    tables[np.arange(tables.shape[1])[None, :] < held[:, None]] = flat  # row-major = concat order
    return tables, held
