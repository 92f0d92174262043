"""Layouts keep autograd: a loss on the batch reaches each item exactly as it would alone
(rows a layout does not carry, like those cut for ``stack``, get a zero gradient).

The collators copy through no-grad fast paths (numpy views, ``torch.no_grad``) when no
item needs a gradient; an item that requires grad must take the differentiable route.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import batchkit

LENGTHS = st.lists(st.integers(1, 7), min_size=1, max_size=5)
DTYPES = st.sampled_from([torch.float32, torch.float64])


def _layouts() -> dict[str, Callable[[list[torch.Tensor]], tuple[torch.Tensor, Any]]]:
    """name -> (items -> (the batch tensor, batch tensor -> per-item tensors))."""

    def pad(side: str) -> Callable[[list[torch.Tensor]], tuple[torch.Tensor, Any]]:
        def run(items: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
            padded = batchkit.pad(items, side=side, pad_to_multiple_of=4)
            return padded.data, padded.unpad

        return run

    def pack(items: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        packed = batchkit.pack(items, max(len(t) for t in items) + 3)
        return packed.data, packed.unpack

    def varlen(items: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        flat = batchkit.pack_varlen(items, pad_to_multiple_of=8)
        return flat.values, flat.unpack

    def stack(items: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        # stack needs one shape: every item cut to the shortest, as a fixed-shape key is
        n = min(len(t) for t in items)
        return batchkit.stack([t[:n] for t in items]), batchkit.unstack

    return {
        "pad-right": pad("right"),
        "pad-left": pad("left"),
        "pack": pack,
        "varlen": varlen,
        "stack": stack,
    }


LAYOUTS = _layouts()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@given(lengths=LENGTHS, dtype=DTYPES, data=st.data())
def test_gradients_reach_each_item_as_alone(
    layout: str, lengths: list[int], dtype: torch.dtype, data: st.DataObject
) -> None:
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    items = [torch.randn(n, 3, generator=gen, dtype=dtype, requires_grad=True) for n in lengths]
    weights = [torch.randn(n, 3, generator=gen, dtype=dtype) for n in lengths]
    batch, split = LAYOUTS[layout](items)
    assert batch.requires_grad
    # An elementwise "model" on the whole batch, then a loss per item on its own slice.
    outputs = split(torch.tanh(batch) * 2)
    sum((out * w[: len(out)]).sum() for out, w in zip(outputs, weights)).backward()
    for i, (item, w, out) in enumerate(zip(items, weights, outputs)):
        alone = item.detach().clone().requires_grad_(True)
        (torch.tanh(alone[: len(out)]) * 2 * w[: len(out)]).sum().backward()
        assert item.grad is not None, f"item {i}: no gradient reached it"
        torch.testing.assert_close(item.grad, alone.grad)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_no_graph_without_grad(layout: str) -> None:
    """Items that need no gradient, or grad mode off: the cheap route, no graph."""
    plain = [torch.randn(n, 3) for n in (2, 5)]
    assert not LAYOUTS[layout](plain)[0].requires_grad
    tracked = [t.clone().requires_grad_(True) for t in plain]
    with torch.no_grad():
        assert not LAYOUTS[layout](tracked)[0].requires_grad
