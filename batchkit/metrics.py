"""Prometheus metrics for ``@batched`` functions (``pip install "batchkit[metrics]"``).

```python
from prometheus_client import start_http_server
import batchkit
from batchkit.metrics import PrometheusMetrics

@batchkit.batched(max_batch_size=32, max_wait_ms=5)
def embed(texts: list[str]) -> list[int]:
    return [len(t) for t in texts]

metrics = PrometheusMetrics()           # the default registry
metrics.track(embed)                    # label batcher="embed" (the qualname)
start_http_server(9100, addr="127.0.0.1")    # or serve metrics.generate_latest()
```

Everything is recorded from the runtime's events (:mod:`batchkit.serve.events`) as
it happens; only the queue-depth and in-flight gauges are read at scrape time from
``f.stats()``. Every series carries a ``batcher`` label. The names are listed in
:data:`METRIC_NAMES` and documented in ``docs/metrics.md``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

try:
    from prometheus_client import (
        CONTENT_TYPE_LATEST,
        REGISTRY,
        CollectorRegistry,
        Counter,
        Histogram,
    )
    from prometheus_client import generate_latest as _generate_latest
    from prometheus_client import make_asgi_app as _make_asgi_app
    from prometheus_client.core import GaugeMetricFamily, Metric
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "batchkit.metrics needs prometheus-client: pip install 'batchkit[metrics]'"
    ) from exc

from batchkit.serve.batched import BatchedFunction
from batchkit.serve.events import BatchEvent, DropEvent
from batchkit.serve.observe import (
    DEFAULT_LATENCY_BUCKETS,
    DEFAULT_SIZE_BUCKETS,
    LABEL_VALUES,
    METRICS,
    batch_observations,
    drop_observations,
)

__all__ = [
    "CONTENT_TYPE_LATEST",
    "DEFAULT_LATENCY_BUCKETS",
    "DEFAULT_SIZE_BUCKETS",
    "METRIC_NAMES",
    "PrometheusMetrics",
]

METRIC_NAMES: dict[str, str] = {
    "inference_batch_size": "histogram: real items per batch",
    "inference_queue_wait_seconds": "histogram: per request, enqueue to dispatch",
    "inference_batch_latency_seconds": "histogram: per batch, dispatch to results",
    "inference_batches_total": "counter, label reason: batches by dispatch reason",
    "inference_requests_total": "counter, label outcome: requests that ran (ok, error)",
    "inference_dropped_requests_total": "counter, label reason: requests that never ran",
    "inference_tokens_total": "counter: sum of the batched items' keys (lengths)",
    "inference_padded_tokens_total": "counter: batch size x longest key, summed over batches",
    "inference_padding_items_total": "counter: filler items added to reach a strict size",
    "inference_queue_depth": "gauge (read at scrape): requests waiting",
    "inference_in_flight_batches": "gauge (read at scrape): batches running",
}
"""Every metric family as exposed (counters with their ``_total``), without the
namespace, and what it measures."""


class _Tracker:
    """The listener attached to one function, holding its label's metric children
    pre-bound (a ``.labels()`` lookup per event would take a lock and hash each time)."""

    def __init__(self, owner: PrometheusMetrics, name: str) -> None:
        self.name = name
        self._owner = owner
        self._children: list[tuple[Counter | Histogram, tuple[str, ...]]] = []
        self._record: dict[tuple[str, str | None], Callable[[float], None]] = {}
        self.removed = False  # a late event must not bring removed series back
        for spec in METRICS:  # every known label value starts at 0
            for value in LABEL_VALUES.get(spec.name, (None,)):
                self._recorder(spec.name, value)

    def _recorder(self, metric: str, value: str | None) -> Callable[[float], None]:
        record = self._record.get((metric, value))
        if record is None:  # first sight (or a label value newer than the table)
            family = self._owner._families[metric]
            labels = (self.name,) if value is None else (self.name, value)
            self._children.append((family, labels))
            child: Any = family.labels(*labels)
            record = child.observe if isinstance(family, Histogram) else child.inc
            self._record[(metric, value)] = record
        return record

    def remove(self) -> None:
        """Remove every series this tracker created."""
        self.removed = True
        for metric, values in self._children:
            metric.remove(*values)
        self._children.clear()
        self._record.clear()

    def on_batch(self, event: BatchEvent) -> None:
        """Record one finished batch (called on the runtime's worker, under its lock)."""
        if self.removed:
            return
        for metric, value, amount in batch_observations(event):
            self._recorder(metric, value)(amount)

    def on_drop(self, event: DropEvent) -> None:
        """Count requests that ended without running."""
        if self.removed:
            return
        for metric, value, amount in drop_observations(event):
            self._recorder(metric, value)(amount)


class PrometheusMetrics:
    """A Prometheus exporter for any number of ``@batched`` functions.

    ``registry``: where the metrics are registered (``None``: prometheus-client's
    default ``REGISTRY``, which ``start_http_server`` and ``make_asgi_app`` serve;
    one exporter per registry). ``namespace``: a prefix, e.g. ``"myapp"`` gives
    ``myapp_inference_batch_size``. ``latency_buckets`` (seconds) apply to the queue
    wait and batch latency histograms, ``size_buckets`` to the batch size histogram.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        namespace: str = "",
        *,
        latency_buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS,
        size_buckets: Sequence[float] = DEFAULT_SIZE_BUCKETS,
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.namespace = namespace
        self._lock = threading.Lock()
        self._tracked: dict[str, tuple[weakref.ref[BatchedFunction[Any]], _Tracker]] = {}

        # First in the registry, so every scrape forgets garbage-collected functions
        # before any family of theirs is written (whatever serves the registry).
        self.registry.register(_Pruner(self))
        self._families: dict[str, Counter | Histogram] = {}
        for spec in METRICS:
            labels = ("batcher",) if spec.label is None else ("batcher", spec.label)
            family: Counter | Histogram
            if spec.kind == "histogram":
                buckets = size_buckets if spec.buckets == "size" else latency_buckets
                family = Histogram(
                    spec.name, spec.doc, labels, namespace=namespace, registry=None, buckets=buckets
                )
            else:
                family = Counter(spec.name, spec.doc, labels, namespace=namespace, registry=None)
            self._families[spec.name] = family
            self.registry.register(family)
        self.registry.register(_ScrapeTimeGauges(self))

    # -- which functions ------------------------------------------------------
    def track(self, f: BatchedFunction[Any], name: str | None = None) -> str:
        """Export ``f``'s metrics under ``batcher=name`` (default: ``f``'s qualname).

        Returns the label. Tracking the same function under the same name again does
        nothing; a name already used by another function raises ``ValueError``.
        """
        if not isinstance(f, BatchedFunction):
            raise TypeError(f"track() needs a @batched function, got {type(f).__name__}")
        label = f.__qualname__ if name is None else name
        if not isinstance(label, str) or not label:
            raise ValueError(f"name must be a non-empty string, got {label!r}")
        with self._lock:
            known = self._tracked.get(label)
            if known is not None:
                holder = known[0]()
                if holder is f:
                    return label
                if holder is not None:
                    raise ValueError(f"a function is already tracked as batcher={label!r}")
                del self._tracked[label]  # its function is gone: the name is free again
                known[1].remove()
            if any(ref() is f for ref, _ in self._tracked.values()):
                raise ValueError(f"{f.__qualname__} is already tracked under another name")
            tracker = _Tracker(self, label)
            self._tracked[label] = (weakref.ref(f), tracker)
        f.add_listener(tracker)
        return label

    def untrack(self, f: BatchedFunction[Any]) -> None:
        """Stop exporting ``f``: detach the listener and remove its series."""
        with self._lock:
            found = [name for name, (ref, _) in self._tracked.items() if ref() is f]
            if not found:
                raise KeyError(f"{f.__qualname__} is not tracked")
            _, tracker = self._tracked.pop(found[0])
            # Under the lock: a track() of a new function under this name must not
            # lose its fresh series to this removal.
            tracker.remove()
        f.remove_listener(tracker)

    @property
    def tracked(self) -> dict[str, BatchedFunction[Any]]:
        """The tracked functions by label (those still alive)."""
        with self._lock:
            items = [(name, ref()) for name, (ref, _) in self._tracked.items()]
        return {name: f for name, f in items if f is not None}

    def _prune_dead(self) -> None:
        """Forget functions that were garbage-collected (they were tracked weakly)."""
        with self._lock:
            dead = [name for name, (ref, _) in self._tracked.items() if ref() is None]
            for name in dead:
                self._tracked.pop(name)[1].remove()

    # -- exposition -------------------------------------------------------------
    content_type: str = CONTENT_TYPE_LATEST
    """The ``Content-Type`` of :meth:`generate_latest`'s text."""

    def generate_latest(self) -> bytes:
        """The registry in Prometheus text format (serve it at ``/metrics``)."""
        return _generate_latest(self.registry)

    def asgi_app(self) -> Callable[..., Any]:
        """An ASGI app serving the registry (``app.mount("/metrics", ...)``)."""
        return _make_asgi_app(self.registry)


