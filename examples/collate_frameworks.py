"""One collator, any array library: numpy, torch, JAX and the bare Array API standard.

Each layout gives back arrays of the items' own library, on their device, and its
inverse gives every item back. JAX: a ``jax.jit`` model over ``pad(...,
pad_to_multiple_of=...)`` compiles once per width, and over ``pack_varlen`` with a
fixed ``num_segments`` once for every batch. A library that is not installed is
skipped, saying how to install it.

    python examples/collate_frameworks.py
"""

from __future__ import annotations

import importlib.util

import numpy as np

import batchkit

LENGTHS = [5, 2, 7]


def with_numpy() -> None:
    padded = batchkit.pad([np.arange(n) for n in LENGTHS], side="left")
    assert isinstance(padded.data, np.ndarray) and padded.data.shape == (3, 7)
    # lists give numpy too; return_tensors picks another library by name
    assert isinstance(batchkit.PadCollator()([{"input_ids": [1, 2]}])["input_ids"], np.ndarray)
    print("numpy: pad ->", padded.data.shape)


def with_torch() -> None:
    import torch

    items = [torch.arange(n, dtype=torch.float32) for n in LENGTHS]
    padded = batchkit.pad(items, pad_to_multiple_of=8)
    assert isinstance(padded.data, torch.Tensor) and padded.data.shape == (3, 8)
    hidden = padded.data[..., None] * 2  # any [B, L, ...] model output
    assert all(torch.equal(h[:, 0], x * 2) for h, x in zip(padded.unpad(hidden), items))
    print("torch: pad ->", tuple(padded.data.shape), padded.data.device)


def with_jax() -> None:
    import jax
    import jax.numpy as jnp

    traces = []

    @jax.jit
    def masked_mean(data: jax.Array, mask: jax.Array) -> jax.Array:
        traces.append(data.shape)  # runs only when jit compiles for a new shape
        return jnp.sum(jnp.where(mask, data, 0), axis=1) / jnp.sum(mask, axis=1)

    for lengths in ([5, 2, 7], [8, 1, 3], [3, 3, 3], [12, 4, 9]):
        padded = batchkit.pad(
            [jnp.arange(n, dtype=jnp.float32) for n in lengths], pad_to_multiple_of=8
        )
        assert isinstance(padded.data, jax.Array)  # JAX in, JAX out, on the same device
        means = masked_mean(padded.data, padded.mask)
        assert np.allclose(np.asarray(means), [(n - 1) / 2 for n in lengths])
    assert traces == [(3, 8), (3, 16)]  # four batches, two widths, two compiles

    @jax.jit
    def segment_sums(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
        traces.append(values.shape)
        same = segment_ids[:, None] == segment_ids[None, :]  # block-diagonal mask
        return jnp.sum(jnp.where(same, values[None, :], 0), axis=1)

    traces.clear()
    for lengths in ([5, 2, 7], [1], [6, 6, 6, 6]):
        pack = batchkit.pack_varlen(
            [jnp.ones(n) for n in lengths], pad_to_multiple_of=32, num_segments=8
        )
        sums = segment_sums(pack.values, pack.segment_ids)
        assert [float(s[0]) for s in pack.unpack(sums)] == [float(n) for n in lengths]
    assert len(traces) == 1  # every pack is [32] with 9 cu_seqlens: one compile
    print("jax: pad compiled", 2, "times for 4 batches; pack_varlen once for 3")


def with_array_api_strict() -> None:
    import array_api_strict as xp

    items = [xp.arange(n) for n in LENGTHS]
    pack = batchkit.pack(items, max_length=8)
    assert type(pack.data) is type(items[0])  # built with the standard's functions alone
    back = pack.unpack(pack.data)
    assert all(bool(xp.all(b == x)) for b, x in zip(back, items))
    print("array-api-strict: pack ->", pack.data.shape)


for name, module, run, install in (
    ("numpy", "numpy", with_numpy, ""),
    ("torch", "torch", with_torch, 'pip install "batchkit-ml[torch]"'),
    ("jax", "jax", with_jax, 'pip install "batchkit-ml[jax]"'),
    ("array-api-strict", "array_api_strict", with_array_api_strict, "pip install array-api-strict"),
):
    if importlib.util.find_spec(module) is None:
        print(f"{name}: skipped, not installed ({install})")
    else:
        run()
print("ok")
