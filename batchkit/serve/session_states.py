"""Where the states of a stateful function's sessions are kept: per session objects
(the default), or rows of one stacked array that stays on the states' device.

A store hands out a *slot* per live session and reads or writes states by slot. The
batch function sees the states of one batch as `gather(slots)` returns them: a list
of objects, or one stacked array whose row `i` is item `i`'s state (rows gathered by
index, as paged KV blocks are; the buffer is written back by index, never rebuilt).
Stores are not thread-safe: the session layer (`batchkit.serve.sessions`) calls them
under its lock. torch is never imported here: a tensor buffer can only exist if the
caller's `init` made a tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["ObjectStates", "StackedStates", "StateStore"]


class StateStore(Protocol):
    """What the session layer needs of a state store (see the module docstring)."""

    def add(self, state: Any) -> int:
        """Keep `state` for a new session; return its slot."""
        ...

    def remove(self, slot: int) -> None:
        """Forget the state in `slot` (the session ended); the slot may be reused."""
        ...

    def gather(self, slots: Sequence[int]) -> Any:
        """The states in `slots`, in that order, as the batch function receives them."""
        ...

    def check(self, new_states: Any, count: int, name: str) -> None:
        """Raise unless `new_states` holds one state per item of a batch of `count`."""
        ...

    def commit(self, slots: Sequence[int], rows: Sequence[int], new_states: Any) -> None:
        """Store `new_states[rows[j]]` in `slots[j]`, for every `j`."""
        ...

    def row(self, states: Any, i: int) -> Any:
        """Item `i`'s state in a gathered `states` (kept to put it back on failure)."""
        ...

    def put(self, slot: int, state: Any) -> None:
        """Store one `state` (a `row`, or an `init` value) in `slot`."""
        ...


class _Slots:
    """Slot numbers: the lowest free one is reused first (keeps a stacked buffer dense)."""

    def __init__(self) -> None:
        self.free: list[int] = []
        self.next = 0

    def take(self) -> int:
        if self.free:
            self.free.sort(reverse=True)
            return self.free.pop()
        self.next += 1
        return self.next - 1

    def give_back(self, slot: int) -> None:
        self.free.append(slot)


def _count_of(new_states: Any, name: str) -> int:
    if isinstance(new_states, (str, bytes, dict, set)):
        raise TypeError(
            f"{name} returned new_states as a {type(new_states).__name__}: return a "
            "sequence (or a stacked array) with one state per item"
        )
    try:
        return len(new_states)
    except TypeError:
        raise TypeError(
            f"{name} returned new_states of type {type(new_states).__name__}, which has "
            "no len(): return a sequence (or a stacked array) with one state per item"
        ) from None


class ObjectStates:
    """Per session state objects, any Python values; the batch function gets a list
    of them (one per item) and returns a sequence of new ones (a list, a tuple, or an
    array whose rows are the states). The default store; needs no torch."""

    def __init__(self) -> None:
        self._states: list[Any] = []
        self._slots = _Slots()

    def add(self, state: Any) -> int:
        """Keep `state` for a new session; return its slot."""
        slot = self._slots.take()
        if slot == len(self._states):
            self._states.append(state)
        else:
            self._states[slot] = state
        return slot

    def remove(self, slot: int) -> None:
        """Drop the state in `slot` (nothing keeps it alive afterwards)."""
        self._states[slot] = None
        self._slots.give_back(slot)

    def gather(self, slots: Sequence[int]) -> list[Any]:
        """The states in `slots`, as a list."""
        states = self._states
        return [states[s] for s in slots]

    def check(self, new_states: Any, count: int, name: str) -> None:
        """Raise unless `new_states` has `count` entries.

        Raises:
            TypeError: It has no `len()`, or is a `str`, `bytes`, `dict` or `set`.
            ValueError: Its length is not `count`.
        """
        got = _count_of(new_states, name)
        if got != count:
            raise ValueError(f"{name} returned {got} new states for a batch of {count} items")

    def commit(self, slots: Sequence[int], rows: Sequence[int], new_states: Any) -> None:
        """Store `new_states[rows[j]]` in `slots[j]`."""
        for slot, i in zip(slots, rows):
            self._states[slot] = new_states[i]

    def row(self, states: Any, i: int) -> Any:
        """`states[i]`."""
        return states[i]

    def put(self, slot: int, state: Any) -> None:
        """Store `state` in `slot`."""
        self._states[slot] = state


