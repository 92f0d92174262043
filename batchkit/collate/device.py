"""Moving a whole batch to a device: :func:`to_device`.

A batch is whatever the collators return (``Padded``, ``Packed``, ``Varlen``, the dict
collators' dicts) or any nesting of dicts, lists, tuples and dataclasses around tensors.
A page-locked (pinned) tensor is copied with ``non_blocking=True``, so the host-to-GPU
copy overlaps with whatever the GPU is doing; that is what ``pin_memory=True`` is for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import numpy as np

from batchkit._backend import is_tensor, require_torch

BatchT = TypeVar("BatchT")


def to_device(batch: BatchT, device: Any, *, non_blocking: bool | None = None) -> BatchT:
    """``batch`` with every tensor moved to ``device``, in the same layout type.

    Walks ``Padded``/``Packed``/``Varlen`` (any dataclass), dicts and other mappings,
    lists, tuples and named tuples; numpy arrays are converted with
    ``torch.as_tensor`` first (a device copy needs a tensor), and everything else
    (ints, strings, None, other objects) is returned as it is. ``non_blocking``
    defaults to "this tensor is pinned": a page-locked tensor is copied asynchronously,
    a pageable one synchronously (torch would copy it synchronously anyway). Pass
    ``non_blocking=True`` to force it; reading a tensor copied that way *to the host*
    needs a ``torch.cuda.synchronize()`` first. Autograd is kept: a moved tensor that
    requires grad passes its gradient back to the original.
    """
    torch = require_torch("to_device")
    if non_blocking is not None and not isinstance(non_blocking, bool):
        raise TypeError(
            f"to_device: non_blocking must be None, True or False, got {non_blocking!r}"
        )
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"to_device: device {str(device)!r} needs CUDA, and torch.cuda.is_available() "
            "is False on this machine"
        )
    return cast(BatchT, _move(batch, target, non_blocking, torch, ""))


def _move(x: Any, device: Any, non_blocking: bool | None, torch: Any, path: str) -> Any:
    if is_tensor(x):
        return x.to(device, non_blocking=x.is_pinned() if non_blocking is None else non_blocking)
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "biufc":
            raise TypeError(
                f"to_device: {path or 'the batch'} is a numpy array of dtype {x.dtype}, "
                "which has no torch equivalent"
            )
        host = torch.as_tensor(x if x.flags.writeable else x.copy())
        return host.to(device, non_blocking=bool(non_blocking))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        changes = {
            f.name: _move(getattr(x, f.name), device, non_blocking, torch, f"{path}.{f.name}")
            for f in dataclasses.fields(x)
            if f.init
        }
        return dataclasses.replace(x, **changes)
    if isinstance(x, Mapping):
        moved = {k: _move(v, device, non_blocking, torch, f"{path}[{k!r}]") for k, v in x.items()}
        return moved if type(x) is dict else type(x)(moved)  # type: ignore[call-arg]
    if isinstance(x, (list, tuple)):
        items = [_move(v, device, non_blocking, torch, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
            return type(x)(*items)
        return type(x)(items)
    return x
