"""A layout's inverse applied to a model's outputs: one result per item.

A batch layout (`Padded`, `Varlen`, `Packed`, the dict a collator builds) knows
where each item went. `Layout.split` uses that to cut an output of the batch back
into one result per item, leaf by leaf:

- a *per-token* leaf (it starts with the layout's token axes: ``[B, L]`` for a
  padded batch, ``[T]`` for a varlen one, ``[R, max_length]`` for a packed one)
  becomes each item's own steps;
- any other leaf is taken *by row*: item ``i`` gets ``leaf[i]``.

Mappings (dicts, a Hugging Face ``ModelOutput``), tuples and lists are walked, so
each item gets a structure of the same keys. Where a leaf's shape fits both
readings and the outputs show that this is no accident of the data, the reading
must be declared (``per_token=``); see `split_outputs`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from batchkit._backend import is_array


class AmbiguousOutputWarning(UserWarning):
    """An output leaf of shape ``[B, L]`` was read per token by its shape alone, with
    nothing in the outputs to tell it from a pooled ``[B, H]`` leaf whose width
    happens to equal the padded length ``L``: declare ``per_token=``."""


PerToken = bool | Collection[str] | None
"""How `Layout.split` reads each leaf: ``None`` by its shape; ``True`` every leaf per
token; ``False`` every leaf by row; a collection of keys of a mapping output: those
keys' leaves per token, every other leaf by row."""


@dataclass(frozen=True, slots=True)
class Inverse:
    """Where each item of a batch went, on the host (no arrays): what `split_outputs`
    needs to cut an output.

    Attributes:
        who: The layout's split, named in errors (``"Padded.split"``).
        token_axes: The leading shape of a per-token leaf; None when the layout has
            no token axis (nothing was padded: every leaf is by row).
        num_rows: The leading size of a by-row leaf.
        rows: Item ``i``'s row in a by-row leaf; None for an item that has none
            (an empty sequence a collator dropped).
        cut_tokens: A per-token leaf (already checked to start with ``token_axes``)
            cut into one slice per item, in item order.
    """

    who: str
    token_axes: tuple[int, ...] | None
    num_rows: int
    rows: tuple[int | None, ...]
    cut_tokens: Callable[[Any], list[Any]]


class Layout:
    """A batch layout that can give each item its own part of an output (`split`)."""

    __slots__ = ()

    def inverse(self) -> Inverse:
        """The host-side record `split` cuts by (it holds no arrays of the batch)."""
        raise NotImplementedError

    def split(self, outputs: Any, *, per_token: PerToken = None) -> list[Any]:
        """One result per item of an output computed from this batch.

        A per-token leaf (one that starts with the layout's token axes: ``[B, L]``
        for `Padded`, ``[T]`` for `Varlen`, ``[R, max_length]`` for `Packed`) gives
        each item its own steps, exactly as ``unpad``/``unpack`` do; every other
        leaf is taken by row (item ``i`` gets ``leaf[i]``). A mapping (a dict, a
        Hugging Face ``ModelOutput``), tuple or list is split leaf by leaf into one
        structure of the same keys per item; ``None`` leaves stay ``None``.

        Args:
            outputs: An array or tensor, or a mapping/tuple/list of them.
            per_token: ``None`` reads each leaf by its shape (see below); ``True``
                every leaf per token; ``False`` every leaf by row; a collection
                of keys of a mapping ``outputs``: those keys per token, every
                other by row.

        Returns:
            One result per item, in item order.

        Raises:
            ValueError: A leaf fits neither reading (its shape and the expected
                ones named), or, with ``per_token=None``, fits both and its shape
                cannot tell: a varlen leaf whose ``T`` equals the number of items,
                or a 2-D ``[B, L]`` leaf when another leaf has an axis of size
                ``L`` (a model width equal to the padded length).
            TypeError: A leaf is not an array, tensor or None, or ``per_token``
                names keys while ``outputs`` is not a mapping.

        Warns:
            AmbiguousOutputWarning: With ``per_token=None``, a 2-D ``[B, L]`` leaf
                is read per token while no leaf of the outputs has a third axis to
                show the model's widths: a pooled ``[B, H]`` with ``H == L`` would
                look the same.
        """
        return split_outputs(outputs, self.inverse(), per_token)


