"""``batchkit memory``: KV cache and activations of a transformer; the largest batch that fits."""

from __future__ import annotations

import argparse
from typing import Any

from batchkit.cli._args import CliError, fraction, positive_int
from batchkit.tools.memory import (
    COUNT_UNITS_HINT,
    DTYPE_BYTES,
    SIZE_UNITS_HINT,
    dtype_bytes,
    format_bytes,
    memory_plan,
    parse_bytes,
    parse_count,
)

# The exit status when not even one sequence fits (2 is a bad argument, as for every
# command): a script can test the plan without reading it.
NOTHING_FITS = 1


def _bytes_arg(text: str) -> str:
    """The text, once it reads as a size: the report shows it beside the bytes it means."""
    try:
        parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _count_arg(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(n: int) -> str:
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)


def _decimal_note(text: str) -> str:
    """Said where the size was given in decimal units, which are easy to take for binary."""
    power = {"kb": 3, "mb": 6, "gb": 9, "tb": 12}.get(text[-2:].lower())
    if power is None:
        return ""
    unit = text[-2:]
    return (
        f" = {format_bytes(parse_bytes(text))} ({unit} is decimal: 1 {unit} = 10^{power} bytes,"
        f" 1 {unit[0]}iB = 2^{power // 3 * 10})"
    )


def add_parser(commands: Any) -> None:
    """Register the command.

    Args:
        commands: The ``add_subparsers()`` object of the ``batchkit`` parser.
    """
    p: argparse.ArgumentParser = commands.add_parser(
        "memory",
        help="KV-cache / activation memory of a transformer; the largest batch that fits",
        description=(
            "KV cache per token and per sequence (2 x layers x kv_heads x head_dim x bytes "
            "per token) and, given --gpu-memory, the largest batch of --seq-len-token "
            "sequences that fits after the weights (--params) and a reserve."
        ),
    )
    p.add_argument("--layers", type=positive_int, required=True, help="transformer layers")
    p.add_argument("--kv-heads", type=positive_int, required=True,
                   help="key/value heads (fewer than query heads with GQA/MQA)")  # fmt: skip
    p.add_argument("--head-dim", type=positive_int, required=True, help="dimensions per head")
    p.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sequence")
    dtypes = ", ".join(sorted(DTYPE_BYTES))
    p.add_argument("--dtype", default="fp16", help=f"KV cache dtype (default fp16; {dtypes})")
    p.add_argument("--batch-size", type=positive_int, help="also show the cache of this batch")
    p.add_argument("--gpu-memory", type=_bytes_arg,
                   help=f"device memory with a unit, e.g. 80GiB or 24GB: {SIZE_UNITS_HINT}; "
                        "a bare number is refused")  # fmt: skip
    p.add_argument("--params", type=_count_arg,
                   help=f"model parameters with a suffix, e.g. 7B: {COUNT_UNITS_HINT}; a bare "
                        "number is refused")  # fmt: skip
    p.add_argument("--weight-dtype", help="weights dtype (default: --dtype)")
    p.add_argument(
        "--reserve",
        type=fraction,
        default=0.1,
        help="fraction of GPU memory kept free for the framework (default 0.1)",
    )
    p.add_argument("--hidden-size", type=positive_int,
                   help="model width: also count peak activations per sequence")  # fmt: skip
    p.add_argument("--intermediate-size", type=positive_int,
                   help="MLP width (default 4 x --hidden-size)")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan.

    Args:
        args: The parsed command line.

    Returns:
        0, or ``NOTHING_FITS`` when not even one sequence fits the GPU memory.
    """
    for name in ("dtype", "weight_dtype"):
        value = getattr(args, name)
        if value is not None:
            dtype_bytes(value)  # a ValueError naming the known dtypes
    if args.intermediate_size is not None and args.hidden_size is None:
        raise CliError("--intermediate-size needs --hidden-size")
    plan = memory_plan(
        layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        seq_len=args.seq_len,
        dtype=args.dtype,
        gpu_memory=args.gpu_memory,
        params=args.params,
        weight_dtype=args.weight_dtype,
        reserve=args.reserve,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
    )
    size = dtype_bytes(args.dtype)
    print(
        f"KV cache: 2 (K and V) x {args.layers} layers x {args.kv_heads} KV heads x "
        f"{args.head_dim} dims x {size:g} B ({args.dtype})"
    )
    print(f"  per token     {format_bytes(plan.kv_bytes_per_token):>12}")
    print(
        f"  per sequence  {format_bytes(plan.kv_bytes_per_sequence):>12}"
        f"  ({args.seq_len} tokens, {plan.kv_bytes_per_sequence:,} bytes)"
    )
    if args.batch_size:
        total = plan.kv_bytes_per_sequence * args.batch_size
        print(f"  batch of {args.batch_size:<4} {format_bytes(total):>12}")
    if plan.activation_bytes_per_sequence:
        print(
            f"activations (peak, one layer at a time): "
            f"{format_bytes(plan.activation_bytes_per_sequence)} per sequence"
        )
    if plan.weight_bytes:
        per_param = dtype_bytes(args.weight_dtype or args.dtype)
        print(
            f"weights: {_count(args.params)} params x {per_param:g} B"
            f" = {format_bytes(plan.weight_bytes)}"
        )
    if plan.gpu_bytes is None or plan.available_bytes is None or plan.max_batch_size is None:
        return 0
    usable = plan.gpu_bytes - plan.reserved_bytes
    given = str(args.gpu_memory).replace(" ", "")
    print(f"GPU memory {given} = {plan.gpu_bytes:,} bytes{_decimal_note(given)}")
    print(
        f"GPU {format_bytes(plan.gpu_bytes)}: reserve {args.reserve:.0%} "
        f"{format_bytes(plan.reserved_bytes)}, weights {format_bytes(plan.weight_bytes)} "
        f"-> {format_bytes(max(plan.available_bytes, 0))} for sequences"
    )
    if plan.max_batch_size == 0:
        if not plan.weights_fit:
            print(
                f"the weights alone do not fit: {format_bytes(plan.weight_bytes)} of weights, "
                f"{format_bytes(usable)} usable after the reserve "
                f"({format_bytes(-plan.available_bytes)} short)"
            )
        short = plan.shortfall_bytes or 0
        print(
            f"largest batch: 0 (one {args.seq_len}-token sequence needs {format_bytes(short)} "
            f"more)"
        )
        return NOTHING_FITS
    tokens = plan.max_batch_size * args.seq_len
    print(
        f"largest batch: {plan.max_batch_size} sequences of {args.seq_len} tokens "
        f"({tokens:,} tokens in the KV cache)"
    )
    kv_only = plan.available_bytes // plan.kv_bytes_per_sequence
    if kv_only > plan.max_batch_size:
        print(
            f"  activations counted: each sequence also needs "
            f"{format_bytes(plan.activation_bytes_per_sequence)} of peak activations; the KV "
            f"cache alone would allow {kv_only}"
        )
    return 0
