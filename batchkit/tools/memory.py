"""Transformer memory arithmetic: KV cache, activations, and the largest batch that fits.

Everything is counted in bytes, exactly: the numbers are meant to be checked by
hand (``2 * layers * kv_heads * head_dim * tokens * bytes_per_element``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# The KV-cache formula and dtype sizes live with the KV blocks; re-exported here.
from batchkit.kv.memory import (
    DTYPE_BYTES,
    ceil_bytes,
    check_counts,
    check_positive,
    dtype_bytes,
    kv_cache_bytes,
)

__all__ = [
    "DTYPE_BYTES",
    "MemoryPlan",
    "activation_bytes",
    "dtype_bytes",
    "format_bytes",
    "kv_cache_bytes",
    "memory_plan",
    "parse_bytes",
    "parse_count",
]

# Decimal suffixes (KB, MB, ...) are powers of 1000; binary ones (KiB, ...) and bare
# letters (K, M, G, as nvidia-smi and free print them) are powers of 1024. A number
# without a unit is refused (see _parse): "24" is 24 GiB or 24 GB meant, never 24 bytes.
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip
_COUNT_UNITS = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
SIZE_UNITS_HINT = "GiB or G (binary, 2^30 bytes), GB (decimal, 10^9 bytes), MiB, MB, ... or B"
COUNT_UNITS_HINT = "B or G (10^9), M (10^6), K (10^3), T (10^12), or an exponent (7e9)"

GiB = 2**30


def _parse(text: str, units: dict[str, int], what: str, hint: str) -> float:
    match = _NUMBER.match(text)
    if match is not None and not match.group(3) and not match.group(2):
        # A bare "24" or "7" is a unit left out, far more often than 24 bytes or 7
        # parameters meant: refuse it, saying which units there are.
        raise ValueError(f"cannot read {text!r} as {what}: give a unit: {hint}")
    unit = match.group(3).lower() if match else ""
    if match is None or (unit and unit not in units):
        raise ValueError(f"cannot read {text!r} as {what}")
    value = float(match.group(1)) * (units[unit] if unit else 1)
    if not math.isfinite(value):
        raise ValueError(f"cannot read {text!r} as {what}")
    return value


def _whole(text: str, value: float, unit: str) -> int:
    # int() would make 0.5 a 0, and a later "must be positive, got 0" quote a value never given.
    if 0 < value < 1:
        raise ValueError(f"{text!r} is less than one {unit}")
    return int(value)


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80G"`` (binary), ``"80GB"`` (decimal), ``"1.5TiB"``, ``"4096B"`` -> bytes.

    "GB" is decimal, as disk and GPU vendors count: ``24GB`` is 24 x 10^9 bytes, 22.35
    GiB. A number with no unit is refused: ``"24"`` is nearly always 24 GiB or 24 GB
    meant, not 24 bytes (write ``"24B"`` for bytes, ``"24e9"`` for 24 x 10^9).

    Args:
        text: A number with a unit (any case): ``B``, ``KB``..``TB`` (powers of
            1000), ``KiB``..``TiB`` or ``K``..``T`` (powers of 1024); or a number
            written with an exponent (``2.4e10``), read as bytes.

    Returns:
        Whole bytes (a fraction is dropped).

    Raises:
        ValueError: ``text`` is not a size, has no unit (the message lists the
            units), or is less than one byte.
    """
    value = _parse(
        text, _SIZE_UNITS, "a memory size (e.g. 80GiB, 24GB, 4096B)", SIZE_UNITS_HINT
    )
    return _whole(text, value, "byte")