class _Pruner:
    """A collector with no samples: forgets garbage-collected functions at each scrape."""

    def __init__(self, owner: PrometheusMetrics) -> None:
        self.owner = owner

    def describe(self) -> Iterable[Metric]:
        """No names."""
        return []

    def collect(self) -> Iterable[Metric]:
        """Prune, then nothing to report."""
        self.owner._prune_dead()
        return []


class _ScrapeTimeGauges:
    """A custom collector: queue depth and in-flight batches, read when scraped.

    A gauge set on every event would be stale between events and cost a lock per
    arrival; reading the runtime's load at scrape time is exact and costs nothing
    between scrapes.
    """

    def __init__(self, owner: PrometheusMetrics) -> None:
        self.owner = owner
        ns = f"{owner.namespace}_" if owner.namespace else ""
        self.depth_name = f"{ns}inference_queue_depth"
        self.in_flight_name = f"{ns}inference_in_flight_batches"

    def describe(self) -> Iterable[Metric]:
        """Names for the registry's duplicate check (no samples)."""
        return self._families({})

    def collect(self) -> Iterable[Metric]:
        """One sample per tracked function."""
        return self._families(self.owner.tracked)

    def _families(self, tracked: dict[str, BatchedFunction[Any]]) -> list[Metric]:
        depth = GaugeMetricFamily(
            self.depth_name, "Requests waiting in the queue.", labels=["batcher"]
        )
        in_flight = GaugeMetricFamily(
            self.in_flight_name, "Batches running now.", labels=["batcher"]
        )
        for name, f in tracked.items():
            waiting, running = f.load()
            depth.add_metric([name], waiting)
            in_flight.add_metric([name], running)
        return [depth, in_flight]
