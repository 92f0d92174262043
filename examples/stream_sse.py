"""Streaming out of a batch: a FastAPI endpoint that sends server-sent events.

A text-to-speech-like model turns each text into audio chunks, one per word, for a
whole batch of texts at once: its batch function is a generator that yields, per
step, one entry per text (a chunk, or ``batchkit.END`` once that text is spoken).
Concurrent HTTP requests share batches; each gets exactly its own chunks, as
``text/event-stream``, and a client that disconnects early stops only its own stream.

Run:  python examples/stream_sse.py          (serves http://127.0.0.1:8001)
Try:  curl -N '127.0.0.1:8001/speak?text=hello+streaming+world'
Without arguments as a script it also runs a self-check (several clients at once).
"""

from __future__ import annotations

import asyncio
import json
import sys
import zlib
from collections.abc import AsyncIterator, Iterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

import batchkit


def speak_one(word: str) -> str:
    """What the emulated model makes of one word: a deterministic 'audio' digest."""
    return f"{word}:{zlib.crc32(word.encode()):08x}"


@batchkit.batched(max_batch_size=16, max_wait_ms=5)
def speak(texts: list[str]) -> Iterator[list[object]]:
    """The model: one step per word position, for every text of the batch at once."""
    words = [t.split() for t in texts]
    for step in range(max(map(len, words), default=0)):
        yield [speak_one(w[step]) if step < len(w) else batchkit.END for w in words]


app = FastAPI()


@app.get("/speak")
async def speak_endpoint(text: str) -> StreamingResponse:
    """One event per chunk, then an ``end`` event."""

    async def events() -> AsyncIterator[str]:
        async for chunk in speak.astream(text, timeout=10):
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "event: end\ndata: {}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def self_check() -> None:
    """Several texts streamed at once through the batch function equal one at a time."""
    texts = ["hello streaming world", "one", "batched generators share a batch", ""]

    async def collect(text: str) -> list[str]:
        return [c async for c in speak.astream(text)]

    together = await asyncio.gather(*(collect(t) for t in texts))
    for text, got in zip(texts, together):
        assert got == [speak_one(w) for w in text.split()], (text, got)
    print(f"{len(texts)} streams, {sum(map(len, together))} chunks, each its own")
    print(f"batches: {speak.stats().batches}, time to first chunk p50: "
          f"{speak.stats().time_to_first_chunk.p50 * 1e3:.2f} ms")


if __name__ == "__main__":
    asyncio.run(self_check())
    if "--serve" in sys.argv:
        import uvicorn

        uvicorn.run(app, host="127.0.0.1", port=8001)
