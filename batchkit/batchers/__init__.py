"""Batching policies: which items go together, and when (online, offline, streamed)."""

from batchkit.batchers.base import Batch, Batcher
from batchkit.batchers.bucketed import BucketedBatcher
from batchkit.batchers.cost import BatchCost
from batchkit.batchers.dynamic import DynamicBatcher
from batchkit.batchers.packing import PackingBatcher
from batchkit.batchers.sampler import BatchSampler
from batchkit.batchers.sorted import SortedBatcher
from batchkit.batchers.static import StaticBatcher

__all__ = [
    "Batch",
    "BatchCost",
    "BatchSampler",
    "Batcher",
    "BucketedBatcher",
    "DynamicBatcher",
    "PackingBatcher",
    "SortedBatcher",
    "StaticBatcher",
]
