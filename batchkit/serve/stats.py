"""Counters and latency samples, and the immutable snapshot `f.stats()` returns."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchkit.percentiles import SAMPLE_WINDOW, Percentiles
from batchkit.serve.dispatch.rule import DispatchReason
from batchkit.serve.targets import LearnedLatency

GROUPS_KEPT = 1024  # groups `Stats.groups` keeps, the most recently used

if TYPE_CHECKING:
    from batchkit.serve.request import Request

__all__ = ["DispatchReason", "GroupStats", "Stats", "StatsRecorder"]


@dataclass(frozen=True)
class GroupStats:
    """One group's share of a grouped function's traffic (`Stats.groups`).

    Attributes:
        requests: Requests of the group admitted to the queue.
        batches: Batches that held at least one of its requests.
        queue_wait: Seconds from one of its requests' admission until its batch
            left the queue (percentiles of the most recent samples).
    """

    requests: int
    batches: int
    queue_wait: Percentiles


@dataclass
class _GroupCounts:
    requests: int = 0
    batches: int = 0
    queue_wait: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))


@dataclass(frozen=True)
class Stats:
    """A snapshot of one batched function's activity since it was made.

    Returned by [`stats`][batchkit.BatchedFunction.stats]. Counts are of requests
    (items) unless they say batches or calls; times are seconds on the function's
    clock; percentiles cover the most recent 4096 samples.

    Attributes:
        requests: Requests admitted to the queue (those refused with `QueueFull`
            or `Overloaded` are not counted).
        batches: Batches that left the queue.
        calls: Calls of the function: more than `batches` when batches were split
            and retried.
        items_run: Real items in the batches that left (padding not counted).
        padded_slots: Filler items added to batches to reach a policy's strict
            batch size.
        rejected: Requests refused with [`QueueFull`][batchkit.QueueFull].
        timeouts: Requests whose `timeout` passed before they started (waiting in
            the queue, or for room in it).
        cancelled: Requests withdrawn before they started because their caller
            left (a cancelled task, a stream closed early).
        closed: Waiting requests answered with
            [`BatcherClosed`][batchkit.BatcherClosed] when a close timed out.
        failed: Requests whose batch started and that ended with an error (their
            own, the batch's, a `BatchTimeout`, or a close that timed out).
        oom_splits: Parts of batches split in halves after running out of memory.
        isolated: Items that failed alone after their batch was split (by
            `isolate_errors`, a failing `collate`, or out of memory).
        effective_max_batch_size: Per bucket (`"default"` for a policy with one),
            the largest batch learned to fit after running out of memory; a
            bucket is absent while its policy's maximum applies.
        queue_depth: Requests waiting now.
        in_flight: Batches running now.
        batch_sizes: Batch size (real items) -> number of batches of that size,
            by size.
        dispatch_reasons: [`DispatchReason`][batchkit.serve.DispatchReason] value
            (`"full"`, `"max_wait"`, `"idle"`, `"closing"`) -> number of batches.
        queue_wait: Seconds from a request's admission until its batch left the
            queue.
        batch_latency: Seconds from a batch leaving the queue until its results
            (until its last chunk, for a streaming function).
        time_to_first_chunk: Seconds from a streaming batch leaving the queue until
            its first yield (empty for other functions).
        batch_timeouts: Calls of the function given up after `batch_timeout`.
        abandoned_workers: Sync worker threads still stuck in a timed-out call.
        healthy: False once more than `max_concurrent_batches` worker threads are
            stuck in timed-out calls: no more are replaced until one returns.
        overloaded: Requests refused at admission with
            [`Overloaded`][batchkit.Overloaded]: predicted to miss `max_latency_ms`
            (not counted in `requests`).
        shed: Admitted requests dropped with `Overloaded` before they ran: they
            could no longer be answered within `max_latency_ms`.
        groups: With `group` (see `@batched`), per group: its requests,
            batches and queue waits ([`GroupStats`][batchkit.serve.GroupStats]);
            empty without `group`. At most the 1024 most recently used groups are
            kept (a `RuntimeWarning` the first time one is forgotten).
        latency_model: Under `max_latency_ms`, the learned batch-time model; None
            without a target, or until enough batches have run.
        coalesced: With `coalesce` (see `@batched`), callers that joined a request
            of the same key already waiting or running instead of queueing their
            own (not counted in `requests`).
        cache_hits: With `cache`, callers answered from the cache, without queueing
            (not counted in `requests`).
        sessions: A stateful function's (`state=`) live sessions now (0 for
            others).
        sessions_ended: Sessions ended by `end_session` or `end=True`.
        sessions_evicted: Sessions ended after `session_idle_s` without a request.
    """

    requests: int
    batches: int
    calls: int
    items_run: int
    padded_slots: int
    rejected: int
    timeouts: int
    cancelled: int
    closed: int
    failed: int
    oom_splits: int
    isolated: int
    effective_max_batch_size: dict[str, int]
    queue_depth: int
    in_flight: int
    batch_sizes: dict[int, int]
    dispatch_reasons: dict[str, int]
    queue_wait: Percentiles
    batch_latency: Percentiles
    time_to_first_chunk: Percentiles = field(default_factory=Percentiles.empty)
    batch_timeouts: int = 0
    abandoned_workers: int = 0
    healthy: bool = True
    overloaded: int = 0
    shed: int = 0
    latency_model: LearnedLatency | None = None
    groups: dict[Hashable, GroupStats] = field(default_factory=dict)
    coalesced: int = 0
    cache_hits: int = 0
    sessions: int = 0
    sessions_ended: int = 0
    sessions_evicted: int = 0

    @property
    def mean_batch_size(self) -> float:
        """Average real items per batch."""
        return self.items_run / self.batches if self.batches else 0.0

    def __str__(self) -> str:
        """A readable table, one figure a line (what `print(f.stats())` shows).

        Every figure is also a field (`repr()` lists them all as they are).
        """
        rows = self._count_rows() + self._time_rows()
        width = max(len(name) for name, _ in rows) + 2
        return "\n".join(["Stats"] + [f"  {name:<{width}}{value}".rstrip() for name, value in rows])

    def _count_rows(self) -> list[tuple[str, str]]:
        refused = {
            "rejected": self.rejected,
            "overloaded": self.overloaded,
            "shed": self.shed,
            "timeouts": self.timeouts,
            "cancelled": self.cancelled,
            "closed": self.closed,
            "failed": self.failed,
        }
        rows = [
            ("requests", f"{self.requests} admitted; {_counts(refused) or _NONE_LOST}"),
        ]
        if self.coalesced or self.cache_hits:
            shared = f"coalesced {self.coalesced}, cache hits {self.cache_hits}"
            rows.append(("shared", f"{shared} (callers answered without a request)"))
        if self.sessions or self.sessions_ended or self.sessions_evicted:
            rows.append(
                (
                    "sessions",
                    f"{self.sessions} live, {self.sessions_ended} ended, "
                    f"{self.sessions_evicted} evicted",
                )
            )
        rows += [
            (
                "batches",
                f"{self.batches} (calls {self.calls}), mean size {self.mean_batch_size:.1f}, "
                f"padded slots {self.padded_slots}",
            ),
            ("batch sizes", _counts(self.batch_sizes) or "-"),
            ("dispatched", _counts(self.dispatch_reasons) or "-"),
            ("now", f"{self.queue_depth} waiting, {self.in_flight} batches running"),
            (
                "health",
                f"{'healthy' if self.healthy else 'UNHEALTHY'}; batch timeouts "
                f"{self.batch_timeouts}, abandoned workers {self.abandoned_workers}",
            ),
        ]
        if self.oom_splits or self.isolated or self.effective_max_batch_size:
            caps = _counts(self.effective_max_batch_size) or "none"
            rows.append(
                ("errors", f"oom splits {self.oom_splits}, isolated {self.isolated}, caps {caps}")
            )
        return rows

    def _time_rows(self) -> list[tuple[str, str]]:
        rows = [("", f"{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}  (ms; count)")]
        rows.append(("queue wait", _percentiles(self.queue_wait)))
        rows.append(("batch latency", _percentiles(self.batch_latency)))
        if self.time_to_first_chunk.count:
            rows.append(("first chunk", _percentiles(self.time_to_first_chunk)))
        if self.latency_model is not None:
            lines = _fields(self.latency_model)
            rows += [("latency model" if i == 0 else "", line) for i, line in enumerate(lines)]
        for group, g in self.groups.items():
            rows.append((f"group {group!r}", f"{g.requests} requests, {g.batches} batches"))
            rows.append(("  queue wait", _percentiles(g.queue_wait)))
        return rows


_NONE_LOST = "none refused, timed out or failed"


def _counts(counts: dict[str, int] | dict[int, int]) -> str:
    """`a: 3, b: 1` for the non-zero counts, in the order given."""
    return ", ".join(f"{k}: {n}" for k, n in counts.items() if n)


def _percentiles(p: Percentiles) -> str:
    """The four figures in milliseconds, aligned under the header row, and the count."""
    if not p.count:
        return f"{'-':>9}{'-':>9}{'-':>9}{'-':>9}  (0)"
    return "".join(f"{v * 1e3:9.3g}" for v in (p.p50, p.p90, p.p99, p.max)) + f"  ({p.count})"


def _fields(record: object, width: int = 64) -> list[str]:
    """A record's fields as `name=value` (floats to 3 significant digits), in lines of
    about `width` characters; a record that is not a dataclass as its `str()`."""
    if not dataclasses.is_dataclass(record):
        return [str(record)]
    lines = [""]
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        shown = f"{value:.3g}" if isinstance(value, float) and math.isfinite(value) else repr(value)
        part = f"{f.name}={shown}"
        if lines[-1] and len(lines[-1]) + len(part) + 2 > width:
            lines.append("")
        lines[-1] += f", {part}" if lines[-1] else part
    return lines


@dataclass
class StatsRecorder:
    """Mutable counters; updated under the serving core's lock.

    The fields are those of [`Stats`][batchkit.Stats] they feed (`reasons` by
    [`DispatchReason`][batchkit.serve.DispatchReason]; `queue_wait`,
    `batch_latency` and `first_chunk` are windows of the most recent samples, in
    seconds); all start empty.
    """

    requests: int = 0
    batches: int = 0
    calls: int = 0
    items_run: int = 0
    padded_slots: int = 0
    rejected: int = 0
    timeouts: int = 0
    cancelled: int = 0
    closed: int = 0
    failed: int = 0
    oom_splits: int = 0
    isolated: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    reasons: dict[DispatchReason, int] = field(default_factory=dict)
    queue_wait: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))
    batch_latency: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))
    first_chunk: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLE_WINDOW))
    batch_timeouts: int = 0
    overloaded: int = 0
    shed: int = 0
    groups: dict[Hashable, _GroupCounts] = field(default_factory=dict)
    groups_forgotten: int = 0  # groups dropped from `groups`, least recently used first
    coalesced: int = 0
    cache_hits: int = 0

    def record_group_request(self, group: Hashable) -> None:
        """A request of `group` was admitted (grouped functions only).

        Args:
            group: Its group.
        """
        self._group_counts(group).requests += 1

    def _group_counts(self, group: Hashable) -> _GroupCounts:
        """`group`'s counts, now the most recently used; past `GROUPS_KEPT` groups the
        least recently used one is forgotten (warned about once)."""
        counts = self.groups.pop(group, None)
        if counts is None:
            counts = _GroupCounts()
            if len(self.groups) >= GROUPS_KEPT:
                del self.groups[next(iter(self.groups))]
                if not self.groups_forgotten:
                    warnings.warn(
                        f"more than {GROUPS_KEPT} groups: stats().groups keeps the "
                        f"{GROUPS_KEPT} most recently used (and so do the per-group metrics); "
                        "a group per caller or per item is better left out of group=",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                self.groups_forgotten += 1
        self.groups[group] = counts
        return counts

    def record_batch(
        self, requests: list[Request], reason: DispatchReason, padded: int, now: float
    ) -> None:
        """A batch left the queue (called once per batch).

        Args:
            requests: Its requests (their waits are counted to `now`).
            reason: Why it left.
            padded: The size the function is called with.
            now: When it left, on the scheduler's clock.
        """
        size = len(requests)
        self.batches += 1
        self.items_run += size
        self.padded_slots += padded - size
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        # (A comprehension's specialised slot reads beat map() with attrgetter here.)
        self.queue_wait.extend([now - req.enqueued_at for req in requests])
        if self.groups:
            self._record_groups(requests, now)

    def _record_groups(self, requests: list[Request], now: float) -> None:
        seen: set[Hashable] = set()
        for req in requests:
            counts = self._group_counts(req.group)
            counts.queue_wait.append(now - req.enqueued_at)
            if req.group not in seen:
                seen.add(req.group)
                counts.batches += 1

    def snapshot(
        self,
        *,
        queue_depth: int,
        in_flight: int,
        caps: dict[str, int],
        unplaced: int = 0,
        abandoned_workers: int = 0,
        healthy: bool = True,
        latency_model: LearnedLatency | None = None,
    ) -> Stats:
        """Freeze the current values, with what only the caller knows.

        Args:
            queue_depth: Requests waiting now.
            in_flight: Batches running now.
            caps: Learned batch-size caps, by bucket name.
            unplaced: Admitted requests not yet counted (bulk arrivals not placed).
            abandoned_workers: Worker threads stuck in a timed-out call.
            healthy: Whether stuck threads are still replaced.
            latency_model: The learned batch-time model, if any.
        """
        return Stats(
            requests=self.requests + unplaced,
            batches=self.batches,
            calls=self.calls,
            items_run=self.items_run,
            padded_slots=self.padded_slots,
            rejected=self.rejected,
            timeouts=self.timeouts,
            cancelled=self.cancelled,
            closed=self.closed,
            failed=self.failed,
            oom_splits=self.oom_splits,
            isolated=self.isolated,
            effective_max_batch_size=caps,
            queue_depth=queue_depth,
            in_flight=in_flight,
            batch_sizes=dict(sorted(self.batch_sizes.items())),
            dispatch_reasons={r.value: n for r, n in self.reasons.items()},
            queue_wait=Percentiles.of(self.queue_wait),
            batch_latency=Percentiles.of(self.batch_latency),
            time_to_first_chunk=Percentiles.of(self.first_chunk),
            batch_timeouts=self.batch_timeouts,
            abandoned_workers=abandoned_workers,
            healthy=healthy,
            overloaded=self.overloaded,
            shed=self.shed,
            latency_model=latency_model,
            groups={
                g: GroupStats(c.requests, c.batches, Percentiles.of(c.queue_wait))
                for g, c in self.groups.items()
            },
            coalesced=self.coalesced,
            cache_hits=self.cache_hits,
        )
