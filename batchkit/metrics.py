"""Prometheus metrics for ``@batched`` functions and continuous batchers
(``pip install "batchkit-ml[metrics]"``).

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

Everything is recorded from the runtime's events (`batchkit.serve.events`) as
it happens; only the queue-depth and in-flight gauges are read at scrape time from
``f.stats()``. A `ContinuousBatcher` is tracked the same way: its
latency histograms and requests by outcome come from its listener events
(`batchkit.generate.observe`); its token, preemption and prefix-cache counters
and its load gauges are read at scrape time from ``batcher.stats()`` and its KV pool.
Every series carries a ``batcher`` label. The names are listed in
`METRIC_NAMES` and documented in ``docs/metrics.md``.

Per-group series (label ``group``) are written only for what was tracked with
``track(f, groups=True)``: a label's cardinality is the user's call. They are read at
scrape time from ``stats().groups`` (listed in `GROUP_METRIC_NAMES`).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

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
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "batchkit.metrics needs prometheus-client: pip install 'batchkit-ml[metrics]'"
    ) from exc

from batchkit.generate.batcher import ContinuousBatcher
from batchkit.generate.observe import FinishEvent, StepEvent
from batchkit.serve.batched import BatchedFunction
from batchkit.serve.coalesce import sharing_counts
from batchkit.serve.events import BatchEvent, DropEvent
from batchkit.serve.observe import (
    DEFAULT_LATENCY_BUCKETS,
    DEFAULT_SIZE_BUCKETS,
    LABEL_VALUES,
    METRICS,
    MetricSpec,
    batch_observations,
    drop_observations,
)

__all__ = [
    "CONTENT_TYPE_LATEST",
    "DEFAULT_GENERATION_BUCKETS",
    "DEFAULT_LATENCY_BUCKETS",
    "DEFAULT_SIZE_BUCKETS",
    "GENERATION_METRICS",
    "GROUP_METRIC_NAMES",
    "METRIC_NAMES",
    "PrometheusMetrics",
]

METRIC_NAMES: dict[str, str] = {
    "inference_batch_size": "histogram: real items per batch",
    "inference_queue_wait_seconds": "histogram: per request, enqueue to dispatch",
    "inference_batch_latency_seconds": "histogram: per batch, dispatch to results",
    "inference_time_to_first_chunk_seconds": "histogram: per streaming batch, to its first chunk",
    "inference_batches_total": "counter, label reason: batches by dispatch reason",
    "inference_requests_total": "counter, label outcome: requests that ran (ok, error)",
    "inference_dropped_requests_total": "counter, label reason: requests that never ran",
    "inference_tokens_total": "counter: sum of the batched items' keys (lengths)",
    "inference_padded_tokens_total": "counter: batch size x longest key, summed over batches",
    "inference_padding_items_total": "counter: filler items added to reach a strict size",
    "inference_queue_depth": "gauge (read at scrape): requests waiting",
    "inference_in_flight_batches": "gauge (read at scrape): batches running",
    "inference_batch_timeouts_total": "counter (read at scrape): calls past batch_timeout",
    "inference_abandoned_workers": "gauge (read at scrape): sync workers stuck in a timed-out call",
    "inference_healthy": "gauge (read at scrape): 1, or 0 once stuck workers pass the bound",
    "inference_coalesced_requests_total": "counter (read at scrape): callers that joined a "
    "request of the same key (coalesce=)",
    "inference_cache_hits_total": "counter (read at scrape): callers answered from the cache",
    "inference_sessions": "gauge (read at scrape): a stateful function's live sessions",
    "inference_sessions_ended_total": "counter (read at scrape): sessions ended by their callers",
    "inference_sessions_evicted_total": "counter (read at scrape): sessions ended idle",
    # continuous batchers (ContinuousBatcher)
    "generation_time_to_first_token_seconds": "histogram: per request, submit to first token",
    "generation_inter_token_latency_seconds": "histogram: per later token, since the previous one",
    "generation_request_latency_seconds": "histogram: per request, submit to its answer",
    "generation_queue_time_seconds": "histogram: per request, submit to its first step",
    "generation_requests_total": "counter, label outcome: requests answered, by how they ended",
    "generation_tokens_generated_total": "counter (read at scrape): tokens sampled",
    "generation_tokens_computed_total": "counter (read at scrape): tokens computed",
    "generation_preemptions_total": "counter (read at scrape): sequences preempted",
    "generation_prefix_cache_hits_total": "counter (read at scrape): prefix-cache block hits",
    "generation_prefix_cache_lookups_total": "counter (read at scrape): prefix-cache lookups",
    "generation_waiting_sequences": "gauge (read at scrape): sequences waiting (new or preempted)",
    "generation_running_sequences": "gauge (read at scrape): sequences running",
    "generation_kv_blocks_used": "gauge (read at scrape, paged mode): KV blocks in use",
    "generation_kv_blocks_free": "gauge (read at scrape, paged mode): KV blocks free",
}
"""Every metric family as exposed (counters with their ``_total``), without the
namespace, and what it measures (the per-group ones are in `GROUP_METRIC_NAMES`)."""

GROUP_METRIC_NAMES: dict[str, str] = {
    "inference_group_admitted_requests_total": (
        "counter (read at scrape), label group: a group's requests admitted to the queue"
    ),
    "inference_group_batches_total": (
        "counter (read at scrape), label group: batches holding a request of the group"
    ),
    "inference_group_queue_wait_seconds": (
        "gauge (read at scrape), labels group, quantile: p50/p99 of a group's recent waits"
    ),
    "generation_group_admitted_requests_total": (
        "counter (read at scrape), label group: a group's requests that started"
    ),
    "generation_group_steps_total": (
        "counter (read at scrape), label group: steps computing a sequence of the group"
    ),
    "generation_group_tokens_computed_total": (
        "counter (read at scrape), label group: tokens computed for the group"
    ),
    "generation_group_tokens_generated_total": (
        "counter (read at scrape), label group: tokens sampled for the group"
    ),
}
"""The per-group families, written only for what was tracked with ``groups=True``
(``@batched`` functions: ``inference_group_*``; continuous batchers:
``generation_group_*``), without the namespace, and what each measures."""

DEFAULT_GENERATION_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)  # fmt: skip
"""Seconds: inter-token latencies of milliseconds up to requests of minutes."""

GENERATION_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "generation_time_to_first_token_seconds",
        "histogram",
        "Seconds from each request's submit to its first generated token.",
        buckets="latency",
    ),
    MetricSpec(
        "generation_inter_token_latency_seconds",
        "histogram",
        "Seconds between consecutive generated tokens of a request.",
        buckets="latency",
    ),
    MetricSpec(
        "generation_request_latency_seconds",
        "histogram",
        "Seconds from each request's submit to its answer (finished, cancelled or failed).",
        buckets="latency",
    ),
    MetricSpec(
        "generation_queue_time_seconds",
        "histogram",
        "Seconds each request waited from submit to its first step.",
        buckets="latency",
    ),
    MetricSpec(
        "generation_requests",
        "counter",
        "Requests answered, by outcome: stop, length, cancelled, timeout, error.",
        "outcome",
    ),
)
"""The continuous batcher's families recorded from its listener events (the others are
read at scrape time)."""

GENERATION_LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "generation_requests": ("stop", "length", "cancelled", "timeout", "error"),
}


def _shown(f: Any) -> str:
    """How errors name a tracked object."""
    return str(f.name if isinstance(f, ContinuousBatcher) else f.__qualname__)


class _Tracker:
    """The listener attached to one function, holding its label's metric children
    pre-bound (a ``.labels()`` lookup per event would take a lock and hash each time)."""

    def __init__(
        self,
        owner: PrometheusMetrics,
        name: str,
        specs: tuple[MetricSpec, ...] = METRICS,
        label_values: dict[str, tuple[str, ...]] = LABEL_VALUES,
    ) -> None:
        self.name = name
        self.groups = False  # write its per-group series (set by track, under the lock)
        self._owner = owner
        self._children: list[tuple[Counter | Histogram, tuple[str, ...]]] = []
        self._record: dict[tuple[str, str | None], Callable[[float], None]] = {}
        self.removed = False  # a late event must not bring removed series back
        for spec in specs:  # every known label value starts at 0
            for value in label_values.get(spec.name, (None,)):
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


class _GenerationTracker(_Tracker):
    """The listener attached to one continuous batcher (called by its driver, under the
    batcher's lock)."""

    def __init__(self, owner: PrometheusMetrics, name: str) -> None:
        super().__init__(owner, name, GENERATION_METRICS, GENERATION_LABEL_VALUES)
        self._ttft = self._recorder("generation_time_to_first_token_seconds", None)
        self._itl = self._recorder("generation_inter_token_latency_seconds", None)
        self._queue = self._recorder("generation_queue_time_seconds", None)
        self._latency = self._recorder("generation_request_latency_seconds", None)

    def on_step(self, event: StepEvent) -> None:
        """Record one step's latencies."""
        if self.removed:
            return
        for seconds in event.queue_times:
            self._queue(seconds)
        for seconds in event.first_token_times:
            self._ttft(seconds)
        for seconds in event.inter_token_times:
            self._itl(seconds)

    def on_finish(self, event: FinishEvent) -> None:
        """Record one answered request."""
        if self.removed:
            return
        self._latency(event.latency)
        self._recorder("generation_requests", event.reason)(1)


_T = TypeVar("_T", bound=_Tracker)
_Tracked = dict[str, tuple["weakref.ref[Any]", _Tracker]]
"""Tracked objects by label: a weak reference to each and its listener."""


class PrometheusMetrics:
    """A Prometheus exporter for any number of ``@batched`` functions and continuous
    batchers ([`ContinuousBatcher`][batchkit.ContinuousBatcher]).

    Args:
        registry: Where the metrics are registered. ``None``: prometheus-client's
            default ``REGISTRY``, which ``start_http_server`` and ``make_asgi_app``
            serve. One exporter per registry: a second one raises prometheus-client's
            ``ValueError`` for the duplicated names.
        namespace: A prefix for every name, e.g. ``"myapp"`` gives
            ``myapp_inference_batch_size`` (``""``: none).
        latency_buckets: Histogram bucket bounds, in seconds, of the queue wait and
            batch latency histograms.
        size_buckets: Bucket bounds, in items, of the batch size histogram.
        generation_buckets: Bucket bounds, in seconds, of the continuous batchers'
            latency histograms.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        namespace: str = "",
        *,
        latency_buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS,
        size_buckets: Sequence[float] = DEFAULT_SIZE_BUCKETS,
        generation_buckets: Sequence[float] = DEFAULT_GENERATION_BUCKETS,
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.namespace = namespace
        self._lock = threading.Lock()
        self._tracked: _Tracked = {}  # @batched functions
        self._tracked_batchers: _Tracked = {}  # continuous batchers

        # First in the registry, so every scrape forgets garbage-collected functions
        # before any family of theirs is written (whatever serves the registry).
        self.registry.register(_Pruner(self))
        self._families: dict[str, Counter | Histogram] = {}
        for spec in METRICS:
            buckets = size_buckets if spec.buckets == "size" else latency_buckets
            self._register(spec, buckets)
        self.registry.register(_ScrapeTimeGauges(self))
        for spec in GENERATION_METRICS:
            self._register(spec, generation_buckets)
        self.registry.register(_GenerationScrapeTime(self))
        self.registry.register(_GroupSeries(self))

    def _register(self, spec: MetricSpec, buckets: Sequence[float]) -> None:
        """Create and register the family of ``spec``."""
        labels = ("batcher",) if spec.label is None else ("batcher", spec.label)
        family: Counter | Histogram
        if spec.kind == "histogram":
            family = Histogram(
                spec.name, spec.doc, labels, namespace=self.namespace, registry=None,
                buckets=buckets,
            )  # fmt: skip
        else:
            family = Counter(spec.name, spec.doc, labels, namespace=self.namespace, registry=None)
        self._families[spec.name] = family
        self.registry.register(family)

    # -- which functions ------------------------------------------------------
    def track(
        self,
        f: BatchedFunction[Any, Any] | ContinuousBatcher,
        name: str | None = None,
        *,
        groups: bool = False,
    ) -> str:
        """Export ``f``'s metrics under ``batcher=name`` (default: ``f``'s qualname; a
        [`ContinuousBatcher`][batchkit.ContinuousBatcher]'s ``name``).

        Tracking the same function under the same name again keeps its series; only
        ``groups`` takes the new call's value (the per-group series are read at
        scrape time, so switching them on or off loses nothing).
        Continuous batchers have names of their own (their series are other families).
        A function is tracked weakly: once it is garbage-collected, its series go at
        the next scrape.

        Args:
            f: A ``@batched`` function or a
                [`ContinuousBatcher`][batchkit.ContinuousBatcher].
            name: The ``batcher`` label of its series.
            groups: Also export one series per group (label ``group``, the group as
                ``str(group)``), read from ``f.stats().groups`` at each scrape: for a
                function, its requests admitted, batches and queue-wait p50/p99; for a
                continuous batcher, its requests started, steps and tokens. One series
                per group ever seen: for a few groups (adapters, tasks), not one per
                user. Groups whose ``str()`` is equal share a series (counters
                summed, quantiles the largest of theirs).

        Returns:
            The label.

        Raises:
            TypeError: ``f`` is neither, or ``groups`` is not a bool.
            ValueError: ``name`` is empty, is already used by another function, or
                ``f`` is tracked under another name; ``groups=True`` for a function
                made without ``group=`` (it has no groups).
        """
        if isinstance(f, ContinuousBatcher):
            label = f.name if name is None else name
        elif isinstance(f, BatchedFunction):
            label = f.__qualname__ if name is None else name
        else:
            raise TypeError(
                f"track() needs a @batched function or a ContinuousBatcher, got {type(f).__name__}"
            )
        if not isinstance(label, str) or not label:
            raise ValueError(f"name must be a non-empty string, got {label!r}")
        if not isinstance(groups, bool):
            raise TypeError(f"groups must be True or False, got {groups!r}")
        if groups and isinstance(f, BatchedFunction) and f.options.policy.group is None:
            raise ValueError(
                f"groups=True: {f.__qualname__} has no groups to export "
                "(make it with @batched(group=...), or give its policy a group)"
            )
        with self._lock:
            if isinstance(f, ContinuousBatcher):
                batcher_tracker = self._claim(
                    self._tracked_batchers, f, label, _GenerationTracker, groups
                )
            else:
                tracker = self._claim(self._tracked, f, label, _Tracker, groups)
        if isinstance(f, ContinuousBatcher):
            if batcher_tracker is not None:
                f.add_listener(batcher_tracker)
        elif tracker is not None:
            f.add_listener(tracker)
        return label

    def _claim(
        self,
        table: _Tracked,
        f: Any,
        label: str,
        make: Callable[[PrometheusMetrics, str], _T],
        groups: bool,
    ) -> _T | None:
        """Under the lock: a new tracker (``make``) for ``f`` under ``label``, entered in
        ``table``; None if ``f`` is there already (its ``groups`` then updated);
        ``ValueError`` if ``label`` is another's, or ``f`` is tracked under another
        name."""
        what = "a continuous batcher" if isinstance(f, ContinuousBatcher) else "a function"
        known = table.get(label)
        if known is not None:
            holder = known[0]()
            if holder is f:
                known[1].groups = groups
                return None
            if holder is not None:
                raise ValueError(f"{what} is already tracked as batcher={label!r}")
            del table[label]  # its function is gone: the name is free again
            known[1].remove()
        if any(ref() is f for ref, _ in table.values()):
            raise ValueError(f"{_shown(f)} is already tracked under another name")
        tracker = make(self, label)
        tracker.groups = groups
        table[label] = (weakref.ref(f), tracker)
        return tracker

    def untrack(self, f: BatchedFunction[Any, Any] | ContinuousBatcher) -> None:
        """Stop exporting ``f``: detach the listener and remove its series.

        Args:
            f: A function or batcher [`track`][batchkit.metrics.PrometheusMetrics.track]
                was given.

        Raises:
            KeyError: ``f`` is not tracked.
        """
        table = self._tracked_batchers if isinstance(f, ContinuousBatcher) else self._tracked
        with self._lock:
            found = [name for name, (ref, _) in table.items() if ref() is f]
            if not found:
                raise KeyError(f"{_shown(f)} is not tracked")
            _, tracker = table.pop(found[0])
            # Under the lock: a track() of a new function under this name must not
            # lose its fresh series to this removal.
            tracker.remove()
        f.remove_listener(tracker)  # type: ignore[arg-type]  # (the one add_listener got)

    @property
    def tracked(self) -> dict[str, BatchedFunction[Any, Any]]:
        """The tracked functions by label (those still alive)."""
        with self._lock:
            items = [(name, ref()) for name, (ref, _) in self._tracked.items()]
        return {name: f for name, f in items if f is not None}

    @property
    def tracked_batchers(self) -> dict[str, ContinuousBatcher]:
        """The tracked continuous batchers by label (those still alive)."""
        with self._lock:
            items = [(name, ref()) for name, (ref, _) in self._tracked_batchers.items()]
        return {name: b for name, b in items if b is not None}

    def _tracked_with_groups(
        self,
    ) -> tuple[dict[str, BatchedFunction[Any, Any]], dict[str, ContinuousBatcher]]:
        """The functions and the continuous batchers tracked with ``groups=True``, by
        label (those still alive)."""
        with self._lock:
            functions = [(n, ref()) for n, (ref, t) in self._tracked.items() if t.groups]
            batchers = [(n, ref()) for n, (ref, t) in self._tracked_batchers.items() if t.groups]
        return (
            {n: f for n, f in functions if f is not None},
            {n: b for n, b in batchers if b is not None},
        )

    def _prune_dead(self) -> None:
        """Forget functions that were garbage-collected (they were tracked weakly)."""
        with self._lock:
            for table in (self._tracked, self._tracked_batchers):
                dead = [name for name, (ref, _) in table.items() if ref() is None]
                for name in dead:
                    table.pop(name)[1].remove()

    # -- exposition -------------------------------------------------------------
    content_type: str = CONTENT_TYPE_LATEST
    """The ``Content-Type`` of
    [`generate_latest`][batchkit.metrics.PrometheusMetrics.generate_latest]'s text."""

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
    """A custom collector: queue depth, in-flight batches, the watchdog's figures
    (batch timeouts, stuck workers, health), the callers served without a request of
    their own (coalesced, cache hits) and a stateful function's sessions (live, ended,
    evicted), read when scraped.

    A gauge set on every event would be stale between events and cost a lock per
    arrival; reading the runtime's load at scrape time is exact and costs nothing
    between scrapes.
    """

    def __init__(self, owner: PrometheusMetrics) -> None:
        self.owner = owner
        ns = f"{owner.namespace}_" if owner.namespace else ""
        self.depth_name = f"{ns}inference_queue_depth"
        self.in_flight_name = f"{ns}inference_in_flight_batches"
        self.timeouts_name = f"{ns}inference_batch_timeouts"
        self.abandoned_name = f"{ns}inference_abandoned_workers"
        self.healthy_name = f"{ns}inference_healthy"
        self.coalesced_name = f"{ns}inference_coalesced_requests"
        self.cache_hits_name = f"{ns}inference_cache_hits"
        self.sessions_name = f"{ns}inference_sessions"
        self.ended_name = f"{ns}inference_sessions_ended"
        self.evicted_name = f"{ns}inference_sessions_evicted"

    def describe(self) -> Iterable[Metric]:
        """Names for the registry's duplicate check (no samples)."""
        return self._families({})

    def collect(self) -> Iterable[Metric]:
        """One sample per tracked function."""
        return self._families(self.owner.tracked)

    def _families(self, tracked: dict[str, BatchedFunction[Any, Any]]) -> list[Metric]:
        depth = GaugeMetricFamily(
            self.depth_name, "Requests waiting in the queue.", labels=["batcher"]
        )
        in_flight = GaugeMetricFamily(
            self.in_flight_name, "Batches running now.", labels=["batcher"]
        )
        timeouts = CounterMetricFamily(
            self.timeouts_name,
            "Calls of the batch function given up after batch_timeout.",
            labels=["batcher"],
        )
        abandoned = GaugeMetricFamily(
            self.abandoned_name,
            "Sync worker threads still stuck in a timed-out call.",
            labels=["batcher"],
        )
        healthy = GaugeMetricFamily(
            self.healthy_name,
            "1 while stuck workers are replaced; 0 once past the bound (none spawned).",
            labels=["batcher"],
        )
        coalesced = CounterMetricFamily(
            self.coalesced_name,
            "Callers that joined a waiting or running request of the same key (coalesce=).",
            labels=["batcher"],
        )
        cache_hits = CounterMetricFamily(
            self.cache_hits_name,
            "Callers answered from the result cache (cache=), without queueing.",
            labels=["batcher"],
        )
        sessions = GaugeMetricFamily(
            self.sessions_name, "A stateful function's live sessions.", labels=["batcher"]
        )
        ended = CounterMetricFamily(
            self.ended_name, "Sessions ended by end_session or end=True.", labels=["batcher"]
        )
        evicted = CounterMetricFamily(
            self.evicted_name, "Sessions ended after session_idle_s idle.", labels=["batcher"]
        )
        for name, f in tracked.items():
            waiting, running = f.load()
            depth.add_metric([name], waiting)
            in_flight.add_metric([name], running)
            stuck, gave_up, ok = f.runtime.core.readings.health()
            timeouts.add_metric([name], gave_up)
            abandoned.add_metric([name], stuck)
            healthy.add_metric([name], 1.0 if ok else 0.0)
            joined, hits = sharing_counts(f.runtime.core)
            coalesced.add_metric([name], joined)
            cache_hits.add_metric([name], hits)
            if f.options.sessions is not None:  # (only stateful functions have series)
                live, ended_count, evicted_count = f.session_counts()
                sessions.add_metric([name], live)
                ended.add_metric([name], ended_count)
                evicted.add_metric([name], evicted_count)
        return [
            depth,
            in_flight,
            timeouts,
            abandoned,
            healthy,
            coalesced,
            cache_hits,
            sessions,
            ended,
            evicted,
        ]


