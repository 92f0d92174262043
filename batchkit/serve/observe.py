"""What batchkit's metrics exporters record: one table of metric families and one
mapping from serving events to observations, shared by the Prometheus exporter
(`batchkit.metrics`) and Ray's (`batchkit.integrations.ray`), so the two can never
disagree on a name, a label or a meaning. Needs neither library.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

from batchkit.serve.events import BatchEvent, DropEvent, DropReason
from batchkit.serve.stats import DispatchReason

DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Seconds: batching waits are often below Prometheus' default 5 ms first bucket."""

DEFAULT_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Items per batch: powers of two, as batch sizes are usually configured."""


class MetricSpec(NamedTuple):
    """One metric family recorded from events (every series also has a `batcher` label).

    Attributes:
        name: The family's name, without namespace; a counter's without its
            `"_total"`.
        kind: `"counter"` or `"histogram"`.
        doc: Its help text.
        label: The one extra label, if any.
        buckets: A histogram's buckets: `"latency"` or `"size"`; None for a counter.
    """

    name: str
    kind: Literal["counter", "histogram"]
    doc: str
    label: str | None = None
    buckets: Literal["latency", "size"] | None = None


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("inference_batch_size", "histogram", "Real items per batch.", buckets="size"),
    MetricSpec(
        "inference_queue_wait_seconds",
        "histogram",
        "Seconds each request waited in the queue before its batch was dispatched.",
        buckets="latency",
    ),
    MetricSpec(
        "inference_batch_latency_seconds",
        "histogram",
        "Seconds from a batch's dispatch to its results (the batch function's run).",
        buckets="latency",
    ),
    MetricSpec(
        "inference_time_to_first_chunk_seconds",
        "histogram",
        "Seconds from a streaming batch's dispatch to its first chunk.",
        buckets="latency",
    ),
    MetricSpec(
        "inference_batches", "counter", "Batches run, by why they left the queue.", "reason"
    ),
    MetricSpec(
        "inference_requests", "counter", "Requests that ran in a batch, by outcome.", "outcome"
    ),
    MetricSpec(
        "inference_dropped_requests",
        "counter",
        "Requests that ended without running: rejected (queue full), timeout, cancelled, closed.",
        "reason",
    ),
    MetricSpec(
        "inference_tokens", "counter", "Sum of the batched items' keys (their lengths, in tokens)."
    ),
    MetricSpec(
        "inference_padded_tokens",
        "counter",
        "Area of the padded batches: batch size times longest key, summed.",
    ),
    MetricSpec(
        "inference_padding_items",
        "counter",
        "Filler items added to batches to reach a strict (preferred) batch size.",
    ),
)

LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "inference_batches": tuple(r.value for r in DispatchReason),
    "inference_requests": ("ok", "error"),
    "inference_dropped_requests": get_args(DropReason),
}
"""Every known value of each extra label: exporters create these series up front, at
0, so that `rate()` and `absent()` work from the first scrape."""

Observation = tuple[str, str | None, float]
"""(metric name, extra label value or None, amount to observe or add)."""


def batch_observations(event: BatchEvent) -> list[Observation]:
    """What one finished batch adds to each metric.

    Args:
        event: The batch that ended.

    Returns:
        `(metric name, extra label value or None, amount)` for every observation.
    """
    out: list[Observation] = [("inference_batch_size", None, event.size)]
    out += [("inference_queue_wait_seconds", None, wait) for wait in event.queue_waits]
    out.append(("inference_batch_latency_seconds", None, event.latency))
    if event.first_chunk is not None:
        out.append(("inference_time_to_first_chunk_seconds", None, event.first_chunk))
    out.append(("inference_batches", event.reason, 1))
    if event.size > event.failed:
        out.append(("inference_requests", "ok", event.size - event.failed))
    if event.failed:
        out.append(("inference_requests", "error", event.failed))
    if event.padded_tokens:  # 0 when the policy has no key: nothing to measure
        out.append(("inference_tokens", None, event.tokens))
        out.append(("inference_padded_tokens", None, event.padded_tokens))
    if event.padded_size > event.size:
        out.append(("inference_padding_items", None, event.padded_size - event.size))
    return out


def drop_observations(event: DropEvent) -> list[Observation]:
    """What requests that ended without running add.

    Args:
        event: The requests dropped.

    Returns:
        One observation: the dropped-requests counter, by reason.
    """
    return [("inference_dropped_requests", event.reason, event.count)]
