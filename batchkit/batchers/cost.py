"""What a batch costs against a policy's `max_tokens` budget.

A policy's `max_tokens` bounds the *cost* of every batch of more than one item. The
cost is a function of the batch's keys (lengths, by default):

- `"padded"` (the default): `len(batch) * max(keys)`, the area of a batch padded to
  its longest item (`pad_sequence`, a `[batch, max_len]` tensor);
- `"sum"`: `sum(keys)`, for padding-free layouts (`pack_varlen`: one concatenated
  sequence) and for graphs (the total node count);
- a callable `cost(keys) -> number`, e.g. `lambda keys: sum(k * k for k in keys)`
  for attention, whose work grows with the square of each length.

A batch is cut by adding items one at a time while the cost stays within the budget;
the first item that takes it over ends the batch (later items are not tried). So a
cost should not fall as items are added; one that does never makes a batch exceed
the budget, but may end a batch earlier than it could have.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Literal

CostFn = Callable[[Sequence[float]], float]
CostLike = Literal["padded", "sum"] | CostFn
COST_NAMES = ("padded", "sum")


class RunningCost:
    """The cost of a batch that grows one key at a time (from `BatchCost.running`)."""

    def add(self, key: float) -> float:
        """Append `key` to the batch.

        Args:
            key: the next item's key (its length).

        Returns:
            The cost of the batch with `key` in it.
        """
        raise NotImplementedError


class BatchCost:
    """A batch cost: its value for a list of keys, and a running form for cutting batches.

    Build one with [`as_batch_cost`][batchkit.batchers.cost.as_batch_cost]; a policy holds
    it as `policy.cost`.
    """

    name: str = "cost"
    bound_is_exact: bool = False  # upper_bound() is the cost of every such batch

    def of(self, keys: Sequence[float]) -> float:
        """The cost of a batch whose items have these keys.

        Args:
            keys: the batch's keys, in batch order.

        Returns:
            The budget the batch uses (0.0 for no keys).
        """
        raise NotImplementedError

    def running(self) -> RunningCost:
        """An empty [`RunningCost`][batchkit.batchers.cost.RunningCost] to grow key by key."""
        raise NotImplementedError

    def upper_bound(self, count: int, longest: float) -> float | None:
        """A cost no batch of `count` keys, none above `longest`, exceeds (None: unknown).

        The online scheduler uses it to skip computing the exact cost of a bucket's
        waiting requests when the bound already says they cannot fill the budget.

        Args:
            count: how many keys.
            longest: the largest key (an upper bound of it is fine).
        """
        return None

    def __repr__(self) -> str:
        return repr(self.name)


class _RunningPadded(RunningCost):
    __slots__ = ("count", "longest")

    def __init__(self) -> None:
        self.count = 0
        self.longest = 0.0

    def add(self, key: float) -> float:
        self.count += 1
        if key > self.longest:
            self.longest = key
        return self.count * self.longest


class PaddedCost(BatchCost):
    """`len(keys) * max(keys)`: every row padded to the longest item."""

    name = "padded"
    bound_is_exact = True

    def of(self, keys: Sequence[float]) -> float:
        """The padded area of the batch: `len(keys) * max(keys)`."""
        return len(keys) * max(keys, default=0.0)

    def running(self) -> RunningCost:
        """A running padded area: O(1) per added key."""
        return _RunningPadded()

    def upper_bound(self, count: int, longest: float) -> float | None:
        """Exactly the padded area of `count` keys padded to `longest`."""
        return count * longest


class _RunningSum(RunningCost):
    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0.0

    def add(self, key: float) -> float:
        self.total += key
        return self.total


class SumCost(BatchCost):
    """`sum(keys)`: padding-free layouts (packed sequences, graphs' node counts)."""

    name = "sum"

    def of(self, keys: Sequence[float]) -> float:
        """The sum of the keys."""
        return float(sum(keys))

    def running(self) -> RunningCost:
        """A running sum: O(1) per added key."""
        return _RunningSum()

    def upper_bound(self, count: int, longest: float) -> float | None:
        """`count * longest`: no sum of `count` keys up to `longest` is larger."""
        return count * longest


class _RunningCall(RunningCost):
    __slots__ = ("cost", "keys")

    def __init__(self, cost: CallableCost) -> None:
        self.cost = cost
        self.keys: list[float] = []

    def add(self, key: float) -> float:
        self.keys.append(key)
        return self.cost.of(self.keys)


class CallableCost(BatchCost):
    """A user's `cost(keys) -> number`, its result checked on every call."""

    def __init__(self, fn: CostFn) -> None:
        """Wrap `fn` (checked by [`as_batch_cost`][batchkit.batchers.cost.as_batch_cost]).

        Args:
            fn: called with a tuple of a candidate batch's keys; returns a number >= 0.
        """
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__

    def of(self, keys: Sequence[float]) -> float:
        """`fn(keys)`, checked to be a number >= 0.

        Raises:
            TypeError: `fn` returned something that is not a real number.
            ValueError: `fn` returned NaN or a negative number.
        """
        return _checked_value(self.fn(tuple(keys)), keys)

    def running(self) -> RunningCost:
        """A running batch that calls `fn` on the whole prefix at each added key.

        Cutting a batch of `n` items therefore calls `fn` `n` times on up to `n` keys.
        """
        return _RunningCall(self)

    def __repr__(self) -> str:
        return f"<cost {self.name}>"


def _checked_value(value: object, keys: Sequence[float]) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"cost(keys) must return a number, got {type(value).__name__} for keys {_short(keys)}"
        )
    result = float(value)
    if not result >= 0:  # (NaN fails this too)
        raise ValueError(
            f"cost(keys) must return a number >= 0, got {value!r} for keys {_short(keys)}"
        )
    return result


