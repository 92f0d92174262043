"""Fixtures of the exporter tests: a fresh registry and an exporter on it."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def registry() -> Any:
    prometheus_client = pytest.importorskip("prometheus_client")
    return prometheus_client.CollectorRegistry()


@pytest.fixture
def exporter(registry: Any) -> Any:
    from batchkit.metrics import PrometheusMetrics

    return PrometheusMetrics(registry)
