"""Array backends: numpy always, torch when the caller hands us tensors, and any other
Array API library (JAX, CuPy, array-api-strict, ...) through ``array-api-compat``.

A backend is named by a *kind*: ``"np"`` and ``"pt"`` have hand-written paths (numpy
and torch were measured faster on them, see benchmarks/collate.py), and every other
library's kind is the name of its Array API namespace (``"jax.numpy"``,
``"array_api_strict"``, ``"array_api_compat.cupy"``), whose arrays the collators
build with the standard's functions alone: allocated on the input's device, never
written in place, lengths kept as host integers.

The collators never import torch or JAX themselves: a tensor can only reach us if
the caller already imported torch, so we look it up in ``sys.modules``. That keeps
``import batchkit`` (and every collator on numpy input) working with torch absent.
``array_api_compat`` is imported only when an array of a third library (or its name
in ``return_tensors``) arrives.
"""

from __future__ import annotations

import importlib
import numbers
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

ReturnTensors = str | ModuleType | None
"""Where a result goes: ``None`` follows the input (arrays of a library give that
library's arrays on their device; lists and numpy arrays give numpy); a name
(``"np"``/``"numpy"``, ``"pt"``/``"torch"``, ``"jax"``, ``"cupy"``,
``"array_api_strict"``) or an Array API namespace module (``jax.numpy``,
``array_api_strict``, ``numpy``, ``torch``) forces that library."""

# return_tensors names -> the module to import for them ("np" and "pt" need none).
_NAMED_LIBRARIES = {
    "np": "numpy",
    "numpy": "numpy",
    "pt": "torch",
    "torch": "torch",
    "jax": "jax.numpy",
    "cupy": "cupy",
    "array_api_strict": "array_api_strict",
}

# Kinds of the libraries without a hand-written path -> their Array API namespace.
_NAMESPACES: dict[str, Any] = {}


def torch_module() -> Any | None:
    """The already-imported torch module, or None if the process has not imported it."""
    return sys.modules.get("torch")


def _torch() -> Any:
    """The already-imported torch module (callers only reach here holding a tensor)."""
    torch = torch_module()
    if torch is None:  # pragma: no cover - a tensor cannot exist without torch imported
        raise RuntimeError("torch tensors seen but torch is not imported")
    return torch


def require_torch(what: str = 'return_tensors="pt"') -> Any:
    """Import torch for ``what`` (torch output by default); a clear error if it is not
    installed.

    Args:
        what: What needs torch, for the error (``'return_tensors="pt"'``).

    Raises:
        ImportError: torch is not installed (the message gives the pip command).
    """
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without torch
        raise ImportError(f'{what} needs torch: pip install "batchkit-ml[torch]"') from exc
    return torch


def is_tensor(x: object) -> bool:
    """True for a ``torch.Tensor`` (without importing torch).

    Args:
        x: Any value.
    """
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def _compat() -> Any:
    """``array_api_compat``, imported on first use (a third library's array is in play)."""
    import array_api_compat

    return array_api_compat


def _kind_of_namespace(xp: Any) -> str:
    """The kind of a namespace that ``array_api_compat.array_namespace`` returned (or a
    standard namespace module), registering it for `namespace`."""
    name = getattr(xp, "__name__", "")
    if name in ("numpy", "array_api_compat.numpy"):
        return "np"
    if name in ("torch", "array_api_compat.torch"):
        return "pt"
    _NAMESPACES.setdefault(name, xp)
    return name


def is_array(x: object) -> bool:
    """True for a numpy array, a torch tensor, or an array of another Array API library
    (numpy scalars, which carry a namespace too, are not arrays here).

    Args:
        x: Any value.
    """
    if isinstance(x, np.ndarray) or is_tensor(x):
        return True
    # Plain types before the namespace lookup: collators ask this of every value.
    if isinstance(x, (int, float, str, list, tuple, bytes, np.generic)) or x is None:
        return False
    return hasattr(x, "__array_namespace__") or (
        "array_api_compat" in sys.modules and _compat().is_array_api_obj(x)
    )


def array_kind(x: Any) -> str:
    """The kind of an array: ``"np"``, ``"pt"``, or its Array API namespace's name.

    Args:
        x: An array (`is_array` is True for it).
    """
    if isinstance(x, np.ndarray):
        return "np"
    if is_tensor(x):
        return "pt"
    return _kind_of_namespace(_compat().array_namespace(x))