def _short(keys: Sequence[float]) -> str:
    shown = ", ".join(f"{k:g}" for k in list(keys)[:8])
    return f"({shown}{', ...' if len(keys) > 8 else ''})"


PADDED = PaddedCost()
SUM = SumCost()


def as_batch_cost(cost: CostLike | BatchCost) -> BatchCost:
    """The [`BatchCost`][batchkit.batchers.cost.BatchCost] a policy's `cost=` names.

    A callable is tried once on the keys `(1.0,)` here, so a cost that cannot take a
    sequence of keys, or that returns no number, fails when the policy is built rather
    than at its first batch.

    Args:
        cost: `"padded"`, `"sum"`, a callable `cost(keys) -> number`, or a `BatchCost`.

    Raises:
        ValueError: an unknown name, or a callable whose sample cost is NaN or negative.
        TypeError: neither a name nor a callable, or a callable that fails on the
            sample or returns no number.
    """
    if isinstance(cost, BatchCost):
        return cost
    if isinstance(cost, str):
        if cost == "padded":
            return PADDED
        if cost == "sum":
            return SUM
        raise ValueError(
            f"cost must be 'padded', 'sum' or a callable cost(keys) -> number, got {cost!r}"
        )
    if not callable(cost):
        raise TypeError(
            "cost must be 'padded', 'sum' or a callable cost(keys) -> number, "
            f"got {type(cost).__name__}"
        )
    wrapped = CallableCost(cost)
    try:
        wrapped.of((1.0,))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"cost={wrapped.name}: on the sample keys (1.0,): {exc}") from exc
    except Exception as exc:
        raise TypeError(
            f"cost={wrapped.name} failed on the sample keys (1.0,): {type(exc).__name__}: {exc}"
        ) from exc
    return wrapped


__all__ = [
    "COST_NAMES",
    "BatchCost",
    "CallableCost",
    "CostLike",
    "PaddedCost",
    "RunningCost",
    "SumCost",
    "as_batch_cost",
]
