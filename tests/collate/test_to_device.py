"""``to_device`` moves every tensor of a batch, keeps its layout type and everything
that is not a tensor, converts numpy arrays, and copies pinned tensors non-blocking."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import batchkit

from ._helpers import tensors_in

SEQS = [[5, 6, 7], [8], [9, 10]]
DEVICES = ["cpu", "meta"]


def _layouts(return_tensors: str | None) -> dict[str, Any]:
    rt: Any = return_tensors
    return {
        "Padded": batchkit.pad(SEQS, side="left", pad_to_multiple_of=4, return_tensors=rt),
        "Packed": batchkit.pack(SEQS, 2, split=True, return_tensors=rt),
        "Varlen": batchkit.pack_varlen(SEQS, pad_to_multiple_of=8, return_tensors=rt),
        "PadCollator": batchkit.PadCollator(return_tensors=rt or "np")(
            [{"input_ids": s, "label": i, "text": "x"} for i, s in enumerate(SEQS)]
        ),
        "stack": batchkit.stack(
            [([np.ones(2)], (i, "s", None)) for i in range(3)], return_tensors=rt
        ),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("return_tensors", ["pt", None])
@pytest.mark.parametrize("name", sorted(_layouts("pt")))
def test_every_tensor_moves_and_the_layout_stays(
    name: str, return_tensors: str | None, device: str
) -> None:
    """Torch batches and numpy ones (converted with torch.as_tensor) alike."""
    batch = _layouts(return_tensors)[name]
    moved = batchkit.to_device(batch, device)
    assert type(moved) is type(batch)
    want = tensors_in(_layouts("pt")[name])
    got = tensors_in(moved)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, g), (_, w) in zip(got, want, strict=True):
        assert g.device.type == device, path
        assert (g.dtype, g.shape) == (w.dtype, w.shape), path
        if device == "cpu":
            assert torch.equal(g, w), path


def test_layout_metadata_and_inverses_survive_the_move() -> None:
    padded = batchkit.to_device(batchkit.pad(SEQS, side="left", return_tensors="pt"), "meta")
    assert (padded.side, padded.batch_size, padded.max_length) == ("left", 3, 3)
    assert [x.shape for x in padded.unpad(torch.empty(3, 3, 4, device="meta"))] == [
        (3, 4),
        (1, 4),
        (2, 4),
    ]
    packed = batchkit.to_device(batchkit.pack(SEQS, 2, split=True), "cpu")
    assert [len(p) for p in packed.pieces] == [2, 1, 1]
    assert [x.tolist() for x in packed.unpack(packed.data)] == SEQS
    varlen = batchkit.to_device(batchkit.pack_varlen(SEQS), "cpu")
    assert varlen.max_seqlen == 3 and varlen.num_items == 3


class Pair(NamedTuple):
    ids: Any
    name: str


def test_containers_and_plain_values_are_kept() -> None:
    batch = {
        "pair": Pair(torch.ones(2), "a"),
        "list": [1, "b", None],
        "n": 3,
        "t": (torch.ones(1),),
    }
    moved = batchkit.to_device(batch, "meta")
    assert isinstance(moved["pair"], Pair) and moved["pair"].name == "a"
    assert moved["pair"].ids.device.type == "meta" and moved["t"][0].device.type == "meta"
    assert moved["list"] == [1, "b", None] and moved["n"] == 3


def test_read_only_numpy_arrays_convert_without_warning() -> None:
    frozen = np.arange(4)
    frozen.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch.as_tensor warns on a read-only array
        out = batchkit.to_device({"x": frozen}, "cpu")
    assert out["x"].tolist() == [0, 1, 2, 3]


def test_a_numpy_array_torch_cannot_hold_is_named() -> None:
    with pytest.raises(TypeError, match=r"to_device: \['text'\] is a numpy array of dtype <U1"):
        batchkit.to_device({"text": np.array(["a", "b"])}, "cpu")


class _Recorded(torch.Tensor):
    """A tensor that records the non_blocking flag of every .to() call on it."""

    calls: list[Any] = []
    pinned = False

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            cls.calls.append(kwargs.get("non_blocking"))
        return super().__torch_function__(func, types, args, kwargs)

    def is_pinned(self, device: Any = None) -> bool:  # type: ignore[override]
        return type(self).pinned


@pytest.mark.parametrize(
    ("pinned", "non_blocking", "expected"),
    [(True, None, True), (False, None, False), (False, True, True), (True, False, False)],
)
def test_non_blocking_defaults_to_whether_the_tensor_is_pinned(
    pinned: bool, non_blocking: bool | None, expected: bool
) -> None:
    _Recorded.calls, _Recorded.pinned = [], pinned
    tensor = torch.Tensor._make_subclass(_Recorded, torch.ones(2))
    batchkit.to_device({"x": tensor}, "cpu", non_blocking=non_blocking)
    assert _Recorded.calls == [expected]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(TypeError, match="non_blocking must be None, True or False, got 1"):
        batchkit.to_device({}, "cpu", non_blocking=1)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="Invalid device string|Expected one of"):
        batchkit.to_device({}, "nonsense")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_cuda_is_refused() -> None:
    with pytest.raises(RuntimeError, match="to_device: device 'cuda' needs CUDA"):
        batchkit.to_device(batchkit.pad(SEQS, return_tensors="pt"), "cuda")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_gradients_flow_back_through_the_move(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    items = [torch.randn(n, 2, dtype=torch.float64, requires_grad=True) for n in (3, 1)]
    moved = batchkit.to_device(batchkit.pad(items), device)
    assert moved.data.requires_grad
    for i, x in enumerate(moved.unpad(moved.data)):
        (x * (i + 1)).sum().backward(retain_graph=True)
    for i, item in enumerate(items):
        assert torch.equal(item.grad, torch.full_like(item, i + 1.0))