def kind_of(x: object) -> str:
    """``"pt"`` for tensors, ``"np"`` for numpy arrays, ``"list"`` for python sequences,
    the namespace's name for another Array API library's arrays (`array_kind`).

    Args:
        x: An item.

    Raises:
        TypeError: ``x`` is none of those.
    """
    if isinstance(x, np.ndarray):
        return "np"
    if is_tensor(x):
        return "pt"
    if isinstance(x, (list, tuple)):
        return "list"
    if is_array(x):
        return array_kind(x)
    raise TypeError(
        "expected a list, numpy array, torch tensor or an Array API library's array, "
        f"got {type(x).__name__}"
    )


def namespace(kind: str) -> Any:
    """The Array API namespace of a kind (``array_api_compat``'s wrappers for numpy and
    torch, whose own modules are not fully standard).

    Args:
        kind: ``"np"``, ``"pt"``, or a kind `array_kind` or `resolve_return_tensors`
            returned.
    """
    if kind == "np":
        return importlib.import_module("array_api_compat.numpy")
    if kind == "pt":
        return importlib.import_module("array_api_compat.torch")
    return _NAMESPACES[kind]


def _import_library(name: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        extra = "jax" if name.startswith("jax") else "torch" if name == "torch" else None
        hint = f'pip install "batchkit-ml[{extra}]"' if extra else f"pip install {name}"
        raise ImportError(f"{what} needs {name.split('.')[0]}: {hint}") from exc


def _kind_of_module(module: ModuleType) -> str:
    """The kind of a library's module: numpy, torch, a standard namespace (it has
    ``__array_api_version__``) or one ``array_api_compat`` wraps (CuPy, Dask)."""
    name = module.__name__
    if name in ("numpy", "torch", "array_api_compat.numpy", "array_api_compat.torch"):
        return _kind_of_namespace(module)
    wrapped = {"cupy": "cupy", "dask.array": "dask.array"}.get(name)
    if wrapped is not None:
        return _kind_of_namespace(importlib.import_module(f"array_api_compat.{wrapped}"))
    if hasattr(module, "__array_api_version__"):
        return _kind_of_namespace(module)
    raise TypeError(
        f"return_tensors: module {name!r} is not an Array API namespace (it has no "
        "__array_api_version__); pass jax.numpy, array_api_strict, numpy, torch, ..."
    )


def resolve_return_tensors(return_tensors: object) -> str | None:
    """The kind ``return_tensors`` asks for (None: follow the input), importing the
    library it names.

    Args:
        return_tensors: The value given (see `ReturnTensors`).

    Raises:
        TypeError: It is neither None, a string nor a module, or a module that is not
            an Array API namespace.
        ValueError: A name not in the table.
        ImportError: The library named is not installed (the message gives the pip
            command).
    """
    if return_tensors is None or return_tensors == "np" or return_tensors == "pt":
        return return_tensors  # type: ignore[return-value]
    if isinstance(return_tensors, str) and return_tensors in _NAMESPACES:
        return return_tensors  # a kind seen before ("jax.numpy")
    if isinstance(return_tensors, str):
        library = _NAMED_LIBRARIES.get(return_tensors)
        if library is None:
            names = ", ".join(f'"{n}"' for n in _NAMED_LIBRARIES)
            raise ValueError(
                f"return_tensors must be None, one of {names}, or an Array API namespace "
                f"module, got {return_tensors!r}"
            )
        if library in ("numpy", "torch"):
            return "np" if library == "numpy" else "pt"
        what = f"return_tensors={return_tensors!r}"
        return _kind_of_module(_import_library(library, what))
    if isinstance(return_tensors, ModuleType):
        return _kind_of_module(return_tensors)
    raise TypeError(
        "return_tensors must be None, a library's name or an Array API namespace module, "
        f"got {type(return_tensors).__name__}"
    )


def check_return_tensors(return_tensors: object) -> None:
    """Reject anything `resolve_return_tensors` refuses.

    Args:
        return_tensors: The value given.

    Raises:
        TypeError: Not None, a string or a namespace module.
        ValueError: An unknown name.
        ImportError: The library named is not installed.
    """
    resolve_return_tensors(return_tensors)


def output_kind(input_kind: str, return_tensors: ReturnTensors) -> str:
    """The backend a result is returned in: explicit request, else the input's
    (lists give numpy).

    Args:
        input_kind: The input's kind (``"pt"``, ``"np"``, ``"list"`` or a namespace's).
        return_tensors: The caller's request, or None.
    """
    requested = resolve_return_tensors(return_tensors)
    if requested is not None:
        return requested
    return "np" if input_kind == "list" else input_kind


def is_generic(kind: str) -> bool:
    """True for a kind built with the Array API standard alone (not numpy, torch or lists).

    Args:
        kind: A kind.
    """
    return kind not in ("np", "pt", "list")


def device_of(x: Any) -> Any:
    """Where an array lives: None for numpy, the torch device, or the library's device.

    Args:
        x: An array.
    """
    if isinstance(x, np.ndarray):
        return None
    if is_tensor(x):
        return x.device
    return _compat().device(x)


def to_numpy(x: Any) -> np.ndarray:
    """Host numpy view/copy of an array or tensor.

    Args:
        x: An array, tensor (detached, brought to the CPU), another library's array
            (copied to the host) or anything ``np.asarray`` takes.
    """
    if isinstance(x, np.ndarray):
        return x
    if is_tensor(x):
        out: np.ndarray = x.detach().cpu().numpy()
        return out
    if type(x).__module__.split(".")[0] == "cupy":
        host: np.ndarray = x.get()  # CuPy refuses implicit host copies by design
        return host
    try:
        return np.asarray(x)
    except (TypeError, ValueError, RuntimeError):
        return np.from_dlpack(x)


def to_kind(x: np.ndarray | Any, kind: str, device: Any = None, *, pin: bool = False) -> Any:
    """Convert an array to ``kind`` (on ``device`` for any kind but numpy); with ``pin``,
    a torch result lies in page-locked host memory (see `check_pin_memory`).

    An array already of ``kind`` (and on ``device``, or with ``device`` None) is
    returned as it is; between two libraries the data goes through the host.

    Args:
        x: A numpy array, tensor, or another library's array.
        kind: ``"np"``, ``"pt"`` or a namespace's kind.
        device: Where the result goes (None: where it is; the library's default
            device for a host array).
        pin: For torch, put the result in page-locked host memory.
    """
    if kind == "np":
        return to_numpy(x)
    if kind == "pt":
        torch = require_torch()
        if not (isinstance(x, np.ndarray) or is_tensor(x)):
            x = to_numpy(x)
        if pin:
            if isinstance(x, np.ndarray):
                return pinned_copy(x)
            return x if x.is_pinned() else x.pin_memory()  # PinMemoryBackward keeps a graph
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(np.ascontiguousarray(x))
        return x if device is None else x.to(device)
    xp = namespace(kind)
    if not isinstance(x, np.ndarray) and array_kind(x) == kind:
        return x if device is None else _compat().to_device(x, device)
    host = to_numpy(x)
    return xp.asarray(host) if device is None else xp.asarray(host, device=device)


def pinned_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised torch tensor of ``shape`` and torch ``dtype`` in page-locked memory.

    Args:
        shape: The tensor's shape.
        dtype: A torch dtype.
    """
    return _torch().empty(shape, dtype=dtype, pin_memory=True)


def pinned_copy(arr: np.ndarray, dtype: Any = None) -> Any:
    """A page-locked torch tensor holding a copy of the host array ``arr`` (cast to the
    torch ``dtype`` when given).

    Args:
        arr: A host numpy array.
        dtype: A torch dtype to cast to, or None to keep ``arr``'s.
    """
    src = require_torch().from_numpy(np.ascontiguousarray(arr))
    out = pinned_empty(tuple(src.shape), src.dtype if dtype is None else dtype)
    return out.copy_(src)


def pinned_numpy_out(shape: tuple[int, ...], np_dtype: Any) -> tuple[Any, np.ndarray]:
    """A page-locked torch tensor and a numpy view of it, for numpy to build into with
    ``out=`` (so a numpy-built batch is allocated pinned rather than copied there).

    Args:
        shape: The tensor's shape.
        np_dtype: A numpy dtype that has a torch equivalent.
    """
    dtype = require_torch().from_numpy(np.empty(0, dtype=np_dtype)).dtype
    out = pinned_empty(shape, dtype)
    return out, out.numpy()


def join_tensors(
    torch: Any, join: Callable[..., Any], tensors: Sequence[Any], *, pin: bool = False
) -> Any:
    """``join(tensors, dim=0)`` (``torch.cat`` or ``torch.stack``). Without an autograd
    graph (cheaper than detaching each item) unless an item requires grad while grad
    mode is on: then the batch keeps the graph, so that a loss on it reaches the items.

    With ``pin`` the result lies in page-locked memory: written there directly with
    ``out=``, or, on the autograd route (where ``out=`` is refused), copied there by a
    differentiable ``pin_memory()``.

    Args:
        torch: The torch module.
        join: ``torch.cat`` or ``torch.stack``.
        tensors: The tensors, on one device.
        pin: Put the result in page-locked host memory.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        joined = join(tensors, dim=0)
        return joined.pin_memory() if pin else joined
    with torch.no_grad():
        if not pin:
            return join(tensors, dim=0)
        first = tensors[0]
        if join is torch.stack:
            shape = (len(tensors), *first.shape)
        else:
            shape = (sum(int(t.shape[0]) for t in tensors), *first.shape[1:])
        dtype = first.dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)  # as the join itself promotes
        return join(tensors, dim=0, out=pinned_empty(tuple(shape), dtype))


