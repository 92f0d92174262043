"""batchkit: composable batching primitives for ML inference."""

from batchkit import collate
from batchkit.collate import (
    PadCollator,
    Packed,
    Padded,
    Varlen,
    VarlenCollator,
    pack,
    pack_varlen,
    pad,
    stack,
    unstack,
)

__version__ = "0.1.0"

__all__ = [
    "PadCollator",
    "Packed",
    "Padded",
    "Varlen",
    "VarlenCollator",
    "collate",
    "pack",
    "pack_varlen",
    "pad",
    "stack",
    "unstack",
]
