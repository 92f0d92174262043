"""Ray Serve: per-replica stats and batchkit's metrics through Ray's metrics agent.

A Serve replica is an actor; several replicas share a node, so each cannot open its
own Prometheus port, and a ``/metrics`` route behind Serve's proxy would answer from
whichever replica the request reached. :class:`RayMetrics` records batchkit's
events with ``ray.serve.metrics`` instead: Ray's agent on each node exports them
with Serve's own metrics, every series tagged ``deployment``, ``replica`` (and
``application``) by Serve, plus batchkit's ``batcher`` label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchkit.serve.batched import BatchedFunction
from batchkit.serve.events import BatchEvent, DropEvent, DropReason
from batchkit.serve.stats import DispatchReason, Stats

# As batchkit.metrics (which needs prometheus-client; Ray's own exporter does not).
DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Seconds, for the queue-wait and batch-latency histograms."""

DEFAULT_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Items per batch."""

_DROP_REASONS: tuple[DropReason, ...] = ("rejected", "timeout", "cancelled", "closed")


def _require_ray_serve() -> Any:
    try:
        from ray.serve import metrics
    except ImportError as exc:
        raise ImportError(
            "batchkit.integrations.ray needs Ray Serve: pip install 'batchkit[ray]'"
        ) from exc
    return metrics


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's view of a ``@batched`` function (picklable: return it from a
    deployment method)."""

    deployment: str  # "" outside a Serve replica
    replica: str  # Serve's unique replica tag; "" outside a Serve replica
    stats: Stats


def replica_stats(f: BatchedFunction[Any]) -> ReplicaStats:
    """``f.stats()`` tagged with the Serve replica this process is (empty outside Serve)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        ctx = serve.get_replica_context()
    except RayServeException:  # not inside a replica
        return ReplicaStats("", "", f.stats())
    return ReplicaStats(ctx.deployment, ctx.replica_tag, f.stats())


class _RayTracker:
    """The listener for one function: Ray metric objects plus its ``batcher`` tag."""

    def __init__(self, owner: RayMetrics, name: str) -> None:
        self.owner = owner
        self.tags = {"batcher": name}
        self._tagged = {
            (kind, value): {"batcher": name, kind: value}
            for kind, values in (
                ("reason", [r.value for r in DispatchReason] + list(_DROP_REASONS)),
                ("outcome", ["ok", "error"]),
            )
            for value in values
        }

    def _tags(self, kind: str, value: str) -> dict[str, str]:
        tags = self._tagged.get((kind, value))
        if tags is None:  # a dispatch reason newer than this module
            tags = self._tagged[(kind, value)] = {"batcher": self.tags["batcher"], kind: value}
        return tags

    def on_batch(self, event: BatchEvent) -> None:
        """Record one finished batch (on the runtime's worker, under its lock)."""
        m, tags = self.owner, self.tags
        m.batch_size.observe(event.size, tags)
        for wait in event.queue_waits:
            m.queue_wait.observe(wait, tags)
        m.batch_latency.observe(event.latency, tags)
        m.batches.inc(1, self._tags("reason", event.reason))
        if event.size > event.failed:
            m.requests.inc(event.size - event.failed, self._tags("outcome", "ok"))
        if event.failed:
            m.requests.inc(event.failed, self._tags("outcome", "error"))
        if event.padded_tokens:
            m.tokens.inc(event.tokens, tags)
            m.padded_tokens.inc(event.padded_tokens, tags)
        if event.padded_size > event.size:
            m.padding_items.inc(event.padded_size - event.size, tags)

    def on_drop(self, event: DropEvent) -> None:
        """Count requests that ended without running."""
        self.owner.dropped.inc(event.count, self._tags("reason", event.reason))


class RayMetrics:
    """batchkit's metrics for ``@batched`` functions, exported by Ray's metrics agent.

    Create one per process (per replica: in the deployment's ``__init__``) and
    :meth:`track` each function. The metric names are those of
    :mod:`batchkit.metrics` (``inference_batch_size``, ``inference_queue_wait_seconds``,
    ...), prefixed by ``namespace`` if given; Ray's exporter adds its ``ray_``
    prefix. Inside a Serve replica every series also carries Serve's ``deployment``,
    ``replica`` and ``application`` tags. The queue-depth and in-flight gauges are
    left to Serve (``ray_serve_replica_processing_queries``,
    ``ray_serve_deployment_queued_queries``): Ray has no scrape-time gauges.
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

        def counter(name: str, doc: str, *extra: str) -> Any:
            return metrics.Counter(f"{ns}{name}", doc, tag_keys=("batcher", *extra))

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return metrics.Histogram(
                f"{ns}{name}", doc, boundaries=list(buckets), tag_keys=("batcher",)
            )

        self.batch_size = histogram("inference_batch_size", "Real items per batch.", size_buckets)
        self.queue_wait = histogram(
            "inference_queue_wait_seconds",
            "Seconds each request waited before its batch was dispatched.",
            latency_buckets,
        )
        self.batch_latency = histogram(
            "inference_batch_latency_seconds",
            "Seconds from a batch's dispatch to its results.",
            latency_buckets,
        )
        self.batches = counter("inference_batches", "Batches run, by dispatch reason.", "reason")
        self.requests = counter("inference_requests", "Requests that ran, by outcome.", "outcome")
        self.dropped = counter(
            "inference_dropped_requests", "Requests that ended without running.", "reason"
        )
        self.tokens = counter("inference_tokens", "Sum of the batched items' keys (lengths).")
        self.padded_tokens = counter(
            "inference_padded_tokens", "Batch size times longest key, summed over batches."
        )
        self.padding_items = counter(
            "inference_padding_items", "Filler items added to reach a strict batch size."
        )
        self._tracked: dict[str, _RayTracker] = {}

    def track(self, f: BatchedFunction[Any], name: str | None = None) -> str:
        """Record ``f``'s events under ``batcher=name`` (default: its qualname); returns it."""
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
