"""The Prometheus exporter: exact values after known workloads, names, labels, lifetime."""

from __future__ import annotations

import asyncio
import gc
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

import batchkit  # noqa: E402
from batchkit import DynamicBatcher, QueueFull, RequestTimeout, StaticBatcher  # noqa: E402
from batchkit.metrics import GROUP_METRIC_NAMES, METRIC_NAMES, PrometheusMetrics  # noqa: E402
from tests.metrics._samples import value  # noqa: E402
from tests.serve._wait import wait_until  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def double(xs: list[int]) -> list[int]:
    return [2 * x for x in xs]


class Gate:
    """A batch function that blocks until released, to hold requests in the queue."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, xs: list[Any]) -> list[Any]:
        self.started.set()
        assert self.release.wait(10)
        return xs


def test_static_workload_exact_counts(registry: Any, exporter: PrometheusMetrics) -> None:
    f = batchkit.batched(batcher=StaticBatcher(4))(double)
    assert exporter.track(f) == "double"
    assert f.map(range(12)) == [2 * x for x in range(12)]
    lb = {"batcher": "double"}
    assert value(registry, "inference_batch_size_count", **lb) == 3
    assert value(registry, "inference_batch_size_sum", **lb) == 12
    assert value(registry, "inference_batch_size_bucket", le="4.0", **lb) == 3
    assert value(registry, "inference_batch_size_bucket", le="2.0", **lb) == 0
    assert value(registry, "inference_queue_wait_seconds_count", **lb) == 12
    assert value(registry, "inference_batch_latency_seconds_count", **lb) == 3
    assert value(registry, "inference_batches_total", reason="full", **lb) == 3
    assert value(registry, "inference_batches_total", reason="max_wait", **lb) == 0
    assert value(registry, "inference_requests_total", outcome="ok", **lb) == 12
    assert value(registry, "inference_requests_total", outcome="error", **lb) == 0
    for reason in ("rejected", "timeout", "cancelled", "closed", "overloaded"):
        assert value(registry, "inference_dropped_requests_total", reason=reason, **lb) == 0
    assert value(registry, "inference_queue_depth", **lb) == 0
    assert value(registry, "inference_in_flight_batches", **lb) == 0
    f.close()


def test_a_streaming_function_exports_its_time_to_first_chunk(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    @batchkit.batched(batcher=StaticBatcher(2))
    def spell(words: list[str]) -> Any:
        for step in range(max(map(len, words))):
            yield [w[step] if step < len(w) else batchkit.END for w in words]

    lb = {"batcher": exporter.track(spell)}
    streams = [spell.stream(w) for w in ("ab", "cde", "f", "gh")]
    assert ["".join(s) for s in streams] == ["ab", "cde", "f", "gh"]
    assert value(registry, "inference_time_to_first_chunk_seconds_count", **lb) == 2
    assert value(registry, "inference_batch_latency_seconds_count", **lb) == 2
    spell.close()


def test_the_watchdog_is_exported_at_scrape_time(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    release = threading.Event()

    def model(xs: list[int]) -> list[int]:
        if -1 in xs:
            release.wait(10)
        return xs

    f = batchkit.batched(max_batch_size=1, max_wait_ms=0, batch_timeout=0.05)(model)
    exporter.track(f, name="hangs")
    lb = {"batcher": "hangs"}
    assert value(registry, "inference_healthy", **lb) == 1
    for _ in range(2):  # one stuck thread is replaced; the second passes the bound
        with pytest.raises(batchkit.BatchTimeout):
            f(-1)
    assert value(registry, "inference_batch_timeouts_total", **lb) == 2
    assert value(registry, "inference_abandoned_workers", **lb) == 2
    assert value(registry, "inference_healthy", **lb) == 0
    release.set()
    wait_until(lambda: value(registry, "inference_abandoned_workers", **lb) == 0)
    assert value(registry, "inference_healthy", **lb) == 1
    f.close()


def test_a_stateful_functions_sessions_are_exported_at_scrape_time(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    clock = [0.0]

    @batchkit.batched(
        max_batch_size=4, state=lambda: 0, session_idle_s=10.0, clock=lambda: clock[0]
    )
    def total(chunks: list[int], states: list[int]) -> tuple[list[int], list[int]]:
        sums = [s + c for c, s in zip(chunks, states)]
        return sums, sums

    exporter.track(total, name="sums")
    lb = {"batcher": "sums"}
    for key in ("a", "b", "c"):
        total(1, session=key)
    total(1, session="a", end=True)
    assert value(registry, "inference_sessions", **lb) == 2
    assert value(registry, "inference_sessions_ended_total", **lb) == 1
    clock[0] = 11.0  # "b" and "c" have been idle past session_idle_s
    assert value(registry, "inference_sessions", **lb) == 0
    assert value(registry, "inference_sessions_evicted_total", **lb) == 2
    total.close()


def test_failed_items_count_as_errors(registry: Any, exporter: PrometheusMetrics) -> None:
    def model(xs: list[int]) -> list[Any]:
        return [ValueError("odd") if x % 2 else x for x in xs]

    f = batchkit.batched(batcher=StaticBatcher(5))(model)
    exporter.track(f, name="m")
    with pytest.raises(ValueError):
        f.map(range(10))
    assert value(registry, "inference_requests_total", batcher="m", outcome="ok") == 5
    assert value(registry, "inference_requests_total", batcher="m", outcome="error") == 5
    f.close()


def test_rejections_from_queue_full(registry: Any, exporter: PrometheusMetrics) -> None:
    f = batchkit.batched(max_batch_size=4, max_wait_ms=1, max_queue_size=2)(double)
    exporter.track(f, name="small")
    with pytest.raises(QueueFull):
        f.map([1, 2, 3])  # all or nothing: three rejected at once
    gate = Gate()
    g = batchkit.batched(max_batch_size=1, max_wait_ms=0, max_queue_size=1)(gate)
    exporter.track(g, name="gated")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(g, 1)
        assert gate.started.wait(5)  # 1 runs; the queue is empty
        second = pool.submit(g, 2)
        wait_for(lambda: g.stats().queue_depth == 1)
        assert value(registry, "inference_queue_depth", batcher="gated") == 1
        with pytest.raises(QueueFull):
            g(3)
        gate.release.set()
        assert (first.result(5), second.result(5)) == (1, 2)
    assert (
        value(registry, "inference_dropped_requests_total", batcher="small", reason="rejected") == 3
    )
    assert (
        value(registry, "inference_dropped_requests_total", batcher="gated", reason="rejected") == 1
    )
    assert value(registry, "inference_requests_total", batcher="gated", outcome="ok") == 2
    f.close()
    g.close()


def test_timeouts_cancellations_and_closes(registry: Any, exporter: PrometheusMetrics) -> None:
    gate = Gate()
    f = batchkit.batched(max_batch_size=1, max_wait_ms=0)(gate)
    exporter.track(f, name="slow")
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(f, "runs")
        assert gate.started.wait(5)
        with pytest.raises(RequestTimeout):
            f("late", timeout=0.02)

        async def cancel_one() -> None:
            task = asyncio.ensure_future(f.acall("cancelled"))
            await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancel_one())
        queued = [pool.submit(f, f"queued{i}") for i in range(2)]
        wait_for(lambda: f.stats().queue_depth == 2)
        assert value(registry, "inference_queue_depth", batcher="slow") == 2
        f.close(timeout=0.05)  # the gate holds: the two waiting requests fail as "closed"
        gate.release.set()
        for fut in [running, *queued]:
            with pytest.raises(batchkit.BatcherClosed):
                fut.result(5)
    drops = {
        r: value(registry, "inference_dropped_requests_total", batcher="slow", reason=r)
        for r in ("rejected", "timeout", "cancelled", "closed")
    }
    assert drops == {"rejected": 0, "timeout": 1, "cancelled": 1, "closed": 2}
    assert f.stats().timeouts == 1 and f.stats().cancelled == 1


def test_requests_refused_for_a_latency_target_count_as_overloaded(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    now = [0.0]

    def model(xs: list[int]) -> list[int]:
        now[0] += 0.010 + 0.001 * len(xs)  # the injected clock: a batch's time
        return xs

    f = batchkit.batched(max_batch_size=8, max_latency_ms=50, clock=lambda: now[0])(model)
    exporter.track(f, name="slo")
    for n in (1, 2, 4, 8, 3, 6, 5, 7):
        f.map(range(n))
    with pytest.raises(batchkit.Overloaded):
        f.map(range(100))
    dropped = value(
        registry, "inference_dropped_requests_total", batcher="slo", reason="overloaded"
    )
    assert dropped == 100 and f.stats().overloaded == 100
    f.close()


def test_tokens_padding_and_dispatch_reasons(registry: Any, exporter: PrometheusMetrics) -> None:
    f = batchkit.batched(batcher=DynamicBatcher(4, 5, key=len))(lambda xs: xs)
    exporter.track(f, name="tok")
    f.map(["a", "bb", "ccc", "dddd"])  # one full batch: 10 tokens in a 4 x 4 area
    assert value(registry, "inference_tokens_total", batcher="tok") == 10
    assert value(registry, "inference_padded_tokens_total", batcher="tok") == 16
    assert value(registry, "inference_batches_total", batcher="tok", reason="full") == 1

    strict = DynamicBatcher(4, 5, preferred_batch_sizes=(4,), strict_sizes=True)
    g = batchkit.batched(batcher=strict)(lambda xs: xs)
    exporter.track(g, name="strict")
    g.map([1, 2, 3])  # no batch running: leaves at once ("idle"), padded up to 4
    assert value(registry, "inference_padding_items_total", batcher="strict") == 1
    assert value(registry, "inference_batches_total", batcher="strict", reason="idle") == 1
    assert value(registry, "inference_batch_size_sum", batcher="strict") == 3
    f.close()
    g.close()


def test_many_concurrent_callers_histogram_counts(registry: Any) -> None:
    exporter = PrometheusMetrics(registry, namespace="svc")
    f = batchkit.batched(max_batch_size=16, max_wait_ms=2)(double)
    exporter.track(f)

    async def main() -> list[int]:
        return list(await asyncio.gather(*(f.acall(i) for i in range(300))))

    assert asyncio.run(main()) == [2 * i for i in range(300)]
    stats = f.stats()
    name = f.__qualname__
    assert value(registry, "svc_inference_batch_size_count", batcher=name) == stats.batches
    assert value(registry, "svc_inference_batch_size_sum", batcher=name) == 300
    assert value(registry, "svc_inference_queue_wait_seconds_count", batcher=name) == 300
    reasons = sum(
        value(registry, "svc_inference_batches_total", batcher=name, reason=r)
        for r in ("full", "max_wait", "idle", "closing")
    )
    assert reasons == stats.batches < 300  # batches were formed
    f.close()


def test_exposition_has_every_documented_name(registry: Any, exporter: PrometheusMetrics) -> None:
    f = batchkit.batched(max_batch_size=4)(double)
    exporter.track(f)
    f(1)
    text = exporter.generate_latest().decode()
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    exported = {re.sub(r"_created$", "", n) for n in families}
    assert set(METRIC_NAMES) <= exported
    documented = set(re.findall(r"^\| `((?:inference|generation)_\w+)` \|", DOCS.read_text(), re.M))
    assert documented == set(METRIC_NAMES) | set(GROUP_METRIC_NAMES)  # (groups: test_groups)
    assert exporter.content_type.startswith("text/plain")
    f.close()


def test_track_untrack_names_and_weak_references(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    f = batchkit.batched(max_batch_size=4)(double)
    g = batchkit.batched(max_batch_size=4)(double)
    assert exporter.track(f, name="a") == "a"
    assert exporter.track(f, name="a") == "a"  # idempotent
    with pytest.raises(ValueError, match="already tracked"):
        exporter.track(g, name="a")
    with pytest.raises(ValueError, match="another name"):
        exporter.track(f, name="b")
    with pytest.raises(TypeError):
        exporter.track(double)  # type: ignore[arg-type]
    exporter.track(g, name="b")
    assert set(exporter.tracked) == {"a", "b"}
    exporter.untrack(f)
    f(1)  # no longer observed, and its series are gone
    assert (
        registry.get_sample_value("inference_requests_total", {"batcher": "a", "outcome": "ok"})
        is None
    )
    assert registry.get_sample_value("inference_queue_depth", {"batcher": "a"}) is None
    with pytest.raises(KeyError):
        exporter.untrack(f)
    exporter.track(f, name="a")  # back, from zero
    assert value(registry, "inference_requests_total", batcher="a", outcome="ok") == 0
    f.close()
    del g
    gc.collect()
    exporter.generate_latest()  # a scrape forgets collected functions
    assert set(exporter.tracked) == {"a"}
    assert registry.get_sample_value("inference_batch_size_count", {"batcher": "b"}) is None


def test_one_exporter_per_registry(registry: Any, exporter: PrometheusMetrics) -> None:
    with pytest.raises(ValueError, match="Duplicated"):
        PrometheusMetrics(registry)
    PrometheusMetrics(registry, namespace="other")  # a namespace makes the names distinct


def test_asgi_app_serves_the_registry(registry: Any, exporter: PrometheusMetrics) -> None:
    f = batchkit.batched(max_batch_size=4)(double)
    exporter.track(f, name="asgi")
    f(1)
    app = exporter.asgi_app()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/", "query_string": b"", "headers": []}
    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b'inference_requests_total{batcher="asgi",outcome="ok"} 1.0' in body
    f.close()


# -- helpers --------------------------------------------------------------------
def wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def test_coalesced_callers_and_cache_hits_are_exported(
    registry: Any, exporter: PrometheusMetrics
) -> None:
    f = batchkit.batched(double, cache={})
    lb = {"batcher": exporter.track(f, name="shared")}
    assert f.map([1, 1, 2, 1]) == [2, 2, 4, 2]  # two callers join 1
    assert f(2) == 4  # a hit
    assert value(registry, "inference_coalesced_requests_total", **lb) == 2
    assert value(registry, "inference_cache_hits_total", **lb) == 1
    assert value(registry, "inference_requests_total", outcome="ok", **lb) == 2
    f.close()