def check_per_token(per_token: object, who: str) -> None:
    """Refuse a ``per_token`` that is not None, a bool or a collection of keys.

    Args:
        per_token: The value given.
        who: Who took it, named in the error.

    Raises:
        TypeError: It is none of those (a string is not a collection of keys here).
    """
    if per_token is None or isinstance(per_token, bool):
        return
    if isinstance(per_token, (str, bytes)) or not isinstance(per_token, Collection):
        raise TypeError(
            f"{who}: per_token must be None, a bool or a collection of keys, got {per_token!r}"
        )


def split_outputs(outputs: Any, inverse: Inverse, per_token: PerToken = None) -> list[Any]:
    """`Layout.split` on an `Inverse`: one result per item (see `Layout.split`).

    Args:
        outputs: An array or tensor, or a mapping/tuple/list of them.
        inverse: Where each item went.
        per_token: See `PerToken`.
    """
    declared: dict[str, bool] | bool | None
    check_per_token(per_token, inverse.who)
    if per_token is None or isinstance(per_token, bool):
        declared = per_token
    else:
        if not isinstance(outputs, Mapping):
            raise TypeError(
                f"{inverse.who}: per_token names keys {sorted(map(str, per_token))} but the "
                f"outputs are a {type(outputs).__name__}, not a mapping"
            )
        unknown = sorted(str(k) for k in per_token if k not in outputs)
        if unknown:
            raise ValueError(
                f"{inverse.who}: per_token names keys {unknown} that the outputs do not "
                f"have (they have {sorted(map(str, outputs))})"
            )
        declared = {key: key in per_token for key in outputs}
    widths: dict[int, str] = {}
    _collect_widths(outputs, "outputs", widths)
    return _Splitter(inverse, widths).walk(outputs, "outputs", declared)


