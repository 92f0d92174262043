"""Sizing the KV cache: bytes per block, and blocks that fit in a memory budget."""

from __future__ import annotations

from typing import Any

import numpy as np


def _itemsize(dtype: Any) -> int:
    """Bytes per element of a numpy/torch dtype, a dtype name, or an int (bytes)."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype < 1:
            raise ValueError(f"dtype bytes must be positive, got {dtype}")
        return dtype
    size = getattr(dtype, "itemsize", None)  # torch.dtype and np.dtype both have it
    if isinstance(size, int):
        return size
    return int(np.dtype(dtype).itemsize)


def kv_block_bytes(
    block_size: int, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: Any = "float16"
) -> int:
    """Bytes one block takes: keys and values, every layer, ``block_size`` tokens."""
    for name, value in (
        ("block_size", block_size),
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    return 2 * num_layers * num_kv_heads * head_dim * block_size * _itemsize(dtype)


def num_blocks_for(
    memory_bytes: int,
    *,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = "float16",
) -> int:
    """How many whole blocks fit in ``memory_bytes`` (0 if not even one)."""
    per_block = kv_block_bytes(
        block_size, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    return max(int(memory_bytes) // per_block, 0)
