"""batchkit: composable batching primitives for ML inference.

- ``batchkit.collate``: batch layouts (stack, pad, pack, varlen) and their inverses.
- ``batchkit.batchers``: policies (static, dynamic, bucketed, sorted).
- ``batchkit.serve``: ``@batched``, which runs any callable in batches for many callers.
"""

from batchkit import batchers, collate, serve
from batchkit.batchers import (
    Batch,
    Batcher,
    BucketedBatcher,
    DynamicBatcher,
    SortedBatcher,
    StaticBatcher,
)
from batchkit.collate import (
    Packed,
    PadCollator,
    Padded,
    Varlen,
    VarlenCollator,
    pack,
    pack_varlen,
    pad,
    stack,
    unstack,
)
from batchkit.serve import (
    BatchedFunction,
    BatcherClosed,
    BatchkitError,
    QueueFull,
    RequestTimeout,
    Stats,
    batched,
)

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BatchedFunction",
    "Batcher",
    "BatcherClosed",
    "BatchkitError",
    "BucketedBatcher",
    "DynamicBatcher",
    "PadCollator",
    "Packed",
    "Padded",
    "QueueFull",
    "RequestTimeout",
    "SortedBatcher",
    "StaticBatcher",
    "Stats",
    "Varlen",
    "VarlenCollator",
    "batched",
    "batchers",
    "collate",
    "pack",
    "pack_varlen",
    "pad",
    "serve",
    "stack",
    "unstack",
]