def check_pin_memory(pin_memory: object, who: str, kind: str, device: Any = None) -> None:
    """Refuse ``pin_memory=True`` where a batch cannot be pinned, before anything is
    allocated, so the caller gets a clear error rather than a crash inside torch.

    Page-locked (pinned) host memory is what lets ``tensor.to("cuda", non_blocking=True)``
    overlap the copy with compute; it exists only for torch tensors on the host, in the
    process that will do the copy, and only where CUDA is available.

    Args:
        pin_memory: The caller's ``pin_memory`` argument.
        who: The caller, named in the errors.
        kind: The output about to be built: ``"np"``, ``"pt"`` or a namespace's kind.
        device: Its torch device (None for numpy, or not known yet).

    Raises:
        TypeError: ``pin_memory`` is not a bool.
        ValueError: The output is numpy, or the items are on a GPU already.
        RuntimeError: In a ``DataLoader`` worker, or CUDA is not available.
    """
    if pin_memory is False:
        return
    if not isinstance(pin_memory, bool):
        raise TypeError(f"{who}: pin_memory must be True or False, got {pin_memory!r}")
    if kind != "pt":
        came = (
            'numpy (numpy or list input, or return_tensors="np")'
            if kind == "np"
            else f"{kind} arrays (that library manages its own host memory)"
        )
        raise ValueError(
            f"{who}: pin_memory=True pins torch tensors, but this batch comes out as {came}; "
            'pass return_tensors="pt"'
        )
    if device is not None and device.type != "cpu":
        raise ValueError(
            f"{who}: pin_memory=True pins host memory, but the items are on {device} "
            "already; pass pin_memory=False"
        )
    torch = require_torch("pin_memory=True")
    data = sys.modules.get("torch.utils.data")
    if data is not None and data.get_worker_info() is not None:
        raise RuntimeError(
            f"{who}: pin_memory=True inside a DataLoader worker process: the batch reaches "
            "the main process through shared memory, which is not page-locked; pass "
            "pin_memory=True to the DataLoader instead (it pins in the main process)"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{who}: pin_memory=True needs CUDA: page-locked memory only speeds up copies "
            "to a CUDA device, and torch.cuda.is_available() is False on this machine; "
            "leave pin_memory=False here"
        )


