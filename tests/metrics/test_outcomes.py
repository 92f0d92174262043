"""Requests that end badly are exported as they ended: a batch whose task was cancelled
counts its requests as errors; withdrawn map() items count as timeouts."""

from __future__ import annotations

import asyncio
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
