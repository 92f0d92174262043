"""How long a batch takes: a model learned online from the batches that ran.

A batch's time is modelled as `a + b * size + c * cost` (size: the padded batch size;
cost: the policy's cost of its keys, 0 for a keyless policy), fitted to the most
recent batches. What makes it usable for admission decisions on a noisy machine:

- the fit is robust (iteratively reweighted least squares with Huber weights), and
  recent batches weigh more (the weight halves every `HALF_LIFE` batches): one
  stalled batch (a garbage collection, a page fault) hardly moves it, a change of
  regime (a slower device, heavier inputs) moves it within a few dozen batches;
- a prediction adds a *margin*: the spread of the residuals (their 98th percentile
  over the window, which a few outliers do not reach), plus the *shift*, the smaller
  residual of the last 2 batches against the fit: a sudden slowdown shows there
  after 2 batches, long before the fit has moved, while one outlier never does;
- a *stall* (a batch that took more than `STALL_RATIO` times its fitted time: a
  collection, a page fault, a neighbour on the device) is left out of the spread,
  as long as stalls stay rare (at most `STALL_SHARE` of the window, and two in a
  window of a few batches): a stall cannot be predicted, and counting it in every
  prediction would refuse work the device can do in time;
- the model can be *refuted*: when `REFUTE_WINDOW` batches in a row take less than
  `REFUTE_RATIO` of their fitted time (a device that got fast after a slow warm-up:
  CUDA context, autotuning, compilation, caches), the older batches are forgotten
  and the model learns again from the recent ones. Until it has seen enough
  batches again it predicts with the refuted fit: that one overestimates (the
  device got faster), so admission stays bounded meanwhile. Admitting everything
  instead let a refutation under heavy load (small batches of short inputs, twice
  under half their fitted time) fill the queue with seconds of work.

The fit itself is recomputed every `REFIT_EVERY` batches (a few small numpy
operations); the shift follows every batch.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_SAMPLES = 8  # batches observed before a prediction is made
WINDOW = 128  # batches kept
HALF_LIFE = 16  # batches after which a sample weighs half as much in the fit
REFIT_EVERY = 8  # batches between two fits
SPREAD_QUANTILE = 0.98
SHIFT_WINDOW = 2  # the newest batches whose smaller residual is the shift
STALL_RATIO = 2.0  # a batch over this many times its fitted time is a stall
STALL_SHARE = 0.1  # at most this share of the window is set aside as stalls
REFUTE_RATIO = 0.5  # a batch under this share of its fitted time disagrees with the fit
REFUTE_WINDOW = 2  # that many disagreeing batches in a row refute the model
_HUBER_K = 2.0  # residuals beyond this many robust standard deviations are down-weighted


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
            (predicting), `"refusing"`
            (it predicts that even a lone request on an idle device would be late:
            it refuses, and probes), or `"probing"` (refusing, and a probe request
            was let in to learn whether the prediction still holds).
        refusing_since: When it began refusing with nothing ahead, on the
            batcher's clock (`time.monotonic()` unless a `clock=` was given); None
            unless refusing or probing.
        probes: Requests let in as probes since it began refusing.
        refuted: Times the model was found too slow and learned again (a slow
            warm-up shows as one).
        lateness_ms: How much later than planned at admission recent requests were
            answered (the median of the 99th percentiles of the last 7 groups of 128
            requests; a dropped request counts its earliest possible answer):
            admission adds it to its predictions, so that a queue of batches whose
            noise adds up does not admit requests that will be dropped near their
            deadline. Requests that waited through a stall are left out. 0 when
            plans run on time.
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
    lateness_ms: float = 0.0

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
    """Learns `a + b * size + c * cost` seconds from observed batches; predicts with a margin.

    Not thread-safe: the serving core uses it under its lock.
    """

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._fit: LearnedLatency | None = None  # its margin: the spread alone
        self._since_fit = 0
        self._recent: deque[float] = deque(maxlen=SHIFT_WINDOW)  # residuals, ms
        # Whether each batch of the window took over STALL_RATIO times its fit when it
        # ran (what `observe` tells its caller is a stall while they stay rare).
        self._over: deque[bool] = deque(maxlen=WINDOW)
        self._model: LearnedLatency | None = None  # the fit with the whole margin
        self._faster = 0  # newest batches in a row under REFUTE_RATIO of their fit
        self.refuted = 0  # times the model was forgotten as too slow
        # The refuted model, predicted with until enough batches are seen again.
        self._fallback: LearnedLatency | None = None

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
        """One batch ran.

        Args:
            size: Its padded size.
            cost: The policy's cost of its keys (0 for a keyless policy).
            seconds: How long it took, from leaving the queue to its results.

        Returns:
            Whether it was a stall, as the fit sets them aside: over `STALL_RATIO`
            times its fitted time, with stalls still rare in the window (at most
            `STALL_SHARE` of it, or two). Always False before the first fit.
        """
        sample = (float(size), float(cost), float(seconds))
        self._samples.append(sample)
        self._model = None
        if self._fit is None:
            return False
        self._since_fit += 1
        self._recent.append(_residual_ms(self._fit, sample))
        fitted = self._fit.fit_ms(size, cost)
        over = seconds * 1e3 > STALL_RATIO * fitted
        self._over.append(over)
        stall = over and sum(self._over) <= _stalls_allowed(len(self._over))
        self._faster = self._faster + 1 if seconds * 1e3 < REFUTE_RATIO * fitted else 0
        if self._faster >= REFUTE_WINDOW:
            self._forget_all_but(REFUTE_WINDOW)
        return stall

    def _forget_all_but(self, newest: int) -> None:
        """The fit is refuted: learn again from the `newest` batches alone."""
        self._fallback = self.snapshot()
        kept = list(self._samples)[-newest:]
        self._samples.clear()
        self._samples.extend(kept)
        self._fit = self._model = None
        self._recent.clear()
        self._over.clear()
        self._since_fit = self._faster = 0
        self.refuted += 1

    def predict(self, size: float, cost: float = 0.0) -> float:
        """The predicted seconds of a batch, margin included (call only when `ready`).

        Args:
            size: The batch's padded size.
            cost: The policy's cost of its keys.
        """
        model = self.snapshot()
        assert model is not None, "predict() before the model is ready"
        return model.predict_ms(size, cost) / 1e3

    @property
    def spread_s(self) -> float:
        """The residuals' spread alone, in seconds: the margin less the recent shift
        (call only when `ready`). What a prediction adds for one batch's noise; over
        several batches in a row that noise partly cancels, a shift does not."""
        model = self.snapshot()
        assert model is not None, "spread_s before ready"
        fit = model if self._fit is None else self._fit  # (relearning: the refuted one's)
        return fit.margin_ms / 1e3

    def snapshot(self) -> LearnedLatency | None:
        """The model now, in milliseconds; None until `ready`."""
        if len(self._samples) < MIN_SAMPLES:
            return self._fallback
        self._fallback = None
        if self._fit is None or self._since_fit >= REFIT_EVERY:
            self._refit()
        if self._model is None:
            assert self._fit is not None
            shift = max(min(self._recent), 0.0) if len(self._recent) == SHIFT_WINDOW else 0.0
            self._model = dataclasses.replace(self._fit, margin_ms=self._fit.margin_ms + shift)
        return self._model

    def _refit(self) -> None:
        data = np.array(self._samples)
        design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        seconds = data[:, 2]
        ages = np.arange(len(data) - 1, -1, -1, dtype=float)
        recency = 0.5 ** (ages / HALF_LIFE)
        coef = _robust_fit(design, seconds, recency)
        stalled = _stalls(seconds, design @ coef)
        if stalled.size:  # fitted again without them, which still pull a short window
            recency[stalled] = 0.0
            coef = _robust_fit(design, seconds, recency)
        residuals = np.delete((seconds - design @ coef) * 1e3, stalled)
        spread = max(float(np.quantile(residuals, SPREAD_QUANTILE)), 0.0)
        stalls = int(stalled.size)
        a, b, c = (float(x) * 1e3 for x in coef)
        largest_size, largest_cost = (float(x) for x in data[:, :2].max(axis=0))
        fit = LearnedLatency(a, b, c, spread, len(data), largest_size, largest_cost, stalls=stalls)
        self._fit = fit
        newest = list(self._samples)[-SHIFT_WINDOW:]
        self._recent = deque((_residual_ms(fit, s) for s in newest), maxlen=SHIFT_WINDOW)
        self._since_fit = 0
        self._model = None


def _stalls(seconds: np.ndarray, fitted: np.ndarray) -> np.ndarray:
    """The indices of the batches set aside as stalls: the slowest of those over
    `STALL_RATIO` times their fit, at most `STALL_SHARE` of them (two in a short
    window: a slow first batch or two)."""
    ratios = seconds / np.maximum(fitted, 1e-12)
    over = np.flatnonzero(ratios > STALL_RATIO)
    return over[np.argsort(ratios[over])[::-1][: _stalls_allowed(len(seconds))]]


def _stalls_allowed(batches: int) -> int:
    """How many of a window of `batches` may be set aside as stalls: `STALL_SHARE` of
    them, and at least two (a slow first batch or two)."""
    return max(2, int(STALL_SHARE * batches))


def _residual_ms(fit: LearnedLatency, sample: tuple[float, float, float]) -> float:
    """How much longer a batch `(size, cost, seconds)` took than `fit` says, in ms."""
    size, cost, seconds = sample
    return seconds * 1e3 - fit.fit_ms(size, cost)


def _robust_fit(design: np.ndarray, y: np.ndarray, recency: np.ndarray) -> np.ndarray:
    """Non-negative weighted least squares, reweighted twice with Huber weights."""
    weights = recency
    coef = _nonnegative_fit(design, y, weights)
    for _ in range(2):
        residuals = y - design @ coef
        spread = 1.4826 * _weighted_quantile(np.abs(residuals), recency, 0.5)
        scale = max(spread, 1e-3 * float(y.mean()), 1e-9)
        excess = np.abs(residuals) / (_HUBER_K * scale)
        weights = recency * np.minimum(1.0, 1.0 / np.maximum(excess, 1e-12))
        coef = _nonnegative_fit(design, y, weights)
    return coef


def _nonnegative_fit(design: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least squares with every coefficient >= 0: a column whose coefficient
    comes out negative is dropped and the rest refitted (three columns at most). The
    first column is the intercept (all ones)."""
    scales = np.abs(design).max(axis=0)  # conditioning: sizes ~10, costs ~10^4
    # A term that never varied (every batch of one size) cannot be told apart from the
    # fixed time: it goes there, which over-predicts smaller batches, never under.
    active = [0] + [j for j in range(1, design.shape[1]) if np.ptp(design[:, j]) > 0]
    scaled = design[:, active] / scales[active]
    gram = scaled.T @ (scaled * weights[:, None])
    moment = scaled.T @ (y * weights)
    coef = np.zeros(design.shape[1])
    kept = list(range(len(active)))
    while kept:
        solution = _solve(gram[kept][:, kept], moment[kept])
        if np.all(solution >= 0):
            for j, value in zip(kept, solution):
                coef[active[j]] = value / scales[active[j]]
            return coef
        del kept[int(np.argmin(solution))]
    return coef


def _solve(gram: np.ndarray, moment: np.ndarray) -> np.ndarray:
    """The normal equations' least-norm solution (they are singular when every batch
    had one size: the fixed and per-item times cannot be told apart)."""
    solution: np.ndarray = np.linalg.lstsq(gram, moment, rcond=1e-10)[0]
    return solution


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    """The `q` quantile of `values` where each counts with its weight."""
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    index = int(np.searchsorted(cumulative, q * cumulative[-1]))
    return float(values[order][min(index, len(values) - 1)])
