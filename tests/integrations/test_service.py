"""The FastAPI example served by uvicorn on 127.0.0.1: a few hundred concurrent HTTP
requests, each answered with exactly its unbatched embedding, in batches."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

APP_PATH = Path(__file__).resolve().parents[2] / "examples" / "service" / "app.py"
N_REQUESTS = 300


def load_app_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("batchkit_example_service", APP_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the module's annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[str, Any, Any]]:
    """(base URL, the app, the module), served by uvicorn in a thread on a free port."""
    module = load_app_module()
    app = module.create_app(max_batch_size=32, max_wait_ms=2)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # a free port, only on loopback
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app, module
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


WORDS = ["the", "model", "batches", "concurrent", "requests", "by", "length", "so", "padding"]


def texts(n: int) -> list[str]:
    """``n`` distinct texts of 1 to about 90 words."""
    return [" ".join(WORDS[i % 9 :] + WORDS * (i % 10)) + f" #{i}" for i in range(n)]


def test_concurrent_requests_get_their_unbatched_results(service: tuple[str, Any, Any]) -> None:
    url, app, module = service
    inputs = texts(N_REQUESTS)

    async def fire() -> list[Any]:
        # Ten requests per client: one httpx pool with hundreds of requests in flight
        # spends more time on its own queue than the server on the requests.
        clients = [httpx.AsyncClient(base_url=url, timeout=30) for _ in range(N_REQUESTS // 10)]
        try:
            responses = await asyncio.gather(
                *(
                    clients[i % len(clients)].post("/embed", json={"text": t})
                    for i, t in enumerate(inputs)
                )
            )
            metrics_text = (await clients[0].get("/metrics")).text
            health = (await clients[0].get("/healthz")).json()
        finally:
            for client in clients:
                await client.aclose()
        return [responses, metrics_text, health]

    responses, metrics_text, health = asyncio.run(fire())
    assert all(r.status_code == 200 for r in responses), responses[0].text
    import torch

    got = torch.tensor([r.json()["embedding"] for r in responses])
    want = torch.tensor([module.embed_alone(app.state.encoder, t) for t in inputs])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    stats = app.state.model.stats()
    assert stats.requests == stats.items_run == N_REQUESTS
    assert stats.batches < N_REQUESTS / 2, stats  # batches were actually formed
    assert health == {"ok": True, "queue_depth": 0, "batches": stats.batches}

    def sample(name: str, **labels: str) -> float:
        sel = ",".join(f'{k}="{v}"' for k, v in {"batcher": "embed", **labels}.items())
        m = re.search(rf"^{name}\{{{sel}\}} (\S+)$", metrics_text, re.M)
        assert m, f"{name} missing from /metrics"
        return float(m.group(1))

    assert sample("inference_batch_size_sum") == N_REQUESTS
    assert sample("inference_batch_size_count") == stats.batches
    assert sample("inference_queue_wait_seconds_count") == N_REQUESTS
    assert sample("inference_requests_total", outcome="ok") == N_REQUESTS
    assert sample("inference_queue_depth") == 0
    # Bucketing by length keeps the padded area close to the real tokens.
    assert 0 < sample("inference_tokens_total") <= sample("inference_padded_tokens_total")


def test_metrics_endpoint_is_prometheus_text(service: tuple[str, Any, Any]) -> None:
    url, _, _ = service
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert "# TYPE inference_batch_latency_seconds histogram" in response.text
