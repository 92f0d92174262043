"""Ray Serve: per-replica stats and batchkit's metrics through Ray's metrics agent.

A Serve replica is an actor; several replicas share a node, so each cannot open its
own Prometheus port, and a ``/metrics`` route behind Serve's proxy would answer from
whichever replica the request reached. `RayMetrics` records batchkit's
events with ``ray.serve.metrics`` instead: Ray's agent on each node exports them
with Serve's own metrics, every series tagged ``deployment``, ``replica`` (and
``application``) by Serve, plus batchkit's ``batcher`` label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchkit.serve.batched import BatchedFunction
from batchkit.serve.events import BatchEvent, DropEvent
from batchkit.serve.observe import (
    DEFAULT_LATENCY_BUCKETS,
    DEFAULT_SIZE_BUCKETS,
    METRICS,
    batch_observations,
    drop_observations,
)
from batchkit.serve.stats import Stats


def _require_ray_serve() -> Any:
    try:
        from ray.serve import metrics
    except ImportError as exc:
        raise ImportError(
            "batchkit.integrations.ray needs Ray Serve: pip install 'batchkit-ml[ray]'"
        ) from exc
    return metrics


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's view of a ``@batched`` function (picklable: return it from a
    deployment method).

    Attributes:
        deployment: The Serve deployment's name; ``""`` outside a Serve replica.
        replica: Serve's unique replica tag; ``""`` outside a Serve replica.
        stats: The function's [`Stats`][batchkit.Stats] in this replica.
    """

    deployment: str
    replica: str
    stats: Stats


def replica_stats(f: BatchedFunction[Any, Any]) -> ReplicaStats:
    """``f.stats()`` tagged with the Serve replica this process is (empty outside Serve).

    Args:
        f: A ``@batched`` function living in this process.

    Raises:
        ImportError: Ray Serve is not installed.
    """
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        ctx = serve.get_replica_context()
    except RayServeException:  # not inside a replica
        return ReplicaStats("", "", f.stats())
    return ReplicaStats(ctx.deployment, ctx.replica_tag, f.stats())


class _RayTracker:
    """The listener for one function: its ``batcher`` tag and each series' tag dict."""

    def __init__(self, owner: RayMetrics, name: str) -> None:
        self.owner = owner
        self.name = name
        self._tags: dict[tuple[str, str | None], dict[str, str]] = {}

    def _tags_for(self, metric: str, value: str | None) -> dict[str, str]:
        tags = self._tags.get((metric, value))
        if tags is None:
            label = self.owner.labels[metric]
            tags = {"batcher": self.name}
            if label is not None and value is not None:
                tags[label] = value
            self._tags[(metric, value)] = tags
        return tags

    def on_batch(self, event: BatchEvent) -> None:
        """Record one finished batch (on the runtime's worker, under its lock)."""
        for metric, value, amount in batch_observations(event):
            self.owner.record(metric, amount, self._tags_for(metric, value))

    def on_drop(self, event: DropEvent) -> None:
        """Count requests that ended without running."""
        for metric, value, amount in drop_observations(event):
            self.owner.record(metric, amount, self._tags_for(metric, value))


class RayMetrics:
    """batchkit's metrics for ``@batched`` functions, exported by Ray's metrics agent.

    Create one per process (per replica: in the deployment's ``__init__``) and
    [`track`][batchkit.integrations.ray.RayMetrics.track] each function. The metric
    names are those of
    `batchkit.metrics` (``inference_batch_size``, ``inference_queue_wait_seconds``,
    ...), prefixed by ``namespace`` if given; Ray's exporter adds its ``ray_``
    prefix. Inside a Serve replica every series also carries Serve's ``deployment``,
    ``replica`` and ``application`` tags. The queue-depth and in-flight gauges are
    left to Serve (``ray_serve_replica_processing_queries``,
    ``ray_serve_deployment_queued_queries``): Ray has no scrape-time gauges.

    Args:
        namespace: A prefix for every name, e.g. ``"myapp"`` gives
            ``myapp_inference_batch_size`` (``""``: none).
        latency_buckets: Histogram bucket bounds, in seconds, of the queue wait and
            batch latency histograms.
        size_buckets: Bucket bounds, in items, of the batch size histogram.

    Raises:
        ImportError: Ray Serve is not installed.
    """

    def __init__(
        self,
        namespace: str = "",
        *,
        latency_buckets: Sequence[float] = DEFAULT_LATENCY_BUCKETS,
        size_buckets: Sequence[float] = DEFAULT_SIZE_BUCKETS,
    ) -> None:
        metrics = _require_ray_serve()
        ns = f"{namespace}_" if namespace else ""
        self._families: dict[str, Any] = {}
        self._histograms: set[str] = set()
        self.labels: dict[str, str | None] = {}
        for spec in METRICS:
            tag_keys = ("batcher",) if spec.label is None else ("batcher", spec.label)
            if spec.kind == "histogram":
                buckets = size_buckets if spec.buckets == "size" else latency_buckets
                family = metrics.Histogram(
                    f"{ns}{spec.name}", spec.doc, boundaries=list(buckets), tag_keys=tag_keys
                )
                self._histograms.add(spec.name)
            else:
                family = metrics.Counter(f"{ns}{spec.name}", spec.doc, tag_keys=tag_keys)
            self._families[spec.name] = family
            self.labels[spec.name] = spec.label
        self._tracked: dict[str, _RayTracker] = {}

    def record(self, metric: str, amount: float, tags: dict[str, str]) -> None:
        """Observe (histograms) or add (counters) ``amount`` to one series.

        Args:
            metric: A name of ``batchkit.metrics.METRIC_NAMES`` (without namespace).
            amount: The observation (seconds, items) or the increment.
            tags: The series' tags: ``batcher`` and the metric's own label, if any.
        """
        family = self._families[metric]
        if metric in self._histograms:
            family.observe(amount, tags)
        else:
            family.inc(amount, tags)

    def track(self, f: BatchedFunction[Any, Any], name: str | None = None) -> str:
        """Record ``f``'s events under ``batcher=name``.

        Args:
            f: A ``@batched`` function.
            name: The ``batcher`` tag of its series (default: ``f``'s qualname).

        Returns:
            The tag.

        Raises:
            TypeError: ``f`` is not a ``@batched`` function.
            ValueError: ``name`` is empty or already tracked.
        """
        if not isinstance(f, BatchedFunction):
            raise TypeError(f"track() needs a @batched function, got {type(f).__name__}")
        label = f.__qualname__ if name is None else name
        if not isinstance(label, str) or not label:
            raise ValueError(f"name must be a non-empty string, got {label!r}")
        if label in self._tracked:
            raise ValueError(f"a function is already tracked as batcher={label!r}")
        tracker = self._tracked[label] = _RayTracker(self, label)
        f.add_listener(tracker)
        return label