class _GenerationScrapeTime:
    """A custom collector: the continuous batchers' counters and load, read when scraped
    from ``batcher.stats()`` and its KV pool (counted by the batcher anyway: exact, and
    nothing to do per step)."""

    COUNTERS: tuple[tuple[str, str], ...] = (
        ("generation_tokens_generated", "Tokens sampled."),
        ("generation_tokens_computed", "Tokens computed: prefill, recompute and decode."),
        (
            "generation_preemptions",
            "Sequences preempted (their KV blocks freed, recomputed later).",
        ),
        ("generation_prefix_cache_hits", "Full prompt blocks found in the prefix cache."),
        ("generation_prefix_cache_lookups", "Full prompt blocks looked up in the prefix cache."),
    )
    GAUGES: tuple[tuple[str, str], ...] = (
        ("generation_waiting_sequences", "Sequences waiting (new or preempted)."),
        ("generation_running_sequences", "Sequences running."),
        ("generation_kv_blocks_used", "KV blocks in use (paged mode)."),
        ("generation_kv_blocks_free", "KV blocks free (paged mode)."),
    )

    def __init__(self, owner: PrometheusMetrics) -> None:
        self.owner = owner
        self.prefix = f"{owner.namespace}_" if owner.namespace else ""

    def describe(self) -> Iterable[Metric]:
        """Names for the registry's duplicate check (no samples)."""
        return self._families({})

    def collect(self) -> Iterable[Metric]:
        """One sample per tracked batcher (KV series for paged ones only)."""
        return self._families(self.owner.tracked_batchers)

    def _families(self, tracked: dict[str, ContinuousBatcher]) -> list[Metric]:
        p = self.prefix
        counters = {
            name: CounterMetricFamily(p + name, doc, labels=["batcher"])
            for name, doc in self.COUNTERS
        }
        gauges = {
            name: GaugeMetricFamily(p + name, doc, labels=["batcher"]) for name, doc in self.GAUGES
        }
        for label, batcher in tracked.items():
            stats = batcher.stats()
            alloc = batcher.allocator
            pool = alloc.stats() if alloc is not None else None
            counts = {
                "generation_tokens_generated": stats.tokens_generated,
                "generation_tokens_computed": stats.tokens_computed,
                "generation_preemptions": stats.preemptions,
                "generation_prefix_cache_hits": pool.prefix_hits if pool else 0,
                "generation_prefix_cache_lookups": pool.prefix_queries if pool else 0,
            }
            for name, count in counts.items():
                counters[name].add_metric([label], count)
            gauges["generation_waiting_sequences"].add_metric([label], stats.waiting)
            gauges["generation_running_sequences"].add_metric([label], stats.running)
            if pool is not None:
                gauges["generation_kv_blocks_used"].add_metric([label], pool.num_used)
                gauges["generation_kv_blocks_free"].add_metric([label], pool.num_free)
        return [*counters.values(), *gauges.values()]