def parse_count(text: str) -> int:
    """``"7B"``, ``"7e9"``, ``"125M"``, ``"70b"`` -> a parameter count.

    A number with neither a suffix nor an exponent is refused: ``"7"`` is nearly
    always 7 billion meant, not 7 parameters.

    Args:
        text: A number with a suffix (any case): ``K`` (10^3), ``M`` (10^6), ``B``
            or ``G`` (10^9), ``T`` (10^12); or written with an exponent (``7e9``).

    Raises:
        ValueError: ``text`` is not a count, has neither suffix nor exponent (the
            message lists the suffixes), or is less than one.
    """
    value = _parse(text, _COUNT_UNITS, "a parameter count (e.g. 7B, 125M, 7e9)", COUNT_UNITS_HINT)
    return _whole(text, value, "parameter")


def format_bytes(n: float) -> str:
    """Bytes in binary units, two decimals: ``2.00 GiB`` (below 1 KiB: ``512 B``).

    Args:
        n: A number of bytes.
    """
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def activation_bytes(
    *,
    seq_len: int,
    hidden_size: int,
    intermediate_size: int | None = None,
    batch_size: int = 1,
    dtype: str = "fp16",
) -> int:
    """Peak activation bytes of one forward pass over ``batch_size * seq_len`` tokens.

    Layers run one after another, so only one layer's tensors are alive at once:
    the residual stream in and out (``2 * hidden``) and the MLP's up and gate
    projections (``2 * intermediate``, default ``4 * hidden``), per token. Attention
    scores are not counted (FlashAttention-style kernels never materialise them).
    A planning estimate, not an allocator trace.

    Args:
        seq_len: Tokens per sequence.
        hidden_size: The model's hidden size.
        intermediate_size: The MLP's inner size; ``None`` means ``4 * hidden_size``.
        batch_size: Sequences in the forward pass.
        dtype: The activations' element type (``"fp16"``, ``"bf16"``, ``"fp32"``, ...).

    Raises:
        ValueError: A size is not a positive integer, or an unknown ``dtype``.
    """
    intermediate = 4 * hidden_size if intermediate_size is None else intermediate_size
    check_counts(
        seq_len=seq_len, hidden_size=hidden_size, intermediate_size=intermediate,
        batch_size=batch_size,
    )  # fmt: skip
    per_token = 2 * hidden_size + 2 * intermediate
    return ceil_bytes(per_token * seq_len * batch_size, dtype_bytes(dtype))


@dataclass(frozen=True)
class MemoryPlan:
    """How a transformer's serving memory splits, and the largest batch that fits.

    [`memory_plan`][batchkit.memory_plan] returns it. Every figure is in bytes.

    Attributes:
        kv_bytes_per_sequence: The KV cache of one sequence of ``seq_len`` tokens.
        kv_bytes_per_token: The KV cache of one token.
        activation_bytes_per_sequence: Peak activations of one sequence; 0 unless a
            hidden size was given.
        weight_bytes: The weights; 0 unless a parameter count was given.
        gpu_bytes: The GPU memory given; None if none was.
        reserved_bytes: ``gpu_bytes * reserve``, kept free for the framework and
            fragmentation (0 without a GPU).
        available_bytes: What is left for KV cache and activations after weights and
            reserve; negative when the weights alone overflow (by that much), so no
            shortfall is hidden by clamping it at zero. None without a GPU.
        max_batch_size: Sequences of ``seq_len`` tokens that fit; None without a GPU.
    """

    kv_bytes_per_sequence: int
    kv_bytes_per_token: int
    activation_bytes_per_sequence: int
    weight_bytes: int
    gpu_bytes: int | None
    reserved_bytes: int
    available_bytes: int | None
    max_batch_size: int | None

    @property
    def bytes_per_sequence(self) -> int:
        """What one more sequence in the batch costs."""
        return self.kv_bytes_per_sequence + self.activation_bytes_per_sequence

    @property
    def weights_fit(self) -> bool | None:
        """Whether the weights fit in the GPU memory left after the reserve (None: no GPU
        memory given)."""
        if self.available_bytes is None:
            return None
        return self.available_bytes >= 0

    @property
    def shortfall_bytes(self) -> int | None:
        """How much more usable memory one sequence needs: 0 when one fits, None when no
        GPU memory was given. When the weights alone overflow, their overflow counts too
        (``bytes_per_sequence - available_bytes`` with ``available_bytes`` negative)."""
        if self.available_bytes is None:
            return None
        return max(self.bytes_per_sequence - self.available_bytes, 0)


