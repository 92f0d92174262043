"""Shared hypothesis strategies and comparison helpers for the collate tests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

DTYPES = ("int32", "int64", "float32", "float64", "bool")
FEATURE_SHAPES: tuple[tuple[int, ...], ...] = ((), (2,), (2, 3))
BACKENDS = ("np", "pt", "list")


@dataclass
class Batch:
    """A generated batch: ``items`` in the backend, ``arrays`` the same data in numpy."""

    items: list[Any]
    arrays: list[np.ndarray]
    backend: str
    dtype: str
    feat: tuple[int, ...]

    @property
    def lengths(self) -> list[int]:
        return [a.shape[0] for a in self.arrays]

    def pad_value(self) -> Any:
        """A pad value representable in the batch's dtype (and distinct from 0)."""
        return True if self.dtype == "bool" else 7


def to_backend(arr: np.ndarray, backend: str) -> Any:
    if backend == "np":
        return arr.copy()
    if backend == "pt":
        return torch.from_numpy(arr.copy())
    return arr.tolist()


@st.composite
def batches(
    draw: st.DrawFn,
    backend: str | None = None,
    *,
    max_items: int = 5,
    max_len: int = 7,
    min_len: int = 0,
    dtypes: tuple[str, ...] = DTYPES,
    feats: tuple[tuple[int, ...], ...] = FEATURE_SHAPES,
) -> Batch:
    backend = backend or draw(st.sampled_from(BACKENDS))
    dtype = draw(st.sampled_from(dtypes))
    feat = draw(st.sampled_from(feats))
    lengths = draw(st.lists(st.integers(min_len, max_len), min_size=1, max_size=max_items))
    if backend == "list" and not any(lengths):
        feat = ()  # all-`[]` python lists carry no feature axes
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    arrays = []
    for n in lengths:
        raw = rng.integers(-50, 50, size=(n, *feat))
        arrays.append((raw > 0) if dtype == "bool" else raw.astype(dtype))
    items = [to_backend(a, backend) for a in arrays]
    return Batch(items, arrays, backend, dtype, feat)


def np_of(x: Any) -> np.ndarray:
    """Numpy copy of an array or tensor."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def expected_kind(backend: str, return_tensors: str | None) -> type:
    if return_tensors == "pt" or (return_tensors is None and backend == "pt"):
        return torch.Tensor
    return np.ndarray


def assert_items_equal(got: list[Any], batch: Batch, kind: type) -> None:
    """``got`` holds exactly ``batch``'s items (values, shapes; dtype unless python lists)."""
    assert len(got) == len(batch.arrays)
    for i, (g, want) in enumerate(zip(got, batch.arrays, strict=True)):
        assert isinstance(g, kind), (i, type(g))
        g_np = np_of(g)
        if batch.backend == "list" and want.size == 0:
            assert g_np.size == 0  # `[]` carries no feature axes to recover
            continue
        assert g_np.shape == want.shape, (i, g_np.shape, want.shape)
        if batch.backend != "list":
            assert g_np.dtype == want.dtype, (i, g_np.dtype, want.dtype)
        np.testing.assert_array_equal(g_np.astype(want.dtype), want, err_msg=f"item {i}")


def snapshot(items: list[Any]) -> list[Any]:
    """Deep copies of the items, to check later that nothing mutated them."""
    out: list[Any] = []
    for x in items:
        if isinstance(x, torch.Tensor):
            out.append(x.clone())
        elif isinstance(x, np.ndarray):
            out.append(x.copy())
        else:
            out.append(np.asarray(x).tolist())
    return out


def assert_unchanged(items: list[Any], before: list[Any]) -> None:
    for i, (x, b) in enumerate(zip(items, before, strict=True)):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, b), f"item {i} mutated"
        elif isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, b, err_msg=f"item {i} mutated")
        else:
            assert np.asarray(x).tolist() == b, f"item {i} mutated"


def scribble(x: Any) -> None:
    """Overwrite an output array/tensor in place (to prove it does not alias inputs)."""
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bool:
            x.logical_not_()
        else:
            x.add_(1)
    elif x.dtype == bool:
        np.logical_not(x, out=x)
    else:
        x += 1


def tensors_in(batch: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a batch (layout dataclasses, dicts, lists, tuples), with its path."""
    if isinstance(batch, torch.Tensor):
        return [(path, batch)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = [(f".{f.name}", getattr(batch, f.name)) for f in dataclasses.fields(batch)]
    elif isinstance(batch, dict):
        fields = [(f"[{k!r}]", v) for k, v in batch.items()]
    elif isinstance(batch, (list, tuple)):
        fields = [(f"[{i}]", v) for i, v in enumerate(batch)]
    else:
        return []
    return [found for name, value in fields for found in tensors_in(value, path + name)]
