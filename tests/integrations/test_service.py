"""The FastAPI example served by uvicorn on 127.0.0.1: a few hundred concurrent HTTP
requests, each answered with exactly its unbatched embedding, in batches; batchkit's
errors answered with their HTTP status (full queue 503 + Retry-After, missed latency
target 503 + Retry-After from the target, timeout 504, closed 503); batch settings
read from the environment. Past capacity under a latency target, with MiniLM:
test_service_overload.py."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from tests._modules import load_module  # noqa: E402
from tests.integrations._http import serving  # noqa: E402

APP_PATH = Path(__file__).resolve().parents[2] / "examples" / "service" / "app.py"
N_REQUESTS = 300


def load_app_module() -> ModuleType:
    return load_module(APP_PATH, "batchkit_example_service")


@pytest.fixture(scope="module")
def module() -> ModuleType:
    return load_app_module()


@pytest.fixture(scope="module")
def service(module: ModuleType) -> Iterator[tuple[str, Any, Any]]:
    """(base URL, the app, the module) of a service batching up to 32 requests."""
    app = module.create_app(settings=module.BatchSettings(max_batch_size=32, max_wait_ms=2))
    with serving(app) as url:
        yield url, app, module


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
    assert health == {
        "ok": True,
        "queue_depth": 0,
        "batches": stats.batches,
        "overloaded": 0,
        "shed": 0,
        "latency_model": None,  # no BATCHKIT_MAX_LATENCY_MS: nothing to learn
    }

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


class GatedEncoder:
    """The tiny encoder, whose forward pass waits until the test opens the gate."""

    def __init__(self, module: ModuleType) -> None:
        self.inner = module.TinyEncoder()
        self.gate = threading.Event()
        self.tokenize = self.inner.tokenize
        self.max_chars = self.inner.max_chars

    def __call__(self, batch: Any) -> Any:
        assert self.gate.wait(10), "the test never opened the gate"
        return self.inner(batch)


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "condition not reached within 10 s"
        time.sleep(0.005)


def post_later(url: str, text: str) -> tuple[threading.Thread, list[Any]]:
    """POST /embed from a thread; the response lands in the returned list."""
    out: list[Any] = []
    thread = threading.Thread(
        target=lambda: out.append(httpx.post(f"{url}/embed", json={"text": text}, timeout=20))
    )
    thread.start()
    return thread, out


def test_full_queue_answers_503_with_retry_after(
    module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Settings from the environment: one request per batch, one may wait.
    monkeypatch.setenv("BATCHKIT_MAX_BATCH_SIZE", "1")
    monkeypatch.setenv("BATCHKIT_MAX_QUEUE_SIZE", "1")
    encoder = GatedEncoder(module)
    app = module.create_app(encoder)
    model = app.state.model
    with serving(app) as url:
        running, running_out = post_later(url, "runs first")
        wait_until(lambda: model.stats().in_flight == 1)
        waiting, waiting_out = post_later(url, "waits")
        wait_until(lambda: model.stats().queue_depth == 1)
        refused = httpx.post(f"{url}/embed", json={"text": "one too many"}, timeout=20)
        encoder.gate.set()
        running.join(20)
        waiting.join(20)
    assert refused.status_code == 503
    assert refused.headers["Retry-After"] == "1"
    assert refused.json()["error"] == "QueueFull"
    assert running_out[0].status_code == waiting_out[0].status_code == 200
    assert model.stats().rejected == 1


def test_request_waiting_past_its_timeout_answers_504(module: ModuleType) -> None:
    settings = module.BatchSettings(max_batch_size=1, request_timeout_s=0.05)
    encoder = GatedEncoder(module)
    app = module.create_app(encoder, settings)
    model = app.state.model
    with serving(app) as url:
        running, running_out = post_later(url, "holds the only slot")
        wait_until(lambda: model.stats().in_flight == 1)
        late = httpx.post(f"{url}/embed", json={"text": "cannot start in time"}, timeout=20)
        encoder.gate.set()
        running.join(20)
    assert late.status_code == 504
    assert "Retry-After" not in late.headers
    assert late.json()["error"] == "RequestTimeout"
    assert running_out[0].status_code == 200
    assert model.stats().timeouts == 1


def test_closed_batcher_answers_503(module: ModuleType) -> None:
    app = module.create_app(settings=module.BatchSettings())
    with serving(app) as url:
        assert httpx.post(f"{url}/embed", json={"text": "before"}, timeout=20).status_code == 200
        app.state.model.close()  # as at shutdown
        after = httpx.post(f"{url}/embed", json={"text": "after"}, timeout=20)
    assert after.status_code == 503
    assert after.json()["error"] == "BatcherClosed"


def test_a_subclass_of_a_mapped_error_answers_as_its_base(module: ModuleType) -> None:
    import batchkit

    class Busy(batchkit.QueueFull):
        pass

    response = module.error_response(Busy("try later"))
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"


@pytest.mark.parametrize(("target_s", "retry_after"), [(0.05, "1"), (1.0, "1"), (2.5, "3")])
def test_overloaded_answers_503_retry_after_its_target_and_the_times(
    module: ModuleType, target_s: float, retry_after: str
) -> None:
    import json

    import batchkit

    error = batchkit.Overloaded("would be late", predicted_s=target_s * 1.5, target_s=target_s)
    response = module.error_response(error)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == retry_after  # whole seconds, at least 1
    assert json.loads(response.body) == {
        "detail": "would be late",
        "error": "Overloaded",
        "predicted_ms": round(target_s * 1.5e3, 1),
        "target_ms": round(target_s * 1e3, 1),
    }


def test_latency_target_from_the_environment_reaches_the_batcher(
    module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHKIT_MAX_LATENCY_MS", "250")
    app = module.create_app()
    assert app.state.settings.max_latency_ms == 250.0
    with serving(app) as url:  # a target learns batch times: a model in /healthz
        for i in range(8):
            assert httpx.post(f"{url}/embed", json={"text": f"t{i}"}, timeout=20).is_success
        health = httpx.get(f"{url}/healthz", timeout=10).json()
    assert health["latency_model"] is not None and health["latency_model"]["samples"] == 8


def test_settings_come_from_the_environment(module: ModuleType) -> None:
    settings = module.BatchSettings.from_env(
        {
            "BATCHKIT_MAX_BATCH_SIZE": "8",
            "BATCHKIT_MAX_WAIT_MS": "0.5",
            "BATCHKIT_MAX_QUEUE_SIZE": "100",
            "BATCHKIT_REQUEST_TIMEOUT_S": "2",
            "BATCHKIT_MAX_LATENCY_MS": "300",
        }
    )
    assert settings == module.BatchSettings(8, 0.5, 100, 2.0, 300.0)
    assert module.BatchSettings.from_env({}) == module.BatchSettings()
    assert module.BatchSettings().max_latency_ms is None  # no target unless asked


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("BATCHKIT_MAX_BATCH_SIZE", "0"),
        ("BATCHKIT_MAX_BATCH_SIZE", "4.5"),
        ("BATCHKIT_MAX_WAIT_MS", "-1"),
        ("BATCHKIT_MAX_WAIT_MS", "soon"),
        ("BATCHKIT_MAX_QUEUE_SIZE", "lots"),
        ("BATCHKIT_REQUEST_TIMEOUT_S", "nan"),
        ("BATCHKIT_MAX_LATENCY_MS", "0"),
        ("BATCHKIT_MAX_LATENCY_MS", "-50"),
        ("BATCHKIT_MAX_LATENCY_MS", "inf"),
        ("BATCHKIT_MAX_LATENCY_MS", "fast"),
    ],
)
def test_a_bad_setting_names_its_variable(module: ModuleType, name: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be .* got '{re.escape(value)}'"):
        module.BatchSettings.from_env({name: value})


def test_serving_freezes_the_startup_heap_out_of_garbage_collection(module: ModuleType) -> None:
    import gc

    gc.unfreeze()  # (process-wide: whatever an earlier app froze)
    app = module.create_app(settings=module.BatchSettings())
    assert gc.get_freeze_count() == 0
    with serving(app) as url:  # the model and libraries: never walked by a collection
        assert gc.get_freeze_count() > 0
        assert httpx.post(f"{url}/embed", json={"text": "frozen"}, timeout=20).is_success