_S = TypeVar("_S")


def _by_label(groups: Mapping[Hashable, _S]) -> dict[str, list[_S]]:
    """Each group's stats under its label, ``str(group)``: groups that print alike
    share one (a series is named by its labels alone, and two samples with the same
    labels would make the scrape invalid)."""
    out: dict[str, list[_S]] = {}
    for group, stats in groups.items():
        out.setdefault(str(group), []).append(stats)
    return out


class _GroupSeries:
    """A custom collector: the per-group series of what was tracked with
    ``groups=True``, read when scraped from ``stats().groups``.

    The runtime counts each group anyway, so nothing is recorded per event; a scrape
    reads one ``stats()`` per object tracked with groups, and none for the others. With
    nothing tracked with groups it writes no family at all (its names are only
    reserved, by ``describe``).
    """

    def __init__(self, owner: PrometheusMetrics) -> None:
        self.owner = owner
        self.prefix = f"{owner.namespace}_" if owner.namespace else ""

    def describe(self) -> Iterable[Metric]:
        """Names for the registry's duplicate check (no samples)."""
        return [*self._function_families({}), *self._batcher_families({})]

    def collect(self) -> Iterable[Metric]:
        """The families of the kinds tracked with groups (a function's, a continuous
        batcher's), one sample per group."""
        functions, batchers = self.owner._tracked_with_groups()
        families: list[Metric] = []
        if functions:
            families += self._function_families(functions)
        if batchers:
            families += self._batcher_families(batchers)
        return families

    def _function_families(self, tracked: dict[str, BatchedFunction[Any, Any]]) -> list[Metric]:
        p = self.prefix
        labels = ["batcher", "group"]
        admitted = CounterMetricFamily(
            p + "inference_group_admitted_requests",
            "Requests of the group admitted to the queue.",
            labels=labels,
        )
        batches = CounterMetricFamily(
            p + "inference_group_batches",
            "Batches that held at least one request of the group.",
            labels=labels,
        )
        # Gauges, not a summary: a summary's _count and _sum must count every request
        # since the start, and the stats keep only a window of recent waits.
        wait = GaugeMetricFamily(
            p + "inference_group_queue_wait_seconds",
            "Seconds from admission to the batch leaving the queue, quantiles of the "
            "group's most recent 4096 requests (NaN before its first batch).",
            labels=[*labels, "quantile"],
        )
        for name, f in tracked.items():
            for group, parts in _by_label(f.stats().groups).items():
                admitted.add_metric([name, group], sum(s.requests for s in parts))
                batches.add_metric([name, group], sum(s.batches for s in parts))
                waits = [s.queue_wait for s in parts if s.queue_wait.count]
                # The quantile of merged samples is at most the largest of the parts'.
                wait.add_metric([name, group, "0.5"], max((w.p50 for w in waits), default=math.nan))
                wait.add_metric(
                    [name, group, "0.99"], max((w.p99 for w in waits), default=math.nan)
                )
        return [admitted, batches, wait]

    def _batcher_families(self, tracked: dict[str, ContinuousBatcher]) -> list[Metric]:
        p = self.prefix
        labels = ["batcher", "group"]
        admitted = CounterMetricFamily(
            p + "generation_group_admitted_requests",
            "Requests of the group that started (ran a first step).",
            labels=labels,
        )
        steps = CounterMetricFamily(
            p + "generation_group_steps",
            "Steps that computed at least one sequence of the group.",
            labels=labels,
        )
        computed = CounterMetricFamily(
            p + "generation_group_tokens_computed",
            "Tokens computed for the group: prefill, recompute and decode.",
            labels=labels,
        )
        generated = CounterMetricFamily(
            p + "generation_group_tokens_generated",
            "Tokens sampled for the group.",
            labels=labels,
        )
        for name, batcher in tracked.items():
            for group, parts in _by_label(batcher.stats().groups).items():
                admitted.add_metric([name, group], sum(s.admitted for s in parts))
                steps.add_metric([name, group], sum(s.steps for s in parts))
                computed.add_metric([name, group], sum(s.tokens_computed for s in parts))
                generated.add_metric([name, group], sum(s.tokens_generated for s in parts))
        return [admitted, steps, computed, generated]
