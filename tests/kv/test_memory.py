"""Sizing the KV pool: bytes per block, blocks per memory budget, and their bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

from batchkit.kv import kv_block_bytes, num_blocks_for


def test_kv_block_bytes_and_num_blocks_for_size_the_pool() -> None:
    # Llama-2-7B-like: 32 layers, 32 KV heads of 128, fp16, 16-token blocks = 8 MiB
    per = kv_block_bytes(16, num_layers=32, num_kv_heads=32, head_dim=128, dtype="float16")
    assert per == 2 * 32 * 32 * 128 * 16 * 2 == 8 * 2**20
    assert (
        num_blocks_for(10 * 2**30, block_size=16, num_layers=32, num_kv_heads=32, head_dim=128)
        == 1280
    )
    assert kv_block_bytes(1, num_layers=1, num_kv_heads=1, head_dim=1, dtype=np.float32) == 8
    assert num_blocks_for(1, block_size=1, num_layers=1, num_kv_heads=1, head_dim=1) == 0
    torch = pytest.importorskip("torch")
    assert kv_block_bytes(1, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.bfloat16) == 4
    with pytest.raises(ValueError):
        kv_block_bytes(0, num_layers=1, num_kv_heads=1, head_dim=1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 16.5, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        {"block_size": 16, "num_layers": 2.5, "num_kv_heads": 2, "head_dim": 8},
        {"block_size": 16, "num_layers": 2, "num_kv_heads": True, "head_dim": 8},
    ],
)
def test_kv_sizes_must_be_whole_numbers(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="must be a positive integer"):
        kv_block_bytes(**kwargs)


@pytest.mark.parametrize("memory", [float("inf"), float("nan"), -1])
def test_num_blocks_for_refuses_a_memory_that_is_no_size(memory: float) -> None:
    with pytest.raises(ValueError, match="memory_bytes must be a finite number"):
        num_blocks_for(memory, block_size=16, num_layers=2, num_kv_heads=2, head_dim=8)
