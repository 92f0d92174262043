"""Batch layouts and their exact inverses.

Every function takes a list of per-request items (python lists, numpy arrays or
torch tensors; first axis = sequence) and returns a batch whose inverse gives each
request its own slice back. With ``pin_memory=True`` the batch is allocated in
page-locked memory, and `to_device` moves it to a GPU without blocking.
"""

from batchkit.collate.collators import DEFAULT_PAD_VALUES, PadCollator, VarlenCollator
from batchkit.collate.device import to_device
from batchkit.collate.inverse import AmbiguousOutputWarning, FeatureBatch
from batchkit.collate.pack import Packed, Placement, pack
from batchkit.collate.pad import Padded, pad
from batchkit.collate.shapes import ShapeBuckets
from batchkit.collate.stack import register_leaf, stack, unstack
from batchkit.collate.varlen import Varlen, pack_varlen

__all__ = [
    "DEFAULT_PAD_VALUES",
    "AmbiguousOutputWarning",
    "FeatureBatch",
    "PadCollator",
    "Packed",
    "Padded",
    "Placement",
    "ShapeBuckets",
    "Varlen",
    "VarlenCollator",
    "pack",
    "pack_varlen",
    "pad",
    "register_leaf",
    "stack",
    "to_device",
    "unstack",
]
