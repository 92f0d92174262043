"""The streaming example over real HTTP (uvicorn on 127.0.0.1): concurrent clients each
get exactly their own server-sent events; one leaving early costs nobody else."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests._modules import load_module  # noqa: E402
from tests.integrations._http import serving  # noqa: E402

APP_PATH = Path(__file__).resolve().parents[2] / "examples" / "stream_sse.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_module(APP_PATH, "batchkit_example_stream_sse")


async def read_events(client: httpx.AsyncClient, text: str, stop_after: int | None) -> list[str]:
    chunks: list[str] = []
    async with client.stream("GET", "/speak", params={"text": text}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        event = "message"
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: "):
                if event == "end":
                    return chunks
                chunks.append(json.loads(line[len("data: ") :]))
                if stop_after is not None and len(chunks) == stop_after:
                    return chunks  # leaves: the response is closed early
    raise AssertionError(f"the stream for {text!r} ended without its end event")


def test_concurrent_sse_clients_get_their_own_chunks(example: ModuleType) -> None:
    texts = [" ".join(f"w{i}x{j}" for j in range(i % 5 + 1)) for i in range(24)]
    leavers = {3: 1, 7: 2}  # client index -> chunks read before it disconnects

    async def main(url: str) -> list[list[str]]:
        async with httpx.AsyncClient(base_url=url, timeout=20) as client:
            return await asyncio.gather(
                *(read_events(client, t, leavers.get(i)) for i, t in enumerate(texts))
            )

    with serving(example.app) as url:
        results = asyncio.run(main(url))
    for i, (text, got) in enumerate(zip(texts, results)):
        expected = [example.speak_one(w) for w in text.split()]
        assert got == expected[: leavers.get(i, len(expected))], text
    stats = example.speak.stats()
    assert stats.items_run == len(texts) and stats.batches < len(texts)  # real batches
