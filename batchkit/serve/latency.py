"""How long a batch takes: a model learned online from the batches that ran.

A batch's time is modelled as `a + b * size + c * cost` (size: the padded batch size;
cost: the policy's cost of its keys, 0 for a keyless policy), fitted to the most
recent batches. Two things make it usable for admission decisions on a noisy machine:

- recent batches weigh more (the weight halves every `half_life` batches), so the
  model follows a change of regime (a slower device, heavier inputs) within a few
  dozen batches;
- the fit is robust (iteratively reweighted least squares with Huber weights): one
  stalled batch (a garbage collection, a page fault) hardly moves it; and a
  prediction adds a *margin*, the recency-weighted 90th percentile of the
  residuals, so it is an upper estimate, and it widens within a few batches of a
  change, before the fit itself has moved.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_SAMPLES = 8  # batches observed before a prediction is made
WINDOW = 128  # batches kept
HALF_LIFE = 16  # batches after which a sample weighs half as much
MARGIN_QUANTILE = 0.95
_HUBER_K = 2.0  # residuals beyond this many robust standard deviations are down-weighted


@dataclass(frozen=True)
class LearnedLatency:
    """The learned batch-time model, as [`Stats.latency_model`][batchkit.Stats] reports it.

    A batch's predicted time is `fixed_ms + per_item_ms * size + per_cost_ms * cost
    + margin_ms`.

    Attributes:
        fixed_ms: A batch's fixed time, in milliseconds.
        per_item_ms: Milliseconds per item (of the padded batch size).
        per_cost_ms: Milliseconds per unit of the policy's batch cost (tokens, for
            the default `"padded"` cost); 0 for a keyless policy.
        margin_ms: What a prediction adds to the fit: the recent residuals' 90th
            percentile.
        samples: Batches the model was fitted to (the most recent ones).
    """

    fixed_ms: float
    per_item_ms: float
    per_cost_ms: float
    margin_ms: float
    samples: int

    def predict_ms(self, size: int, cost: float = 0.0) -> float:
        """The predicted time of a batch, in milliseconds (margin included).

        Args:
            size: The batch's padded size.
            cost: The policy's cost of the batch's keys.
        """
        return (
            self.fixed_ms + self.per_item_ms * size + self.per_cost_ms * cost + self.margin_ms
        )


class BatchTimeLearner:
    """Learns `a + b * size + c * cost` seconds from observed batches; predicts with a margin.

    Not thread-safe: the serving core uses it under its lock. A refit runs at the first
    prediction after new observations (a few small numpy operations on at most
    `WINDOW` samples), so observing is cheap.
    """

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=WINDOW)
        self._coef = np.zeros(3)
        self._margin = 0.0
        self._stale = False

    @property
    def ready(self) -> bool:
        """Whether enough batches were observed to predict."""
        return len(self._samples) >= MIN_SAMPLES

    def observe(self, size: int, cost: float, seconds: float) -> None:
        """One batch ran.

        Args:
            size: Its padded size.
            cost: The policy's cost of its keys (0 for a keyless policy).
            seconds: How long it took, from leaving the queue to its results.
        """
        self._samples.append((float(size), float(cost), float(seconds)))
        self._stale = True

    def predict(self, size: float, cost: float = 0.0) -> float:
        """The predicted seconds of a batch, margin included (call only when `ready`).

        Args:
            size: The batch's padded size.
            cost: The policy's cost of its keys.
        """
        if self._stale:
            self._refit()
        a, b, c = self._coef
        return max(a + b * size + c * cost, 0.0) + self._margin

    def snapshot(self) -> LearnedLatency | None:
        """The model now, in milliseconds; None until `ready`."""
        if not self.ready:
            return None
        if self._stale:
            self._refit()
        a, b, c = (float(x) * 1e3 for x in self._coef)
        return LearnedLatency(a, b, c, self._margin * 1e3, len(self._samples))

    def _refit(self) -> None:
        data = np.array(self._samples)
        design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        seconds = data[:, 2]
        ages = np.arange(len(data) - 1, -1, -1, dtype=float)
        recency = 0.5 ** (ages / HALF_LIFE)
        coef = _robust_fit(design, seconds, recency)
        residuals = seconds - design @ coef
        self._coef = coef
        self._margin = max(_weighted_quantile(residuals, recency, MARGIN_QUANTILE), 0.0)
        self._stale = False


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
    comes out negative is dropped and the rest refitted (three columns at most)."""
    scales = np.abs(design).max(axis=0)  # conditioning: sizes ~10, costs ~10^4
    active = [j for j in range(design.shape[1]) if scales[j] > 0]
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
