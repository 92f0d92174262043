"""How long a tracked function's series live: gone from the next scrape once it is
collected, its name free again, and never brought back by a late event."""

from __future__ import annotations

import gc

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

import batchkit  # noqa: E402
from batchkit.metrics import PrometheusMetrics  # noqa: E402


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
    (tracker,) = f.runtime.core.answers.listeners
    metrics.untrack(f)
    f.add_listener(tracker)  # as if an event were on its way during the untrack
    f.map(range(3))
    assert 'batcher="embed"' not in metrics.generate_latest().decode()
    assert registry.get_sample_value("inference_batches_total", {"batcher": "embed"}) is None
    f.close()