class StackedStates:
    """Every session's state as one row of a single stacked array (numpy, or a torch
    tensor on the states' device), allocated from the first state's shape, dtype and
    device, and doubled when full.

    The batch function gets `buffer[slots]` (the batch's rows, gathered by index: a
    copy) and returns new states stacked the same way, `(batch, *state_shape)`,
    written back with one indexed assignment. Every state must have the first one's
    shape. Nothing is copied between host and device but the slot indices.

    Args:
        capacity: Rows allocated at first (`max_sessions` when it is given).
    """

    def __init__(self, capacity: int = 16) -> None:
        self._capacity = max(int(capacity), 1)
        self._buffer: Any = None
        self._slots = _Slots()

    @property
    def buffer(self) -> Any:
        """The stacked array of all slots (None until the first session)."""
        return self._buffer

    def _index(self, positions: Sequence[int]) -> Any:
        buffer = self._buffer
        if isinstance(buffer, np.ndarray):
            return np.asarray(positions, dtype=np.intp)
        torch = sys.modules["torch"]  # (a tensor buffer: torch is imported)
        return torch.as_tensor(positions, dtype=torch.long, device=buffer.device)

    def _allocate(self, state: Any, rows: int) -> Any:
        if isinstance(state, np.ndarray):
            return np.zeros((rows, *state.shape), dtype=state.dtype)
        new_zeros = getattr(state, "new_zeros", None)
        if new_zeros is None or not hasattr(state, "shape"):
            raise TypeError(
                f"stack_states=True needs each state to be a numpy array or a torch "
                f"tensor, got {type(state).__name__}"
            )
        return new_zeros((rows, *state.shape))

    def add(self, state: Any) -> int:
        """Write `state` into a free row; return its slot.

        Raises:
            TypeError: `state` is not a numpy array or a torch tensor.
            ValueError: Its shape is not the first state's.
        """
        if self._buffer is None:
            self._buffer = self._allocate(state, self._capacity)
        shape = tuple(self._buffer.shape[1:])
        if tuple(getattr(state, "shape", ())) != shape:
            raise ValueError(
                f"every state must have the first state's shape {shape} (stack_states=True), "
                f"got {tuple(getattr(state, 'shape', ()))}"
            )
        slot = self._slots.take()
        if slot >= self._buffer.shape[0]:  # full: double it (rows keep their slots)
            grown = self._allocate(self._buffer[0], 2 * self._buffer.shape[0])
            grown[: self._buffer.shape[0]] = self._buffer
            self._buffer = grown
        self._buffer[slot] = state
        return slot

    def remove(self, slot: int) -> None:
        """Free `slot`'s row (it is overwritten when reused)."""
        self._slots.give_back(slot)

    def gather(self, slots: Sequence[int]) -> Any:
        """`buffer[slots]`: the batch's states stacked, a copy."""
        return self._buffer[self._index(slots)]

    def check(self, new_states: Any, count: int, name: str) -> None:
        """Raise unless `new_states` is shaped `(count, *state_shape)`.

        Raises:
            TypeError: It has no `shape`.
            ValueError: Its shape is not `(count, *state_shape)`.
        """
        shape = getattr(new_states, "shape", None)
        if shape is None:
            raise TypeError(
                f"{name} returned new_states of type {type(new_states).__name__}: with "
                "stack_states=True return one stacked array (batch, *state_shape)"
            )
        expected = (count, *self._buffer.shape[1:])
        if tuple(shape) != expected:
            raise ValueError(
                f"{name} returned new_states of shape {tuple(shape)}, expected {expected} "
                f"(a batch of {count} items)"
            )

    def commit(self, slots: Sequence[int], rows: Sequence[int], new_states: Any) -> None:
        """`buffer[slots] = new_states[rows]`, one indexed write."""
        if len(rows) == new_states.shape[0] and list(rows) == list(range(len(rows))):
            self._buffer[self._index(slots)] = new_states
        else:
            self._buffer[self._index(slots)] = new_states[self._index(rows)]

    def row(self, states: Any, i: int) -> Any:
        """Row `i` of a gathered batch."""
        return states[i]

    def put(self, slot: int, state: Any) -> None:
        """Write one row."""
        self._buffer[slot] = state
