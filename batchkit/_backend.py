"""Array backends: numpy always, torch when the caller hands us tensors.

The collators never import torch themselves: a tensor can only reach us if the
caller already imported torch, so we look it up in ``sys.modules``. That keeps
``import batchkit`` (and every collator on numpy input) working with torch absent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Literal

import numpy as np

ReturnTensors = Literal["np", "pt"] | None
"""``"np"`` forces numpy output, ``"pt"`` torch output, ``None`` follows the input."""

_SCALAR_TYPES = (bool, int, float, np.generic)


def torch_module() -> Any | None:
    """The already-imported torch module, or None if the process has not imported it."""
    return sys.modules.get("torch")


def _torch() -> Any:
    """The already-imported torch module (callers only reach here holding a tensor)."""
    torch = torch_module()
    if torch is None:  # pragma: no cover - a tensor cannot exist without torch imported
        raise RuntimeError("torch tensors seen but torch is not imported")
    return torch


def require_torch() -> Any:
    """Import torch for ``return_tensors="pt"``; a clear error if it is not installed."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError('return_tensors="pt" needs torch: pip install "batchkit[torch]"') from exc
    return torch


def is_tensor(x: object) -> bool:
    """True for a ``torch.Tensor`` (without importing torch)."""
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def kind_of(x: object) -> str:
    """``"pt"`` for tensors, ``"np"`` for numpy arrays, ``"list"`` for python sequences."""
    if isinstance(x, np.ndarray):
        return "np"
    if is_tensor(x):
        return "pt"
    if isinstance(x, (list, tuple)):
        return "list"
    raise TypeError(f"expected a list, numpy array or torch tensor, got {type(x).__name__}")


def check_return_tensors(return_tensors: object) -> None:
    """Reject anything but None, "np" or "pt"."""
    if return_tensors not in (None, "np", "pt"):
        raise ValueError(f'return_tensors must be "np", "pt" or None, got {return_tensors!r}')


def output_kind(input_kind: str, return_tensors: ReturnTensors) -> str:
    """The backend a result is returned in: explicit request, else torch in -> torch out."""
    check_return_tensors(return_tensors)
    if return_tensors is not None:
        return return_tensors
    return "pt" if input_kind == "pt" else "np"


def to_numpy(x: Any) -> np.ndarray:
    """Host numpy view/copy of an array or tensor."""
    if isinstance(x, np.ndarray):
        return x
    if is_tensor(x):
        out: np.ndarray = x.detach().cpu().numpy()
        return out
    return np.asarray(x)


def to_kind(x: np.ndarray | Any, kind: str, device: Any = None) -> Any:
    """Convert a numpy array or tensor to ``kind`` ("np" or "pt"), on ``device`` for torch."""
    if kind == "np":
        return to_numpy(x)
    torch = require_torch()
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    return x if device is None else x.to(device)


