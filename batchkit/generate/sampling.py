"""How one request picks its next tokens: greedy, or sampled with a generator of its own.

[`Sampling`][batchkit.generate.Sampling] holds the knobs a caller passes to
``submit(..., sampling=...)``; the batcher gives each sampled request a
[`TokenSampler`][batchkit.generate.TokenSampler] (``StepBatch.seqs[i].sampler``), which
owns its random generator for the request's whole life. A step function turns its
logits into tokens with [`next_tokens`][batchkit.generate.next_tokens]. Because each
request draws from its own generator, and only for the tokens it samples, its tokens
are the same whether it runs alone or batched, chunked, preempted and recomputed.

The filters are those of ``transformers``' ``generate(do_sample=True)``, in its order:
logits in float32, divided by the temperature, then top-k, then top-p (nucleus), then
one draw from the softmax. torch is imported only when a token is sampled.

Logits that make no distribution (a NaN or ``+inf`` among them, or every one
``-inf``; sampled, also logits the temperature overflows) give no token:
``next_tokens`` hands that row a ``ValueError`` instead, which, returned by a step
function, fails that request alone.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling settings of one request (``submit(..., sampling=Sampling(...))``).

    Args:
        temperature: Logits are divided by it before the filters; ``0`` picks the most
            likely token (greedy). A finite number >= 0.
        top_k: Keep only the ``top_k`` most likely tokens; ``0`` keeps all.
        top_p: Keep the smallest set of most likely tokens whose probabilities sum to
            at least ``top_p`` (nucleus sampling), in ``(0, 1]``; ``1`` keeps all.
        seed: Seeds this request's own generator, so its tokens are reproducible and
            independent of what it is batched with; ``None``: a fresh random seed.

    Raises:
        ValueError: ``temperature < 0`` (or not finite), ``top_k < 0``, ``top_p``
            outside ``(0, 1]``, or ``seed`` outside ``[0, 2**64)``.
        TypeError: A value of the wrong type (``top_k`` and ``seed`` are ints).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"Sampling.{name} must be a number, got {value!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"Sampling.temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not 0 < self.top_p <= 1:  # (NaN fails this too)
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise TypeError(f"Sampling.top_k must be an int, got {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"Sampling.top_k must be >= 0 (0 keeps every token), got {self.top_k}")
        seed = self.seed
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
                raise TypeError(f"Sampling.seed must be None or an int, got {seed!r}")
            if not 0 <= seed < 2**64:  # what torch.Generator.manual_seed takes
                raise ValueError(f"Sampling.seed must be in [0, 2**64), got {seed}")

    @property
    def is_greedy(self) -> bool:
        """Whether it always picks the most likely token (``temperature == 0``)."""
        return self.temperature == 0


class TokenSampler:
    """One request's sampler: its settings and its own torch generator.

    The generator is made on the device of the first logits it samples from, seeded
    with ``sampling.seed``, and advances only when this request samples a token.

    Args:
        sampling: The request's settings (not greedy: a greedy request needs no sampler).
    """

    __slots__ = ("sampling", "_generator")

    def __init__(self, sampling: Sampling) -> None:
        self.sampling = sampling
        self._generator: Any = None

    def generator(self, device: Any) -> Any:
        """This request's ``torch.Generator`` on ``device``, made and seeded on first use.

        Args:
            device: The device of the logits it samples from.
        """
        if self._generator is None:
            import torch

            g = torch.Generator(device=device)
            if self.sampling.seed is None:
                g.seed()  # fresh entropy, drawn once: later tokens still follow from it
            else:
                g.manual_seed(self.sampling.seed)
            self._generator = g
        return self._generator

    def sample(self, logits: Any) -> int:
        """One token drawn from ``logits`` (torch, ``[V]``) after the filters.

        Args:
            logits: One row of next-token logits (any float dtype, any device).

        Returns:
            The token id.

        Raises:
            ValueError: The filtered logits make no distribution (see `draw`).
        """
        token = self.draw(logits)
        if token is None:
            raise ValueError(NOT_FINITE)
        return token

    def draw(self, logits: Any) -> int | None:
        """`sample`, or None where the filtered logits make no distribution (a NaN
        or ``+inf`` among them, every one ``-inf``, or overflowed by the temperature).

        Args:
            logits: One row of next-token logits (any float dtype, any device).
        """
        import torch

        p = self.sampling
        scores = logits.to(torch.float32).reshape(1, -1)
        if p.temperature != 1:
            scores = scores / p.temperature
        if p.top_k:
            kth = torch.topk(scores, min(p.top_k, scores.shape[-1])).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1:
            # drop the least likely tokens whose probabilities sum to at most 1 - top_p,
            # always keeping the most likely one
            ordered, order = torch.sort(scores, descending=False)
            drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - p.top_p
            drop[:, -1] = False
            scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        probs = scores.softmax(dim=-1)
        # Checked on the device and read with the token: a multinomial over NaN is a
        # device-side assert on CUDA (fatal to the process's context), and reading the
        # check first would cost a second host sync per sampled row. An unusable row
        # draws from a uniform stand-in, and that draw is discarded.
        usable = probs.isfinite().all()
        stand_in = probs.where(usable, 1.0)
        token = torch.multinomial(stand_in, 1, generator=self.generator(probs.device))
        drawn, ok = torch.stack((token.view(()), usable.long())).tolist()
        return int(drawn) if ok else None


def sampler_for(sampling: Sampling | None) -> TokenSampler | None:
    """The sampler a request with ``sampling`` needs: ``None`` for a greedy one.

    Args:
        sampling: The request's settings, or ``None`` (greedy).
    """
    if sampling is None or sampling.is_greedy:
        return None
    return TokenSampler(sampling)


NOT_FINITE = (
    "the next-token logits are not finite (a NaN or +inf among them, every one -inf, "
    "or overflowed by the temperature): no token can be picked"
)


def next_tokens(logits: Any, samplers: Sequence[TokenSampler | None]) -> list[int | ValueError]:
    """Each row's next token: the most likely one, or one drawn by the row's sampler.

    A step function calls it with one row of logits per sequence and
    ``[s.sampler for s in batch.seqs]``, and returns what it gives; rows without a
    sampler are greedy (the float32 argmax, as ``generate(do_sample=False)``).

    Args:
        logits: torch ``[B, V]``, next-token logits, one row per sequence.
        samplers: ``B`` samplers (``StepBatch.seqs[i].sampler``), ``None`` for greedy.

    Returns:
        ``B`` entries, each a token id, or a ``ValueError`` for a row whose logits
        make no distribution (a step function returning it fails that row's request
        alone).

    Raises:
        ValueError: ``samplers`` does not have one entry per row.
    """
    if len(samplers) != int(logits.shape[0]):
        raise ValueError(f"{len(samplers)} samplers for {int(logits.shape[0])} rows of logits")
    # argmax in float32, as generate's greedy search: a float64 near-tie must break alike.
    # A row whose largest logit is not finite (a NaN propagates to it) reads -1, in the
    # same host sync as the tokens.
    scores = logits.float()
    finite = scores.amax(dim=-1).isfinite()
    tokens: list[Any] = scores.argmax(dim=-1).masked_fill(~finite, -1).tolist()
    for row, sampler in enumerate(samplers):
        token = tokens[row]
        if token >= 0 and sampler is not None:
            token = sampler.draw(logits[row])  # None: no distribution after its filters
        if token is None or token < 0:
            tokens[row] = ValueError(NOT_FINITE)
        else:
            tokens[row] = token
    return tokens