def _collect_widths(value: Any, path: str, widths: dict[int, str]) -> None:
    """Every size an axis after the second has in ``value``'s leaves -> the first leaf
    that shows it: sizes the model has whatever the batch (a hidden width)."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            _collect_widths(item, f"{path}[{key!r}]", widths)
    elif isinstance(value, (tuple, list)):
        for j, item in enumerate(value):
            _collect_widths(item, f"{path}[{j}]", widths)
    elif is_array(value):
        shape = tuple(int(d) for d in value.shape)
        for size in shape[2:]:
            widths.setdefault(size, f"{path} of shape {shape}")


class _Splitter:
    """One walk of an output structure, cutting each leaf by `inverse`."""

    def __init__(self, inverse: Inverse, widths: dict[int, str]) -> None:
        self.inverse = inverse
        self.widths = widths
        self.num_items = len(inverse.rows)

    def walk(self, value: Any, path: str, declared: dict[str, bool] | bool | None) -> list[Any]:
        n = self.num_items
        if value is None:
            return [None] * n
        if isinstance(value, Mapping):
            columns = {
                key: self.walk(
                    item,
                    f"{path}[{key!r}]",
                    declared[key] if isinstance(declared, dict) else declared,
                )
                for key, item in value.items()
            }
            make: Any = dict if type(value) is dict else type(value)  # (a ModelOutput)
            return [make({key: columns[key][i] for key in value}) for i in range(n)]
        if isinstance(value, (tuple, list)):
            columns_seq = [
                self.walk(item, f"{path}[{j}]", declared) for j, item in enumerate(value)
            ]
            if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
                return [type(value)(*(c[i] for c in columns_seq)) for i in range(n)]
            return [type(value)(c[i] for c in columns_seq) for i in range(n)]
        if not is_array(value):
            raise TypeError(
                f"{self.inverse.who}: leaf {path} is a {type(value).__name__}, not an array "
                "or tensor: it cannot be split per item"
            )
        assert not isinstance(declared, dict)  # (a mapping's keys were resolved above)
        return self.leaf(value, path, declared)

    def leaf(self, value: Any, path: str, per_token: bool | None) -> list[Any]:
        inv = self.inverse
        shape = tuple(int(d) for d in value.shape)
        axes = inv.token_axes
        token = axes is not None and shape[: len(axes)] == axes
        row = len(shape) >= 1 and shape[0] == inv.num_rows
        if per_token is None:
            if token and row:
                self._check_unambiguous(shape, path)
            per_token = token
            if not token and not row:
                raise ValueError(
                    f"{inv.who}: leaf {path} of shape {shape} starts neither with the "
                    f"per-token axes {axes} nor with the batch's {inv.num_rows} rows"
                )
        if per_token:
            if not token:
                raise ValueError(
                    f"{inv.who}: leaf {path} of shape {shape} is read per token but does "
                    f"not start with the per-token axes {axes}"
                )
            return inv.cut_tokens(value)
        if not row:
            raise ValueError(
                f"{inv.who}: leaf {path} of shape {shape} is read by row but does not "
                f"start with the batch's {inv.num_rows} rows"
            )
        return [self._row(value, r, i, path) for i, r in enumerate(inv.rows)]

    def _check_unambiguous(self, shape: tuple[int, ...], path: str) -> None:
        """A leaf that fits both readings: refuse it where its shape cannot tell."""
        axes = self.inverse.token_axes
        assert axes is not None
        if len(axes) == 1:
            why = f"the batch has as many tokens as items ({axes[0]})"
        elif len(shape) == 2 and axes[-1] in self.widths:
            why = (
                f"a width of {axes[-1]}, its second axis, is also the width of "
                f"{self.widths[axes[-1]]}, so it may be pooled"
            )
        elif len(shape) == 2 and not self.widths:
            # Nothing shows the model's widths: per token by its shape, said aloud.
            # (The message names no size, so the warning shows once per leaf.)
            warnings.warn(
                f"{self.inverse.who}: leaf {path}, 2-D [batch, padded length], was read "
                "per token by its shape alone; a pooled [batch, width] output whose "
                "width equals the padded length looks the same. Declare it with "
                "per_token= (True, False, or the keys that are per-token)",
                AmbiguousOutputWarning,
                stacklevel=2,
            )
            return
        else:
            return  # [B, L, ...], or [B, L] beside leaves without width L: per token
        raise ValueError(
            f"{self.inverse.who}: leaf {path} of shape {shape} can be per-token (the "
            f"token axes are {axes}) or by row ({self.inverse.num_rows} rows), and {why}: "
            "declare it with per_token= (True, False, or the keys that are per-token), "
            "e.g. return batch.split(outputs, per_token=...) from the batch function"
        )

    def _row(self, value: Any, row: int | None, item: int, path: str) -> Any:
        if row is None:
            raise ValueError(
                f"{self.inverse.who}: item {item} has no row in leaf {path} (its empty "
                "sequence was left out of the batch); read that leaf per token, or keep "
                "empty items out"
            )
        return value[row, ...]


class FeatureBatch(dict[str, Any], Layout):
    """The dict [`PadCollator`][batchkit.collate.PadCollator] and
    [`VarlenCollator`][batchkit.collate.VarlenCollator] return: a plain ``dict`` of
    batched arrays (``model(**batch)`` works) that also knows where each item went,
    so [`split`][batchkit.Padded.split] gives each item its part of
    the model's outputs.

    Per-token leaves are ``[B, L, ...]`` for `PadCollator` (its padded keys' width)
    and ``[1, T, ...]`` for `VarlenCollator` (its flat row; an empty sequence it
    left out gets no steps and no row); by-row leaves have one row per item
    (per kept sequence for `VarlenCollator`). A `PadCollator` batch in which
    nothing was padded has no per-token axes: every leaf is by row.

    A copy made by ``type(batch)(mapping)`` (as some libraries rebuild mappings)
    carries no layout and refuses `split`;
    [`to_device`][batchkit.collate.to_device] keeps it.

    Args:
        *args: As ``dict``'s (the collators build it and set its layout).
        **kwargs: As ``dict``'s.
    """

    __slots__ = ("_inverse",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The layout, or a picklable function that builds it on first use.
        self._inverse: Inverse | Callable[[], Inverse] | None = None

    def inverse(self) -> Inverse:
        """Where each item went (see [`split`][batchkit.Padded.split]).

        Raises:
            ValueError: This mapping was rebuilt from another and lost its layout.
        """
        if self._inverse is None:
            raise ValueError(
                "FeatureBatch.split: this mapping carries no layout (it was rebuilt from "
                "a collator's output by type(batch)(...)): split the collator's own output"
            )
        if not isinstance(self._inverse, Inverse):
            self._inverse = self._inverse()
        return self._inverse

    def with_values(self, values: Mapping[str, Any]) -> FeatureBatch:
        """A `FeatureBatch` of ``values`` (the same keys, moved or converted) with this
        batch's layout.

        Args:
            values: The new value of each key.
        """
        batch = FeatureBatch(values)
        batch._inverse = self._inverse
        return batch

    def __reduce__(self) -> Any:  # (pickled to and from DataLoader workers)
        return (_rebuild_feature_batch, (dict(self), self._inverse))


def _rebuild_feature_batch(
    values: dict[str, Any], inverse: Inverse | Callable[[], Inverse] | None
) -> FeatureBatch:
    batch = FeatureBatch(values)
    batch._inverse = inverse
    return batch