def scatter_rows(data: Any, host_mask: np.ndarray, mask: Any, values: Any) -> None:
    """``data[mask] = values`` (row-major fill), by the fastest route for the backend.

    On CPU, torch's boolean-index assignment (nonzero + index_put) is several times
    slower than numpy's on zero-copy views; elsewhere ``masked_scatter_`` also avoids
    the host sync that boolean indexing costs on CUDA.

    Args:
        data: The padded batch ``[B, L, *feat]`` to fill (numpy or torch).
        host_mask: Host bool ``[B, L]``: where the values go.
        mask: The same mask in ``data``'s backend and device.
        values: ``[T, *feat]``, ``T`` the number of True entries, in row-major order.
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
    a numpy view is copied through it: torch has no indexing kernel for some (uint16+).

    Args:
        dst: The array or tensor written.
        dst_rows: Host int rows of ``dst``.
        src: The array or tensor read, of ``dst``'s backend.
        src_rows: Host int rows of ``src``, one per ``dst_rows`` entry.
        kind: ``"np"`` or ``"pt"``.
        device: For torch, the device of both.
    """
    if kind == "pt" and _copies_via_numpy(dst, src):
        dst.numpy()[dst_rows] = src.numpy()[src_rows]
        return
    dst[from_host(kind, dst_rows, device)] = src[from_host(kind, src_rows, device)]


