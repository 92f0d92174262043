"""Moving a whole batch to a device: `to_device`.

A batch is whatever the collators return (``Padded``, ``Packed``, ``Varlen``, the dict
collators' dicts) or any nesting of dicts, lists, tuples and dataclasses around arrays.
A page-locked (pinned) tensor is copied with ``non_blocking=True``, so the host-to-GPU
copy overlaps with whatever the GPU is doing; that is what ``pin_memory=True`` is for.
Arrays of other Array API libraries (JAX, CuPy, ...) move with their own library's
``to_device``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import numpy as np

from batchkit._backend import _compat, check_pin_memory, is_array, is_tensor, require_torch
from batchkit.collate.inverse import FeatureBatch

BatchT = TypeVar("BatchT")


def _is_torch_device(device: Any) -> bool:
    """A device torch names: a string (``"cuda:1"``), an int (a CUDA index) or a
    ``torch.device``."""
    if isinstance(device, (str, int)) and not isinstance(device, bool):
        return True
    return type(device).__module__ == "torch" and type(device).__name__ == "device"


def to_device(batch: BatchT, device: Any, *, non_blocking: bool | None = None) -> BatchT:
    """``batch`` with every array moved to ``device``, in the same layout type.

    Walks ``Padded``/``Packed``/``Varlen`` (any dataclass), dicts and other mappings,
    lists, tuples and named tuples; everything that is not an array (ints, strings,
    None, other objects) is returned as it is.

    A torch ``device`` (``"cuda"``, ``"cuda:1"``, a ``torch.device``) moves tensors,
    and numpy arrays become tensors there (``torch.as_tensor`` first: a device copy
    needs a tensor). ``non_blocking`` defaults to "this tensor is pinned": a
    page-locked tensor is copied asynchronously, a pageable one synchronously (torch
    would copy it synchronously anyway). Pass ``non_blocking=True`` to force it;
    reading a tensor copied that way *to the host* needs a
    ``torch.cuda.synchronize()`` first. Autograd is kept: a moved tensor that
    requires grad passes its gradient back to the original.

    Any other library's device (``jax.devices("gpu")[0]``, a CuPy device) moves that
    library's arrays with its own ``to_device``, and leaves numpy arrays on the host;
    torch is not needed then.

    Args:
        batch: The batch: a collator's output or any nesting of containers around
            arrays.
        device: A torch device (anything ``torch.device`` takes), or a device object
            of the batch's array library.
        non_blocking: ``None`` copies pinned tensors asynchronously and the others
            synchronously; ``True`` or ``False`` forces it for every tensor.

    Returns:
        A new batch of the same type; the input is not changed.

    Raises:
        TypeError: ``non_blocking`` is not None or a bool, or a numpy array's dtype
            has no torch equivalent (the message names where it is in the batch).
        RuntimeError: ``device`` is a CUDA device and CUDA is not available.
        ImportError: ``device`` is a torch device and torch is not installed.
    """
    if non_blocking is not None and not isinstance(non_blocking, bool):
        raise TypeError(
            f"to_device: non_blocking must be None, True or False, got {non_blocking!r}"
        )
    if not _is_torch_device(device):
        compat = _compat()
        return cast(
            BatchT,
            map_leaves(
                batch,
                lambda x, path: (
                    compat.to_device(x, device)
                    if is_array(x) and not isinstance(x, np.ndarray)
                    else x
                ),
            ),
        )
    torch = require_torch("to_device")
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"to_device: device {str(device)!r} needs CUDA, and torch.cuda.is_available() "
            "is False on this machine"
        )

    def move(x: Any, path: str) -> Any:
        if is_tensor(x):
            pinned = x.is_pinned() if non_blocking is None else non_blocking
            return x.to(target, non_blocking=pinned)
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in "biufc":
                raise TypeError(
                    f"to_device: {path or 'the batch'} is a numpy array of dtype {x.dtype}, "
                    "which has no torch equivalent"
                )
            host = torch.as_tensor(x if x.flags.writeable else x.copy())
            return host.to(target, non_blocking=bool(non_blocking))
        if is_array(x):
            raise TypeError(
                f"to_device: {path or 'the batch'} is a {type(x).__name__}, which a torch "
                f"device cannot hold; pass a device of its own library"
            )
        return x

    return cast(BatchT, map_leaves(batch, move))


def pinned_batch(batch: BatchT, who: str) -> BatchT:
    """``batch`` with every host tensor copied to page-locked memory (pinned ones kept).

    Numpy arrays, GPU tensors and other values stay as they are, as
    ``DataLoader(pin_memory=True)`` treats them.

    Args:
        batch: A batch (any nesting ``map_leaves`` walks).
        who: The caller, named in the error when CUDA is missing.
    """

    def pin(x: Any, path: str) -> Any:
        if not is_tensor(x) or x.device.type != "cpu" or x.is_pinned():
            return x
        check_pin_memory(True, who, "pt", x.device)
        return x.pin_memory()

    return cast(BatchT, map_leaves(batch, pin))


def map_leaves(x: Any, leaf: Callable[[Any, str], Any], path: str = "") -> Any:
    """``x`` rebuilt with ``leaf(value, path)`` in place of every value that is not a
    container: dataclasses (their init fields), mappings, lists, tuples, named tuples.

    Args:
        x: The structure.
        leaf: Called with each leaf and its path (e.g. ``".data"``, ``"['x'][0]"``);
            its result takes the leaf's place.
        path: The path of ``x`` itself (``""`` at the top).
    """
    if is_array(x):
        return leaf(x, path)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changes = {
            f.name: map_leaves(getattr(x, f.name), leaf, f"{path}.{f.name}")
            for f in dataclasses.fields(x)
            if f.init
        }
        return dataclasses.replace(x, **changes)
    if isinstance(x, Mapping):
        mapped = {k: map_leaves(v, leaf, f"{path}[{k!r}]") for k, v in x.items()}
        if isinstance(x, FeatureBatch):
            return x.with_values(mapped)  # (keeps where each item went)
        return mapped if type(x) is dict else type(x)(mapped)  # type: ignore[call-arg]
    if isinstance(x, (list, tuple)):
        items = [map_leaves(v, leaf, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
            return type(x)(*items)
        return type(x)(items)
    return leaf(x, path)
