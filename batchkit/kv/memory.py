"""Sizing the KV cache: bytes per token, per sequence, per block, and blocks that fit.

One formula, checked by hand in the tests: a key and a value vector per layer, per
KV head, per token: ``2 * layers * kv_heads * head_dim * tokens * bytes(dtype)``.
"""

from __future__ import annotations

import math
import numbers
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np

# Bytes per element; fp8/int8 store one byte, 4-bit formats half of one.
DTYPE_BYTES: dict[str, float] = {
    "fp64": 8, "float64": 8, "double": 8,
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2, "bf16": 2, "bfloat16": 2,
    "fp8": 1, "float8": 1, "int8": 1,
    "int4": 0.5, "fp4": 0.5, "nf4": 0.5,
}  # fmt: skip


def dtype_bytes(dtype: Any) -> float:
    """Bytes per element of ``dtype``.

    Args:
        dtype: A name (``"fp16"``, ``"bfloat16"``, ``"fp8"``, ``"int4"``; any case),
            a numpy or torch dtype, or an int (bytes).

    Returns:
        Bytes per element (0.5 for the 4-bit formats).

    Raises:
        ValueError: An unknown name (the message lists the known ones) or an int < 1.
    """
    if isinstance(dtype, str):
        try:
            return DTYPE_BYTES[dtype.lower()]
        except KeyError:
            known = ", ".join(sorted(DTYPE_BYTES))
            raise ValueError(f"unknown dtype {dtype!r} (known: {known})") from None
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype < 1:
            raise ValueError(f"dtype bytes must be positive, got {dtype}")
        return dtype
    size = getattr(dtype, "itemsize", None)  # torch.dtype and np.dtype both have it
    if isinstance(size, int):
        return size
    return int(np.dtype(dtype).itemsize)


def check_positive(**values: float) -> None:
    """Raise a ValueError naming the first value that is not a positive finite number.

    Args:
        **values: The values, by the names the error gives them.
    """
    for name, value in values.items():
        # (An int is always finite; math.isfinite would overflow on one above 1e308.)
        finite = isinstance(value, numbers.Integral) or math.isfinite(value)
        if isinstance(value, bool) or not value > 0 or not finite:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


def check_counts(**values: int) -> None:
    """Raise a ValueError naming the first value that is not a positive integer
    (layers, heads, tokens: a fractional one is a mistake, not a size).

    Args:
        **values: The values, by the names the error gives them.
    """
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def ceil_bytes(count: float, per_element: float) -> int:
    """``ceil(count * per_element)`` as a Python int, exactly: no float rounding, and no
    OverflowError for a count beyond a float's range. A float factor is taken as written
    (``0.1`` is 1/10, not the binary float nearest to it), so 10% of 80 GiB is 8 GiB.

    Args:
        count: Elements (or bytes).
        per_element: Bytes per element (or a fraction).

    Raises:
        ValueError: A value is not finite.
    """
    return int(math.ceil(_exact(count) * _exact(per_element)))


def _exact(x: float) -> Fraction:
    """``x`` as a fraction: ints, numpy ints, Fractions and Decimals exactly; floats
    (numpy's too) by their shortest decimal form."""
    if isinstance(x, numbers.Integral):
        return Fraction(int(x))
    if isinstance(x, (numbers.Rational, Decimal)):
        return Fraction(x)
    if not math.isfinite(x):
        raise ValueError(f"expected a finite number, got {x!r}")
    return Fraction(str(x)) if isinstance(x, (float, np.floating)) else Fraction(float(x))


def kv_cache_bytes(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    seq_len: int,
    batch_size: int = 1,
    dtype: Any = "fp16",
) -> int:
    """Bytes of the KV cache for ``batch_size`` sequences of ``seq_len`` tokens.

    A key and a value vector per layer, per KV head, per token:
    ``2 * layers * kv_heads * head_dim * seq_len * batch_size * bytes(dtype)``.
    Llama-2-7B (32 layers, 32 KV heads of 128, fp16) at 4096 tokens: 2 GiB per sequence.

    Args:
        layers: Transformer layers.
        kv_heads: Key/value heads per layer (fewer than the query heads under
            grouped-query attention).
        head_dim: Elements per head.
        seq_len: Tokens per sequence.
        batch_size: Sequences.
        dtype: The cache's element type: a name (``"fp16"``, ``"fp8"``), a numpy or
            torch dtype, or bytes per element as an int.

    Returns:
        Bytes, rounded up to a whole byte.

    Raises:
        ValueError: A count is not a positive integer (the message names it), or an
            unknown ``dtype``.
    """
    check_counts(
        layers=layers, kv_heads=kv_heads, head_dim=head_dim, seq_len=seq_len, batch_size=batch_size
    )
    elements = 2 * layers * kv_heads * head_dim * seq_len * batch_size
    return ceil_bytes(elements, dtype_bytes(dtype))


def kv_block_bytes(
    block_size: int, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: Any = "float16"
) -> int:
    """Bytes one block takes: keys and values, every layer, ``block_size`` tokens.

    Args:
        block_size: Tokens per block.
        num_layers: Transformer layers.
        num_kv_heads: Key/value heads per layer (fewer than the query heads under
            grouped-query attention).
        head_dim: Elements per head.
        dtype: The cache's element type: a name (``"float16"``, ``"fp8"``), a numpy
            or torch dtype, or bytes per element as an int.

    Raises:
        ValueError: A count is not a positive integer, or an unknown ``dtype``.
    """
    check_counts(block_size=block_size)
    return kv_cache_bytes(
        layers=num_layers, kv_heads=num_kv_heads, head_dim=head_dim, seq_len=block_size,
        dtype=dtype,
    )  # fmt: skip


def num_blocks_for(
    memory_bytes: int,
    *,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: Any = "float16",
) -> int:
    """How many whole blocks fit in ``memory_bytes`` (0 if not even one).

    Args:
        memory_bytes: The memory given to the KV cache, in bytes.
        block_size: Tokens per block.
        num_layers: Transformer layers.
        num_kv_heads: Key/value heads per layer (fewer than the query heads under
            grouped-query attention).
        head_dim: Elements per head.
        dtype: The cache's element type: a name (``"float16"``, ``"fp8"``), a numpy
            or torch dtype, or bytes per element as an int.

    Raises:
        ValueError: ``memory_bytes`` is negative or not finite, a count is not a
            positive integer, or an unknown ``dtype``.
    """
    if isinstance(memory_bytes, bool) or not (0 <= memory_bytes < math.inf):
        raise ValueError(f"memory_bytes must be a finite number >= 0, got {memory_bytes!r}")
    per_block = kv_block_bytes(
        block_size, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    return max(int(memory_bytes) // per_block, 0)
