"""Padding ragged requests into one batch, and handing each caller its slice back.

Run: python examples/collate_pad.py   (numpy only; the torch part runs if torch is installed)
"""

from __future__ import annotations

import numpy as np

import batchkit

requests = [[5, 6, 7], [8], [9, 10]]  # token ids from three callers

# Right padding (the default): real tokens first, padding after.
batch = batchkit.pad(requests)
print("right-padded:\n", batch.data, "\nmask:\n", batch.mask.astype(int))
assert batch.data.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
assert batch.lengths.tolist() == [3, 1, 2]

# Left padding, rounded up to a multiple of 8: what decoder-only generation wants
# (every row's last real token sits in the last column) and what tensor cores like.
left = batchkit.pad(requests, side="left", pad_value=-1, pad_to_multiple_of=8)
print("left-padded to a multiple of 8:\n", left.data)
assert left.data.shape == (3, 8)
assert left.data[:, -1].tolist() == [7, 8, 10]  # the next-token position of every row
assert (left.data[~left.mask] == -1).all()

# Any per-position model output [B, L, ...] comes back per caller, padding dropped.
hidden = np.cumsum(left.data * left.mask, axis=1)[..., None]  # a stand-in "model", [B, L, 1]
per_caller = left.unpad(hidden)
assert [h.shape for h in per_caller] == [(3, 1), (1, 1), (2, 1)]
assert per_caller[0][:, 0].tolist() == [5, 11, 18]

# Items may carry feature axes: [length, *features] -> [B, L, *features].
embeddings = [np.ones((n, 4), dtype=np.float32) * n for n in (2, 5, 3)]
emb = batchkit.pad(embeddings)
assert emb.data.shape == (3, 5, 4) and emb.mask.shape == (3, 5)

# max_length: an item longer than it is an error, unless truncate=True cuts it.
try:
    batchkit.pad(requests, max_length=2)
except ValueError as exc:
    print("max_length=2:", exc)
cut = batchkit.pad(requests, max_length=2, truncate=True)
assert cut.data.tolist() == [[5, 6], [8, 0], [9, 10]]

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None
if torch is not None:
    # Tensors in, tensors out (same device); or return_tensors="pt" from lists.
    tensors = [torch.tensor(r) for r in requests]
    tb = batchkit.pad(tensors)
    assert isinstance(tb.data, torch.Tensor) and tb.mask.dtype == torch.bool
    ref = torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True)
    assert torch.equal(tb.data, ref)
    assert torch.equal(batchkit.pad(requests, return_tensors="pt").data, ref)

print("ok")
