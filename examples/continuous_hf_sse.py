"""A Hugging Face causal LM served over FastAPI, its tokens streamed as server-sent events.

A tiny random Llama (built offline from a config: no download) runs under
``batchkit.integrations.transformers.continuous_batcher``: every step is one forward
pass over all running requests, their keys and values in batchkit's paged KV pool.
``POST /generate`` takes token ids (a real server would tokenize text first), sampling
settings and a token budget, and streams each token as it is generated; a client that
disconnects cancels only its own request.

As a script it starts the server in-process on a free port, streams a few requests
at once with httpx (greedy ones checked equal to ``model.generate`` on each prompt
alone, a seeded one drawn twice alike), prints them and exits.

Run:  python examples/continuous_hf_sse.py
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator

import httpx
import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from transformers import LlamaConfig, LlamaForCausalLM

from batchkit.generate import Sampling
from batchkit.integrations.transformers import continuous_batcher

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=None, eos_token_id=None, pad_token_id=0,
)  # fmt: skip
model = LlamaForCausalLM(config).eval()
batcher = continuous_batcher(model, max_num_seqs=8, max_num_batched_tokens=128, num_blocks=64)


class GenerateRequest(BaseModel):
    """The body of ``POST /generate``."""

    prompt_ids: list[int]
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


app = FastAPI()


@app.post("/generate")
async def generate(req: GenerateRequest) -> StreamingResponse:
    """One ``data:`` event per generated token, then an ``end`` event."""
    try:
        sampling = Sampling(
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed
        )
        handle = batcher.submit(
            req.prompt_ids, max_new_tokens=req.max_new_tokens, sampling=sampling
        )
    except (TypeError, ValueError) as exc:  # a bad request is the client's error, by name
        raise HTTPException(status_code=422, detail=str(exc)) from None

    async def events() -> AsyncIterator[str]:
        try:
            async for token in handle:
                yield f"data: {json.dumps(token)}\n\n"
            yield f"event: end\ndata: {json.dumps(handle.finish_reason)}\n\n"
        finally:
            handle.cancel()  # the client left early: stop generating for it (no-op if done)

    return StreamingResponse(events(), media_type="text/event-stream")


async def stream(client: httpx.AsyncClient, body: dict[str, object]) -> list[int]:
    """The tokens one client receives."""
    tokens: list[int] = []
    async with client.stream("POST", "/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("event: end"):
                break
            if line.startswith("data: "):
                tokens.append(json.loads(line[len("data: ") :]))
    return tokens


def solo_greedy(prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


async def clients(base_url: str) -> None:
    prompts = [[5, 17, 42, 8], [9, 33, 21, 2, 60, 61, 62], [100, 3], [7] * 20]
    seeded = {"prompt_ids": [11, 12, 13], "max_new_tokens": 12, "temperature": 0.8,
              "top_k": 40, "top_p": 0.95, "seed": 7}  # fmt: skip
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        bodies = [{"prompt_ids": p, "max_new_tokens": 10} for p in prompts] + [seeded, seeded]
        results = await asyncio.gather(*(stream(client, b) for b in bodies))
        refused = await client.post("/generate", json={"prompt_ids": [1], "top_p": 0})
    for prompt, got in zip(prompts, results):
        assert got == solo_greedy(prompt, 10), (prompt, got)
        print(f"greedy {prompt} -> {got}")
    assert results[-1] == results[-2]
    print(f"seeded (twice, alike) -> {results[-1]}")
    assert refused.status_code == 422
    print(f"refused: {refused.json()['detail']}")


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            threading.Event().wait(0.02)
        asyncio.run(clients(f"http://127.0.0.1:{port}"))
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        batcher.close()
    stats = batcher.stats()
    print(f"{stats.finished} requests, {stats.steps} steps, {stats.tokens_generated} tokens")


if __name__ == "__main__":
    main()
