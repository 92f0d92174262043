"""batchkit: composable batching primitives for ML inference.

- ``batchkit.collate``: batch layouts (stack, pad, pack, varlen) and their inverses.
- ``batchkit.batchers``: policies (static, dynamic, bucketed, sorted).
- ``batchkit.serve``: ``@batched``, which runs any callable in batches for many callers.
- ``batchkit.generate``: ``ContinuousBatcher``, continuous batching of generation.
- ``batchkit.kv``: paged KV-cache blocks (allocator, block tables, prefix cache).
- ``batchkit.tools``: plan before deploying (``simulate``, ``profile``, ``memory_plan``).
- ``batchkit.metrics`` and ``batchkit.integrations.ray``: Prometheus and Ray (optional
  extras, not imported here).

The headline names of each are importable from ``batchkit`` itself.
"""

from batchkit import batchers, collate, generate, kv, serve
from batchkit.batchers import (
    Batch,
    Batcher,
    BatchSampler,
    BucketedBatcher,
    DynamicBatcher,
    PackingBatcher,
    SortedBatcher,
    StaticBatcher,
)
from batchkit.collate import (
    AmbiguousOutputWarning,
    Packed,
    PadCollator,
    Padded,
    ShapeBuckets,
    Varlen,
    VarlenCollator,
    pack,
    pack_varlen,
    pad,
    stack,
    to_device,
    unstack,
)
from batchkit.generate import ContinuousBatcher, GenerationHandle, GenerationStats, StepBatch
from batchkit.kv import BlockAllocator, BlockTable, OutOfBlocks, StepLayout
from batchkit.serve import (
    END,
    BatchedFunction,
    BatcherClosed,
    BatchInterrupted,
    BatchkitError,
    BatchTimeout,
    Overloaded,
    QueueFull,
    RequestTimeout,
    Settings,
    Stats,
    TooManySessions,
    batched,
)
from batchkit.tools.memory import MemoryPlan, activation_bytes, kv_cache_bytes, memory_plan
from batchkit.tools.profile import ProfileResult, profile
from batchkit.tools.simulate import LatencyModel, SimResult, simulate

__version__ = "0.1.0"

__all__ = [
    "END",
    "AmbiguousOutputWarning",
    "Batch",
    "BatchSampler",
    "BatchedFunction",
    "Batcher",
    "BatcherClosed",
    "BatchInterrupted",
    "BatchkitError",
    "BatchTimeout",
    "BlockAllocator",
    "BlockTable",
    "BucketedBatcher",
    "ContinuousBatcher",
    "DynamicBatcher",
    "GenerationHandle",
    "GenerationStats",
    "LatencyModel",
    "MemoryPlan",
    "OutOfBlocks",
    "Overloaded",
    "Packed",
    "PackingBatcher",
    "PadCollator",
    "Padded",
    "ProfileResult",
    "QueueFull",
    "RequestTimeout",
    "Settings",
    "ShapeBuckets",
    "SimResult",
    "SortedBatcher",
    "StaticBatcher",
    "Stats",
    "StepBatch",
    "StepLayout",
    "TooManySessions",
    "Varlen",
    "VarlenCollator",
    "activation_bytes",
    "batched",
    "batchers",
    "collate",
    "generate",
    "kv",
    "kv_cache_bytes",
    "memory_plan",
    "pack",
    "pack_varlen",
    "pad",
    "profile",
    "serve",
    "simulate",
    "stack",
    "to_device",
    "unstack",
]
