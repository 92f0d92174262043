"""A streaming GRU serving 64 concurrent sessions from asyncio, one chunk at a time.

Each session (say, one audio stream) sends its frames in chunks; the GRU needs the
hidden state the session's previous chunk left. ``@batched(state=...)`` keeps one
state per session and runs each session's chunks in order, one at a time, while
chunks of different sessions share a batch. With ``stack_states=True`` the hidden
states live as rows of one ``[sessions, hidden]`` tensor (on the model's device):
each batch gathers its rows by index and writes the new ones back, so no state is
copied to the host or re-stacked per batch. ``end=True`` on a session's last chunk
frees its row.

Every chunk's output is checked against the GRU run on that session alone, chunk by
chunk (within float rounding: a batched matmul may sum in another order). Runs on
CPU in a few seconds:

    python examples/sessions_streaming_gru.py
"""

from __future__ import annotations

import asyncio
import random

import torch

import batchkit

FEATURES, HIDDEN, FRAMES = 16, 32, 8  # a chunk is FRAMES frames of FEATURES values
SESSIONS = 64

torch.manual_seed(0)
torch.set_num_threads(1)
gru = torch.nn.GRU(FEATURES, HIDDEN, batch_first=True).eval()


@batchkit.batched(
    max_batch_size=64,
    max_wait_ms=2,
    collate=torch.stack,  # [B, FRAMES, FEATURES]
    state=lambda: torch.zeros(HIDDEN),
    stack_states=True,
    max_sessions=SESSIONS,
)
@torch.inference_mode()
def step(chunks: torch.Tensor, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk per session: `states` is `[B, HIDDEN]`, the sessions' rows."""
    outputs, last = gru(chunks, states.unsqueeze(0).contiguous())
    return outputs, last[0]  # per item: its [FRAMES, HIDDEN] outputs; its new state


@torch.inference_mode()
def alone(chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The reference: one session's chunks through the GRU, in order, unbatched."""
    state = torch.zeros(1, 1, HIDDEN)
    outputs = []
    for chunk in chunks:
        out, state = gru(chunk.unsqueeze(0), state)
        outputs.append(out[0])
    return outputs


async def stream(chunks: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """One session's client: each chunk is sent when the previous answer came back."""
    outputs = []
    for i, chunk in enumerate(chunks):
        outputs.append(await step.acall(chunk, session=key, end=i == len(chunks) - 1))
    return outputs


async def main() -> None:
    rng = random.Random(0)
    sessions = [
        [torch.randn(FRAMES, FEATURES) for _ in range(rng.randint(5, 40))] for _ in range(SESSIONS)
    ]
    served = await asyncio.gather(*(stream(chunks, key) for key, chunks in enumerate(sessions)))
    for chunks, outputs in zip(sessions, served):
        for got, expected in zip(outputs, alone(chunks), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    stats = step.stats()
    chunks_total = sum(len(c) for c in sessions)
    print(f"{SESSIONS} sessions, {chunks_total} chunks, each equal to its session run alone")
    print(
        f"{stats.batches} batches, {stats.mean_batch_size:.1f} chunks per batch on average; "
        f"live sessions at the end: {stats.sessions} (ended: {stats.sessions_ended})"
    )
    assert stats.sessions == 0 and stats.sessions_ended == SESSIONS
    await step.aclose()


if __name__ == "__main__":
    asyncio.run(main())
