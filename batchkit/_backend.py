"""Array backends: numpy always, torch when the caller hands us tensors.

The collators never import torch themselves: a tensor can only reach us if the
caller already imported torch, so we look it up in ``sys.modules``. That keeps
``import batchkit`` (and every collator on numpy input) working with torch absent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

ReturnTensors = Literal["np", "pt"] | None
"""``"np"`` forces numpy output, ``"pt"`` torch output, ``None`` follows the input."""

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
    if _copies_via_numpy(data, values):
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


def _copies_via_numpy(dst: Any, src: Any) -> bool:
    """Whether a CPU tensor copy ``src`` -> ``dst`` may go through numpy views (faster,
    and the only route for some dtypes): not when ``src`` carries an autograd graph,
    which numpy would cut."""
    return (
        dst.device.type == "cpu"
        and str(dst.dtype) in _NUMPY_VIEWABLE
        and str(src.dtype) in _NUMPY_VIEWABLE
        and not src.requires_grad
    )


def copy_rows(
    dst: Any, dst_rows: np.ndarray, src: Any, src_rows: np.ndarray, kind: str, device: Any
) -> None:
    """``dst[dst_rows] = src[src_rows]`` for host index arrays. On CPU a torch dtype with
    a numpy view is copied through it: torch has no indexing kernel for some (uint16+)."""
    if kind == "pt" and _copies_via_numpy(dst, src):
        dst.numpy()[dst_rows] = src.numpy()[src_rows]
        return
    dst[from_host(kind, dst_rows, device)] = src[from_host(kind, src_rows, device)]


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
