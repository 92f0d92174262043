"""``pin_memory=True``: every collator and layout allocates its output tensors in
page-locked memory where CUDA exists, and refuses clearly where pinning cannot happen
(no CUDA, numpy output, items already on a GPU, inside a DataLoader worker)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import batchkit

from ._helpers import tensors_in

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="page-locked memory needs CUDA")
needs_no_cuda = pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")

INTS = [[5, 6, 7], [8], [9, 10]]
TENSORS = [torch.tensor(x) for x in INTS]
ARRAYS = [np.asarray(x) for x in INTS]
FEATURES = [
    {"input_ids": [5, 6, 7], "token_type_ids": [0, 0, 1], "labels": [1.0, 0.0], "idx": 0},
    {"input_ids": [8], "token_type_ids": [0], "labels": [0.0, 1.0], "idx": 1},
]
TENSOR_FEATURES = [
    {"input_ids": t, "attention_mask": torch.ones(len(t), dtype=torch.bool)} for t in TENSORS
]

# name -> (pin_memory -> batch): every builder in batchkit.collate, over its input kinds.
BUILDERS: dict[str, Callable[[bool], Any]] = {
    "pad-tensors": lambda pin: batchkit.pad(
        TENSORS, side="left", pad_to_multiple_of=4, pin_memory=pin
    ),
    "pad-lists": lambda pin: batchkit.pad(INTS, return_tensors="pt", pin_memory=pin),
    "pad-numpy": lambda pin: batchkit.pad(ARRAYS, return_tensors="pt", pin_memory=pin),
    "pack-tensors": lambda pin: batchkit.pack(TENSORS, 4, pin_memory=pin),
    "pack-lists-split": lambda pin: batchkit.pack(
        INTS, 2, split=True, return_tensors="pt", pin_memory=pin
    ),
    "pack_varlen-tensors": lambda pin: batchkit.pack_varlen(TENSORS, pin_memory=pin),
    "pack_varlen-lists": lambda pin: batchkit.pack_varlen(
        INTS, return_tensors="pt", pin_memory=pin
    ),
    "pack_varlen-numpy-tail": lambda pin: batchkit.pack_varlen(
        ARRAYS, pad_to_multiple_of=8, return_tensors="pt", pin_memory=pin
    ),
    "pack_varlen-tensors-no-tail": lambda pin: batchkit.pack_varlen(
        TENSORS, pad_to_multiple_of=3, pin_memory=pin
    ),
    "stack": lambda pin: batchkit.stack(
        [{"x": torch.ones(2), "n": np.arange(2), "y": 1, "f": 0.5, "s": "a"}] * 2,
        return_tensors="pt",
        pin_memory=pin,
    ),
    "PadCollator": lambda pin: batchkit.PadCollator(
        pad_to_multiple_of=8, return_tensors="pt", pin_memory=pin
    )(FEATURES),
    "PadCollator-tensors": lambda pin: batchkit.PadCollator(pin_memory=pin)(TENSOR_FEATURES),
    "VarlenCollator": lambda pin: batchkit.VarlenCollator(
        return_tensors="pt", return_sample_index=True, pin_memory=pin
    )([{"input_ids": ids} for ids in INTS]),
}


def _assert_pinned_and_equal(pinned: Any, plain: Any) -> None:
    got, want = tensors_in(pinned), tensors_in(plain)
    assert [path for path, _ in got] == [path for path, _ in want]
    for (path, g), (_, w) in zip(got, want, strict=True):
        assert g.is_pinned(), f"{path} is not pinned"
        assert g.dtype == w.dtype and torch.equal(g, w), path


@pytest.fixture
def simulated_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host allocator standing in for CUDA's page-locked one, so that machines without
    CUDA check too that every output tensor is allocated through the pinned route.

    Tensors allocated with ``pin_memory=True`` (``torch.empty``/``torch.full``) or made
    by ``Tensor.pin_memory()`` are recorded by storage; ``Tensor.is_pinned()`` answers
    from that record. ``test_outputs_are_pinned_on_cuda`` checks the real allocator.
    """
    kept: list[torch.Tensor] = []  # held, so that no recorded address is reused
    pinned: set[int] = set()
    real_empty, real_full = torch.empty, torch.full

    def record(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        pinned.add(t.untyped_storage().data_ptr())
        return t

    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        out = real_empty(*args, **kwargs)
        return record(out) if pin_memory else out

    def full(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        out = real_full(*args, **kwargs)
        return record(out) if pin_memory else out

    def pin(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        return record(self.clone())  # a copy, keeping autograd, as pin_memory() does

    def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
        ptr = self.untyped_storage().data_ptr()
        return self.device.type == "cpu" and ptr != 0 and ptr in pinned

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "full", full)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.usefixtures("simulated_pinned_memory")
def test_outputs_are_allocated_pinned(name: str) -> None:
    plain = BUILDERS[name](False)
    assert not any(t.is_pinned() for _, t in tensors_in(plain))
    _assert_pinned_and_equal(BUILDERS[name](True), plain)


@needs_cuda
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_outputs_are_pinned_on_cuda(name: str) -> None:
    plain = BUILDERS[name](False)
    pinned = BUILDERS[name](True)
    _assert_pinned_and_equal(pinned, plain)
    on_gpu = batchkit.to_device(pinned, "cuda")  # non_blocking: the tensors are pinned
    torch.cuda.synchronize()
    for (path, g), (_, w) in zip(tensors_in(on_gpu), tensors_in(plain), strict=True):
        assert g.device.type == "cuda" and torch.equal(g.cpu(), w), path


LAYOUT_BUILDERS = ("pad-tensors", "pack-lists-split", "pack_varlen-numpy-tail")


@pytest.mark.parametrize("name", LAYOUT_BUILDERS)
@pytest.mark.usefixtures("simulated_pinned_memory")
def test_a_layout_pins_itself_as_dataloader_pin_memory_asks(name: str) -> None:
    """DataLoader(pin_memory=True) calls .pin_memory() on what a worker's collate_fn
    returned; without the method a Padded/Packed/Varlen passed through unpinned."""
    plain = BUILDERS[name](False)
    pinned = plain.pin_memory()
    assert type(pinned) is type(plain)
    _assert_pinned_and_equal(pinned, plain)
    assert pinned.pin_memory() is not pinned  # a copy, whose tensors are kept as they are
    assert all(
        a is b
        for (_, a), (_, b) in zip(tensors_in(pinned.pin_memory()), tensors_in(pinned), strict=True)
    )
    as_numpy = batchkit.pad(ARRAYS).pin_memory()
    assert isinstance(as_numpy.data, np.ndarray)  # numpy left as it is, as DataLoader does


def _pad_worker_collate(batch: list[list[int]]) -> Any:
    return batchkit.pad(batch, return_tensors="pt")


@needs_cuda
def test_dataloader_pin_memory_pins_layouts_from_workers() -> None:
    loader = DataLoader(
        INTS,
        batch_size=3,
        num_workers=1,
        collate_fn=_pad_worker_collate,
        pin_memory=True,
        multiprocessing_context="fork",
    )
    batch = next(iter(loader))
    assert isinstance(batch, batchkit.Padded)
    assert all(t.is_pinned() for _, t in tensors_in(batch))


LAYOUTS_WITH_GRAD: dict[str, Callable[[list[torch.Tensor]], tuple[torch.Tensor, Any]]] = {
    "pad": lambda xs: (lambda p: (p.data, p.unpad))(batchkit.pad(xs, pin_memory=True)),
    "pack": lambda xs: (lambda p: (p.data, p.unpack))(batchkit.pack(xs, 8, pin_memory=True)),
    "pack_varlen": lambda xs: (lambda v: (v.values, v.unpack))(
        batchkit.pack_varlen(xs, pad_to_multiple_of=4, pin_memory=True)
    ),
    "stack": lambda xs: (lambda s: (s, list))(batchkit.stack(xs, pin_memory=True)),
}


def _check_pinned_gradients(layout: str) -> None:
    items = [torch.randn(3, 2, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    batch, split = LAYOUTS_WITH_GRAD[layout](items)
    assert batch.is_pinned() and batch.requires_grad
    weights = [torch.full_like(x, i + 1.0) for i, x in enumerate(items)]
    sum((y * w).sum() for y, w in zip(split(batch), weights, strict=True)).backward()
    for x, w in zip(items, weights, strict=True):
        assert torch.equal(x.grad, w)


@pytest.mark.parametrize("layout", sorted(LAYOUTS_WITH_GRAD))
@pytest.mark.usefixtures("simulated_pinned_memory")
def test_pinned_batches_keep_autograd(layout: str) -> None:
    _check_pinned_gradients(layout)


@needs_cuda
@pytest.mark.parametrize("layout", sorted(LAYOUTS_WITH_GRAD))
def test_pinned_batches_keep_autograd_on_cuda(layout: str) -> None:
    _check_pinned_gradients(layout)


# ------------------------------------------------------------------------- refusals

TORCH_OUTPUT: dict[str, Callable[[], Any]] = {
    "pad": lambda: batchkit.pad(TENSORS, pin_memory=True),
    "pack": lambda: batchkit.pack(INTS, 4, return_tensors="pt", pin_memory=True),
    "pack_varlen": lambda: batchkit.pack_varlen(TENSORS, pin_memory=True),
    "stack": lambda: batchkit.stack([torch.ones(2)] * 2, pin_memory=True),
    "PadCollator": lambda: batchkit.PadCollator(pin_memory=True),
    "VarlenCollator": lambda: batchkit.VarlenCollator(pin_memory=True),
    "Padded.pin_memory()": lambda: batchkit.pad(TENSORS).pin_memory(),
    "Packed.pin_memory()": lambda: batchkit.pack(TENSORS, 4).pin_memory(),
    "Varlen.pin_memory()": lambda: batchkit.pack_varlen(TENSORS).pin_memory(),
}


@needs_no_cuda
@pytest.mark.parametrize("who", sorted(TORCH_OUTPUT))
def test_without_cuda_pin_memory_is_refused_by_name(who: str) -> None:
    with pytest.raises(RuntimeError, match=rf"^{re.escape(who)}.*pin_memory=True needs CUDA"):
        TORCH_OUTPUT[who]()


NUMPY_OUTPUT: dict[str, Callable[[], Any]] = {
    "pad": lambda: batchkit.pad(ARRAYS, pin_memory=True),
    "pad-lists": lambda: batchkit.pad(INTS, pin_memory=True),
    "pad-tensors-np": lambda: batchkit.pad(TENSORS, return_tensors="np", pin_memory=True),
    "pack": lambda: batchkit.pack(ARRAYS, 4, pin_memory=True),
    "pack_varlen": lambda: batchkit.pack_varlen(INTS, pin_memory=True),
    "pack_varlen-tail": lambda: batchkit.pack_varlen(ARRAYS, pad_to_multiple_of=8, pin_memory=True),
    "stack": lambda: batchkit.stack([{"x": np.ones(2)}] * 2, pin_memory=True),
    "stack-numbers": lambda: batchkit.stack([1, 2], pin_memory=True),
    "PadCollator": lambda: batchkit.PadCollator(return_tensors="np", pin_memory=True),
    "VarlenCollator": lambda: batchkit.VarlenCollator(return_tensors="np", pin_memory=True),
}


@pytest.mark.parametrize("case", sorted(NUMPY_OUTPUT))
def test_numpy_output_cannot_be_pinned(case: str) -> None:
    """Pinning needs torch: numpy (or list) input without return_tensors="pt", or
    return_tensors="np", is refused on every machine rather than silently left unpinned."""
    with pytest.raises(ValueError, match='pin_memory=True pins torch tensors.*return_tensors="pt"'):
        NUMPY_OUTPUT[case]()


def test_pin_memory_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="pin_memory must be True or False, got 'yes'"):
        batchkit.pad(INTS, return_tensors="pt", pin_memory="yes")  # type: ignore[arg-type]


@needs_cuda
def test_items_already_on_the_gpu_are_not_pinned() -> None:
    items = [t.cuda() for t in TENSORS]
    for build in (
        lambda: batchkit.pad(items, pin_memory=True),
        lambda: batchkit.pack(items, 4, pin_memory=True),
        lambda: batchkit.pack_varlen(items, pin_memory=True),
        lambda: batchkit.stack(items, pin_memory=True),
        lambda: batchkit.PadCollator(pin_memory=True)([{"input_ids": t} for t in items]),
    ):
        with pytest.raises(ValueError, match="pins host memory, but the items are on cuda"):
            build()


def _pinning_collate(batch: list[list[int]]) -> Any:
    return batchkit.pad(batch, return_tensors="pt", pin_memory=True)


def test_pinning_inside_a_dataloader_worker_is_refused() -> None:
    """A worker's batch crosses to the main process through shared memory, which is not
    page-locked; DataLoader(pin_memory=True) is the way there (checked before CUDA is)."""
    loader = DataLoader(
        INTS,
        batch_size=3,
        num_workers=1,
        collate_fn=_pinning_collate,
        multiprocessing_context="fork",
    )
    with pytest.raises(RuntimeError, match="pin_memory=True inside a DataLoader worker"):
        next(iter(loader))