def full(kind: str, shape: tuple[int, ...], fill: Any, like: Any, *, pin: bool = False) -> Any:
    """An array of ``shape`` filled with ``fill``, with ``like``'s dtype and device
    (in page-locked host memory with ``pin``, for torch).

    An integer or bool dtype must hold ``fill`` exactly: -100 in uint8 would wrap to 156
    (and padding be trained on), 0.5 in int64 would become 0. A float dtype rounds.

    Args:
        kind: ``"np"`` or ``"pt"``.
        shape: The result's shape.
        fill: The value every element holds.
        like: An array or tensor whose dtype (and device) the result takes.
        pin: For torch, allocate the result in page-locked host memory.

    Raises:
        ValueError: An integer or bool dtype cannot hold ``fill`` exactly.
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
        return torch.full(shape, fill, dtype=dtype, device=like.device, pin_memory=pin)
    if is_generic(kind):
        xp = namespace(kind)
        dtype = like.dtype
        if not xp.isdtype(dtype, ("real floating", "complex floating")):
            _check_fill(fill, _held_exactly(xp, dtype, fill), dtype)
        return xp.full(shape, fill, dtype=dtype, device=device_of(like))
    dtype = like.dtype
    if dtype.kind in "biu":
        try:
            held = np.asarray(fill).astype(dtype).item()
        except (TypeError, ValueError, OverflowError):
            held = None
        _check_fill(fill, held, dtype)
    return np.full(shape, fill, dtype=dtype)


def _held_exactly(xp: Any, dtype: Any, fill: Any) -> Any:
    """``fill`` as a bool or integer ``dtype`` of namespace ``xp`` would hold it, computed
    on the host (None when it cannot hold it at all)."""
    if not isinstance(fill, (numbers.Real, np.generic)) or isinstance(fill, complex):
        return None
    if xp.isdtype(dtype, "bool"):
        return bool(fill)
    if fill != fill or fill in (float("inf"), float("-inf")):  # nan, inf
        return None
    info = xp.iinfo(dtype)
    held = int(fill)  # type: ignore[arg-type]
    return held if info.min <= held <= info.max else None


def _check_fill(fill: Any, held: Any, dtype: Any) -> None:
    """``held`` is ``fill`` cast to ``dtype`` and back (None if the cast failed)."""
    if held is None or held != fill:
        raise ValueError(f"pad value {fill!r} does not fit the data's dtype {dtype}")


def from_host(kind: str, arr: np.ndarray, device: Any = None, *, pin: bool = False) -> Any:
    """A host numpy array in the output backend (on ``device``; page-locked with ``pin``).

    Args:
        kind: ``"np"``, ``"pt"`` or a namespace's kind.
        arr: The host array.
        device: Where the result goes (not for numpy).
        pin: For torch, put the result in page-locked host memory.
    """
    return to_kind(arr, kind, device, pin=pin)


def check_leading_axes(outputs: Any, expected: tuple[int, ...], what: str) -> None:
    """Raise a ValueError stating both shapes when ``outputs`` does not start with ``expected``.

    Args:
        outputs: The array or tensor checked.
        expected: The leading axes it must have.
        what: The caller, named in the error (``"unpad"``).
    """
    shape = tuple(getattr(outputs, "shape", ()))
    if shape[: len(expected)] != expected:
        raise ValueError(
            f"{what}: outputs of shape {shape} do not start with the batch's "
            f"leading axes {expected}"
        )


def concat(parts: Sequence[Any], *, pin: bool = False) -> Any:
    """Concatenate arrays or tensors along axis 0, in the backend of the first part
    (page-locked with ``pin``, for tensors).

    Args:
        parts: The arrays or tensors (not empty).
        pin: For tensors, put the result in page-locked host memory.
    """
    first = parts[0]
    if is_tensor(first):
        torch = _torch()
        return join_tensors(torch, torch.cat, list(parts), pin=pin)
    if isinstance(first, np.ndarray):
        return np.concatenate(parts, axis=0)
    return namespace(array_kind(first)).concat(list(parts), axis=0)


def gather_rows(kind: str, values: Any, index: np.ndarray, fill: Any, device: Any) -> Any:
    """``values[index]`` along axis 0 for a standard namespace, where an index equal to
    ``len(values)`` picks a row of ``fill``: one gather builds a padded or packed
    layout without writing into an array (JAX arrays, for one, are immutable).

    Args:
        kind: The namespace's kind.
        values: ``[T, *feat]``.
        index: Host int ``[K]``, each in ``0..T`` (``T``: a padding row).
        fill: The padding rows' value (must fit ``values``'s dtype).
        device: ``values``'s device, where the index goes.
    """
    xp = namespace(kind)
    pad_row = full(kind, (1, *values.shape[1:]), fill, like=values)
    source = xp.concat([values, pad_row], axis=0)
    return xp.take(source, from_host(kind, index, device), axis=0)