@dataclass(frozen=True, slots=True)
class Ragged:
    """Variable-length items as one flat buffer: the layout every collator starts from.

    ``values`` is ``[T, *feat]`` (numpy or torch), the items concatenated along
    their first (sequence) axis; ``lengths`` is a host int64 array ``[N]``.
    """

    values: Any
    lengths: np.ndarray
    kind: str  # "np" or "pt": the backend of ``values``

    @property
    def num_items(self) -> int:
        """N, the number of items."""
        return int(self.lengths.shape[0])

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Trailing axes shared by every item."""
        return tuple(self.values.shape[1:])

    @property
    def device(self) -> Any:
        """The torch device of ``values`` (None for numpy)."""
        return getattr(self.values, "device", None) if self.kind == "pt" else None

    def offsets(self) -> np.ndarray:
        """Host int64 ``[N+1]``: item ``i`` is ``values[offsets[i]:offsets[i+1]]``."""
        out = np.zeros(self.num_items + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out


def _describe(x: Any) -> str:
    shape = tuple(getattr(x, "shape", ()))
    return f"{type(x).__name__} of shape {shape} and dtype {getattr(x, 'dtype', '?')}"


def _check_numeric(arr: Any, index: int) -> None:
    dtype = arr.dtype
    if isinstance(arr, np.ndarray) and dtype.kind not in "biufc":
        raise TypeError(f"item {index}: expected numbers, got dtype {dtype}")


def _item_array(item: Any, index: int, kind: str) -> Any:
    """One item as an array with a sequence axis, with errors naming the item."""
    if item is None:
        raise TypeError(f"item {index}: got None, expected a sequence")
    try:
        item_kind = kind_of(item)
    except TypeError as exc:
        raise TypeError(f"item {index}: {exc}") from None
    if item_kind != kind:
        raise TypeError(
            f"item {index}: mixed input types; item 0 is a {kind} item but item {index} is a "
            f"{item_kind} item (convert them to one type first)"
        )
    if kind == "list":
        try:
            arr = np.asarray(item)
        except ValueError as exc:
            raise ValueError(f"item {index}: ragged nested list ({exc})") from None
        if arr.dtype == object:
            raise ValueError(f"item {index}: ragged or non-numeric nested list")
    else:
        arr = item
    if arr.ndim == 0:
        raise ValueError(f"item {index}: a scalar has no sequence axis; got {_describe(arr)}")
    _check_numeric(arr, index)
    return arr


def _fast_flat_list(items: Sequence[Any]) -> np.ndarray | None:
    """Flat python lists of scalars in one conversion; None when the fast path doesn't apply."""
    first = next((s for s in items if len(s)), None)
    if first is None or not isinstance(first[0], _SCALAR_TYPES):
        return None
    try:
        flat = np.array(list(chain.from_iterable(items)))
    except (ValueError, TypeError):
        return None
    if flat.ndim != 1 or flat.dtype.kind not in "biuf":
        return None
    return flat


def _check_list_items(items: Sequence[Any]) -> None:
    """Every item of a python-list batch must itself be a list or tuple (errors name the item)."""
    for i, item in enumerate(items):
        if not isinstance(item, (list, tuple)):
            _item_array(item, i, "list")  # raises the precise TypeError for this item


def _fast_tensors(
    items: Sequence[Any], return_tensors: ReturnTensors, max_length: int | None
) -> Ragged | None:
    """Tensors of one device and feature shape in a single check pass; None otherwise
    (the general path then names the offending item)."""
    torch = _torch()
    first = items[0]
    device, feat, tensor_type = first.device, first.shape[1:], torch.Tensor
    for s in items:
        if not isinstance(s, tensor_type) or s.ndim == 0:
            return None
        if s.shape[1:] != feat or s.device != device:
            return None
    if max_length is not None:
        items = [s[:max_length] for s in items]
    lengths = np.fromiter((s.shape[0] for s in items), dtype=np.int64, count=len(items))
    values = cat_rows(torch, list(items))
    out_kind = output_kind("pt", return_tensors)
    return Ragged(to_kind(values, out_kind), lengths, out_kind)


def cat_rows(torch: Any, tensors: list[Any]) -> Any:
    """The tensors' rows in one fresh buffer (see :func:`join_tensors`)."""
    return join_tensors(torch, torch.cat, tensors)


