"""Paged KV-cache blocks: a refcounted pool, per-sequence block tables, prefix caching,
the per-step layout paged-attention kernels read, and a reference paged attention.
"""

from batchkit.kv.allocator import AllocatorStats, BlockAllocator, OutOfBlocks
from batchkit.kv.attention import paged_attention, write_kv
from batchkit.kv.block_table import BlockTable, blocks_for, slots_of
from batchkit.kv.layout import StepLayout, build_decode_layout, build_layout
from batchkit.kv.memory import kv_block_bytes, num_blocks_for
from batchkit.kv.prefix import PrefixCache, block_digest

__all__ = [
    "AllocatorStats",
    "BlockAllocator",
    "BlockTable",
    "OutOfBlocks",
    "PrefixCache",
    "StepLayout",
    "block_digest",
    "blocks_for",
    "build_decode_layout",
    "build_layout",
    "kv_block_bytes",
    "num_blocks_for",
    "paged_attention",
    "slots_of",
    "write_kv",
]
