"""A deterministic toy "model" for exactness tests: the next token is a hash of all earlier ones.

Two step functions compute it the way a real model would: ``SlottedToy`` keeps a running
state per row and advances it by the chunk it is given; ``PagedToy`` writes each token
into a flat "KV cache" at its slot and re-reads the whole history through the block
table. Both check the step contract as they go (``start`` equals what they computed
before; state is never used after release), so a scheduler bug shows up as a wrong token
or an error, never silently. A padding row (``is_padding``) gets ``PADDING_RESULT``, an
entry that would fail any request it reached.
"""

from __future__ import annotations

import numpy as np

from batchkit.generate import StepBatch

VOCAB = 23
MOD = 1_000_003
PADDING_RESULT = -1  # not a token id: applied to a request, it would fail it


def advance(h: int, tokens: list[int]) -> int:
    for t in tokens:
        h = (h * 31 + t + 7) % MOD
    return h


def solo(prompt: list[int], max_new_tokens: int, stops: frozenset[int] = frozenset()) -> list[int]:
    """The tokens one request generates alone."""
    h = advance(0, prompt)
    out: list[int] = []
    while len(out) < max_new_tokens:
        tok = h % VOCAB
        out.append(tok)
        if tok in stops:
            break
        h = advance(h, [tok])
    return out


class SlottedToy:
    """Per-row running state, advanced chunk by chunk."""

    def __init__(self) -> None:
        self.state: dict[int, tuple[int, int, int]] = {}  # request id -> (slot, h, computed)
        self.steps = 0

    def __call__(self, batch: StepBatch) -> list[int | None]:
        self.steps += 1
        for rid in batch.released:
            self.state.pop(rid, None)
        slots = [s.slot for s in batch.requests]
        if len(set(slots)) != len(slots):
            raise AssertionError(f"two sequences share a row: {slots}")
        out: list[int | None] = []
        for s in batch.seqs:
            if s.is_padding:
                out.append(PADDING_RESULT)
                continue
            if s.start == 0:
                h = 0
            else:
                slot, h, computed = self.state[s.request_id]
                if slot != s.slot or computed != s.start:
                    raise AssertionError(f"state of {s.request_id} moved or skipped tokens")
            h = advance(h, s.token_ids[s.start : s.start + s.num_tokens])
            self.state[s.request_id] = (s.slot, h, s.start + s.num_tokens)  # type: ignore[assignment]
            out.append(h % VOCAB if s.sample else None)
        return out


class PagedToy:
    """Tokens written into a paged cache at their slots; history re-read via block tables."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.cache = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.block_size = block_size
        self.steps = 0

    def __call__(self, batch: StepBatch) -> list[int | None]:
        self.steps += 1
        layout = batch.layout
        write = layout.slot_mapping >= 0  # -1: do not write (padding rows)
        self.cache[layout.slot_mapping[write]] = layout.input_ids[write]
        bs = self.block_size
        out: list[int | None] = []
        for b, s in enumerate(batch.seqs):
            if s.is_padding:
                out.append(PADDING_RESULT)
                continue
            length = int(layout.seq_lens[b])
            blocks = layout.block_tables[b, : -(-length // bs)]
            history = self.cache.reshape(-1, bs)[blocks].reshape(-1)[:length]
            if (history != np.asarray(s.token_ids[:length])).any():
                raise AssertionError(f"request {s.request_id}: the cache holds other tokens")
            out.append(advance(0, history.tolist()) % VOCAB if s.sample else None)
        return out