def join_tensors(torch: Any, join: Callable[..., Any], tensors: Sequence[Any]) -> Any:
    """``join(tensors, dim=0)`` (``torch.cat`` or ``torch.stack``). Without an autograd
    graph (cheaper than detaching each item) unless an item requires grad while grad
    mode is on: then the batch keeps the graph, so that a loss on it reaches the items."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return join(tensors, dim=0)
    with torch.no_grad():
        return join(tensors, dim=0)


def scatter_rows(data: Any, host_mask: np.ndarray, mask: Any, values: Any) -> None:
    """``data[mask] = values`` (row-major fill), by the fastest route for the backend.

    On CPU, torch's boolean-index assignment (nonzero + index_put) is several times
    slower than numpy's on zero-copy views; elsewhere ``masked_scatter_`` also avoids
    the host sync that boolean indexing costs on CUDA.
    """
    if isinstance(data, np.ndarray):
        data[host_mask] = values
        return
    if (
        data.device.type == "cpu"
        and str(values.dtype) in _NUMPY_VIEWABLE
        and not values.requires_grad  # (numpy would cut the graph; masked_scatter_ keeps it)
    ):
        data.numpy()[host_mask] = values.numpy()
        return
    extra = (1,) * (data.ndim - mask.ndim)
    data.masked_scatter_(mask.view(*mask.shape, *extra), values)


# torch dtypes whose tensors have a numpy view (bfloat16, complex32, ... do not).
_NUMPY_VIEWABLE = frozenset(
    f"torch.{name}"
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32",
                 "float64", "complex64", "complex128", "uint16", "uint32", "uint64")
)


def copy_rows(
    dst: Any, dst_rows: np.ndarray, src: Any, src_rows: np.ndarray, kind: str, device: Any
) -> None:
    """``dst[dst_rows] = src[src_rows]`` for host index arrays. On CPU a torch dtype with
    a numpy view is copied through it: torch has no indexing kernel for some (uint16+)."""
    if (
        kind == "pt"
        and dst.device.type == "cpu"
        and str(dst.dtype) in _NUMPY_VIEWABLE
        and not src.requires_grad  # (through numpy the copy would cut the autograd graph)
    ):
        dst.numpy()[dst_rows] = src.numpy()[src_rows]
        return
    dst[from_host(kind, dst_rows, device)] = src[from_host(kind, src_rows, device)]


def to_ragged(
    items: Sequence[Any],
    *,
    return_tensors: ReturnTensors = None,
    max_length: int | None = None,
) -> Ragged:
    """Validate and concatenate items (lists, arrays or tensors) into a :class:`Ragged`.

    Items longer than ``max_length`` are cut to their first ``max_length`` steps
    (callers decide beforehand whether that is allowed). Inputs are never mutated:
    the flat buffer is always a fresh copy. Python lists holding no numbers at all
    (every item empty) give int64, the dtype of token ids.
    """
    check_return_tensors(return_tensors)
    if isinstance(items, (np.ndarray,)) or is_tensor(items):
        items = list(items)  # a padded 2-D array given as a batch of rows
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise TypeError(f"expected a sequence of items, got {type(items).__name__}")
    if len(items) == 0:
        raise ValueError("expected at least one item, got an empty batch")
    if items[0] is None:
        raise TypeError("item 0: got None, expected a sequence")
    try:
        kind = kind_of(items[0])
    except TypeError as exc:
        raise TypeError(f"item 0: {exc}") from None

    if kind == "list":
        _check_list_items(items)
        # Cut to 0 after conversion, below: an emptied list would lose its feature axis.
        if max_length:
            items = [s[:max_length] if len(s) > max_length else s for s in items]
        lengths = np.fromiter((len(s) for s in items), dtype=np.int64, count=len(items))
        flat = _fast_flat_list(items) if max_length != 0 else None
        if flat is not None:
            out_kind = output_kind("list", return_tensors)
            if out_kind == "pt" and flat.dtype.kind == "f":
                flat = flat.astype(np.float32)  # torch's default float, as torch.tensor() gives
            return Ragged(to_kind(flat, out_kind), lengths, out_kind)
        arrays = [_item_array(s, i, "list") for i, s in enumerate(items)]
    else:
        if kind == "pt":
            fast = _fast_tensors(items, return_tensors, max_length)
            if fast is not None:
                return fast
        arrays = [_item_array(s, i, kind) for i, s in enumerate(items)]
    if max_length is not None:
        arrays = [a[:max_length] for a in arrays]

    # Feature axes must agree; an empty item may come without them (``[]``).
    feat = next((tuple(a.shape[1:]) for a in arrays if a.shape[0] or a.ndim > 1), ())
    for i, a in enumerate(arrays):
        if tuple(a.shape[1:]) != feat:
            if a.shape[0] == 0 and a.ndim == 1:
                arrays[i] = a.reshape((0, *feat))
                continue
            raise ValueError(
                f"item {i}: feature shape {tuple(a.shape[1:])} differs from the batch's "
                f"{feat} (item shapes are [length, *features])"
            )
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    if 0 < np.count_nonzero(lengths) < len(arrays):
        # An empty item has no values to give a dtype (``[]`` is float64, ``torch.tensor([])``
        # float32): it must not promote the others' (int64 ids would lose precision).
        arrays = _empties_as_values(arrays, lengths, kind)

    if kind == "pt":
        torch = _torch()
        device = arrays[0].device
        for i, a in enumerate(arrays):
            if a.device != device:
                raise ValueError(f"item {i}: on device {a.device}, but item 0 is on {device}")
        values = cat_rows(torch, arrays)
        out_kind = output_kind("pt", return_tensors)
        return Ragged(to_kind(values, out_kind), lengths, out_kind)

    values = np.concatenate(arrays, axis=0)
    if kind == "list" and values.size == 0:
        values = values.astype(np.int64)  # no numbers to infer from: token ids, as HF gives
    out_kind = output_kind(kind, return_tensors)
    if out_kind == "pt" and kind == "list" and values.dtype == np.float64:
        values = values.astype(np.float32)
    return Ragged(to_kind(values, out_kind), lengths, out_kind)


def _empties_as_values(arrays: list[Any], lengths: np.ndarray, kind: str) -> list[Any]:
    """``arrays`` with the empty ones cast to the dtype the non-empty ones promote to."""
    filled = [a for a, n in zip(arrays, lengths) if n]
    if kind == "pt":
        torch = _torch()
        dtype = filled[0].dtype
        for a in filled[1:]:
            dtype = torch.promote_types(dtype, a.dtype)
        return [a if n else a.to(dtype) for a, n in zip(arrays, lengths)]
    dtype = np.result_type(*filled)
    return [a if n else a.astype(dtype) for a, n in zip(arrays, lengths)]


def full(kind: str, shape: tuple[int, ...], fill: Any, like: Any) -> Any:
    """An array of ``shape`` filled with ``fill``, with ``like``'s dtype and device.

    An integer or bool dtype must hold ``fill`` exactly: -100 in uint8 would wrap to 156
    (and padding be trained on), 0.5 in int64 would become 0. A float dtype rounds.
    """
    if kind == "pt":
        torch = _torch()
        dtype = like.dtype
        if not (dtype.is_floating_point or dtype.is_complex):
            try:
                held = torch.tensor(fill).to(dtype).item()
            except (TypeError, RuntimeError, OverflowError):
                held = None
            _check_fill(fill, held, dtype)
        return torch.full(shape, fill, dtype=dtype, device=like.device)
    dtype = like.dtype
    if dtype.kind in "biu":
        try:
            held = np.asarray(fill).astype(dtype).item()
        except (TypeError, ValueError, OverflowError):
            held = None
        _check_fill(fill, held, dtype)
    return np.full(shape, fill, dtype=dtype)


def _check_fill(fill: Any, held: Any, dtype: Any) -> None:
    """``held`` is ``fill`` cast to ``dtype`` and back (None if the cast failed)."""
    if held is None or held != fill:
        raise ValueError(f"pad value {fill!r} does not fit the data's dtype {dtype}")


def from_host(kind: str, arr: np.ndarray, device: Any = None) -> Any:
    """A host numpy array in the output backend (on ``device`` for torch)."""
    return to_kind(arr, kind, device)


def check_leading_axes(outputs: Any, expected: tuple[int, ...], what: str) -> None:
    """Raise a ValueError stating both shapes when ``outputs`` does not start with ``expected``."""
    shape = tuple(getattr(outputs, "shape", ()))
    if shape[: len(expected)] != expected:
        raise ValueError(
            f"{what}: outputs of shape {shape} do not start with the batch's "
            f"leading axes {expected}"
        )


def concat(parts: Sequence[Any]) -> Any:
    """Concatenate arrays or tensors along axis 0, in the backend of the first part."""
    if is_tensor(parts[0]):
        return _torch().cat(list(parts), dim=0)
    return np.concatenate(parts, axis=0)
