"""Regressions from a review of the exporter: each test failed before its fix."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

import batchkit  # noqa: E402
from batchkit import RequestTimeout  # noqa: E402
from batchkit.metrics import PrometheusMetrics  # noqa: E402
from tests.serve._wait import wait_until  # noqa: E402


def _exporter() -> tuple[PrometheusMetrics, prometheus_client.CollectorRegistry]:
    registry = prometheus_client.CollectorRegistry()
    return PrometheusMetrics(registry), registry


def _make():
    @batchkit.batched(max_batch_size=8)
    def embed(xs):
        return xs

    return embed


def test_a_collected_function_is_gone_from_the_very_next_scrape() -> None:
    metrics, _ = _exporter()
    f = _make()
    metrics.track(f, name="embed")
    f.map(range(3))
    f.close()
    del f
    gc.collect()
    assert 'batcher="embed"' not in metrics.generate_latest().decode()  # was: one scrape late


def test_the_name_of_a_collected_function_can_be_tracked_again() -> None:
    metrics, registry = _exporter()
    f = _make()
    metrics.track(f, name="embed")
    f.close()
    del f
    gc.collect()
    g = _make()
    assert metrics.track(g, name="embed") == "embed"  # was ValueError: already tracked
    g.map(range(5))
    sample = registry.get_sample_value(
        "inference_requests_total", {"batcher": "embed", "outcome": "ok"}
    )
    assert sample == 5.0
    g.close()


def test_a_late_event_does_not_bring_back_removed_series() -> None:
    metrics, registry = _exporter()
    f = _make()
    metrics.track(f, name="embed")
    (tracker,) = f.runtime.core.listeners
    metrics.untrack(f)
    f.add_listener(tracker)  # as if an event were on its way during the untrack
    f.map(range(3))
    assert 'batcher="embed"' not in metrics.generate_latest().decode()
    assert registry.get_sample_value("inference_batches_total", {"batcher": "embed"}) is None
    f.close()


def test_a_batch_whose_task_was_cancelled_is_exported() -> None:
    metrics, registry = _exporter()
    started = threading.Event()

    @batchkit.batched(max_batch_size=4)
    async def f(xs):
        started.set()
        await asyncio.sleep(10)
        return xs

    metrics.track(f, name="f")

    async def main() -> None:
        asyncio.ensure_future(f(1))
        while not started.is_set():
            await asyncio.sleep(0.001)
        # leaving with the batch running: asyncio.run cancels its task

    asyncio.run(main())
    stats = f.stats()
    assert (stats.batches, stats.failed, stats.in_flight) == (1, 1, 0)
    labels = {"batcher": "f", "outcome": "error"}
    err = registry.get_sample_value("inference_requests_total", labels)
    assert err == 1.0  # was 0: the batch never reached the listeners
    assert registry.get_sample_value("inference_batch_latency_seconds_count", {"batcher": "f"}) == 1


def test_a_thread_map_timeout_counts_timeouts_and_names_the_callers_timeout() -> None:
    release = threading.Event()

    @batchkit.batched(max_batch_size=1, max_queue_size=2, when_full="block")
    def f(xs):
        release.wait(10)
        return xs

    busy = threading.Thread(target=lambda: f(0))
    busy.start()
    wait_until(lambda: f.stats().in_flight == 1)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout, match=r"timeout=0.2s"):  # was the time left: 0.19..s
        f.map([1, 2, 3, 4], timeout=0.2)
    assert time.monotonic() - t0 < 5
    stats = f.stats()
    assert stats.cancelled == 0  # was 2: the withdrawn items counted as cancelled
    assert stats.timeouts == 3  # the one that waited for room, and the two withdrawn
    release.set()
    busy.join()
    f.close()
