"""Stack / unstack nested structures of arrays (numpy, torch or any Array API
library's), tensors and scalars.

Containers (dicts, lists, tuples, named tuples) are walked; leaves are stacked
along a new first axis. Leaves are dispatched through a type table, like
``torch.utils.data.default_collate``, so other array types can be registered
with `register_leaf`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from batchkit._backend import (
    ReturnTensors,
    array_kind,
    check_pin_memory,
    device_of,
    is_array,
    is_generic,
    is_tensor,
    join_tensors,
    namespace,
    output_kind,
    pinned_copy,
    pinned_numpy_out,
    require_torch,
    resolve_return_tensors,
    to_kind,
)

StackFn = Callable[[Sequence[Any], str], Any]
UnstackFn = Callable[[Any], list[Any]]

_LEAF_TYPES: dict[type, tuple[StackFn, UnstackFn]] = {}


def register_leaf(cls: type, stack_fn: StackFn, unstack_fn: UnstackFn) -> None:
    """Teach [`stack`][batchkit.collate.stack.stack] and [`unstack`][batchkit.unstack] a leaf type.

    A value of exactly type ``cls`` (subclasses are not matched) is then a leaf: it is
    not walked into, and its own functions batch and split it. Registering a type
    again replaces its functions.

    Args:
        cls: The leaf type.
        stack_fn: ``stack_fn(leaves, path)`` builds the batched leaf from the items'
            leaves (``path`` names the position, e.g. ``"['x']"``, for its error
            messages).
        unstack_fn: ``unstack_fn(batched)`` returns the per-item leaves, in order.
    """
    _LEAF_TYPES[cls] = (stack_fn, unstack_fn)


def _check_leaf_pin(pin: bool, path: str, kind: str, device: Any = None) -> None:
    if pin:
        check_pin_memory(pin, f"stack() at {path}" if path else "stack()", kind, device)


def _stack_arrays(leaves: Sequence[Any], path: str, requested: str | None, pin: bool) -> Any:
    first = leaves[0]
    kind = array_kind(first)
    for i, leaf in enumerate(leaves):
        if not is_array(leaf) or array_kind(leaf) != kind:
            raise TypeError(
                f"item {i}{path}: got {type(leaf).__name__}, but item 0 has {type(first).__name__}"
            )
        if tuple(leaf.shape) != tuple(first.shape):
            raise ValueError(
                f"item {i}{path}: shape {tuple(leaf.shape)} differs from item 0's "
                f"{tuple(first.shape)}"
            )
    out_kind = requested or kind
    device = None if kind == "np" else device_of(first)
    _check_leaf_pin(pin, path, out_kind, device)
    if kind == "pt":
        torch = require_torch()
        out = join_tensors(torch, torch.stack, leaves, pin=pin)
        return out if out_kind == "pt" else to_kind(out, out_kind)
    if is_generic(kind):
        for i, leaf in enumerate(leaves):
            if device_of(leaf) != device:
                raise ValueError(f"item {i}{path}: on device {device_of(leaf)}, item 0 on {device}")
        return to_kind(namespace(kind).stack(list(leaves), axis=0), out_kind)
    if pin:  # numpy builds the batch straight into page-locked memory
        shape = (len(leaves), *first.shape)
        pinned, view = pinned_numpy_out(shape, np.result_type(*leaves))
        np.stack(leaves, out=view)
        return pinned
    out_np = np.stack(leaves)
    if out_kind == "pt":
        return require_torch().from_numpy(out_np)
    return out_np if out_kind == "np" else to_kind(out_np, out_kind)


def _stack_scalars(leaves: Sequence[Any], path: str, requested: str | None, pin: bool) -> Any:
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, (numbers.Number, np.generic)) or isinstance(leaf, str):
            raise TypeError(f"item {i}{path}: expected a number, got {type(leaf).__name__}")
    out_kind = output_kind("list", requested)
    _check_leaf_pin(pin, path, out_kind)
    out = np.asarray(leaves)
    if out_kind == "pt":
        torch = require_torch()
        dtype = None
        if out.dtype == np.float64 and not any(isinstance(x, np.generic) for x in leaves):
            dtype = torch.get_default_dtype()  # as torch.tensor() does
        return pinned_copy(out, dtype) if pin else torch.as_tensor(out, dtype=dtype)
    return out if out_kind == "np" else to_kind(out, out_kind)


def _is_namedtuple(x: object) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _stack(items: Sequence[Any], path: str, return_tensors: str | None, pin: bool) -> Any:
    first = items[0]
    leaf_fns = _LEAF_TYPES.get(type(first))
    if leaf_fns is not None:
        return leaf_fns[0](items, path)
    if isinstance(first, Mapping):
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise TypeError(f"item {i}{path}: expected a mapping, got {type(item).__name__}")
            if item.keys() != first.keys():
                diff = set(first.keys()) ^ set(item.keys())
                raise ValueError(
                    f"item {i}{path}: keys differ from item 0's: {sorted(map(str, diff))}"
                )
        out = {
            k: _stack([it[k] for it in items], f"{path}[{k!r}]", return_tensors, pin) for k in first
        }
        return out if type(first) is dict else type(first)(out)  # type: ignore[call-arg]
    if isinstance(first, (list, tuple)):
        for i, item in enumerate(items):
            if type(item) is not type(first) or len(item) != len(first):
                size = len(item) if hasattr(item, "__len__") else "?"
                raise ValueError(
                    f"item {i}{path}: expected a {type(first).__name__} of length {len(first)}, "
                    f"got {type(item).__name__} of length {size}"
                )
        columns = [
            _stack([it[j] for it in items], f"{path}[{j}]", return_tensors, pin)
            for j in range(len(first))
        ]
        if _is_namedtuple(first):
            return type(first)(*columns)
        return type(first)(columns)
    if is_array(first):
        return _stack_arrays(items, path, return_tensors, pin)
    if isinstance(first, (str, bytes)) or first is None:
        return list(items)  # kept as a plain list: one entry per item
    return _stack_scalars(items, path, return_tensors, pin)


def stack(
    items: Sequence[Any], *, return_tensors: ReturnTensors = None, pin_memory: bool = False
) -> Any:
    """Stack same-structured items into one structure of batched leaves.

    ``stack([{"x": a0, "y": 1}, {"x": a1, "y": 2}])`` gives
    ``{"x": array[2, ...], "y": array([1, 2])}``. Arrays and tensors are stacked
    along a new axis 0 in their own library and on their device (tensors stay
    tensors, JAX arrays JAX arrays, unless ``return_tensors`` says otherwise);
    numbers become an array; strings, bytes and None become a list.

    Args:
        items: The items, each the same structure (same keys, lengths and types;
            arrays of the same shape).
        return_tensors: The leaves' library: a name (``"np"``, ``"pt"``, ``"jax"``,
            ...) or an Array API namespace; ``None`` follows each leaf (each library's
            arrays give its own, numpy arrays and numbers give numpy).
        pin_memory: Allocate every stacked tensor in page-locked memory (CUDA
            needed); a leaf that would come out as numpy is refused (pass
            ``return_tensors="pt"``). Leaves of
            [`register_leaf`][batchkit.collate.register_leaf] types are built by their
            own ``stack_fn`` and not pinned.

    Raises:
        TypeError: ``items`` is not a sequence, or an item's value differs in type
            from item 0's (the message names the item and where in it).
        ValueError: No items, items differ in keys, lengths or shapes (named the
            same way), or ``pin_memory=True`` meets a leaf that comes out as numpy.
        RuntimeError: ``pin_memory=True`` without CUDA, or in a ``DataLoader`` worker.
    """
    requested = resolve_return_tensors(return_tensors)
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"stack() expects a sequence of items, got {type(items).__name__}")
    if len(items) == 0:
        raise ValueError("stack() needs at least one item")
    return _stack(items, "", requested, pin_memory)


def _batch_size(batch: Any, path: str) -> int | None:
    leaf_fns = _LEAF_TYPES.get(type(batch))
    if leaf_fns is not None:
        return len(leaf_fns[1](batch))
    if isinstance(batch, list) and not batch:
        return None  # items that each held an empty list: says nothing about the size
    if isinstance(batch, Mapping):
        sizes = [(k, _batch_size(v, f"{path}[{k!r}]")) for k, v in batch.items()]
    elif isinstance(batch, tuple) or (isinstance(batch, list) and _is_container_list(batch)):
        sizes = [(j, _batch_size(v, f"{path}[{j}]")) for j, v in enumerate(batch)]
    elif is_array(batch):
        return int(batch.shape[0])
    else:
        return len(batch)
    known = [(k, n) for k, n in sizes if n is not None]
    for k, n in known:
        if n != known[0][1]:
            raise ValueError(
                f"unstack(): leaf {path}[{k!r}] has {n} items but {path}[{known[0][0]!r}] "
                f"has {known[0][1]}"
            )
    return known[0][1] if known else None


def _is_container_list(batch: list[Any]) -> bool:
    """A list whose entries are batched leaves (not a per-item list of strings)."""
    return bool(batch) and all(
        isinstance(v, (Mapping, tuple, list)) or is_array(v) or type(v) in _LEAF_TYPES
        for v in batch
    )


def _unstack(batch: Any, n: int) -> list[Any]:
    leaf_fns = _LEAF_TYPES.get(type(batch))
    if leaf_fns is not None:
        return leaf_fns[1](batch)
    if isinstance(batch, Mapping):
        cols = {k: _unstack(v, n) for k, v in batch.items()}
        make = type(batch) if type(batch) is not dict else dict
        return [make({k: cols[k][i] for k in batch}) for i in range(n)]  # type: ignore[call-arg]
    if isinstance(batch, list) and not batch:
        return [[] for _ in range(n)]  # stack() of items that each held an empty list
    if isinstance(batch, tuple) or (isinstance(batch, list) and _is_container_list(batch)):
        cols_seq = [_unstack(v, n) for v in batch]
        if _is_namedtuple(batch):
            return [type(batch)(*(c[i] for c in cols_seq)) for i in range(n)]
        return [type(batch)(c[i] for c in cols_seq) for i in range(n)]
    if is_generic_array(batch):  # the standard promises indexing, not iteration
        return [batch[i, ...] for i in range(n)]
    return list(batch)  # arrays/tensors split along axis 0; per-item lists as they are


def is_generic_array(x: Any) -> bool:
    """An array of a library other than numpy and torch."""
    return not isinstance(x, np.ndarray) and not is_tensor(x) and is_array(x)


def unstack(batch: Any) -> list[Any]:
    """Inverse of [`stack`][batchkit.collate.stack.stack]: one structure per item.

    Leaves are indexed along axis 0: ``unstack(stack(xs)) == xs`` structurally
    (numbers come back as numpy scalars, array leaves as views).

    Args:
        batch: A batched structure, such as ``stack`` or a model's batched output
            returns (dicts, lists, tuples of arrays, tensors or per-item lists).

    Raises:
        ValueError: The leaves disagree on the batch size (both named), or the batch
            holds no leaves.
    """
    n = _batch_size(batch, "")
    if n is None:
        raise ValueError("unstack(): the batch holds no leaves, so its size is unknown")
    return _unstack(batch, n)
