"""The example service's HTTP edge, over real HTTP on 127.0.0.1: a body over
``BATCHKIT_MAX_BODY_BYTES`` is a 413 before it is read; a text is cut to what the
model reads and tokenised on the batcher's worker thread, never on the event loop; a
lone surrogate is a 422; a client too slow to send its request is disconnected; past
``limit_concurrency`` uvicorn answers 503 at once. None of these reaches the model."""

from __future__ import annotations

import socket
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
pytest.importorskip("uvicorn")

from tests._modules import load_module  # noqa: E402
from tests.integrations._http import serving  # noqa: E402

APP_PATH = Path(__file__).resolve().parents[2] / "examples" / "service" / "app.py"
MAX_BODY = 4096


@pytest.fixture(scope="module")
def module() -> ModuleType:
    return load_module(APP_PATH, "batchkit_example_service_edge")


class RecordingEncoder:
    """The tiny encoder, noting each text it tokenises and the thread it ran on."""

    def __init__(self, module: ModuleType) -> None:
        self.inner = module.TinyEncoder()
        self.max_chars = 200
        self.seen: list[tuple[int, str]] = []  # (len(text), thread name)

    def tokenize(self, text: str) -> Any:
        self.seen.append((len(text), threading.current_thread().name))
        return self.inner.tokenize(text)

    def __call__(self, batch: Any) -> Any:
        return self.inner(batch)


def start(module: ModuleType, encoder: Any = None, **server: Any) -> Any:
    """(app, its uvicorn options) with the test's body limit and ``server`` settings."""
    settings = module.ServerSettings(**{"max_body_bytes": MAX_BODY, **server})
    app = module.create_app(encoder, module.BatchSettings(), settings)
    return app, settings.uvicorn_options()


def raw_request(url: str, data: bytes, wait_s: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection; what the server sends back before it
    closes the connection or goes quiet for ``wait_s``."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and out.startswith(b"HTTP/1.1 413"):
                    break  # the answer's head is enough
        except TimeoutError:
            pass
    return out


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(module: ModuleType) -> None:
    app, options = start(module)
    with serving(app, **options) as url:
        head = (
            "POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10 * 2**20}\r\n\r\n"
        )
        answer = raw_request(url, head.encode())  # not one byte of the body sent
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert app.state.model.stats().requests == 0


def test_a_streamed_body_over_the_limit_is_413(module: ModuleType) -> None:
    app, options = start(module)

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer
        yield b'{"text": "'
        for _ in range(4 * MAX_BODY // 1024):
            yield b"w" * 1024
        yield b'"}'

    with serving(app, **options) as url:
        response = httpx.post(f"{url}/embed", content=chunks(), timeout=20)
    assert response.status_code == 413
    assert "BATCHKIT_MAX_BODY_BYTES" in response.json()["detail"]
    assert app.state.model.stats().requests == 0


def test_a_long_text_is_cut_and_tokenised_off_the_event_loop(module: ModuleType) -> None:
    encoder = RecordingEncoder(module)
    app, options = start(module, encoder)
    texts = ["short text", "word " * 700]  # 3500 characters: under the body limit
    with serving(app, **options) as url:
        responses = [httpx.post(f"{url}/embed", json={"text": t}, timeout=20) for t in texts]
    assert [r.status_code for r in responses] == [200, 200]
    for response, text in zip(responses, texts):
        want = module.embed_alone(encoder.inner, text[: encoder.max_chars])
        assert response.json()["embedding"] == pytest.approx(want, abs=1e-5)
    assert max(length for length, _ in encoder.seen) <= encoder.max_chars
    threads = {name for _, name in encoder.seen}
    assert all(name.startswith("batchkit-") for name in threads), threads  # the worker's


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"text": "abc \\ud800"}', "lone surrogate"),
        (b'{"txt": "abc \\udfff"}', "Field required"),  # a bad body echoing one
    ],
)
def test_a_lone_surrogate_is_422(module: ModuleType, body: bytes, says: str) -> None:
    app, options = start(module)
    with serving(app, **options) as url:
        response = httpx.post(
            f"{url}/embed",
            content=body,
            headers={"content-type": "application/json"},
            timeout=20,
        )
        fine = httpx.post(f"{url}/embed", json={"text": "abc \u00e9"}, timeout=20)
    assert response.status_code == 422, response.text
    assert says in response.text
    assert fine.status_code == 200
    assert app.state.model.stats().requests == 1


@pytest.mark.parametrize(
    "sent",
    [
        b"POST /embed HTTP/1.1\r\nHost:",  # headers never finished
        b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"text": ',  # body never finished
    ],
    ids=["headers", "body"],
)
def test_a_client_too_slow_to_send_its_request_is_disconnected(
    module: ModuleType, sent: bytes
) -> None:
    app, options = start(module, read_timeout_s=0.2)
    with serving(app, **options) as url:
        started = time.monotonic()
        answer = raw_request(url, sent, wait_s=10.0)
        waited = time.monotonic() - started
        after = httpx.post(f"{url}/embed", json={"text": "still serving"}, timeout=20)
    assert not answer.startswith(b"HTTP/1.1 200")
    assert waited < 5.0  # closed by the server (at 0.2 s), not by the client's 10 s
    assert after.status_code == 200


def test_connections_past_limit_concurrency_get_503_at_once(module: ModuleType) -> None:
    app, options = start(module, limit_concurrency=3)
    with serving(app, **options) as url:
        host, port = url.removeprefix("http://").split(":")
        # Two connections that send nothing: with this request's own, three.
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            refused = httpx.post(f"{url}/embed", json={"text": "a third"}, timeout=20)
        finally:
            for sock in idle:
                sock.close()
        served = None
        for _ in range(100):  # until the server has seen the idle ones close
            served = httpx.post(f"{url}/embed", json={"text": "room again"}, timeout=20)
            if served.status_code == 200:
                break
            time.sleep(0.05)
    assert refused.status_code == 503
    assert served is not None and served.status_code == 200
    assert app.state.model.stats().requests == 1  # the refused one never reached it


def test_server_settings_come_from_the_environment(module: ModuleType) -> None:
    settings = module.ServerSettings.from_env(
        {
            "BATCHKIT_MAX_BODY_BYTES": "1000",
            "BATCHKIT_LIMIT_CONCURRENCY": "50",
            "BATCHKIT_BACKLOG": "16",
            "BATCHKIT_KEEP_ALIVE_S": "2",
            "BATCHKIT_READ_TIMEOUT_S": "1.5",
        }
    )
    assert settings == module.ServerSettings(1000, 50, 16, 2, 1.5)
    assert module.ServerSettings.from_env({}) == module.ServerSettings()
    options = settings.uvicorn_options()
    assert {k: options[k] for k in ("limit_concurrency", "backlog", "timeout_keep_alive")} == {
        "limit_concurrency": 50,
        "backlog": 16,
        "timeout_keep_alive": 2,
    }


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("BATCHKIT_MAX_BODY_BYTES", "0"),
        ("BATCHKIT_MAX_BODY_BYTES", "1e6"),
        ("BATCHKIT_LIMIT_CONCURRENCY", "none"),
        ("BATCHKIT_BACKLOG", "-1"),
        ("BATCHKIT_KEEP_ALIVE_S", "0"),
        ("BATCHKIT_READ_TIMEOUT_S", "inf"),
    ],
)
def test_a_bad_server_setting_names_its_variable(module: ModuleType, name: str, value: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be .* got '{value}'"):
        module.ServerSettings.from_env({name: value})