def memory_plan(
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    seq_len: int,
    dtype: str = "fp16",
    gpu_memory: int | str | None = None,
    params: int | str | None = None,
    weight_dtype: str | None = None,
    reserve: float = 0.1,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
) -> MemoryPlan:
    """KV cache per sequence and, given ``gpu_memory``, the largest batch that fits.

    ``gpu_memory`` minus ``reserve`` (a fraction of it, like vLLM's
    ``gpu_memory_utilization = 1 - reserve``) minus the weights (``params`` times
    ``weight_dtype``'s bytes, default ``dtype``) is shared by the sequences; each
    costs its KV cache plus, when ``hidden_size`` is given, its peak activations.

    Args:
        layers: Transformer layers.
        kv_heads: Key/value heads per layer (fewer than the query heads under
            grouped-query attention).
        head_dim: Elements per head.
        seq_len: Tokens per sequence (prompt plus generated).
        dtype: The KV cache's (and activations') element type: ``"fp16"``,
            ``"bf16"``, ``"fp8"``, ``"int4"``, ... (see ``DTYPE_BYTES``).
        gpu_memory: GPU memory, in bytes (a number) or as text with a unit
            (``"80GiB"``; ``"24GB"`` is decimal, 24 x 10^9 bytes; see `parse_bytes`);
            ``None``: no batch size is planned.
        params: The model's parameter count, as a number or text with a suffix
            (``"7B"``, ``"125M"``; see `parse_count`); ``None``: weights are not
            counted.
        weight_dtype: The weights' element type; ``None``: ``dtype``.
        reserve: The fraction of ``gpu_memory`` kept free, in ``[0, 1)``.
        hidden_size: The model's hidden size, to count activations; ``None``: they
            are not counted.
        intermediate_size: The MLP's inner size; ``None`` means ``4 * hidden_size``.

    Raises:
        ValueError: ``reserve`` is outside ``[0, 1)``, a size or count is not
            positive, a text size or count cannot be read, or an unknown dtype.
    """
    if not (0 <= reserve < 1):
        raise ValueError(f"reserve must be a fraction in [0, 1), got {reserve!r}")
    kv_seq = kv_cache_bytes(
        layers=layers, kv_heads=kv_heads, head_dim=head_dim, seq_len=seq_len, dtype=dtype
    )
    kv_token = kv_cache_bytes(
        layers=layers, kv_heads=kv_heads, head_dim=head_dim, seq_len=1, dtype=dtype
    )
    act_seq = 0
    if hidden_size is not None:
        act_seq = activation_bytes(
            seq_len=seq_len, hidden_size=hidden_size, intermediate_size=intermediate_size,
            dtype=dtype,
        )  # fmt: skip
    n_params = parse_count(params) if isinstance(params, str) else params
    weights = 0
    if n_params is not None:
        check_positive(params=n_params)
        weights = ceil_bytes(n_params, dtype_bytes(weight_dtype or dtype))
    gpu = parse_bytes(gpu_memory) if isinstance(gpu_memory, str) else gpu_memory
    if gpu is None:
        return MemoryPlan(kv_seq, kv_token, act_seq, weights, None, 0, None, None)
    check_positive(gpu_memory=gpu)
    gpu = int(gpu)  # whole bytes (a float or numpy size given), so the plan is all ints
    reserved = ceil_bytes(gpu, reserve)
    available = gpu - reserved - weights
    fits = max(available, 0) // (kv_seq + act_seq)
    return MemoryPlan(kv_seq, kv_token, act_seq, weights, gpu, reserved, available, fits)
