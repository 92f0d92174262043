"""The batch costs the property tests draw from, and an independent reference for each."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from batchkit.batchers.base import Batcher


def squares(keys: Sequence[float]) -> float:
    """Attention-like: the work of each item grows with the square of its length."""
    return float(sum(k * k for k in keys))


costs = st.sampled_from(["padded", "sum", squares])


def reference_cost(policy: Batcher, keys: Sequence[float]) -> float:
    """The cost of ``keys`` by the policy's ``cost=``, computed here, not by the policy."""
    name = policy.cost.name
    if name == "padded":
        return len(keys) * max(keys)
    if name == "sum":
        return float(sum(keys))
    assert name == "squares"
    return squares(keys)


def within_budget(policy: Batcher, keys: Sequence[float]) -> bool:
    """Whether a batch of ``keys`` keeps the policy's token budget (one item always does)."""
    budget = policy.max_tokens
    return budget is None or len(keys) <= 1 or reference_cost(policy, keys) <= budget
