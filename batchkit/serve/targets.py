"""Latency targets (`max_latency_ms`): which requests can still be answered in time.

The model, in five lines:

1. A batch takes `a + b * size + c * cost` seconds, fitted robustly to the recent
   batches (stalls set aside while rare; the fit refuted and learned again when
   batches keep beating it); a prediction adds a margin, the residuals' spread and
   their recent shift.
2. A request's deadline is its admission plus the target, less a reserve for
   answering its caller.
3. Admission replays the scheduler over what waits and the new request (buckets take
   turns, oldest head first; each batch as large as its bucket's batches lately leave,
   cut so that its most urgent member is in time, on the slot that frees first): it
   refuses the request if the replay answers it late or makes an admitted one late.
4. A waiting request is dropped when it would be late even alone in the next batch,
   or, once a batch overran its prediction, when the replay of what waits finds it
   late; a batch's oldest members are dropped instead of the batch cut when a full
   batch waits behind them.
5. A batch leaves at the latest start that keeps its most urgent member in time;
   while it refuses with nothing ahead, one probe at a time is let in, at doubling
   intervals.

The parameters, and what each trades:

- `MIN_SAMPLES`: batches seen before anything is refused (and between two fits);
  fewer refuse sooner on less evidence.
- `HALF_LIFE`: batches after which a batch weighs half as much in the fit; shorter
  follows a changed device sooner and noise more.
- `SPREAD_QUANTILE`: the residuals' quantile a prediction adds; higher answers fewer
  requests late and refuses more.
- `STALL_RATIO`: a batch over this many times its fitted time is a stall (left out of
  the margin while at most one in `HALF_LIFE` batches is); two in a row under its
  inverse refute the fit.
- `ANSWER_RESERVE`: the share of the target kept for answering after a batch ends.
- `MAX_PROBE_INTERVAL_S`: the longest wait between two probes while refusing; longer
  costs less while the device stays slow and notices later when it recovers.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from batchkit.batchers.base import Batcher, take_within_budget
from batchkit.errors import Overloaded
from batchkit.serve.buckets import Bucket, by_bucket
from batchkit.serve.request import Request

MIN_SAMPLES = 8
HALF_LIFE = 16
SPREAD_QUANTILE = 0.98
STALL_RATIO = 2.0
ANSWER_RESERVE = 0.02
MAX_PROBE_INTERVAL_S = 1.0

WINDOW = 8 * HALF_LIFE  # older batches weigh under 0.4% in the fit: not kept
# A wake-up this long after a request's latest hopeful start finds it surely too late
# (a start at exactly that time plus its batch's time may round to its deadline).
_ROUNDING_S = 1e-6


@dataclass(frozen=True)
class LearnedLatency:
    """The learned batch-time model, as [`Stats.latency_model`][batchkit.Stats] reports it.

    A batch's predicted time is `fixed_ms + per_item_ms * size + per_cost_ms * cost
    + margin_ms` within the sizes and costs seen. Beyond them it is never
    extrapolated downward: the time at the largest seen is scaled up in proportion
    (a term that never varied, e.g. every batch of one size, counts as fixed time).

    Attributes:
        fixed_ms: A batch's fixed time, in milliseconds.
        per_item_ms: Milliseconds per item (of the padded batch size).
        per_cost_ms: Milliseconds per unit of the policy's batch cost (tokens, for
            the default `"padded"` cost); 0 for a keyless policy.
        margin_ms: What a prediction adds to the fit: the residuals' spread (their
            98th percentile) plus the recent shift (the smaller residual of the last
            2 batches, when positive).
        samples: Batches the model was fitted to (the most recent ones).
        largest_size: The largest padded batch size among them (0: no limit).
        largest_cost: The largest batch cost among them (0: no limit).
        stalls: Batches among them left out of the margin as stalls (they took more
            than twice their fitted time, and were rare).
        state: What admission does with the model: `"warming"` (fewer than 8
            batches seen since start: everything is admitted, the fit fields are 0),
            `"relearning"` (refuted, fewer than 8 batches seen since: it predicts
            with the refuted model, whose batches took longer than the device's do
            now, so it admits less than it will, never more), `"serving"`
            (predicting), `"refusing"` (it predicts that even a lone request on an
            idle device would be late: it refuses, and probes), or `"probing"`
            (refusing, and a probe request was let in to learn whether the
            prediction still holds).
        refusing_since: When it began refusing with nothing ahead, on the
            batcher's clock (`time.monotonic()` unless a `clock=` was given); None
            unless refusing or probing.
        probes: Requests let in as probes since it began refusing.
        refuted: Times the model was found too slow and learned again (a slow
            warm-up shows as one).
    """

    fixed_ms: float
    per_item_ms: float
    per_cost_ms: float
    margin_ms: float
    samples: int
    largest_size: float = 0.0
    largest_cost: float = 0.0
    stalls: int = 0
    state: str = "serving"
    refusing_since: float | None = None
    probes: int = 0
    refuted: int = 0

    def predict_ms(self, size: float, cost: float = 0.0) -> float:
        """The predicted time of a batch, in milliseconds (margin included).

        Args:
            size: The batch's padded size.
            cost: The policy's cost of the batch's keys.
        """
        return self.fit_ms(size, cost) + self.margin_ms

    def fit_ms(self, size: float, cost: float = 0.0) -> float:
        """The fitted time of a batch, in milliseconds, without the margin.

        Args:
            size: The batch's padded size.
            cost: The policy's cost of the batch's keys.
        """
        scale = 1.0
        if self.largest_size > 0 and size > self.largest_size:
            scale, size = size / self.largest_size, self.largest_size
        if self.largest_cost > 0 and cost > self.largest_cost:
            scale, cost = max(scale, cost / self.largest_cost), self.largest_cost
        return (self.fixed_ms + self.per_item_ms * size + self.per_cost_ms * cost) * scale


class BatchTimeLearner:
    """Learns `a + b * size + c * cost` seconds from observed batches (line 1 of the model).

    Not thread-safe: the serving core uses it under its lock.
    """

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._fit: LearnedLatency | None = None  # its margin: the spread alone
        self._since_fit = 0
        self._recent: deque[float] = deque(maxlen=2)  # the newest residuals, ms
        self._over: deque[bool] = deque(maxlen=WINDOW)  # each batch over STALL_RATIO
        self._model: LearnedLatency | None = None  # the fit with the whole margin
        self._faster = 0  # newest batches in a row under 1 / STALL_RATIO of their fit
        self.refuted = 0
        self._fallback: LearnedLatency | None = None  # the refuted model, meanwhile

    @property
    def ready(self) -> bool:
        """Whether enough batches were observed to predict."""
        return len(self._samples) >= MIN_SAMPLES or self._fallback is not None

    @property
    def relearning(self) -> bool:
        """Refuted, and predicting with the refuted model until enough batches are seen."""
        return len(self._samples) < MIN_SAMPLES and self._fallback is not None

    @property
    def samples(self) -> int:
        """Batches the model learns from now (at most `WINDOW`)."""
        return len(self._samples)

    def observe(self, size: int, cost: float, seconds: float) -> bool:
        """One batch ran: learn from it.

        Args:
            size: Its padded size.
            cost: The policy's cost of its keys (0 for a keyless policy).
            seconds: How long it took, from leaving the queue to its results.

        Returns:
            Whether it was a stall, as the fit sets them aside (always False before
            the first fit).
        """
        sample = (float(size), float(cost), float(seconds))
        self._samples.append(sample)
        self._model = None
        if self._fit is None:
            return False
        self._since_fit += 1
        self._recent.append(_residual_ms(self._fit, sample))
        fitted = self._fit.fit_ms(size, cost)
        self._over.append(seconds * 1e3 > STALL_RATIO * fitted)
        stall = self._over[-1] and sum(self._over) <= _stalls_allowed(len(self._over))
        self._faster = self._faster + 1 if seconds * 1e3 * STALL_RATIO < fitted else 0
        if self._faster >= 2:  # (one fast batch is noise; two in a row, a faster device)
            self._fallback = self.snapshot()
            self._samples = deque(list(self._samples)[-2:], maxlen=WINDOW)
            self._fit = self._model = None
            self._recent.clear()
            self._over.clear()
            self._since_fit = self._faster = 0
            self.refuted += 1
        return stall

    def predict(self, size: float, cost: float = 0.0) -> float:
        """The predicted seconds of a batch, margin included (call only when `ready`).

        Args:
            size: The batch's padded size.
            cost: The policy's cost of its keys.
        """
        model = self.snapshot()
        assert model is not None, "predict() before the model is ready"
        return model.predict_ms(size, cost) / 1e3

    def snapshot(self) -> LearnedLatency | None:
        """The model now, in milliseconds; None until `ready`."""
        if len(self._samples) < MIN_SAMPLES:
            return self._fallback
        self._fallback = None
        if self._fit is None or self._since_fit >= MIN_SAMPLES:
            self._refit()
        if self._model is None:
            assert self._fit is not None
            shift = max(min(self._recent), 0.0) if len(self._recent) == 2 else 0.0
            self._model = dataclasses.replace(self._fit, margin_ms=self._fit.margin_ms + shift)
        return self._model

    def _refit(self) -> None:
        data = np.array(self._samples)
        design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        seconds = data[:, 2]
        recency = 0.5 ** (np.arange(len(data) - 1, -1, -1, dtype=float) / HALF_LIFE)
        coef = _robust_fit(design, seconds, recency)
        ratios = seconds / np.maximum(design @ coef, 1e-12)
        over = np.flatnonzero(ratios > STALL_RATIO)
        stalled = over[np.argsort(ratios[over])[::-1][: _stalls_allowed(len(seconds))]]
        if stalled.size:  # fitted again without them, which still pull a short window
            recency[stalled] = 0.0
            coef = _robust_fit(design, seconds, recency)
        residuals = np.delete((seconds - design @ coef) * 1e3, stalled)
        spread = max(float(np.quantile(residuals, SPREAD_QUANTILE)), 0.0)
        a, b, c = (float(x) * 1e3 for x in coef)
        largest_size, largest_cost = (float(x) for x in data[:, :2].max(axis=0))
        self._fit = LearnedLatency(
            a, b, c, spread, len(data), largest_size, largest_cost, stalls=int(stalled.size)
        )
        newest = list(self._samples)[-2:]
        self._recent = deque((_residual_ms(self._fit, s) for s in newest), maxlen=2)
        self._since_fit = 0
        self._model = None


def _stalls_allowed(batches: int) -> int:
    """How many of a window of `batches` may be set aside as stalls: one in
    `HALF_LIFE`, and at least two (a slow first batch or two)."""
    return max(2, batches // HALF_LIFE)


def _residual_ms(fit: LearnedLatency, sample: tuple[float, float, float]) -> float:
    """How much longer a batch `(size, cost, seconds)` took than `fit` says, in ms."""
    size, cost, seconds = sample
    return seconds * 1e3 - fit.fit_ms(size, cost)


def _robust_fit(design: np.ndarray, y: np.ndarray, recency: np.ndarray) -> np.ndarray:
    """Non-negative weighted least squares, reweighted twice with Huber weights
    (k = 2 robust standard deviations, the MAD's)."""
    coef = _nonnegative_fit(design, y, recency)
    for _ in range(2):
        residuals = y - design @ coef
        spread = 1.4826 * _weighted_quantile(np.abs(residuals), recency, 0.5)
        scale = max(spread, 1e-3 * float(y.mean()), 1e-9)
        excess = np.abs(residuals) / (2.0 * scale)
        coef = _nonnegative_fit(
            design, y, recency * np.minimum(1.0, 1.0 / np.maximum(excess, 1e-12))
        )
    return coef


def _nonnegative_fit(design: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0: a column whose coefficient
    comes out negative is dropped and the rest refitted. The first column is the
    intercept. A term that never varied (every batch of one size) cannot be told
    apart from the fixed time: it goes there, which over-predicts smaller batches."""
    scales = np.abs(design).max(axis=0)  # conditioning: sizes ~10, costs ~10^4
    active = [0] + [j for j in range(1, design.shape[1]) if np.ptp(design[:, j]) > 0]
    scaled = design[:, active] / scales[active]
    gram = scaled.T @ (scaled * weights[:, None])
    moment = scaled.T @ (y * weights)
    coef = np.zeros(design.shape[1])
    kept = list(range(len(active)))
    while kept:
        # (The least-norm solution: the equations are singular for one batch size.)
        solution = np.linalg.lstsq(gram[kept][:, kept], moment[kept], rcond=1e-10)[0]
        if np.all(solution >= 0):
            for j, value in zip(kept, solution):
                coef[active[j]] = value / scales[active[j]]
            return coef
        del kept[int(np.argmin(solution))]
    return coef


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The `q` quantile of `values` where each counts with its weight."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    index = int(np.searchsorted(cumulative, q * cumulative[-1]))
    return float(values[order][min(index, len(values) - 1)])


class Probing:
    """While admission refuses with nothing ahead (the model says even a lone request
    would be late), one probe at a time is let in, at doubling intervals from the
    target up to `MAX_PROBE_INTERVAL_S` (or the target, if longer), so that a device
    that became fast again is noticed.

    Args:
        target_s: The latency target, in seconds (the first interval).
    """

    def __init__(self, target_s: float) -> None:
        self.target_s = target_s
        self.since: float | None = None  # refusing with nothing ahead since
        self.probes = 0
        self.pending = False  # a probe was let in, and no batch observed since
        self._next_at = 0.0
        self._interval = target_s

    def refusing(self, now: float) -> bool:
        """Admission refuses at `now` with nothing ahead: whether to let the request in
        as a probe."""
        self.since = self.since or now
        if now < self._next_at:
            return False
        self.probes += 1
        self.pending = True
        self._next_at = now + self._interval
        self._interval = min(2 * self._interval, max(MAX_PROBE_INTERVAL_S, self.target_s))
        return True

    def stop(self) -> None:
        """Admission admits again, or the model was refuted: no longer refusing."""
        self.since = None
        self.probes = 0
        self._next_at = 0.0
        self._interval = self.target_s

    def observed(self, in_time: bool) -> None:
        """A batch ran as one clean call; one in time has the next probe go at once."""
        if in_time:
            self._next_at = 0.0
            self._interval = self.target_s
        self.pending = False


class Departures:
    """The requests that left each bucket over the last target (answered, refused or
    dropped): what flows through a bucket, which a burst that still waits does not
    inflate.

    Args:
        window_s: How far back requests count, in seconds (the target).
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._left: deque[tuple[float, Hashable]] = deque()
        self._by_bucket: dict[Hashable, int] = {}

    def count(self, reqs: Sequence[Request], now: float) -> None:
        """`reqs` left at `now`; forget those that left more than a window ago."""
        left, by_bucket = self._left, self._by_bucket
        for req in reqs:
            left.append((now, req.bucket))
            by_bucket[req.bucket] = by_bucket.get(req.bucket, 0) + 1
        while left and left[0][0] < now - self.window_s:
            _, bucket = left.popleft()
            by_bucket[bucket] -= 1
            if not by_bucket[bucket]:
                del by_bucket[bucket]

    def rate(self, bucket: Hashable) -> float:
        """Requests per second that left `bucket` over the window."""
        return self._by_bucket.get(bucket, 0) / self.window_s


@dataclass(frozen=True)
class Plan:
    """What a replay of the scheduler found (`LatencyTarget.plan`).

    Attributes:
        finish: When the last new request is answered (when it would be dropped: in a
            batch of its own, at the earliest).
        dropped: The waiting requests it would drop as late, in the order it drops them.
        cut: A new request was cut from a batch to keep an earlier member in time.
    """

    finish: float
    dropped: list[Request]
    cut: bool = False


class LatencyTarget:
    """One batched function's `max_latency_ms`: admission, drops, a batch's latest start.

    Not thread-safe: the scheduler calls it under the serving core's lock.

    Args:
        target_s: Each request's target, from admission to result, in seconds.
        policy: The batching policy (its cost, budget and sizes shape the prediction).
    """

    def __init__(self, target_s: float, policy: Batcher) -> None:
        self.target_s = target_s
        self.reserve_s = target_s * ANSWER_RESERVE
        self.policy = policy
        self.learner = BatchTimeLearner()
        self.probing = Probing(target_s)
        # At the rate requests left a bucket, requests join its next batch before it
        # leaves.
        self.departures = Departures(target_s)
        # Predicted times by (padded size, cost), until the model learns again.
        self._times: dict[tuple[int, float], float] = {}
        self._slipped = False  # a batch ran past its predicted end
        self._next_recheck = 0.0  # when a batch still running late is looked at again

    @property
    def ready(self) -> bool:
        """Whether the batch-time model has seen enough batches to predict."""
        return self.learner.ready

    def retarget(self, target_s: float, waiting: Sequence[Request]) -> None:
        """Use `target_s` from now on, for the requests already waiting too.

        Args:
            target_s: The new target, in seconds.
            waiting: Every waiting request (their deadlines count from their admission).
        """
        self.target_s = self.probing.target_s = self.departures.window_s = target_s
        self.reserve_s = target_s * ANSWER_RESERVE
        for req in waiting:
            self.set_deadline(req)

    def set_deadline(self, req: Request, probe: bool = False) -> None:
        """Give an admitted request its deadline (a probe has none: it is never dropped).

        Args:
            req: The request, its `enqueued_at` set.
            probe: It was let in as a probe.
        """
        req.deadline = math.inf if probe else req.enqueued_at + self.target_s - self.reserve_s

    def model(self) -> LearnedLatency:
        """The learned model in milliseconds, with what admission does with it."""
        learner = self.learner
        fit = learner.snapshot()
        if fit is None:
            return LearnedLatency(
                0, 0, 0, 0, learner.samples, state="warming", refuted=learner.refuted
            )
        probing = self.probing
        if probing.since is None:
            state = "relearning" if learner.relearning else "serving"
        else:
            state = "probing" if probing.pending else "refusing"
        return dataclasses.replace(
            fit,
            state=state,
            refusing_since=probing.since,
            probes=probing.probes,
            refuted=learner.refuted,
        )

    def batch_seconds(self, batch: Sequence[Request], size: int | None = None) -> float:
        """The predicted time of a batch (call only when `ready`).

        Args:
            batch: Its requests.
            size: Its size, when more requests join it (at their cost per item).
        """
        n = len(batch) if size is None else size
        cost = 0.0
        if self.policy.key is not None:
            cost = float(self.policy.cost.of([r.key for r in batch])) * max(n / len(batch), 1)
        padded = self.policy.padded_size(n)
        seconds = self._times.get((padded, cost))  # (a replay asks the same sizes often)
        if seconds is None:
            seconds = self._times[padded, cost] = self.learner.predict(padded, cost)
        return seconds

    def latest_start(self, batch: Sequence[Request]) -> float:
        """When `batch` must leave at the latest for its most urgent member to be in time.

        Args:
            batch: The batch that would leave now (non-empty; call when `ready`).
        """
        return min(r.deadline for r in batch) - self.batch_seconds(batch)

    # -- admission -----------------------------------------------------------------
    def admit(
        self,
        reqs: Sequence[Request],
        buckets: Mapping[Hashable, Bucket],
        slots_free_at: Sequence[float],
        now: float,
        idle: bool,
    ) -> bool:
        """Refuse `reqs` (one caller's, one priority, their deadlines set) if the replay
        answers the last of them late, or drops a request admitted before them.

        Args:
            reqs: The new requests, not yet waiting.
            buckets: The waiting requests, by bucket.
            slots_free_at: When each batch slot frees up.
            now: The current time (their admission).
            idle: Nothing waits and nothing runs: a refusal rests on the model alone,
                and a probe may be let in instead.

        Returns:
            True when they are let in as a probe (give them no deadline).

        Raises:
            Overloaded: They would be answered late, or make an admitted one late.
        """
        if not reqs or not self.ready:
            return False
        self.departures.count((), now)  # (forgets what left over a target ago)
        plan = self.plan(buckets, reqs, slots_free_at, joined_from=now)
        more_late = 0
        if plan.dropped:
            before = self.plan(buckets, (), slots_free_at, joined_from=now)
            more_late = len(plan.dropped) - len(before.dropped)
        predicted = plan.finish + self.reserve_s - now
        if predicted <= self.target_s and more_late <= 0:
            if self.probing.since is not None:
                self.probing.stop()
            return False
        if idle and len(reqs) <= self.policy.max_batch_size and self.probing.refusing(now):
            return True
        self.departures.count(reqs, now)
        if predicted <= self.target_s:
            why = f"it would make {more_late} request(s) admitted before it miss the target"
        elif plan.cut:
            why = (
                f"predicted {predicted * 1e3:.1f} ms to answer this request in the next "
                "batch (its own, longer with it, would end past the deadline of a request "
                "admitted before it), over the target"
            )
        else:
            queues, _ = self._queues(buckets, reqs)
            ahead = sum(len(queue) for queue in queues.values()) - len(reqs)
            why = (
                f"predicted {predicted * 1e3:.1f} ms to answer this request ({ahead} "
                "requests ahead of it), over the target"
            )
        raise Overloaded(
            f"{why} max_latency_ms={self.target_s * 1e3:g}",
            predicted_s=predicted,
            target_s=self.target_s,
        )

    # -- the replay ------------------------------------------------------------------
    def plan(
        self,
        buckets: Mapping[Hashable, Bucket],
        reqs: Sequence[Request],
        slots_free_at: Sequence[float],
        joined_from: float | None,
    ) -> Plan:
        """Replay the scheduler over what waits and `reqs`, as if nothing else arrived.

        Only requests served before the last of `reqs` count (those of their priority
        or a more urgent one). At each turn, on the slot that frees first: every
        bucket's fronts late even alone are dropped; the bucket whose front came first
        forms its batch (its oldest dropped instead when a full batch behind them is
        in time), within the budget, cut until its most urgent member is in time.

        Args:
            buckets: The waiting requests, by bucket.
            reqs: New requests (deadlines and `seq` set); none to replay what waits.
            slots_free_at: When each batch slot frees up.
            joined_from: Now, for admission: each bucket's last batch is planned with
                the requests expected to join it before it leaves (see
                `_joined_seconds`). None replays what waits alone.
        """
        max_batch_size = self.policy.max_batch_size
        queues, fresh_from = self._queues(buckets, reqs)
        at = dict.fromkeys(queues, 0)  # each queue's front
        slots = sorted(slots_free_at)
        finish, cut = -math.inf, False
        dropped: list[Request] = []
        while queues:
            start, dropped_before = slots[0], len(dropped)
            self._drop_late_fronts(queues, at, start, dropped)
            if queues:  # the bucket whose front came first forms its batch
                name = min(queues, key=lambda n: (queues[n][at[n]].priority, queues[n][at[n]].seq))
                queue, i = queues[name], at[name]
                i += self.late_at_front(queue[i : i + 4 * max_batch_size], start, max_batch_size)
                dropped += queue[at[name] : i]
                at[name] = i
            late = [r for r in dropped[dropped_before:] if r in reqs]
            if late:  # a new one dropped: in a batch of its own, at the earliest
                earlier = [r for r in dropped if r not in reqs]
                return Plan(start + self.batch_seconds(late[-1:]), earlier, cut)
            if not queues:
                break
            batch = self._cut(queue[i : i + max_batch_size], start, max_batch_size)
            first_new = fresh_from.get(name, math.inf)
            cut_end = min(i + max_batch_size, len(queue))
            if cut_end > max(first_new, i + len(batch)):  # the cut took new ones: for them?
                end = start + self.batch_seconds(queue[i:cut_end])
                if end > queue[cut_end - 1].deadline:
                    return Plan(end, dropped)
                cut = True
            i += len(batch)
            seconds = self.batch_seconds(batch)
            if joined_from is not None and i == len(queue):  # (later arrivals join it)
                until = start - joined_from
                seconds = self._joined_seconds(batch, max_batch_size, until)
            end = start + seconds
            heapq.heapreplace(slots, end)
            if i > first_new:
                finish = end
            at[name] = i
            if i == len(queue):
                del queues[name]
        return Plan(finish, dropped, cut)

    @staticmethod
    def _queues(
        buckets: Mapping[Hashable, Bucket], reqs: Sequence[Request]
    ) -> tuple[dict[Hashable, list[Request]], dict[Hashable, int]]:
        """What a replay serves: each bucket's waiting requests served before `reqs`
        (of their priority or a more urgent one), then `reqs` at the back of theirs;
        and where they begin in each queue."""
        priority = reqs[0].priority if reqs else math.inf
        queues = {}
        for name, bucket in buckets.items():
            queue = [r for r in bucket.candidates(None) if r.priority <= priority]
            if queue:
                queues[name] = queue
        fresh_from = {}
        for name, new in by_bucket(reqs).items():
            queue = queues.setdefault(name, [])
            fresh_from[name] = len(queue)
            queue.extend(new)
        return queues, fresh_from

    def _drop_late_fronts(
        self,
        queues: dict[Hashable, list[Request]],
        at: dict[Hashable, int],
        start: float,
        dropped: list[Request],
    ) -> None:
        """In a replay: move each queue's front (`at`) past the requests late even alone
        in a batch leaving at `start`, onto `dropped`; forget the queues emptied."""
        for name in list(queues):
            queue, i = queues[name], at[name]
            while i < len(queue) and start + self.batch_seconds([queue[i]]) > queue[i].deadline:
                dropped.append(queue[i])
                i += 1
            at[name] = i
            if i == len(queue):
                del queues[name]

    def _cut(self, batch: list[Request], start: float, max_batch_size: int) -> list[Request]:
        """A bucket's batch as the scheduler forms it at `start`: its front within the
        cost budget, cut until its most urgent member is in time."""
        budget = self.policy.max_tokens
        if budget is not None:
            keys = (r.key for r in batch)
            batch = batch[: take_within_budget(keys, max_batch_size, budget, self.policy.cost)]
        while len(batch) > 1 and start > self.latest_start(batch):
            batch = batch[:-1]
        return batch

    def _joined_seconds(self, batch: list[Request], max_batch_size: int, until: float) -> float:
        """The time of a bucket's last planned batch once the requests expected in the
        `until` seconds before it leaves joined it (up to a full batch, within the
        budget). They are expected at the rate the bucket's requests left over the
        last target (answered, refused or dropped): what flows through it, which a
        burst that still waits does not inflate."""
        rate = self.departures.rate(batch[0].bucket)
        size = min(len(batch) + round(rate * max(until, 0.0)), max_batch_size)
        budget = self.policy.max_tokens
        if budget is not None:
            per_item = float(self.policy.cost.of([r.key for r in batch])) / len(batch)
            size = min(size, max(1, int(budget // per_item)) if per_item > 0 else size)
        return self.batch_seconds(batch, size)

    def late_at_front(self, front: Sequence[Request], start: float, max_batch_size: int) -> int:
        """How many of a bucket's first waiting requests to drop so that a full batch
        leaving at `start` is in time: none unless a full batch waits behind them.

        Args:
            front: Its waiting requests, in service order (a few batches' worth).
            start: When the batch leaves.
            max_batch_size: The largest batch.
        """
        if not self.ready:
            return 0
        for first in range(len(front) - max_batch_size + 1):
            if start <= self.latest_start(front[first : first + max_batch_size]):
                return first
        return 0

    # -- while requests wait ---------------------------------------------------------
    def too_late(
        self,
        buckets: Mapping[Hashable, Bucket],
        slots_free_at: Sequence[float],
        running_ends: Sequence[float | None],
        now: float,
    ) -> list[Request]:
        """Drop the waiting requests late even alone in the next batch; and, once the
        schedule slipped, those the replay of what waits finds late.

        Args:
            buckets: The waiting requests, by bucket (the dropped ones leave them).
            slots_free_at: When each batch slot frees up.
            running_ends: The running batches' predicted ends (None: unknown).
            now: The current time.

        Returns:
            The dropped requests, their error set.
        """
        start = min(slots_free_at)
        late: list[Request] = []
        for bucket in buckets.values():
            if bucket.live:
                late += bucket.drop_late_fronts(
                    lambda r: start + self.batch_seconds([r]) > r.deadline
                )
        if self._slipped or self._running_late(running_ends, now):
            self._slipped = False
            planned = self.plan(buckets, (), slots_free_at, None).dropped
            for name, reqs in by_bucket(planned).items():
                buckets[name].drop_waiting(reqs)
            late += planned
        self.set_errors(late, start)
        return late

    def _running_late(self, running_ends: Sequence[float | None], now: float) -> bool:
        """Whether a running batch is past its predicted end (looked at again at most
        every tenth of the target while it runs on)."""
        if now < self._next_recheck:
            return False
        if any(end is not None and now > end for end in running_ends):
            self._next_recheck = now + self.target_s / 10
            return True
        return False

    def next_drop_at(self, buckets: Mapping[Hashable, Bucket]) -> float | None:
        """When the next waiting request becomes too late if no slot frees first: the
        earliest, over the buckets' heads, of its deadline less its own batch's time.
        None when nothing waits with a deadline.

        Args:
            buckets: The waiting requests, by bucket.
        """
        soonest = math.inf
        for bucket in buckets.values():
            head = bucket.head() if bucket.live else None
            if head is not None and head.deadline != math.inf:
                soonest = min(soonest, head.deadline - self.batch_seconds([head]))
        return None if soonest == math.inf else soonest + _ROUNDING_S

    def set_errors(self, dropped: Sequence[Request], start: float) -> None:
        """Give each dropped request its `Overloaded` error.

        Args:
            dropped: Requests dropped while waiting.
            start: The earliest time their batch could have left.
        """
        self.departures.count(dropped, start)
        for req in dropped:
            run = self.batch_seconds([req])
            waited = start - req.enqueued_at
            req.error = Overloaded(
                f"dropped before it ran: waited {waited * 1e3:.1f} ms, and its batch would "
                f"take {run * 1e3:.1f} ms more, over the target "
                f"max_latency_ms={self.target_s * 1e3:g}",
                predicted_s=waited + run + self.reserve_s,
                target_s=self.target_s,
            )

    # -- as batches leave and end ----------------------------------------------------
    def trim(self, chosen: list[Request], now: float) -> None:
        """Cut a batch about to leave until its most urgent member is in time.

        Args:
            chosen: The batch, in order; its last members are removed (they stay
                waiting) while it has more than one and would end late.
            now: When it leaves.
        """
        if self.ready:
            while len(chosen) > 1 and now > self.latest_start(chosen):
                chosen.pop()

    def finished(
        self,
        requests: Sequence[Request],
        padded_size: int,
        seconds: float,
        expected_end: float | None,
        now: float,
        clean: bool,
    ) -> None:
        """A batch ended: learn its time, and note when it ran past its prediction.

        Args:
            requests: Its requests.
            padded_size: The size the function was called with.
            seconds: From leaving the queue to its results.
            expected_end: Its predicted end (None: it had none).
            now: When it ended.
            clean: It ran as one call that completed (its time teaches the model).
        """
        self.departures.count(requests, now)
        if expected_end is not None and now > expected_end:
            self._slipped = True
        if not clean:
            return
        self.probing.observed(in_time=seconds + self.reserve_s <= self.target_s)
        refuted = self.learner.refuted
        keys = [r.key for r in requests]
        cost = 0.0 if self.policy.key is None else float(self.policy.cost.of(keys))
        self.learner.observe(padded_size, cost, seconds)
        self._times.clear()
        if self.learner.refuted > refuted:
            self.probing.stop()
